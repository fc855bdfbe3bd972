//! Parity with the Hugging Face reference: every committed fixture under
//! `tests/fixtures/` is repacked, run, and its logits at every position
//! compared with the `transformers` float32 logits; greedy tokens must match.

use slipstream_engine::StoreChoice;
use slipstream_repack::{repack, QuantChoice, RepackOptions};
use slipstream_testkit::{fixture, greedy, open, rel_err, same_bits, Reference};

fn check(name: &str, quant: QuantChoice, chunk: usize) -> Vec<f32> {
    let dir = fixture(name);
    let r = Reference::read(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.slip");
    repack(
        &RepackOptions {
            input: dir.clone(),
            output: out.clone(),
            overwrite: Default::default(),
            quant,
            ggml_to_affine: false,
        },
        &|_| {},
    )
    .unwrap();
    let mut engine = open(&out, StoreChoice::Resident, chunk);
    let gen = greedy(&mut engine, &r.prompt, r.greedy.len());
    // Compare the greedy tokens up to the first EOS (generation stops there).
    let n = gen.tokens.len();
    assert_eq!(
        gen.tokens[..],
        r.greedy[..n],
        "{name}: greedy tokens differ"
    );
    let vocab = r.vocab();
    let rows = gen.logits.len() / vocab;
    assert_eq!(rows, r.prompt.len() + n - 1);
    let err = rel_err(&gen.logits, &r.logits[..rows * vocab]);
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
                same_bits(&whole, &chunked),
                "{name}: logits with prefill chunk {chunk} differ from one chunk"
            );
        }
    }
}
