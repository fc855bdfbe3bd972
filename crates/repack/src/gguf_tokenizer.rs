//! The tokenizer and generation defaults of a GGUF file, rebuilt from its
//! `tokenizer.*` and `general.*` metadata for the `.slip` manifest.

use std::collections::BTreeMap;

use serde_json::{json, Value as Json};
use slipstream_gguf::{GgufFile, Value};

use crate::{RepackError, Result};

/// Tokenizer fields of the manifest rebuilt from `tokenizer.*` metadata.
pub(crate) struct GgufTokenizer {
    pub tokenizer_json: Option<Vec<u8>>,
    pub chat_template: Option<String>,
    pub eos_token_ids: Vec<u32>,
    pub special_tokens: BTreeMap<String, String>,
    /// Sampling settings from `general.sampling.*` (llama.cpp's keys).
    pub generation: Option<slipstream_format::GenerationDefaults>,
    /// Why there is no tokenizer.json, when there is none.
    pub note: Option<String>,
}

const GPT2_REGEX: &str =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)";
const QWEN2_REGEX: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const QWEN35_REGEX: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

fn strings(v: Option<&Value>) -> Option<Vec<String>> {
    v?.as_array()?
        .iter()
        .map(|x| x.as_str().map(str::to_string))
        .collect()
}

/// The sampling settings a GGUF records (`general.sampling.*`, as
/// llama.cpp writes them); values out of range are left out.
fn sampling_defaults(f: &GgufFile) -> slipstream_format::GenerationDefaults {
    let float = |key: &str, ok: fn(f64) -> bool| {
        f.get(key)
            .and_then(|v| v.as_f64())
            .filter(|x| x.is_finite() && ok(*x))
            .map(|x| x as f32)
    };
    slipstream_format::GenerationDefaults {
        temperature: float("general.sampling.temp", |x| x >= 0.0),
        top_p: float("general.sampling.top_p", |x| x > 0.0 && x <= 1.0),
        top_k: f
            .get("general.sampling.top_k")
            .and_then(|v| v.as_u64())
            .and_then(|k| usize::try_from(k).ok()),
        min_p: float("general.sampling.min_p", |x| (0.0..=1.0).contains(&x)),
        repetition_penalty: float("general.sampling.penalty_repeat", |x| x > 0.0),
        presence_penalty: None,
        frequency_penalty: None,
    }
}

pub(crate) fn tokenizer(f: &GgufFile) -> GgufTokenizer {
    let mut t = GgufTokenizer {
        tokenizer_json: None,
        chat_template: f
            .get("tokenizer.chat_template")
            .and_then(|v| v.as_str())
            .map(str::to_string),
        eos_token_ids: Vec::new(),
        special_tokens: BTreeMap::new(),
        generation: Some(sampling_defaults(f)),
        note: None,
    };
    let tokens = strings(f.get("tokenizer.ggml.tokens"));
    for (key, field) in [
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("eos_token", "tokenizer.ggml.eot_token_id"),
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ] {
        if let Some(id) = f.get(field).and_then(|v| v.as_u64()) {
            if key == "eos_token" && !t.eos_token_ids.contains(&(id as u32)) {
                t.eos_token_ids.push(id as u32);
            }
            if let Some(s) = tokens.as_ref().and_then(|tk| tk.get(id as usize)) {
                t.special_tokens
                    .entry(key.to_string())
                    .or_insert_with(|| s.clone());
            }
        }
    }
    let model = f
        .get("tokenizer.ggml.model")
        .and_then(|v| v.as_str())
        .unwrap_or("");
    if model != "gpt2" {
        t.note = Some(format!("tokenizer.ggml.model {model:?} is not gpt2 BPE; no tokenizer written (use --prompt-tokens)"));
        return t;
    }
    let (Some(tokens), Some(merges)) = (tokens, strings(f.get("tokenizer.ggml.merges"))) else {
        t.note = Some("tokenizer.ggml.tokens or .merges missing; no tokenizer written".into());
        return t;
    };
    let types: Vec<i64> = f
        .get("tokenizer.ggml.token_type")
        .and_then(|v| v.as_array())
        .map(|a| a.iter().map(|x| x.as_f64().unwrap_or(1.0) as i64).collect())
        .unwrap_or_default();
    let pre = f
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let regex = match pre {
        "qwen2" | "deepseek-r1-qwen" => QWEN2_REGEX,
        "qwen35" => QWEN35_REGEX,
        _ => GPT2_REGEX,
    };
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        // ggml token types: 1 normal, 3 control, 4 user defined.
        let ty = types.get(id).copied().unwrap_or(1);
        if ty == 3 || ty == 4 {
            added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty == 3
            }));
        }
        vocab.insert(tok.clone(), json!(id));
    }
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    let tj: Json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            byte_level.clone()
        ]},
        "post_processor": byte_level.clone(),
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges
        }
    });
    t.tokenizer_json = serde_json::to_vec(&tj).ok();
    t
}

/// Builds the tokenizer rebuilt from `tokenizer.ggml.*` the way the engine
/// will at open, so broken metadata (a merge of tokens not in the list, a
/// merge that is not a pair) fails the repack instead of every later open;
/// its ids must lie inside the model's `vocab_size` embedding rows.
pub(crate) fn check_tokenizer(json: &[u8], vocab_size: usize, path: &str) -> Result<()> {
    let bad = |reason: String| RepackError::Corrupt {
        path: path.to_string(),
        reason: format!("tokenizer.ggml.* metadata does not make a tokenizer: {reason}"),
    };
    let tok = tokenizers::Tokenizer::from_bytes(json).map_err(|e| bad(e.to_string()))?;
    let ids = tok.get_vocab_size(true);
    if ids > vocab_size {
        return Err(bad(format!(
            "{ids} tokens, but the model embeds only {vocab_size} (vocab_size)"
        )));
    }
    Ok(())
}
