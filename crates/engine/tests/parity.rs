//! Parity with the Hugging Face reference: every committed fixture under
//! `tests/fixtures/` is repacked, run, and its logits at every position
//! compared with the `transformers` float32 logits; greedy tokens must match.

use std::path::{Path, PathBuf};

use slipstream_engine::{npy, Engine, EngineConfig, GenerateRequest, SamplingParams, StoreChoice};
use slipstream_repack::{repack, QuantChoice, RepackOptions};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

struct Reference {
    prompt: Vec<u32>,
    greedy: Vec<u32>,
    shape: Vec<usize>,
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
        prompt: ids("prompt_tokens"),
        greedy: ids("greedy_tokens"),
        shape,
        logits,
    }
}

/// Max |ours - ref| / max |ref| over the rows both have.
fn rel_error(ours: &[f32], reference: &[f32]) -> f32 {
    let max_ref = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let max_diff = ours
        .iter()
        .zip(reference)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    max_diff / max_ref
}

fn check(name: &str, quant: QuantChoice, chunk: usize) -> Vec<f32> {
    let dir = fixtures().join(name);
    let r = reference(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.slip");
    repack(
        &RepackOptions {
            input: dir.clone(),
            output: out.clone(),
            overwrite: Default::default(),
            quant,
        },
        &|_| {},
    )
    .unwrap();
    let mut engine = Engine::open(
        &out,
        EngineConfig {
            prefill_chunk: chunk,
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
    // Compare the greedy tokens up to the first EOS (generation stops there).
    let n = gen.tokens.len();
    assert_eq!(
        gen.tokens[..],
        r.greedy[..n],
        "{name}: greedy tokens differ"
    );
    let vocab = r.shape[1];
    let rows = gen.logits.len() / vocab;
    assert_eq!(rows, r.prompt.len() + n - 1);
    let err = rel_error(&gen.logits, &r.logits[..rows * vocab]);
    eprintln!(
        "{name} ({quant}, chunk {chunk}): max rel logit error {err:.3e} over {rows} positions"
    );
    assert!(err < 1e-4, "{name}: relative logit error {err:e} >= 1e-4");
    gen.logits
}

#[test]
fn qwen3_5_moe_fused_f32_matches_transformers() {
    check("qwen3_5_moe_fused", QuantChoice::F32, 4096);
}

#[test]
fn qwen3_5_moe_split_bf16_sharded_matches_transformers() {
    check("qwen3_5_moe_split", QuantChoice::F32, 4096);
}

#[test]
fn qwen3_moe_matches_transformers() {
    check("qwen3_moe", QuantChoice::F32, 4096);
}

#[test]
fn qwen3_5_moe_mlx4_matches_dequantized_reference() {
    check("qwen3_5_moe_mlx4", QuantChoice::Q4, 4096);
}

#[test]
fn prefill_chunk_size_is_bit_identical() {
    // Chunks of a few tokens cross both layer kinds' state hand-off many
    // times; the numbers must not move by a single bit.
    for (name, quant) in [
        ("qwen3_5_moe_fused", QuantChoice::F32),
        ("qwen3_5_moe_mlx4", QuantChoice::Q4),
        ("qwen3_moe", QuantChoice::F32),
    ] {
        let whole = check(name, quant, 4096);
        for chunk in [1, 3, 5] {
            let chunked = check(name, quant, chunk);
            assert!(
                whole
                    .iter()
                    .zip(&chunked)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}: logits with prefill chunk {chunk} differ from one chunk"
            );
        }
    }
}
