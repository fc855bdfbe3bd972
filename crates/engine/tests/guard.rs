//! Invariant 3: the memory guard refuses a prompt that would not fit, with a
//! clear error and before allocating; the same prompt runs with the limit
//! raised. (Its own test binary, so no other test moves the footprint.)

use slipstream_engine::guard::current_rss_bytes;
use slipstream_engine::{EngineError, GenerateRequest};
use slipstream_repack::QuantChoice;
use slipstream_testkit::{open, repacked, streaming};

#[test]
fn guard_refuses_an_over_long_prompt_and_accepts_it_with_the_limit_raised() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_5_moe_fused", QuantChoice::Q4, tmp.path());
    let mut e = open(&model, streaming(4), 512);
    assert_eq!(
        e.memory_limit(),
        None,
        "the library sets no limit of its own (the command passes one)"
    );
    let long: Vec<u32> = (0..6000u32).map(|i| (i * 7 + 3) % 500).collect();
    let req = GenerateRequest::new(long.clone(), 2);
    let growth = e.predict_prefill_growth(&e.new_state(), long.len(), false);
    // KV of 6000 tokens in 2 attention layers (64 wide), grown by doubling.
    assert!(growth.state >= 6000 * 64 * 4 * 2 * 2, "{growth:?}");
    assert!(growth.unfilled_slots > 0);
    // Opening verified every dense tensor through the mapping: those pages
    // are already in the footprint and must not be predicted again.
    let dense = slipstream_format::SlipModel::open(&model)
        .unwrap()
        .manifest
        .dense_file_bytes;
    assert!(growth.dense_untouched < dense / 2, "{growth:?} of {dense}");
    let rss = current_rss_bytes().unwrap();
    e.set_memory_limit(Some(rss + growth.total() / 2));
    let mut state = e.new_state();
    let err = e
        .generate_with_state(&mut state, &req, &mut |_| true)
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, EngineError::Memory(_)), "{err:?}");
    assert!(
        msg.contains("memory guard") && msg.contains("exceeds the memory limit"),
        "{msg}"
    );
    assert!(msg.contains("--memory-limit"), "{msg}");
    // Refused before the first chunk: nothing ran, nothing was kept.
    assert_eq!(e.store_counters().misses, 0);
    assert!(state.tokens.is_empty());
    // A short prompt still fits under the same limit.
    let short = GenerateRequest::new(long[..8].to_vec(), 2);
    let g = e.generate(&short, &mut |_| true).unwrap();
    assert_eq!(g.tokens.len(), 2);

    // Raised: the same prompt runs.
    e.set_memory_limit(Some(rss + 4 * growth.total() + (256 << 20)));
    let g = e.generate(&req, &mut |_| true).unwrap();
    assert_eq!(g.tokens.len(), 2);
    assert_eq!(g.stats.prompt_tokens, 6000);
}
