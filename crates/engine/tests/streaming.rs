//! Invariant 1: the expert cache never changes numerics. Every slot count,
//! policy and I/O mode gives tokens and logits bit-identical to the
//! all-resident run.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use slipstream_engine::{
    Engine, EngineConfig, GenerateRequest, SamplingParams, SlipModel, StoreChoice,
};
use slipstream_repack::QuantChoice;
use slipstream_store::{PolicyKind, Readahead, StreamConfig};
use slipstream_testkit::{open, prompt, repacked, same_bits, sampled};

fn generate(model: &Path, store: StoreChoice, chunk: usize) -> (Vec<u32>, Vec<f32>, u64) {
    let mut engine = open(model, store, chunk);
    let gen = engine
        .generate(&sampled(prompt(), 12, 3), &mut |_| true)
        .unwrap();
    (gen.tokens, gen.logits, engine.store_counters().misses)
}

/// Flips one bit inside every expert record `(layer, expert)` of the
/// model's pool file that `bad` picks; returns the model opened afterwards.
fn corrupt_records(model: &Path, bad: impl Fn(usize, usize) -> bool) -> Arc<SlipModel> {
    let file = SlipModel::open(model).unwrap();
    let pool = &file.manifest.experts;
    let path = model.join("experts.bin");
    let mut bytes = std::fs::read(&path).unwrap();
    for layer in 0..pool.num_layers {
        for expert in (0..pool.num_experts).filter(|&e| bad(layer, e)) {
            bytes[pool.record_offset(layer, expert) as usize + 64] ^= 0x01;
        }
    }
    drop(file);
    std::fs::write(&path, bytes).unwrap();
    Arc::new(SlipModel::open(model).unwrap())
}

#[test]
fn every_slot_count_policy_and_io_mode_is_bit_identical() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, quant) in [
        ("qwen3_5_moe_fused", QuantChoice::Q4),
        ("qwen3_moe", QuantChoice::F32),
        ("qwen3_5_moe_mlx4", QuantChoice::Q4),
    ] {
        let model = repacked(name, quant, tmp.path());
        let (tokens, logits, _) = generate(&model, StoreChoice::Resident, 4096);
        for slots in [1usize, 2, 7, 64, 8] {
            for policy in PolicyKind::ALL {
                for direct_io in [false, true] {
                    for chunk in [4096, 4] {
                        let cfg = StreamConfig {
                            slots,
                            policy,
                            io_threads: 3,
                            direct_io,
                            readahead: Readahead::Random,
                            background_fill: true,
                        };
                        let (t, l, misses) = generate(&model, StoreChoice::Streaming(cfg), chunk);
                        let what = format!(
                            "{name}: slots {slots} {policy} direct {direct_io} chunk {chunk}"
                        );
                        assert_eq!(t, tokens, "{what}: tokens differ");
                        assert!(same_bits(&l, &logits), "{what}: logits differ");
                        assert!(misses > 0, "{what}: a cold cache must miss");
                    }
                }
            }
        }
    }
}

#[test]
fn fewer_slots_miss_more() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_5_moe_fused", QuantChoice::Q4, tmp.path());
    let misses = |slots| {
        generate(
            &model,
            StoreChoice::Streaming(StreamConfig {
                slots,
                ..Default::default()
            }),
            4096,
        )
        .2
    };
    let (m1, m4, m8) = (misses(1), misses(4), misses(8));
    assert!(m1 > m4 && m4 >= m8, "misses 1:{m1} 4:{m4} 8:{m8}");
    // All 8 experts resident: only cold misses, at most 8 per layer.
    assert!(m8 <= 8 * 6, "{m8}");
}

#[test]
fn corrupted_record_read_at_run_time_names_layer_and_expert() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_moe", QuantChoice::F32, tmp.path());
    drop(corrupt_records(&model, |l, e| (l, e) == (2, 5)));
    let mut engine = Engine::open(&model, EngineConfig::default()).unwrap();
    // Route every token of a long prompt so expert 5 of layer 2 is needed.
    let err = engine
        .generate(
            &GenerateRequest::new((0..200).map(|i| (i * 13) % 500).collect(), 4),
            &mut |_| true,
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("expert 5 of layer 2") && err.contains("checksum"),
        "{err}"
    );
}

/// A batch whose reads fail verification leaves none of its experts in a
/// slot: the reads still in flight when the first bad record is found are
/// waited for and forgotten, never kept as unverified hits.
#[test]
fn failed_batch_keeps_no_unverified_expert() {
    use slipstream_core::{ExpertRequest, ExpertSource};
    use slipstream_store::{ExpertStore, StreamingStore};
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_moe", QuantChoice::F32, tmp.path());
    let layer = 2;
    let file = corrupt_records(&model, |l, _| l == layer);
    let experts = file.manifest.experts.num_experts;
    let mut store = StreamingStore::open(
        file,
        StreamConfig {
            slots: experts,
            io_threads: 4,
            ..Default::default()
        },
    )
    .unwrap();
    let all: Vec<u32> = (0..experts as u32).collect();
    let counts = vec![1u32; experts];
    let req = ExpertRequest {
        layer,
        experts: &all,
        counts: &counts,
        tokens: experts as u32,
    };
    let mut computed = 0;
    let err = store
        .with_expert_batches(&req, &mut |batch| computed += batch.len())
        .unwrap_err()
        .to_string();
    assert!(err.contains("checksum") && err.contains("layer 2"), "{err}");
    assert_eq!(computed, 0, "no corrupt expert may be computed");
    assert!(
        store.resident_experts()[layer].is_empty(),
        "unverified experts kept: {:?}",
        store.resident_experts()[layer]
    );
    // The store stays usable: the same batch fails again the same way.
    assert!(store.with_expert_batches(&req, &mut |_| {}).is_err());
}

#[test]
fn replaying_the_route_trace_reproduces_the_runtime_counters() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_5_moe_fused", QuantChoice::Q4, tmp.path());
    for policy in PolicyKind::ALL {
        for slots in [1usize, 3, 5] {
            let trace = tmp.path().join(format!("{policy}-{slots}.trace"));
            let mut engine = Engine::open(
                &model,
                EngineConfig {
                    prefill_chunk: 7,
                    store: StoreChoice::Streaming(StreamConfig {
                        slots,
                        policy,
                        ..Default::default()
                    }),
                    route_trace: Some(trace.clone()),
                    ..EngineConfig::default()
                },
            )
            .unwrap();
            let gen = engine
                .generate(
                    &GenerateRequest::new(prompt(), 40).with_sampling(SamplingParams {
                        temperature: 1.0,
                        seed: 11,
                        ..Default::default()
                    }),
                    &mut |_| true,
                )
                .unwrap();
            engine.finish_trace().unwrap();
            let counters = engine.store_counters();
            let (header, records) = slipstream_store::trace::read_trace(&trace).unwrap();
            let r = slipstream_store::replay::replay(
                &header,
                &records,
                slots,
                policy.name(),
                slipstream_store::replay::PhaseFilter::All,
            )
            .unwrap();
            assert_eq!(
                (r.hits, r.misses),
                (counters.hits, counters.misses),
                "{policy} at {slots} slots"
            );
            assert_eq!(
                r.decode_misses, gen.stats.decode_expert_misses,
                "{policy} {slots}"
            );
            // Belady never misses more than the runtime's policy.
            let best = slipstream_store::replay::replay(
                &header,
                &records,
                slots,
                "belady",
                slipstream_store::replay::PhaseFilter::All,
            )
            .unwrap();
            assert!(
                best.misses <= r.misses,
                "belady {} > {policy} {}",
                best.misses,
                r.misses
            );
        }
    }
}

#[test]
fn continuing_a_kept_state_equals_a_fresh_run() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_5_moe_fused", QuantChoice::Q4, tmp.path());
    let mut engine = Engine::open(&model, EngineConfig::default()).unwrap();
    let req = |prompt: Vec<u32>| GenerateRequest::new(prompt, 6);
    // Turn 1, then turn 2 whose prompt extends everything fed so far.
    let mut state = engine.new_state();
    let first = engine
        .generate_with_state(&mut state, &req(prompt()), &mut |_| true)
        .unwrap();
    let mut second_prompt = state.tokens.clone();
    second_prompt.extend_from_slice(&first.tokens[first.tokens.len() - 1..]);
    second_prompt.extend_from_slice(&[5, 6, 7]);
    let kept = engine
        .generate_with_state(&mut state, &req(second_prompt.clone()), &mut |_| true)
        .unwrap();
    assert_eq!(kept.stats.reused_prompt_tokens, prompt().len() + 5);
    let fresh = engine.generate(&req(second_prompt), &mut |_| true).unwrap();
    assert_eq!(kept.tokens, fresh.tokens);
    assert_eq!(fresh.stats.reused_prompt_tokens, 0);
}

#[test]
fn cancel_flag_stops_prefill_between_chunks() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_moe", QuantChoice::Q4, tmp.path());
    let mut engine = open(&model, EngineConfig::default().store, 4);
    let flag = Arc::new(AtomicBool::new(true));
    let gen = engine
        .generate(
            &GenerateRequest::new(prompt(), 6).cancelled_by(flag.clone()),
            &mut |_| true,
        )
        .unwrap();
    assert_eq!(gen.finish, slipstream_engine::FinishReason::Cancelled);
    assert!(gen.tokens.is_empty());
    flag.store(false, Ordering::Relaxed);
}

/// The small hybrid test model (hidden 256, no MTP layer).
fn synthetic_model(dir: &Path) -> PathBuf {
    slipstream_testkit::small_hybrid_model(dir, "synth.slip", 256, 0, 9)
}

#[test]
fn synthetic_model_is_bit_identical_at_every_slot_count() {
    let tmp = tempfile::tempdir().unwrap();
    let model = synthetic_model(tmp.path());
    let (tokens, logits, _) = generate(&model, StoreChoice::Resident, 4096);
    assert!(logits.iter().all(|v| v.is_finite()));
    for slots in [1usize, 2, 7, 32] {
        for policy in PolicyKind::ALL {
            for direct_io in [false, true] {
                let cfg = StreamConfig {
                    slots,
                    policy,
                    io_threads: 2,
                    direct_io,
                    readahead: Readahead::Default,
                    background_fill: true,
                };
                let (t, l, _) = generate(&model, StoreChoice::Streaming(cfg), 5);
                let what = format!("synthetic: slots {slots} {policy} direct {direct_io}");
                assert_eq!(t, tokens, "{what}: tokens differ");
                assert!(same_bits(&l, &logits), "{what}: logits differ");
            }
        }
    }
}

/// `--direct-io auto`: O_DIRECT when every expert has a slot or when the
/// memory beside the predicted footprint cannot cache half of the expert
/// file; buffered otherwise; explicit choices always win.
#[test]
fn auto_direct_io_follows_slots_and_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let path = repacked("qwen3_5_moe_fused", QuantChoice::Q4, tmp.path());
    let file = SlipModel::open(&path).unwrap();
    let m = &file.manifest;
    let experts = m.config.num_experts;
    let pool = m.experts.record_stride * (m.config.num_layers() * experts) as u64;
    let (context, chunk) = (4096, 512);
    let resolve = |mode, slots, memory| {
        slipstream_engine::resolve_direct_io(mode, &file, slots, context, chunk, memory).direct
    };

    // Explicit choices win whatever the memory.
    assert!(resolve(slipstream_store::DirectIo::On, 1, Some(u64::MAX)));
    assert!(!resolve(slipstream_store::DirectIo::Off, experts, Some(1)));

    // Every expert in a slot: a page-cache copy is duplication.
    assert!(resolve(
        slipstream_store::DirectIo::Auto,
        experts,
        Some(u64::MAX)
    ));
    assert!(resolve(slipstream_store::DirectIo::Auto, experts + 5, None));

    // Unknown memory keeps buffered reads.
    assert!(!resolve(slipstream_store::DirectIo::Auto, 2, None));

    // The threshold: room beside the footprint for half the expert file.
    let footprint = slipstream_engine::predict_footprint(&file, 2, context, chunk).total();
    assert!(!resolve(
        slipstream_store::DirectIo::Auto,
        2,
        Some(footprint + pool / 2)
    ));
    assert!(resolve(
        slipstream_store::DirectIo::Auto,
        2,
        Some(footprint + pool / 2 - 1)
    ));
    assert!(resolve(
        slipstream_store::DirectIo::Auto,
        2,
        Some(footprint / 2)
    ));
    // More slots need more memory for the same decision.
    let bigger = slipstream_engine::predict_footprint(&file, 3, context, chunk).total();
    assert!(bigger > footprint);
    assert!(resolve(
        slipstream_store::DirectIo::Auto,
        3,
        Some(footprint + pool / 2)
    ));

    // The reason names the decision's inputs.
    let why = slipstream_engine::resolve_direct_io(
        slipstream_store::DirectIo::Auto,
        &file,
        2,
        context,
        chunk,
        Some(1),
    )
    .reason;
    assert!(
        why.starts_with("auto:") && why.contains("expert file"),
        "{why}"
    );
}

/// With a slot for every expert, idle readers fill the free slots: every
/// expert ends up resident without being asked for, later requests are all
/// hits over the same bytes, and a record corrupted on disk is still caught
/// (on its first use) and never computed.
#[test]
fn background_fill_makes_every_expert_resident_and_verifies_on_use() {
    use slipstream_core::{ExpertRequest, ExpertSource};
    use slipstream_store::{ExpertStore, StreamingStore};
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_moe", QuantChoice::F32, tmp.path());
    let (bad_layer, bad_expert) = (1usize, 3u32);
    let file = corrupt_records(&model, |l, e| (l, e) == (bad_layer, bad_expert as usize));
    let pool = &file.manifest.experts;
    let (layers, experts) = (pool.num_layers, pool.num_experts);
    let open = |fill| {
        StreamingStore::open(
            file.clone(),
            StreamConfig {
                slots: experts,
                io_threads: 3,
                background_fill: fill,
                ..Default::default()
            },
        )
        .unwrap()
    };
    let mut store = open(true);
    let mut plain = open(false);
    // One demand request starts the fill.
    let one = [0u32];
    let req = ExpertRequest {
        layer: 0,
        experts: &one,
        counts: &[1],
        tokens: 1,
    };
    store.with_experts(&req, &mut |_, _| {}).unwrap();
    let resident = store.finish_background_fill().unwrap();
    assert_eq!(resident, layers * experts, "every expert resident");
    assert_eq!(store.counters().misses, 1);
    assert_eq!(store.counters().fills as usize, layers * experts - 1);
    assert_eq!(
        plain.finish_background_fill().unwrap(),
        0,
        "fill off: nothing read unasked"
    );
    // Every later request is a hit (bar the corrupt record) over the bytes a
    // demand read gives.
    let all: Vec<u32> = (0..experts as u32).collect();
    let counts = vec![1u32; experts];
    for layer in 0..layers {
        let req = ExpertRequest {
            layer,
            experts: &all,
            counts: &counts,
            tokens: experts as u32,
        };
        let grab = |s: &mut StreamingStore| {
            let mut got: Vec<(u32, Vec<u8>)> = Vec::new();
            let r = s.with_experts(&req, &mut |e, w| {
                got.push((e, [w.gate.data, w.down.data].concat()))
            });
            got.sort();
            (r.map_err(|e| e.to_string()), got)
        };
        let hits_before = store.counters().hits;
        let (r, got) = grab(&mut store);
        let (r_plain, want) = grab(&mut plain);
        if layer == bad_layer {
            let err = r.unwrap_err();
            assert!(err.contains("checksum") && err.contains("layer 1"), "{err}");
            assert!(r_plain.is_err());
            assert!(
                !got.iter().any(|(e, _)| *e == bad_expert),
                "a corrupt record was computed"
            );
            assert!(!store.resident_experts()[layer].contains(&bad_expert));
        } else {
            r.unwrap();
            r_plain.unwrap();
            assert_eq!(got, want, "layer {layer}: filled bytes differ");
            assert_eq!(store.counters().hits - hits_before, experts as u64);
        }
    }
}

/// A pass that panics inside a layer (the server catches it) leaves the
/// store's request pending; once abandoned, the next request runs.
#[test]
fn a_request_abandoned_mid_layer_does_not_wedge_the_store() {
    use slipstream_core::{ExpertRequest, ExpertSource};
    use slipstream_store::{ExpertStore, StreamingStore};
    let tmp = tempfile::tempdir().unwrap();
    let model = repacked("qwen3_moe", QuantChoice::F32, tmp.path());
    let file = Arc::new(SlipModel::open(&model).unwrap());
    let mut store = StreamingStore::open(
        file,
        StreamConfig {
            slots: 2,
            io_threads: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let (experts, counts) = ([0u32, 1, 2], [1u32, 1, 1]);
    let req = |layer| ExpertRequest {
        layer,
        experts: &experts,
        counts: &counts,
        tokens: 3,
    };
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        store
            .with_expert_batches(&req(1), &mut |_| panic!("a kernel assertion"))
            .ok();
    }));
    assert!(panicked.is_err());
    assert!(
        store.with_expert_batches(&req(0), &mut |_| {}).is_err(),
        "wedged until told"
    );
    store.abandon_pending();
    let mut seen = 0;
    store
        .with_expert_batches(&req(0), &mut |batch| seen += batch.len())
        .expect("the store runs the next request");
    assert_eq!(seen, 3);
}
