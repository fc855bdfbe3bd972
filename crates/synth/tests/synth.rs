use common::tiny;
use slipstream_core::config::LayerKind;
use slipstream_core::{Architecture, ModelConfig, QuantType};
use slipstream_format::SlipModel;
use slipstream_synth::{measure, synthesize, Skew};

mod common;

fn write(
    cfg: &ModelConfig,
    dir: &std::path::Path,
    name: &str,
    seed: u64,
    skew: Skew,
) -> std::path::PathBuf {
    let out = dir.join(name);
    synthesize(&common::options(cfg, out.clone(), seed, skew, 7), &|_| {}).unwrap();
    out
}

#[test]
fn opens_loads_generates_finite_with_canonical_layout() {
    let dir = tempfile::tempdir().unwrap();
    for arch in [
        Architecture::Qwen35Moe,
        Architecture::Qwen3Next,
        Architecture::Qwen3Moe,
    ] {
        let cfg = tiny(arch);
        let p = write(&cfg, dir.path(), arch.name(), 1, Skew::DEFAULT);
        let m = SlipModel::open(&p).unwrap();
        let mut names: Vec<String> = m.manifest.dense.iter().map(|d| d.name.clone()).collect();
        let mut want = slipstream_repack::canonical_dense_names(&cfg);
        names.sort();
        want.sort();
        assert_eq!(names, want);
        for d in &m.manifest.dense {
            let want = if d.name.ends_with("moe.router") || d.name.ends_with("moe.shared_gate") {
                QuantType::Q8
            } else if d.name.contains("norm")
                || d.name.ends_with("gdn.conv")
                || d.name.ends_with("A_log")
                || d.name.ends_with("dt_bias")
            {
                QuantType::F32
            } else {
                QuantType::Q4
            };
            assert_eq!(d.qtype, want, "{}", d.name);
        }
        assert!(m
            .manifest
            .experts
            .parts
            .iter()
            .all(|p| p.qtype == QuantType::Q4));
        slipstream_models::load(&m.manifest.config, &m).unwrap();
        let prompt = measure::random_prompt(cfg.vocab_size, 40, 3);
        let run = measure::run_routes(&p, &prompt, 24).unwrap();
        assert!(run.all_finite, "{arch:?}: non-finite logits");
        assert!(run.max_abs_logit > 0.0 && run.max_abs_logit < 1e3);
        assert_eq!(run.tokens.len(), 24);
    }
}

/// `mtp_num_layers` adds the MTP layer after the main ones: its dense
/// tensors at the real shapes, its experts as one more pool layer.
#[test]
fn mtp_layer_is_written_and_loads() {
    let real = {
        let mut c = slipstream_synth::preset_config(slipstream_synth::Preset::Qwen36_35bA3b, None);
        c.mtp_num_layers = 1;
        c
    };
    let mtp = slipstream_core::schema::layer_tensors(&real, 40);
    let shape = |k: &str| slipstream_core::schema::find(&mtp, k).unwrap().shape;
    assert_eq!(shape("mtp.fc"), [2048, 4096]);
    assert_eq!(shape("mtp.embed_norm"), [1, 2048]);
    assert_eq!(shape("attn.q_proj"), [16 * 256 * 2, 2048]);
    assert_eq!(shape("moe.router"), [256, 2048]);

    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny(Architecture::Qwen35Moe);
    cfg.mtp_num_layers = 1;
    let p = write(&cfg, dir.path(), "mtp", 1, Skew::DEFAULT);
    let m = SlipModel::open(&p).unwrap();
    assert_eq!(m.manifest.config, cfg);
    assert_eq!(m.manifest.experts.num_layers, 3);
    let mut names: Vec<String> = m.manifest.dense.iter().map(|d| d.name.clone()).collect();
    let mut want = slipstream_repack::canonical_dense_names(&cfg);
    names.sort();
    want.sort();
    assert_eq!(names, want);
    assert!(names.contains(&"layers.2.mtp.fc".to_string()));
    let model = slipstream_models::load(&m.manifest.config, &m).unwrap();
    assert_eq!(model.mtp_depth(), 1);
    // The main model runs as before.
    let run = measure::run_routes(&p, &measure::random_prompt(cfg.vocab_size, 20, 3), 4).unwrap();
    assert!(run.all_finite);
}

#[test]
fn same_seed_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(Architecture::Qwen35Moe);
    let a = write(&cfg, dir.path(), "a", 9, Skew::DEFAULT);
    let b = write(&cfg, dir.path(), "b", 9, Skew::DEFAULT);
    let c = write(&cfg, dir.path(), "c", 10, Skew::DEFAULT);
    for f in ["dense.bin", "experts.bin", "manifest.json"] {
        let x = std::fs::read(a.join(f)).unwrap();
        let y = std::fs::read(b.join(f)).unwrap();
        assert!(x == y, "{f} differs for the same seed");
    }
    assert_ne!(
        std::fs::read(a.join("experts.bin")).unwrap(),
        std::fs::read(c.join("experts.bin")).unwrap()
    );
}

#[test]
fn skew_raises_lru_hit_rate() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(Architecture::Qwen35Moe);
    let prompt = measure::random_prompt(cfg.vocab_size, 64, 5);
    let rate = |skew: Skew, name: &str| {
        let p = write(&cfg, dir.path(), name, 2, skew);
        let run = measure::run_routes(&p, &prompt, 96).unwrap();
        let st = measure::replay(&run, 8);
        1.0 - st.lru_misses_per_token / st.requests_per_token
    };
    let uniform = rate(Skew::UNIFORM, "u");
    let skewed = rate(Skew::DEFAULT, "s");
    eprintln!("LRU hit rate at 8 of 32 slots: uniform {uniform:.3}, skewed {skewed:.3}");
    assert!(uniform < 0.45, "uniform routing hit rate {uniform}");
    assert!(
        skewed > uniform + 0.15,
        "skewed {skewed} vs uniform {uniform}"
    );
}

/// The presets at their published shapes, checked by their config and
/// sizes (never written whole): layer pattern, heads, experts, the bytes a
/// q4 model would take, and `--layers` cuts.
#[test]
fn large_presets_have_the_published_shapes() {
    use slipstream_core::schema::{find, layer_tensors};
    use slipstream_synth::{dense_bytes_estimate, expert_layout, preset_config, Preset};
    for p in Preset::ALL {
        assert_eq!(p.name().parse::<Preset>().unwrap(), p);
    }
    let gb = |c: &ModelConfig| {
        let pool = expert_layout(c);
        let record: usize = pool
            .parts
            .iter()
            .map(|(_, q, [r, k])| q.nbytes(*r, *k))
            .sum();
        (pool.num_layers as u64 * pool.num_experts as u64 * record as u64 + dense_bytes_estimate(c))
            as f64
            / 1e9
    };

    let next = preset_config(Preset::Qwen3Next80bA3b, None);
    next.validate().unwrap();
    assert_eq!(next.architecture, Architecture::Qwen3Next);
    assert_eq!(
        (next.num_layers(), next.hidden_size, next.vocab_size),
        (48, 2048, 151936)
    );
    assert_eq!((next.num_experts, next.num_experts_per_tok), (512, 10));
    assert_eq!(
        (
            next.moe_intermediate_size,
            next.shared_expert_intermediate_size
        ),
        (512, 512)
    );
    assert_eq!((next.rope_theta, next.rotary_dim), (1e7, 64));
    let full: Vec<usize> = (0..48)
        .filter(|&l| next.layer_types[l] == LayerKind::FullAttention)
        .collect();
    assert_eq!(full, (0..12).map(|i| 4 * i + 3).collect::<Vec<_>>());
    let l0 = layer_tensors(&next, 0);
    // q, k: 16 heads x 128; v: 32 x 128.
    assert_eq!(find(&l0, "gdn.in_proj_qkv").unwrap().shape, [8192, 2048]);
    assert_eq!(find(&l0, "gdn.in_proj_z").unwrap().shape, [4096, 2048]);
    let l3 = layer_tensors(&next, 3);
    assert_eq!(
        find(&l3, "attn.q_proj").unwrap().shape,
        [16 * 256 * 2, 2048]
    );
    assert_eq!(find(&l3, "attn.k_proj").unwrap().shape, [2 * 256, 2048]);
    // About 45 GB at 4 bits (issue 37).
    let size = gb(&next);
    assert!((40.0..50.0).contains(&size), "80B preset is {size:.1} GB");

    let big = preset_config(Preset::Qwen35_122bA10b, None);
    big.validate().unwrap();
    assert_eq!(big.architecture, Architecture::Qwen35Moe);
    assert_eq!(
        (big.num_layers(), big.hidden_size, big.num_attention_heads),
        (48, 3072, 32)
    );
    assert_eq!((big.num_experts, big.num_experts_per_tok), (256, 8));
    assert!(big.shared_expert_intermediate_size > 0);
    // About 69 GB at 4 bits (issue 37).
    let size = gb(&big);
    assert!((62.0..75.0).contains(&size), "122B preset is {size:.1} GB");

    for p in [Preset::Qwen3Next80bA3b, Preset::Qwen35_122bA10b] {
        let cut = preset_config(p, Some(3));
        assert_eq!(cut.num_layers(), 3);
        assert_eq!(cut.num_experts, preset_config(p, None).num_experts);
    }
}
