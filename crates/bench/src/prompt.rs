//! Prompts of an exact token count, cut from bundled text.
//!
//! The text is the King James Bible the demo model was trained on
//! (`tools/demo/corpus.txt`, public domain), compiled into the binary so a
//! benchmark needs no file beside the model. A model with a tokenizer gets
//! the text's own tokens; a model without one (the synthetic models) gets
//! ids derived from the text's words by hashing, deterministically, never
//! one of the model's end-of-sequence ids.

use std::path::Path;

use anyhow::{bail, Context, Result};

/// The bundled text (4.1 MB, one verse per line).
pub const KJV: &str = include_str!("../../../tools/demo/corpus.txt");

/// What the benchmark needs to know about a `.slip` model, read from its
/// `manifest.json` alone (opening the model would read and so warm its
/// dense weights before the cache is put in its stated state).
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub vocab_size: usize,
    pub num_experts: usize,
    pub num_layers: usize,
    pub eos: Vec<u32>,
    /// `tokenizer.json` bytes, when the model ships one.
    pub tokenizer: Option<Vec<u8>>,
}

impl ModelInfo {
    /// Reads `DIR/manifest.json` (and the tokenizer it names), or for a
    /// GGUF file run in place the manifest its importer derives
    /// (`gguf_index_dir`: where that importer keeps checksum tables of files
    /// whose own directory cannot take one, as `slipstream run` does).
    pub fn read(model: &Path, gguf_index_dir: Option<&Path>) -> Result<Self> {
        if slipstream_repack::is_gguf_file(model) {
            return Self::read_gguf(model, gguf_index_dir);
        }
        let path = model.join("manifest.json");
        let bytes = std::fs::read(&path).with_context(|| {
            format!(
                "reading {}: --model must be a .slip model directory or a GGUF file",
                path.display()
            )
        })?;
        let m: serde_json::Value = serde_json::from_slice(&bytes)
            .with_context(|| format!("parsing {}", path.display()))?;
        let tokenizer = match m["tokenizer"].as_str() {
            Some(name) => {
                let p = model.join(name);
                Some(std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?)
            }
            None => None,
        };
        Self::from_manifest(&m, tokenizer, &path)
    }

    /// A GGUF file's manifest as the in-place importer sees it. Opening
    /// reads the dense tensors; every run puts the file cache in its stated
    /// state afterwards.
    fn read_gguf(path: &Path, gguf_index_dir: Option<&Path>) -> Result<Self> {
        let opts = slipstream_repack::InPlaceOptions {
            index_dir: gguf_index_dir.map(Path::to_path_buf),
        };
        let model = slipstream_repack::open_gguf_in_place(path, &opts)
            .with_context(|| format!("opening {} in place", path.display()))?;
        let m = serde_json::to_value(&model.manifest).context("reading the manifest")?;
        let tokenizer = match m["tokenizer"].as_str() {
            Some(name) => Some(model.read_file(name)?),
            None => None,
        };
        Self::from_manifest(&m, tokenizer, path)
    }

    /// The fields of a manifest (`path` names it in errors).
    fn from_manifest(
        m: &serde_json::Value,
        tokenizer: Option<Vec<u8>>,
        path: &Path,
    ) -> Result<Self> {
        let num = |v: &serde_json::Value, what: &str| -> Result<usize> {
            v.as_u64()
                .map(|n| n as usize)
                .with_context(|| format!("{}: {what} missing or not a number", path.display()))
        };
        let vocab_size = num(&m["config"]["vocab_size"], "config.vocab_size")?;
        let num_experts = num(&m["experts"]["num_experts"], "experts.num_experts")?;
        let num_layers = num(&m["experts"]["num_layers"], "experts.num_layers")?;
        if vocab_size < 2 {
            bail!("{}: vocab_size {vocab_size} is too small", path.display());
        }
        let eos = m["eos_token_ids"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_u64())
                    .map(|v| v as u32)
                    .collect()
            })
            .unwrap_or_default();
        Ok(Self {
            vocab_size,
            num_experts,
            num_layers,
            eos,
            tokenizer,
        })
    }
}

/// How a prompt's ids were made, for the record.
pub fn prompt_source(info: &ModelInfo) -> &'static str {
    if info.tokenizer.is_some() {
        "KJV text, model tokenizer"
    } else {
        "KJV text, hashed words (model has no tokenizer)"
    }
}

/// Exactly `len` prompt ids from `text` (repeated when too short).
pub fn prompt_ids(info: &ModelInfo, text: &str, len: usize) -> Result<Vec<u32>> {
    if text.trim().is_empty() {
        bail!("the prompt text is empty");
    }
    match &info.tokenizer {
        Some(bytes) => {
            let tok = tokenizers::Tokenizer::from_bytes(bytes)
                .map_err(|e| anyhow::anyhow!("loading the model's tokenizer: {e}"))?;
            // Encode growing prefixes (a few bytes per token is typical) so a
            // short prompt does not tokenize the whole 4 MB text.
            let mut bytes_wanted = len.saturating_mul(6).max(256);
            loop {
                let (chunk, whole) = prefix(text, bytes_wanted);
                let ids = tok
                    .encode(chunk, false)
                    .map_err(|e| anyhow::anyhow!("tokenizing the prompt text: {e}"))?
                    .get_ids()
                    .to_vec();
                if ids.len() > len {
                    return Ok(ids[..len].to_vec());
                }
                if whole {
                    if ids.is_empty() {
                        bail!("the prompt text gives no tokens");
                    }
                    return Ok(ids.iter().copied().cycle().take(len).collect());
                }
                bytes_wanted = bytes_wanted.saturating_mul(2);
            }
        }
        None => {
            let words: Vec<&str> = text.split_whitespace().collect();
            let vocab = info.vocab_size as u64;
            Ok(words
                .iter()
                .cycle()
                .take(len)
                .map(|w| hashed_id(w, vocab, &info.eos))
                .collect())
        }
    }
}

/// The first `n` bytes of `text` cut at a char boundary, and whether that is all of it.
fn prefix(text: &str, n: usize) -> (&str, bool) {
    if n >= text.len() {
        return (text, true);
    }
    let mut end = n;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    (&text[..end], false)
}

/// A word's id: xxh3 of the word modulo the vocabulary, salted again until
/// it is not an end-of-sequence id.
fn hashed_id(word: &str, vocab: u64, eos: &[u32]) -> u32 {
    let mut salt = 0u64;
    loop {
        let id = (xxhash_rust::xxh3::xxh3_64_with_seed(word.as_bytes(), salt) % vocab) as u32;
        if !eos.contains(&id) {
            return id;
        }
        salt += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(vocab: usize, eos: Vec<u32>) -> ModelInfo {
        ModelInfo {
            vocab_size: vocab,
            num_experts: 8,
            num_layers: 2,
            eos,
            tokenizer: None,
        }
    }

    #[test]
    fn hashed_prompts_are_deterministic_and_avoid_eos() {
        let i = info(3, vec![0, 1]);
        let a = prompt_ids(&i, KJV, 500).unwrap();
        assert_eq!(a.len(), 500);
        assert!(a.iter().all(|&t| t == 2));
        let i = info(248_320, vec![248_044]);
        let a = prompt_ids(&i, KJV, 3000).unwrap();
        let b = prompt_ids(&i, KJV, 3000).unwrap();
        assert_eq!(a, b);
        assert!(a.iter().all(|&t| (t as usize) < 248_320));
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 500);
    }

    #[test]
    fn short_text_repeats() {
        let a = prompt_ids(&info(1000, vec![]), "in the beginning", 7).unwrap();
        assert_eq!(a.len(), 7);
        assert_eq!(a[0], a[3]);
        assert!(prompt_ids(&info(1000, vec![]), "  ", 7).is_err());
    }
}
