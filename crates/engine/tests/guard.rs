//! Invariant 3: the memory guard refuses a prompt that would not fit, with a
//! clear error and before allocating; the same prompt runs with the limit
//! raised. (Its own test binary, so no other test moves the footprint.)

use std::path::Path;

use slipstream_engine::guard::current_rss_bytes;
use slipstream_engine::{
    Engine, EngineConfig, EngineError, GenerateRequest, SamplingParams, StoreChoice,
};
use slipstream_repack::{repack, QuantChoice, RepackOptions};
use slipstream_store::StreamConfig;

#[test]
fn guard_refuses_an_over_long_prompt_and_accepts_it_with_the_limit_raised() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m.slip");
    repack(
        &RepackOptions {
            input: Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures/qwen3_5_moe_fused"),
            output: model.clone(),
            overwrite: Default::default(),
            quant: QuantChoice::Q4,
        },
        &|_| {},
    )
    .unwrap();
    let mut e = Engine::open(
        &model,
        EngineConfig {
            prefill_chunk: 512,
            store: StoreChoice::Streaming(StreamConfig {
                slots: 4,
                ..Default::default()
            }),
            route_trace: None,
        },
    )
    .unwrap();
    assert!(
        e.memory_limit().is_some(),
        "a default limit is set on Linux"
    );
    let long: Vec<u32> = (0..6000u32).map(|i| (i * 7 + 3) % 500).collect();
    let req = GenerateRequest {
        prompt: long.clone(),
        max_new_tokens: 2,
        sampling: SamplingParams::default(),
        stop_tokens: vec![],
        keep_logits: false,
        cancel: None,
    };
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
    let short = GenerateRequest {
        prompt: long[..8].to_vec(),
        ..req.clone()
    };
    let g = e.generate(&short, &mut |_| true).unwrap();
    assert_eq!(g.tokens.len(), 2);

    // Raised: the same prompt runs.
    e.set_memory_limit(Some(rss + 4 * growth.total() + (256 << 20)));
    let g = e.generate(&req, &mut |_| true).unwrap();
    assert_eq!(g.tokens.len(), 2);
    assert_eq!(g.stats.prompt_tokens, 6000);
}

#[test]
fn default_limit_is_ninety_percent_of_the_smaller_of_ram_and_cgroup() {
    let ram = slipstream_engine::guard::physical_memory_bytes().unwrap();
    let limit = slipstream_engine::default_memory_limit().unwrap();
    let cap = match slipstream_engine::guard::cgroup_limit_bytes() {
        Some(c) => c.min(ram),
        None => ram,
    };
    assert_eq!(limit, cap / 10 * 9);
}
