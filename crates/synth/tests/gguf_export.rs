//! A synthetic model exported as GGUF and imported back by the repacker is
//! the model `synth --format slip --quant q4_0` writes: the same bytes for
//! every tensor and expert (A_log within an ulp: it travels as -exp(A_log)),
//! and the same generated tokens.

use slipstream_core::config::LayerKind;
use slipstream_core::{Architecture, ModelConfig};
use slipstream_format::SlipModel;
use slipstream_synth::gguf_export::synthesize_gguf;
use slipstream_synth::{measure, synthesize_q, Skew, SynthOptions, SynthQuant};

mod common;

/// [`common::tiny`] with three layers (two linear, one full attention),
/// more value heads than key heads (the tiled order is exercised) and 16
/// wider experts.
fn tiny(arch: Architecture) -> ModelConfig {
    let base = common::tiny(arch);
    if !arch.is_hybrid() {
        return ModelConfig {
            num_experts: 16,
            moe_intermediate_size: 128,
            ..base
        };
    }
    ModelConfig {
        layer_types: vec![
            LayerKind::LinearAttention,
            LayerKind::LinearAttention,
            LayerKind::FullAttention,
        ],
        linear_num_value_heads: 6,
        num_experts: 16,
        moe_intermediate_size: 128,
        ..base
    }
}

fn opts(cfg: &ModelConfig, out: std::path::PathBuf) -> SynthOptions {
    common::options(cfg, out, 5, Skew::DEFAULT, 5)
}

#[test]
fn gguf_export_imports_back_to_the_q4_0_slip() {
    let dir = tempfile::tempdir().unwrap();
    for arch in [
        Architecture::Qwen35Moe,
        Architecture::Qwen3Next,
        Architecture::Qwen3Moe,
    ] {
        roundtrip(&tiny(arch), dir.path(), arch.name());
    }
}

/// MTP layers travel as llama.cpp's converter writes them: `block_count`
/// counts them, `nextn_predict_layers` names how many, and the layer after
/// the main ones carries `nextn.*` beside its attention and experts.
#[test]
fn gguf_export_with_an_mtp_layer_imports_back() {
    let dir = tempfile::tempdir().unwrap();
    for (arch, a) in [
        (Architecture::Qwen35Moe, "qwen35moe"),
        (Architecture::Qwen3Next, "qwen3next"),
    ] {
        let mut cfg = tiny(arch);
        cfg.mtp_num_layers = 1;
        let gguf = roundtrip(&cfg, dir.path(), &format!("mtp-{a}"));
        let f = slipstream_gguf::GgufFile::open(&gguf).unwrap();
        let l = cfg.num_layers();
        let meta = |k: &str| {
            f.metadata
                .iter()
                .find(|(name, _)| name == k)
                .map(|(_, v)| format!("{v:?}"))
        };
        assert_eq!(
            meta(&format!("{a}.block_count")),
            Some(format!("{:?}", slipstream_gguf::Value::U32(l as u32 + 1)))
        );
        assert_eq!(
            meta(&format!("{a}.nextn_predict_layers")),
            Some(format!("{:?}", slipstream_gguf::Value::U32(1)))
        );
        for name in [
            "nextn.eh_proj.weight",
            "nextn.enorm.weight",
            "nextn.hnorm.weight",
            "nextn.shared_head_norm.weight",
            "attn_q.weight",
            "ffn_gate_exps.weight",
        ] {
            let full = format!("blk.{l}.{name}");
            assert!(f.tensor(&full).is_some(), "{full} missing");
        }
    }
}

/// qwen3next as llama.cpp's converter leaves it: `ssm_ba` one tensor of
/// both projections, no `ssm_beta` / `ssm_alpha`, no tiled value heads (the
/// round trip above checks the values).
#[test]
fn qwen3next_gguf_fuses_ba_like_the_converter() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(Architecture::Qwen3Next);
    let gguf = dir.path().join("next.gguf");
    synthesize_gguf(&opts(&cfg, gguf.clone()), &|_| {}).unwrap();
    let f = slipstream_gguf::GgufFile::open(&gguf).unwrap();
    let ba = f.tensor("blk.0.ssm_ba.weight").expect("ssm_ba");
    assert_eq!(ba.dims, vec![256, 2 * 6]);
    assert!(f.tensor("blk.0.ssm_beta.weight").is_none());
    assert!(f.tensor("blk.0.ssm_alpha.weight").is_none());
    assert!(
        f.tensor("blk.2.ssm_ba.weight").is_none(),
        "full attention layer"
    );
}

/// Writes `cfg` as a Q4_0 .slip and as a GGUF, imports the GGUF and checks
/// both models are the same; returns the GGUF's path.
fn roundtrip(cfg: &ModelConfig, dir: &std::path::Path, tag: &str) -> std::path::PathBuf {
    let native = dir.join(format!("{tag}-native.slip"));
    let gguf = dir.join(format!("{tag}.gguf"));
    let imported = dir.join(format!("{tag}-imported.slip"));
    synthesize_q(&opts(cfg, native.clone()), SynthQuant::Q4_0, &|_| {}).unwrap();
    synthesize_gguf(&opts(cfg, gguf.clone()), &|_| {}).unwrap();
    let report = slipstream_repack::repack(
        &slipstream_repack::RepackOptions {
            input: gguf.clone(),
            output: imported.clone(),
            overwrite: Default::default(),
            quant: Default::default(),
            // Compared byte for byte with the native Q4_0 model below.
            ggml_to_affine: false,
        },
        &|_| {},
    )
    .unwrap();
    assert_eq!(&report.config, cfg);

    let a = SlipModel::open(&native).unwrap();
    let b = SlipModel::open(&imported).unwrap();
    assert_eq!(a.manifest.experts.parts, b.manifest.experts.parts);
    assert_eq!(a.manifest.experts.checksums, b.manifest.experts.checksums);
    assert_eq!(a.manifest.dense.len(), b.manifest.dense.len());
    for d in &a.manifest.dense {
        let (x, y) = (a.tensor(&d.name).unwrap(), b.tensor(&d.name).unwrap());
        assert_eq!(x.qtype, y.qtype, "{}", d.name);
        assert_eq!([x.rows, x.cols], [y.rows, y.cols], "{}", d.name);
        if d.name.ends_with("A_log") {
            let f = |t: &slipstream_core::Tensor| -> Vec<f32> {
                t.view()
                    .data
                    .chunks(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            };
            for (p, q) in f(&x).iter().zip(f(&y)) {
                assert!(
                    (p - q).abs() <= 2.0 * f32::EPSILON * p.abs().max(1.0),
                    "{p} {q}"
                );
            }
        } else {
            assert!(x.view().data == y.view().data, "{} differs", d.name);
        }
    }
    // The GGUF carries a tokenizer and the chat template.
    assert!(b.manifest.tokenizer.is_some());
    assert!(b.manifest.chat_template.is_some());
    assert_eq!(b.manifest.eos_token_ids, vec![511]);

    let prompt = measure::random_prompt(cfg.vocab_size, 30, 3);
    let ra = measure::run_routes(&native, &prompt, 12).unwrap();
    let rb = measure::run_routes(&imported, &prompt, 12).unwrap();
    assert!(ra.all_finite);
    assert_eq!(ra.tokens, rb.tokens, "{tag}: generated tokens differ");
    gguf
}

/// The router skew survives Q4_0: the control channel stays exact (zero
/// blocks are zero, a `First(v)` block is exact) and the router is f32.
#[test]
fn q4_0_keeps_the_router_skew() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny(Architecture::Qwen35Moe);
    cfg.num_experts = 32;
    let prompt = measure::random_prompt(cfg.vocab_size, 64, 5);
    let rate = |skew: Skew, name: &str| {
        let p = dir.path().join(name);
        let mut o = opts(&cfg, p.clone());
        o.skew = skew;
        synthesize_q(&o, SynthQuant::Q4_0, &|_| {}).unwrap();
        let run = measure::run_routes(&p, &prompt, 96).unwrap();
        let st = measure::replay(&run, 8);
        1.0 - st.lru_misses_per_token / st.requests_per_token
    };
    let uniform = rate(Skew::UNIFORM, "u");
    let skewed = rate(Skew::DEFAULT, "s");
    eprintln!("Q4_0 LRU hit rate at 8 of 32 slots: uniform {uniform:.3}, skewed {skewed:.3}");
    assert!(uniform < 0.45, "uniform routing hit rate {uniform}");
    assert!(
        skewed > uniform + 0.15,
        "skewed {skewed} vs uniform {uniform}"
    );
}

/// Tokenizer metadata that does not build a tokenizer fails the repack
/// (naming the file), not every later open of the written model.
#[test]
fn broken_gguf_tokenizer_fails_the_repack() {
    use slipstream_gguf::{GgufFile, GgufWriter, TensorDecl, Value};
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(Architecture::Qwen3Moe);
    let good = dir.path().join("good.gguf");
    synthesize_gguf(&opts(&cfg, good.clone()), &|_| {}).unwrap();
    let f = GgufFile::open(&good).unwrap();
    let mut meta = f.metadata.clone();
    for (k, v) in meta.iter_mut() {
        if k == "tokenizer.ggml.merges" {
            *v = Value::strings(vec!["no-such-token another-one".into()]);
        }
    }
    let bad = dir.path().join("bad.gguf");
    let decls = f
        .tensors
        .iter()
        .map(|t| TensorDecl::new(t.name.clone(), &t.dims, t.ty))
        .collect();
    let mut w = GgufWriter::create(&bad, &meta, decls, Default::default()).unwrap();
    for t in &f.tensors {
        w.write_tensor(&t.name, f.data(t)).unwrap();
    }
    w.finish().unwrap();
    let out = dir.path().join("m.slip");
    let e = slipstream_repack::repack(
        &slipstream_repack::RepackOptions {
            input: bad,
            output: out.clone(),
            overwrite: Default::default(),
            quant: Default::default(),
            ggml_to_affine: false,
        },
        &|_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("bad.gguf") && e.contains("tokenizer"), "{e}");
    assert!(!out.exists());
}
