//! GGUF parity: each `tests/fixtures/gguf_*/model.gguf` (a tiny random model
//! converted by llama.cpp's own `convert_hf_to_gguf.py`, see
//! `tools/reference/make_gguf_fixtures.py`) is repacked, run, and its logits
//! compared with the `transformers` float32 logits computed on exactly the
//! GGUF's (dequantized) weights; greedy tokens must match. The qwen3.5
//! fixtures have more linear value heads than key heads, so a wrong undo of
//! the converter's value-head reorder fails here.

use std::path::{Path, PathBuf};

use slipstream_engine::text::TextCodec;
use slipstream_engine::{npy, Engine, EngineConfig, GenerateRequest, SamplingParams, StoreChoice};
use slipstream_format::SlipModel;
use slipstream_repack::{repack, QuantChoice, RepackOptions};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

struct Reference {
    text: String,
    prompt: Vec<u32>,
    greedy: Vec<u32>,
    vocab: usize,
    logits: Vec<f32>,
}

fn reference(dir: &Path) -> Reference {
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
    let ids = |k: &str| -> Vec<u32> {
        json[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    let (shape, logits) = npy::read_f32(&dir.join("logits.npy")).unwrap();
    Reference {
        text: json["prompt_text"].as_str().unwrap().to_string(),
        prompt: ids("prompt_tokens"),
        greedy: ids("greedy_tokens"),
        vocab: shape[1],
        logits,
    }
}

/// Repacks, runs, compares; returns the max relative logit error.
fn check(name: &str, bound: f32) -> f32 {
    let dir = fixture(name);
    let r = reference(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.slip");
    let report = repack(
        &RepackOptions {
            input: dir.join("model.gguf"),
            output: out.clone(),
            overwrite: Default::default(),
            quant: QuantChoice::default(),
        },
        &|_| {},
    )
    .unwrap();
    assert_eq!(report.kind.name(), "gguf");

    // The tokenizer rebuilt from tokenizer.ggml.* encodes like the original.
    let model = SlipModel::open(&out).unwrap();
    let codec = TextCodec::from_bytes(&model.read_file("tokenizer.json").unwrap()).unwrap();
    assert_eq!(
        codec.encode(&r.text).unwrap(),
        r.prompt,
        "{name}: tokenizer"
    );
    assert_eq!(codec.decode(&r.prompt).unwrap(), r.text);
    assert_eq!(model.manifest.eos_token_ids, vec![2]);
    assert!(model.manifest.chat_template.is_some());
    drop(model);

    let mut engine = Engine::open(
        &out,
        EngineConfig {
            prefill_chunk: 4096,
            store: StoreChoice::Resident,
            route_trace: None,
        },
    )
    .unwrap();
    let gen = engine
        .generate(
            &GenerateRequest {
                prompt: r.prompt.clone(),
                max_new_tokens: r.greedy.len(),
                sampling: SamplingParams::default(),
                stop_tokens: vec![],
                keep_logits: true,
                cancel: None,
            },
            &mut |_| true,
        )
        .unwrap();
    let n = gen.tokens.len();
    assert_eq!(
        gen.tokens[..],
        r.greedy[..n],
        "{name}: greedy tokens differ"
    );
    let rows = gen.logits.len() / r.vocab;
    assert_eq!(rows, r.prompt.len() + n - 1);
    let reference = &r.logits[..rows * r.vocab];
    let max_ref = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let max_diff = gen
        .logits
        .iter()
        .zip(reference)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    let err = max_diff / max_ref;
    eprintln!("{name}: max rel logit error {err:.3e} over {rows} positions");
    assert!(
        err < bound,
        "{name}: relative logit error {err:e} >= {bound:e}"
    );
    err
}

// The reference runs on the dequantized weights, so the only differences are
// float32 summation order and transcendental functions: the same bound as the
// safetensors parity tests.
const BOUND: f32 = 1e-4;

#[test]
fn qwen35moe_f16_gguf_matches_transformers() {
    check("gguf_qwen35moe_f16", BOUND);
}

#[test]
fn qwen35moe_q8_0_gguf_matches_transformers() {
    check("gguf_qwen35moe_q8_0", BOUND);
}

#[test]
fn qwen35moe_kquant_gguf_matches_transformers() {
    check("gguf_qwen35moe_kquant", BOUND);
}

#[test]
fn qwen3moe_q4_0_gguf_matches_transformers() {
    check("gguf_qwen3moe_q4_0", BOUND);
}
