//! Int16 activations (`Transformer::set_activations`): close to the exact
//! f32 run, and still bit-identical across expert-cache sizes and prefill
//! chunking.

use std::path::Path;

use slipstream_engine::StoreChoice;
use slipstream_kernels::Activations;
use slipstream_repack::QuantChoice;
use slipstream_testkit::{greedy, open, prompt, rel_err, repacked, same_bits, streaming};

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
