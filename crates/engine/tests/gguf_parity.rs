//! GGUF parity: each `tests/fixtures/gguf_*/model.gguf` (a tiny random model
//! converted by llama.cpp's own `convert_hf_to_gguf.py`, see
//! `tools/reference/make_gguf_fixtures.py`) is repacked, run, and its logits
//! compared with the `transformers` float32 logits computed on exactly the
//! GGUF's (dequantized) weights; greedy tokens must match. The qwen3.5
//! fixtures have more linear value heads than key heads, so a wrong undo of
//! the converter's value-head reorder fails here. Q4_0 / Q8_0 fixtures run
//! twice: as GGML blocks (repack's default) and converted to affine group 32.

use slipstream_core::QuantType;
use slipstream_engine::text::TextCodec;
use slipstream_format::SlipModel;
use slipstream_repack::QuantChoice;
use slipstream_testkit::{fixture, repack_into, Reference};

/// Repacks (Q4_0 / Q8_0 converted to affine or not), runs, compares;
/// returns the max relative logit error.
fn check(name: &str, bound: f32, ggml_to_affine: bool) -> f32 {
    let dir = fixture(name);
    let r = Reference::read(&dir);
    let text = r.text.clone().expect("the reference has a prompt_text");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.slip");
    let report = repack_into(
        &dir.join("model.gguf"),
        &out,
        QuantChoice::default(),
        ggml_to_affine,
    );
    assert_eq!(report.kind.name(), "gguf");
    // Converted: no Q4_0 / Q8_0 left, dense or expert; kept: as stored.
    let model = SlipModel::open(&out).unwrap();
    let types: Vec<QuantType> = (model.manifest.dense.iter())
        .map(|d| model.tensor(&d.name).unwrap().qtype)
        .chain(report.expert_layout.iter().map(|p| p.1))
        .collect();
    let ggml_0 = |q: &QuantType| matches!(q, QuantType::Q4_0 | QuantType::Q8_0);
    let affine_32 = |q: &QuantType| matches!(q, QuantType::Affine { group: 32, .. });
    if !ggml_to_affine {
        assert!(
            !types.iter().any(affine_32),
            "{name}: converted though kept"
        );
    } else {
        assert!(
            !types.iter().any(ggml_0),
            "{name}: Q4_0/Q8_0 left: {types:?}"
        );
    }
    drop(model);

    // The tokenizer rebuilt from tokenizer.ggml.* encodes like the original.
    let model = SlipModel::open(&out).unwrap();
    let codec = TextCodec::from_bytes(&model.read_file("tokenizer.json").unwrap()).unwrap();
    assert_eq!(codec.encode(&text).unwrap(), r.prompt, "{name}: tokenizer");
    assert_eq!(codec.decode(&r.prompt).unwrap(), text);
    assert_eq!(model.manifest.eos_token_ids, vec![2]);
    assert!(model.manifest.chat_template.is_some());
    drop(model);

    let (_, err, rows) = r.run_greedy(name, &out, 4096);
    eprintln!(
        "{name} (ggml_to_affine: {ggml_to_affine}): max rel logit error {err:.3e} over {rows} positions"
    );
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
    check("gguf_qwen35moe_f16", BOUND, false);
}

#[test]
fn qwen35moe_q8_0_gguf_matches_transformers() {
    check("gguf_qwen35moe_q8_0", BOUND, false);
}

#[test]
fn qwen35moe_q8_0_gguf_as_affine_matches_transformers() {
    check("gguf_qwen35moe_q8_0", BOUND, true);
}

#[test]
fn qwen35moe_kquant_gguf_matches_transformers() {
    check("gguf_qwen35moe_kquant", BOUND, false);
}

// qwen3next: the converter's split of `in_proj_qkvz` kept, its fused
// `ssm_ba` split into b and a (F16 rows, then Q8_0 block rows).
#[test]
fn qwen3next_f16_gguf_matches_transformers() {
    check("gguf_qwen3next_f16", BOUND, false);
}

#[test]
fn qwen3next_q8_0_gguf_matches_transformers() {
    check("gguf_qwen3next_q8_0", BOUND, false);
}

#[test]
fn qwen3next_q8_0_gguf_as_affine_matches_transformers() {
    check("gguf_qwen3next_q8_0", BOUND, true);
}

#[test]
fn qwen3moe_q4_0_gguf_matches_transformers() {
    check("gguf_qwen3moe_q4_0", BOUND, false);
}

#[test]
fn qwen3moe_q4_0_gguf_as_affine_matches_transformers() {
    check("gguf_qwen3moe_q4_0", BOUND, true);
}
