//! Int16 (affine weights) and Int8 (GGML block weights) activations
//! (`Transformer::set_activations`): close to the exact f32 run, and still
//! bit-identical across expert-cache sizes and prefill chunking.

use std::path::Path;

use slipstream_engine::StoreChoice;
use slipstream_kernels::Activations;
use slipstream_repack::QuantChoice;
use slipstream_testkit::{
    fixture, greedy, open, prompt, rel_err, repacked, repacked_gguf, same_bits, streaming,
    Reference,
};

/// Greedy tokens, all logits and the vocabulary size.
fn logits(
    model: &Path,
    store: StoreChoice,
    chunk: usize,
    act: Activations,
) -> (Vec<u32>, Vec<f32>, usize) {
    let mut engine = open(model, store, chunk);
    engine.model.set_activations(act);
    let gen = greedy(&mut engine, &prompt(), 6);
    (gen.tokens, gen.logits, engine.model_config().vocab_size)
}

#[test]
fn int16_is_close_to_exact_and_cache_invariant() {
    let dir = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_5_moe_fused", QuantChoice::Q4, dir.path());
    let (_, exact, vocab) = logits(&model, StoreChoice::Resident, 4096, Activations::Exact);
    let (tokens, int16, _) = logits(&model, StoreChoice::Resident, 4096, Activations::Int16);
    // The prompt positions (the generated tokens may part after a near tie).
    let rows = prompt().len() * vocab;
    let (a, b) = (&exact[..rows], &int16[..rows]);
    let err = rel_err(b, a);
    eprintln!("int16 vs exact: max rel logit error {err:.3e} over the prompt");
    assert!(err > 0.0, "int16 path not taken");
    assert!(err < 1e-2, "int16 error {err}");
    for (slots, chunk) in [(1, 4096), (3, 5), (64, 1)] {
        let (t, l, _) = logits(&model, streaming(slots), chunk, Activations::Int16);
        assert_eq!(t, tokens, "slots {slots} chunk {chunk}");
        assert!(
            same_bits(&l, &int16),
            "slots {slots} chunk {chunk}: logits differ"
        );
    }
}

/// Int8 activations (GGML block weights, `Activations::Int8`) on the GGUF
/// fixtures made by llama.cpp's converter, kept as GGML blocks: close to the
/// exact run and to the `transformers` reference, the reference's greedy
/// tokens, and bit-identical across expert-slot counts and prefill chunks.
/// Returns the max relative logit error against the exact run.
fn int8_on_gguf(name: &str, bound: f32) -> f32 {
    let r = Reference::read(&fixture(name));
    let dir = tempfile::tempdir().unwrap();
    let model = repacked_gguf(name, dir.path());
    let run = |store, chunk, act| {
        let mut engine = open(&model, store, chunk);
        engine.model.set_activations(act);
        greedy(&mut engine, &r.prompt, r.greedy.len())
    };
    let exact = run(StoreChoice::Resident, 4096, Activations::Exact);
    let int8 = run(StoreChoice::Resident, 4096, Activations::Int8);
    assert_eq!(int8.tokens, r.greedy, "{name}: int8 greedy tokens");
    assert_eq!(exact.tokens, int8.tokens);
    let err = rel_err(&int8.logits, &exact.logits);
    let err_ref = rel_err(&int8.logits, &r.logits[..int8.logits.len()]);
    eprintln!("{name}: int8 vs exact max rel logit error {err:.3e}, vs transformers {err_ref:.3e}");
    assert!(err > 0.0, "{name}: int8 path not taken");
    assert!(err < bound, "{name}: int8 error {err:e} >= {bound:e}");
    assert!(
        err_ref < bound,
        "{name}: int8 error vs transformers {err_ref:e}"
    );
    for (slots, chunk) in [(1, 4096), (3, 5), (64, 1)] {
        let g = run(streaming(slots), chunk, Activations::Int8);
        assert_eq!(g.tokens, int8.tokens, "{name}: slots {slots} chunk {chunk}");
        assert!(
            same_bits(&g.logits, &int8.logits),
            "{name}: slots {slots} chunk {chunk}: logits differ"
        );
    }
    err
}

// Measured 2026-12-07: 1.88e-2 (Q4_0 fixture), 2.31e-2 (K-quant fixture),
// against the exact run and the `transformers` logits alike (the tiny random
// fixtures compound each layer's input rounding; the affine Int16 mode gives
// 2e-3 on its fixture). Greedy tokens still equal the reference's.
const INT8_BOUND: f32 = 5e-2;

#[test]
fn int8_on_q4_0_gguf() {
    int8_on_gguf("gguf_qwen3moe_q4_0", INT8_BOUND);
}

#[test]
fn int8_on_kquant_gguf() {
    int8_on_gguf("gguf_qwen35moe_kquant", INT8_BOUND);
}
