//! Parity with the Hugging Face reference: every committed fixture under
//! `tests/fixtures/` is repacked, run, and its logits at every position
//! compared with the `transformers` float32 logits; greedy tokens must match.

use slipstream_engine::StoreChoice;
use slipstream_format::SlipModel;
use slipstream_repack::QuantChoice;
use slipstream_testkit::{fixture, greedy, open, repacked, same_bits, streaming, Reference};

fn check(name: &str, quant: QuantChoice, chunk: usize) -> Vec<f32> {
    let dir = fixture(name);
    let r = Reference::read(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let out = repacked(name, quant, tmp.path());
    // The greedy tokens are compared up to the first EOS (generation
    // stops there).
    let (gen, err, rows) = r.run_greedy(name, &out, chunk);
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
fn qwen3_next_matches_transformers() {
    // Fused per-key-head `in_proj_qkvz` / `in_proj_ba` split at repack; bf16
    // weights stored f32, so the model's numbers are the reference's.
    check("qwen3_next", QuantChoice::F32, 4096);
}

#[test]
fn qwen3_next_mlx4_matches_dequantized_reference() {
    // mlx-lm keeps in_proj_qkvz / in_proj_ba fused and 4-bit: their code,
    // scale and bias rows are split like float rows.
    check("qwen3_next_mlx4", QuantChoice::Q4, 4096);
}

#[test]
fn qwen3_next_keeps_its_mtp_head_and_streams_bit_identically() {
    let tmp = tempfile::tempdir().unwrap();
    let out = repacked("qwen3_next", QuantChoice::Q4, tmp.path());
    // The config declares no MTP layer; the checkpoint's `mtp.layers.0` is
    // counted and kept, numbered after the main stack.
    let model = SlipModel::open(&out).unwrap();
    let cfg = &model.manifest.config;
    assert_eq!(cfg.architecture.name(), "qwen3_next");
    assert_eq!((cfg.num_layers(), cfg.mtp_num_layers), (4, 1));
    assert!(model.tensor("layers.4.mtp.fc").is_ok());
    drop(model);
    let r = Reference::read(&fixture("qwen3_next"));
    let run = |store: StoreChoice| greedy(&mut open(&out, store, 4096), &r.prompt, 8);
    let resident = run(StoreChoice::Resident);
    for slots in [1usize, 3, 8] {
        let streamed = run(streaming(slots));
        assert_eq!(streamed.tokens, resident.tokens, "slots {slots}");
        assert!(
            same_bits(&streamed.logits, &resident.logits),
            "slots {slots}: logits differ from the resident run"
        );
    }
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
        ("qwen3_next", QuantChoice::F32),
    ] {
        let whole = check(name, quant, 4096);
        for chunk in [1, 3, 5] {
            let chunked = check(name, quant, chunk);
            assert!(
                same_bits(&whole, &chunked),
                "{name}: logits with prefill chunk {chunk} differ from one chunk"
            );
        }
    }
}
