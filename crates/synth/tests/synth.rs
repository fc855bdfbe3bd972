use slipstream_core::config::LayerKind;
use slipstream_core::{Architecture, ModelConfig, QuantType};
use slipstream_format::SlipModel;
use slipstream_synth::{measure, synthesize, Skew, SynthOptions};

fn tiny(arch: Architecture) -> ModelConfig {
    let qwen35 = arch == Architecture::Qwen35Moe;
    ModelConfig {
        architecture: arch,
        vocab_size: 512,
        hidden_size: 256,
        rms_norm_eps: 1e-6,
        layer_types: if qwen35 {
            vec![LayerKind::LinearAttention, LayerKind::FullAttention]
        } else {
            vec![LayerKind::FullAttention; 2]
        },
        tie_word_embeddings: false,
        max_position_embeddings: 4096,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 64,
        rotary_dim: if qwen35 { 32 } else { 64 },
        rope_theta: 1e6,
        attn_output_gate: qwen35,
        linear_num_key_heads: if qwen35 { 2 } else { 0 },
        linear_key_head_dim: if qwen35 { 64 } else { 0 },
        linear_num_value_heads: if qwen35 { 4 } else { 0 },
        linear_value_head_dim: if qwen35 { 64 } else { 0 },
        linear_conv_kernel: if qwen35 { 4 } else { 0 },
        num_experts: 32,
        num_experts_per_tok: 4,
        moe_intermediate_size: 64,
        shared_expert_intermediate_size: if qwen35 { 64 } else { 0 },
        norm_topk_prob: true,
        mtp_num_layers: 0,
    }
}

fn write(
    cfg: &ModelConfig,
    dir: &std::path::Path,
    name: &str,
    seed: u64,
    skew: Skew,
) -> std::path::PathBuf {
    let out = dir.join(name);
    let opts = SynthOptions {
        config: cfg.clone(),
        seed,
        skew,
        output: out.clone(),
        preset_name: "tiny".into(),
        batch: 7,
        overwrite: Default::default(),
    };
    synthesize(&opts, &|_| {}).unwrap();
    out
}

#[test]
fn opens_loads_generates_finite_with_canonical_layout() {
    let dir = tempfile::tempdir().unwrap();
    for arch in [Architecture::Qwen35Moe, Architecture::Qwen3Moe] {
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
