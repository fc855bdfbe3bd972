//! Repacks tiny synthetic checkpoints and checks every stored tensor against
//! its source; checks that each kind of bad input is a clear error.

mod common;

use std::path::Path;

use common::*;
use safetensors::Dtype;
use serde_json::json;
use slipstream_core::config::LayerKind;
use slipstream_core::{Architecture, QuantType};
use slipstream_format::SlipModel;
use slipstream_repack::*;

/// (canonical name, source name, 1+w shift, rows, cols) of every dense tensor.
fn mapping(t: &Tiny, qwen35: bool, prefix: &str, lm_head: bool) -> Vec<(String, String, bool)> {
    let mut v = vec![
        (
            "embed".to_string(),
            format!("{prefix}embed_tokens.weight"),
            false,
        ),
        (
            "final_norm".to_string(),
            format!("{prefix}norm.weight"),
            qwen35,
        ),
    ];
    if lm_head {
        v.push(("lm_head".into(), "lm_head.weight".into(), false));
    }
    for (l, full) in t.full.iter().enumerate() {
        let p = format!("{prefix}layers.{l}.");
        let c = |s: &str| format!("layers.{l}.{s}");
        v.push((
            c("input_norm"),
            format!("{p}input_layernorm.weight"),
            qwen35,
        ));
        v.push((
            c("post_attn_norm"),
            format!("{p}post_attention_layernorm.weight"),
            qwen35,
        ));
        if *full {
            for x in ["q_proj", "k_proj", "v_proj", "o_proj"] {
                v.push((
                    c(&format!("attn.{x}")),
                    format!("{p}self_attn.{x}.weight"),
                    false,
                ));
            }
            v.push((
                c("attn.q_norm"),
                format!("{p}self_attn.q_norm.weight"),
                qwen35,
            ));
            v.push((
                c("attn.k_norm"),
                format!("{p}self_attn.k_norm.weight"),
                qwen35,
            ));
        } else {
            for x in [
                "in_proj_qkv",
                "in_proj_z",
                "in_proj_b",
                "in_proj_a",
                "out_proj",
            ] {
                v.push((
                    c(&format!("gdn.{x}")),
                    format!("{p}linear_attn.{x}.weight"),
                    false,
                ));
            }
            v.push((
                c("gdn.conv"),
                format!("{p}linear_attn.conv1d.weight"),
                false,
            ));
            v.push((c("gdn.A_log"), format!("{p}linear_attn.A_log"), false));
            v.push((c("gdn.dt_bias"), format!("{p}linear_attn.dt_bias"), false));
            v.push((c("gdn.norm"), format!("{p}linear_attn.norm.weight"), false));
        }
        v.push((c("moe.router"), format!("{p}mlp.gate.weight"), false));
        if qwen35 {
            v.push((
                c("moe.shared_gate"),
                format!("{p}mlp.shared_expert_gate.weight"),
                false,
            ));
            for x in ["gate_proj", "up_proj", "down_proj"] {
                v.push((
                    c(&format!("moe.shared.{x}")),
                    format!("{p}mlp.shared_expert.{x}.weight"),
                    false,
                ));
            }
        }
    }
    v
}

/// Checks every dense tensor of an f32 repack bit-exactly against `src`.
fn check_dense_f32(m: &SlipModel, src: &FloatMap, map: &[(String, String, bool)]) {
    assert_eq!(m.manifest.dense.len(), map.len(), "number of dense tensors");
    for (canon, name, shift) in map {
        let (shape, vals) = &src[name];
        let want: Vec<f32> = if *shift {
            vals.iter().map(|v| 1.0f32 + v).collect()
        } else {
            vals.clone()
        };
        bits_eq(&stored_f32(m, canon), &want, canon);
        let t = m.tensor(canon).unwrap();
        let n: usize = shape.iter().product();
        assert_eq!(t.rows * t.cols, n, "{canon} element count");
        if shape.len() == 1 {
            assert_eq!((t.rows, t.cols), (1, shape[0]), "{canon} 1-D as [1, n]");
        } else {
            assert_eq!(t.rows, shape[0], "{canon} rows");
        }
    }
}

/// Expected (gate, up, down) f32 values of expert `e` of layer `l`.
fn expert_src(src: &FloatMap, t: &Tiny, prefix: &str, l: usize, e: usize) -> [Vec<f32>; 3] {
    let p = format!("{prefix}layers.{l}.mlp.experts.");
    let ih = t.inter * t.hidden;
    if let Some((_, gu)) = src.get(&format!("{p}gate_up_proj")) {
        let (_, dn) = &src[&format!("{p}down_proj")];
        let g = gu[e * 2 * ih..e * 2 * ih + ih].to_vec();
        let u = gu[e * 2 * ih + ih..(e + 1) * 2 * ih].to_vec();
        [g, u, dn[e * ih..(e + 1) * ih].to_vec()]
    } else {
        ["gate_proj", "up_proj", "down_proj"].map(|x| src[&format!("{p}{e}.{x}.weight")].1.clone())
    }
}

fn check_experts_f32(m: &SlipModel, src: &FloatMap, t: &Tiny, prefix: &str) {
    let pool = &m.manifest.experts;
    assert_eq!(pool.num_layers, t.full.len());
    assert_eq!(pool.num_experts, t.experts);
    let names: Vec<&str> = pool.parts.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["gate", "up", "down"]);
    assert_eq!(pool.parts[0].shape, [t.inter, t.hidden]);
    assert_eq!(pool.parts[2].shape, [t.hidden, t.inter]);
    let mut buf = vec![0u8; pool.record_stride as usize];
    for l in 0..t.full.len() {
        for e in 0..t.experts {
            m.read_expert(l, e, &mut buf).unwrap();
            let w = m.expert_views(l, e, &buf).unwrap();
            let want = expert_src(src, t, prefix, l, e);
            for (k, view) in [w.gate, w.up, w.down].iter().enumerate() {
                assert_eq!(view.qtype, QuantType::F32);
                bits_eq(
                    &f32_of(view.data),
                    &want[k],
                    &format!("layer {l} expert {e} part {k}"),
                );
            }
        }
    }
}

// ------------------------------------------------------------ qwen3_5_moe

/// A config may announce an MTP head the checkpoint does not carry: the
/// model is imported without one. A head that is there but incomplete is
/// an error naming the missing tensor.
#[test]
fn qwen35_mtp_head_absent_or_incomplete() {
    let d = tmp();
    let t = Tiny::qwen35();
    let prefix = "model.language_model.";
    let src = hf_tensors(&t, true, prefix, true, true);
    let mut config = t.qwen35_config();
    config["text_config"]["mtp_num_hidden_layers"] = json!(1);

    let absent = d.path().join("absent");
    save(&absent, &floats_to_raw(&src, Dtype::F32), 1);
    write_json(&absent.join("config.json"), &config);
    let out = d.path().join("absent.slip");
    let report = run(&absent, &out, QuantChoice::F32).unwrap();
    assert_eq!(report.config.mtp_num_layers, 0);
    let m = SlipModel::open(&out).unwrap();
    assert_eq!(m.manifest.experts.num_layers, t.full.len());

    let partial = d.path().join("partial");
    let mut raw = floats_to_raw(&src, Dtype::F32);
    let mut extra = FloatMap::new();
    let h = t.hidden;
    extra.insert(
        "mtp.fc.weight".into(),
        (vec![h, 2 * h], values("mtp.fc", 2 * h * h)),
    );
    raw.extend(floats_to_raw(&extra, Dtype::F32));
    save(&partial, &raw, 1);
    write_json(&partial.join("config.json"), &config);
    let e = run(&partial, &d.path().join("partial.slip"), QuantChoice::F32)
        .unwrap_err()
        .to_string();
    assert!(e.contains("mtp."), "{e}");
}

#[test]
fn qwen35_fused_f32_is_bit_exact() {
    let d = tmp();
    let input = d.path().join("in");
    let t = Tiny::qwen35();
    let prefix = "model.language_model.";
    let src = hf_tensors(&t, true, prefix, true, true);
    let mut raw = floats_to_raw(&src, Dtype::F32);
    // Tensors outside the text model are skipped.
    let mut extra = FloatMap::new();
    extra.insert("mtp.fc.weight".into(), (vec![4, 4], values("mtp", 16)));
    extra.insert(
        "model.visual.blocks.0.attn.qkv.weight".into(),
        (vec![4, 4], values("vis", 16)),
    );
    raw.extend(floats_to_raw(&extra, Dtype::F32));
    save(&input, &raw, 1);
    write_json(&input.join("config.json"), &t.qwen35_config());
    write_tokenizer_files(&input);

    let out = d.path().join("out.slip");
    let report = run(&input, &out, QuantChoice::F32).unwrap();
    assert_eq!(report.kind, SourceKind::HfSafetensors);
    assert_eq!(
        report.ignored_tensors,
        vec!["model.visual.blocks.0.attn.qkv.weight", "mtp.fc.weight"]
    );
    let m = SlipModel::open(&out).unwrap();
    check_dense_f32(&m, &src, &mapping(&t, true, prefix, true));
    check_experts_f32(&m, &src, &t, prefix);
    // gdn.conv is [C, K].
    let conv = m.tensor("layers.0.gdn.conv").unwrap();
    assert_eq!((conv.rows, conv.cols), (t.conv_dim(), t.kernel));

    let c = &m.manifest.config;
    assert_eq!(c.architecture, Architecture::Qwen35Moe);
    assert_eq!(
        c.layer_types,
        vec![
            LayerKind::LinearAttention,
            LayerKind::LinearAttention,
            LayerKind::LinearAttention,
            LayerKind::FullAttention
        ]
    );
    assert_eq!(c.rotary_dim, 8);
    assert_eq!(c.rope_theta, 1e7);
    assert!(c.attn_output_gate && c.norm_topk_prob && !c.tie_word_embeddings);
    assert_eq!(c.linear_conv_dim(), t.conv_dim());
    assert_eq!(c.shared_expert_intermediate_size, 64);
    assert_eq!(m.manifest.eos_token_ids, vec![2, 7]);
    assert_eq!(
        m.manifest.generation,
        Some(slipstream_format::GenerationDefaults {
            temperature: Some(0.6),
            top_p: Some(0.95),
            top_k: Some(20),
            min_p: Some(0.0),
            repetition_penalty: Some(1.0),
            presence_penalty: None,
            frequency_penalty: None,
        })
    );
    assert_eq!(
        m.manifest
            .special_tokens
            .get("eos_token")
            .map(String::as_str),
        Some("<|im_end|>")
    );
    assert_eq!(
        m.manifest
            .special_tokens
            .get("pad_token")
            .map(String::as_str),
        Some("<|endoftext|>")
    );
    assert!(!m.manifest.special_tokens.contains_key("bos_token"));
    assert!(m
        .manifest
        .chat_template
        .as_deref()
        .unwrap()
        .contains("messages"));
    assert_eq!(m.manifest.tokenizer.as_deref(), Some("tokenizer.json"));
    assert_eq!(
        m.read_file("tokenizer.json").unwrap(),
        std::fs::read(input.join("tokenizer.json")).unwrap()
    );
    assert_eq!(m.manifest.source.kind, "hf-safetensors");
    assert_eq!(m.manifest.source.quant, "f32");

    let names: Vec<String> = m.manifest.dense.iter().map(|e| e.name.clone()).collect();
    let mut want = canonical_dense_names(c);
    let mut got = names.clone();
    want.sort();
    got.sort();
    assert_eq!(got, want);
    assert_eq!(report.tensors_written, names.len());
    assert_eq!(report.experts_written, 4 * 4);
}

#[test]
fn qwen35_split_bf16_sharded_flat_config_tied() {
    let d = tmp();
    let input = d.path().join("in");
    // Interval 2: layers 1 and 3 are full attention.
    let t = Tiny {
        full: vec![false, true, false, true],
        ..Tiny::qwen35()
    };
    let prefix = "model.";
    let mut src = hf_tensors(&t, true, prefix, false, false);
    round_bf16(&mut src);
    save(&input, &floats_to_raw(&src, Dtype::BF16), 3);
    let mut cfg = t.qwen35_text_config();
    let o = cfg.as_object_mut().unwrap();
    o.remove("layer_types");
    o.insert("full_attention_interval".into(), json!(2));
    o.insert("tie_word_embeddings".into(), json!(true));
    write_json(&input.join("config.json"), &cfg);
    assert!(input.join("model-00003-of-00003.safetensors").exists());

    // f32: bf16 values exactly, norms 1 + w in f32.
    let out = d.path().join("f32.slip");
    run(&input, &out, QuantChoice::F32).unwrap();
    let m = SlipModel::open(&out).unwrap();
    check_dense_f32(&m, &src, &mapping(&t, true, prefix, false));
    check_experts_f32(&m, &src, &t, prefix);
    assert!(!m.has_tensor("lm_head"), "tied and absent: no lm_head");
    assert!(m.manifest.config.tie_word_embeddings);
    assert_eq!(
        m.manifest.config.layer_types,
        vec![
            LayerKind::LinearAttention,
            LayerKind::FullAttention,
            LayerKind::LinearAttention,
            LayerKind::FullAttention
        ]
    );
    // No generation config / tokenizer: eos from config.json only.
    assert_eq!(m.manifest.eos_token_ids, vec![2]);
    assert_eq!(m.manifest.tokenizer, None);

    // bf16: matrices keep their exact bytes; norms and small tensors f32.
    let out = d.path().join("bf16.slip");
    run(&input, &out, QuantChoice::Bf16).unwrap();
    let m = SlipModel::open(&out).unwrap();
    for (canon, name, shift) in mapping(&t, true, prefix, false) {
        let tt = m.tensor(&canon).unwrap();
        let (shape, vals) = &src[&name];
        let small = shift
            || canon.ends_with("norm")
            || canon.contains("conv")
            || canon.contains("A_log")
            || canon.contains("dt_bias");
        if small {
            assert_eq!(tt.qtype, QuantType::F32, "{canon}");
        } else {
            assert_eq!(tt.qtype, QuantType::Bf16, "{canon}");
            assert_eq!(shape.len(), 2);
            assert_eq!(
                tt.view().data,
                &to_bytes(vals, Dtype::BF16)[..],
                "{canon} bytes"
            );
        }
    }
    let pool = &m.manifest.experts;
    assert!(pool.parts.iter().all(|p| p.qtype == QuantType::Bf16));
    let mut buf = vec![0u8; pool.record_stride as usize];
    m.read_expert(3, 2, &mut buf).unwrap();
    let w = m.expert_views(3, 2, &buf).unwrap();
    let want = expert_src(&src, &t, prefix, 3, 2);
    assert_eq!(w.up.data, &to_bytes(&want[1], Dtype::BF16)[..]);
    assert_eq!(w.down.data, &to_bytes(&want[2], Dtype::BF16)[..]);
}

// ------------------------------------------------------------ qwen3_moe

#[test]
fn qwen3_moe_f32_plain_norms() {
    let d = tmp();
    let input = d.path().join("in");
    let (t, src) = qwen3_checkpoint(&input);
    let out = d.path().join("out");
    run(&input, &out, QuantChoice::F32).unwrap();
    let m = SlipModel::open(&out).unwrap();
    check_dense_f32(&m, &src, &mapping(&t, false, "model.", true));
    check_experts_f32(&m, &src, &t, "model.");
    let c = &m.manifest.config;
    assert_eq!(c.architecture, Architecture::Qwen3Moe);
    assert_eq!(c.rotary_dim, c.head_dim);
    assert_eq!(c.rope_theta, 1e6);
    assert!(!c.attn_output_gate && c.norm_topk_prob);
    assert_eq!(c.shared_expert_intermediate_size, 0);
    assert_eq!(m.manifest.eos_token_ids, vec![2, 3]);
}

#[test]
fn qwen3_moe_q4_and_q8_layouts() {
    let d = tmp();
    let input = d.path().join("in");
    let (t, src) = qwen3_checkpoint(&input);
    for (quant, main) in [
        (QuantChoice::Q4, QuantType::Q4),
        (QuantChoice::Q8, QuantType::Q8),
    ] {
        let out = d.path().join(format!("{quant}"));
        let report = run(&input, &out, quant).unwrap();
        assert!(report.bytes_out > 0 && report.bytes_in > 0);
        let m = SlipModel::open(&out).unwrap();
        for (canon, name, _) in mapping(&t, false, "model.", true) {
            let tt = m.tensor(&canon).unwrap();
            let want = if canon.ends_with("norm") {
                QuantType::F32
            } else if canon.ends_with("router") {
                QuantType::Q8
            } else {
                main
            };
            assert_eq!(tt.qtype, want, "{quant} {canon}");
            // Dequantized values are close to the source.
            let got = slipstream_kernels::quantize::to_f32(&tt.view());
            let src_vals = &src[&name].1;
            let tol = if want == QuantType::Q4 { 0.15 } else { 0.01 };
            for (i, (a, b)) in got.iter().zip(src_vals).enumerate() {
                assert!((a - b).abs() <= tol, "{quant} {canon}[{i}]: {a} vs {b}");
            }
        }
        assert!(m.manifest.experts.parts.iter().all(|p| p.qtype == main));
        let mut buf = vec![0u8; m.manifest.experts.record_stride as usize];
        m.read_expert(1, 3, &mut buf).unwrap();
        let w = m.expert_views(1, 3, &buf).unwrap();
        let want = expert_src(&src, &t, "model.", 1, 3);
        let got = slipstream_kernels::quantize::to_f32(&w.down);
        let tol = if main == QuantType::Q4 { 0.15 } else { 0.01 };
        assert!(got.iter().zip(&want[2]).all(|(a, b)| (a - b).abs() <= tol));
    }
}

#[test]
fn odd_row_length_stays_f32_under_q4() {
    let d = tmp();
    let input = d.path().join("in");
    let t = Tiny {
        inter: 48, // down_proj rows of 48 cannot be grouped by 64
        ..Tiny::qwen3()
    };
    let src = hf_tensors(&t, false, "model.", false, true);
    save(&input, &floats_to_raw(&src, Dtype::F32), 1);
    write_json(&input.join("config.json"), &t.qwen3_config());
    let out = d.path().join("out");
    let r = run(&input, &out, QuantChoice::Q4).unwrap();
    let q: Vec<QuantType> = r.expert_layout.iter().map(|p| p.1).collect();
    assert_eq!(q, vec![QuantType::Q4, QuantType::Q4, QuantType::F32]);
    SlipModel::open(&out).unwrap();
}

#[test]
fn progress_events_add_up() {
    let d = tmp();
    let input = d.path().join("in");
    qwen3_checkpoint(&input);
    let events = std::cell::RefCell::new(Vec::new());
    let r = repack(
        &RepackOptions {
            input: input.clone(),
            output: d.path().join("out"),
            overwrite: Default::default(),
            quant: QuantChoice::default(),
            ggml_to_affine: false,
        },
        &|e| events.borrow_mut().push(e),
    )
    .unwrap();
    let ev = events.into_inner();
    let ProgressEvent::Started {
        total_bytes,
        tensors,
        experts,
        ..
    } = ev[0]
    else {
        panic!("first event must be Started")
    };
    assert!(matches!(ev.last(), Some(ProgressEvent::Finishing)));
    let mut sum = 0;
    let (mut nt, mut ne) = (0, 0);
    for e in &ev {
        match e {
            ProgressEvent::Tensor { bytes_in, .. } => {
                sum += bytes_in;
                nt += 1
            }
            ProgressEvent::Expert { bytes_in, .. } => {
                sum += bytes_in;
                ne += 1
            }
            _ => {}
        }
    }
    assert_eq!(sum, total_bytes);
    assert_eq!(sum, r.bytes_in);
    assert_eq!((nt, ne), (tensors, experts));
    assert_eq!(ne, 2 * 4);
}

// ------------------------------------------------------------ fixtures

#[test]
fn repacks_reference_fixtures() {
    for name in [
        "qwen3_5_moe_fused",
        "qwen3_5_moe_split",
        "qwen3_moe",
        "qwen3_5_moe_mlx4",
        "qwen3_next",
        "qwen3_next_mlx4",
    ] {
        let input = fixtures_dir().join(name);
        if !input.join("config.json").exists() {
            eprintln!("fixture {name} not present, skipped");
            continue;
        }
        let d = tmp();
        for quant in [QuantChoice::F32, QuantChoice::Q4] {
            let out = d.path().join(format!("{name}-{quant}"));
            let r = run(&input, &out, quant).unwrap_or_else(|e| panic!("{name} {quant}: {e}"));
            let m = SlipModel::open(&out).unwrap();
            let mut got: Vec<String> = m.manifest.dense.iter().map(|e| e.name.clone()).collect();
            let mut want = canonical_dense_names(&m.manifest.config);
            got.sort();
            want.sort();
            assert_eq!(got, want, "{name}");
            assert!(r.bytes_in > 0 && r.experts_written > 0, "{name}");
            assert!(
                m.manifest.tokenizer.is_some() && m.manifest.chat_template.is_some(),
                "{name}"
            );
            assert!(!m.manifest.eos_token_ids.is_empty(), "{name}");
            let mut buf = vec![0u8; m.manifest.experts.record_stride as usize];
            m.read_expert(
                m.manifest.experts.num_layers - 1,
                m.manifest.experts.num_experts - 1,
                &mut buf,
            )
            .unwrap();
        }
    }
}

/// The MLX fixture was made by mlx_lm.convert from the fused fixture's
/// weights: after repacking, both must hold the same numbers (to bf16 /
/// 4-bit precision). This checks the +1 norm convention, the conv layout and
/// the code packing against real mlx-lm output.
#[test]
fn mlx_fixture_matches_its_float_source() {
    let (fused, mlx) = (
        fixtures_dir().join("qwen3_5_moe_fused"),
        fixtures_dir().join("qwen3_5_moe_mlx4"),
    );
    if !fused.join("config.json").exists() || !mlx.join("config.json").exists() {
        eprintln!("fixtures qwen3_5_moe_fused / qwen3_5_moe_mlx4 not present, skipped");
        return;
    }
    let d = tmp();
    run(&fused, &d.path().join("f"), QuantChoice::F32).unwrap();
    run(&mlx, &d.path().join("m"), QuantChoice::F32).unwrap();
    let f = SlipModel::open(&d.path().join("f")).unwrap();
    let m = SlipModel::open(&d.path().join("m")).unwrap();
    assert_eq!(f.manifest.config, m.manifest.config);
    let deq = |t: &slipstream_core::TensorView| slipstream_kernels::quantize::to_f32(t);
    let mut checked = 0;
    for entry in &f.manifest.dense {
        let a = deq(&f.tensor(&entry.name).unwrap().view());
        let mt = m.tensor(&entry.name).unwrap();
        let b = deq(&mt.view());
        assert_eq!(a.len(), b.len(), "{}", entry.name);
        let amax = a.iter().fold(0f32, |x, y| x.max(y.abs()));
        let tol = match mt.qtype {
            QuantType::Affine { bits: 4, .. } => amax / 7.0,
            QuantType::Affine { .. } => amax / 100.0,
            _ => amax / 128.0, // bf16
        };
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= tol,
                "{}[{i}]: float {x} vs mlx {y} (tol {tol})",
                entry.name
            );
        }
        checked += 1;
    }
    assert_eq!(checked, m.manifest.dense.len());
    let pool = &f.manifest.experts;
    let mut fb = vec![0u8; pool.record_stride as usize];
    let mut mb = vec![0u8; m.manifest.experts.record_stride as usize];
    for l in 0..pool.num_layers {
        for e in [0, pool.num_experts - 1] {
            f.read_expert(l, e, &mut fb).unwrap();
            m.read_expert(l, e, &mut mb).unwrap();
            let (fw, mw) = (
                f.expert_views(l, e, &fb).unwrap(),
                m.expert_views(l, e, &mb).unwrap(),
            );
            for (a, b) in [(fw.gate, mw.gate), (fw.up, mw.up), (fw.down, mw.down)] {
                let (a, b) = (deq(&a), deq(&b));
                let amax = a.iter().fold(0f32, |x, y| x.max(y.abs()));
                assert!(
                    a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= amax / 7.0),
                    "layer {l} expert {e}"
                );
            }
        }
    }
}

/// `ggml_to_affine` on the Q4_0 GGUF fixture (Q8_0 dense tensors): every
/// Q4_0 / Q8_0 tensor and expert part becomes affine 4-bit / 8-bit group 32
/// with the same dequantized values,
/// except where one block's bias `-8 d` / `-128 d` would leave f16: that
/// dense tensor, and that expert part in every layer (one pool layout),
/// keep their Q4_0 blocks.
#[test]
fn gguf_q4_0_converts_to_affine_and_falls_back_per_tensor() {
    use slipstream_gguf::{GgmlType, GgufFile, GgufWriter, TensorDecl};
    let dir = tempfile::tempdir().unwrap();
    let src = fixtures_dir().join("gguf_qwen3moe_q4_0/model.gguf");
    let f = GgufFile::open(&src).unwrap();
    // Block 1's d = 8192: finite, but -8 d = -65536 is not an f16.
    let (dense_bad, expert_bad) = ("blk.0.attn_q.weight", "blk.1.ffn_down_exps.weight");
    let patched = dir.path().join("patched.gguf");
    let decls = (f.tensors.iter())
        .map(|t| TensorDecl::new(t.name.clone(), &t.dims, t.ty))
        .collect();
    let mut w = GgufWriter::create(&patched, &f.metadata, decls, Default::default()).unwrap();
    for t in &f.tensors {
        let mut b = f.data(t).to_vec();
        if t.name == dense_bad || t.name == expert_bad {
            let bb = match t.ty {
                GgmlType::Q4_0 => 18,
                GgmlType::Q8_0 => 34,
                ty => panic!("{} is {ty:?}", t.name),
            };
            b[bb..bb + 2].copy_from_slice(&half::f16::from_f32(8192.0).to_le_bytes());
        }
        w.write_tensor(&t.name, &b).unwrap();
    }
    w.finish().unwrap();

    let run_gguf = |input: &Path, out: &Path, ggml_to_affine: bool| {
        repack(
            &RepackOptions {
                input: input.to_path_buf(),
                output: out.to_path_buf(),
                overwrite: Default::default(),
                quant: QuantChoice::default(),
                ggml_to_affine,
            },
            &|_| {},
        )
        .unwrap()
    };
    let (kept, conv) = (dir.path().join("kept.slip"), dir.path().join("conv.slip"));
    let rk = run_gguf(&patched, &kept, false);
    let rc = run_gguf(&patched, &conv, true);
    let to_affine = slipstream_kernels::ggml::affine::affine_of;
    for (pk, pc) in rk.expert_layout.iter().zip(&rc.expert_layout) {
        let expect = match to_affine(pk.1) {
            Some(q) if pk.0 != "down" => q,
            _ => pk.1,
        };
        assert_eq!(pc.1, expect, "expert part {}", pk.0);
    }
    let g32 = |q: QuantType| matches!(q, QuantType::Affine { group: 32, .. });
    assert!(rc.expert_layout.iter().any(|p| g32(p.1)));
    let (mk, mc) = (
        SlipModel::open(&kept).unwrap(),
        SlipModel::open(&conv).unwrap(),
    );
    let mut converted = 0;
    for d in &mk.manifest.dense {
        let (a, b) = (mk.tensor(&d.name).unwrap(), mc.tensor(&d.name).unwrap());
        if d.name == "layers.0.attn.q_proj" {
            assert_eq!(b.qtype, a.qtype, "the overflowing tensor is kept");
            assert!(a.qtype.is_ggml());
        } else if let Some(q) = to_affine(a.qtype) {
            assert_eq!(b.qtype, q, "{}", d.name);
            converted += 1;
        } else {
            assert_eq!(a.qtype, b.qtype, "{}", d.name);
        }
        let (mut x, mut y) = (vec![0f32; a.cols], vec![0f32; a.cols]);
        for r in 0..a.rows {
            slipstream_kernels::dequantize_row(&a.view(), r, &mut x);
            slipstream_kernels::dequantize_row(&b.view(), r, &mut y);
            for (p, q) in x.iter().zip(&y) {
                assert!(
                    p.to_bits() == q.to_bits() || (*p == 0.0 && *q == 0.0),
                    "{}",
                    d.name
                );
            }
        }
    }
    assert!(converted > 0);
}

/// qwen3_next's fused `in_proj_qkvz` / `in_proj_ba` (rows grouped per key
/// head, transformers' `fix_query_key_value_ordering`) become the canonical
/// qkv / z / b / a bit for bit; its flat config and its undeclared MTP head
/// are read; `norm_topk_prob` comes from the config.
#[test]
fn qwen3_next_fused_projections_split_per_key_head() {
    let input = fixtures_dir().join("qwen3_next");
    let d = tmp();
    let out = d.path().join("next");
    let report = run(&input, &out, QuantChoice::F32).unwrap();
    let c = &report.config;
    assert_eq!(c.architecture, Architecture::Qwen3Next);
    assert_eq!(
        c.layer_types,
        [
            vec![LayerKind::LinearAttention; 3],
            vec![LayerKind::FullAttention]
        ]
        .concat()
    );
    assert_eq!((c.rope_theta, c.rotary_dim, c.mtp_num_layers), (1e7, 8, 1));
    assert!(c.attn_output_gate && c.norm_topk_prob);
    assert!(
        report.ignored_tensors.is_empty(),
        "{:?}",
        report.ignored_tensors
    );

    let bytes = std::fs::read(input.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let bf16 = |name: &str| -> Vec<f32> {
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), Dtype::BF16);
        t.data()
            .chunks_exact(2)
            .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
            .collect()
    };
    let m = SlipModel::open(&out).unwrap();
    let (nk, dk, r, dv, h) = (4, 16, 2, 16, 64);
    for l in 0..3 {
        // [nk, q dk | k dk | v r*dv | z r*dv, h] and [nk, b r | a r, h].
        let qkvz = bf16(&format!("model.layers.{l}.linear_attn.in_proj_qkvz.weight"));
        let ba = bf16(&format!("model.layers.{l}.linear_attn.in_proj_ba.weight"));
        let per = 2 * dk + 2 * r * dv;
        let rows = |src: &[f32], per: usize, from: usize, n: usize| -> Vec<f32> {
            (0..nk)
                .flat_map(|g| src[(g * per + from) * h..(g * per + from + n) * h].to_vec())
                .collect()
        };
        let qkv = [
            rows(&qkvz, per, 0, dk),
            rows(&qkvz, per, dk, dk),
            rows(&qkvz, per, 2 * dk, r * dv),
        ]
        .concat();
        let gdn = |k: &str| stored_f32(&m, &format!("layers.{l}.gdn.{k}"));
        bits_eq(&gdn("in_proj_qkv"), &qkv, "in_proj_qkv");
        bits_eq(
            &gdn("in_proj_z"),
            &rows(&qkvz, per, 2 * dk + r * dv, r * dv),
            "in_proj_z",
        );
        bits_eq(&gdn("in_proj_b"), &rows(&ba, 2 * r, 0, r), "in_proj_b");
        bits_eq(&gdn("in_proj_a"), &rows(&ba, 2 * r, r, r), "in_proj_a");
    }
    // Zero-centred norms are shifted, the MTP head's too.
    let w = bf16("mtp.pre_fc_norm_hidden.weight");
    let shifted: Vec<f32> = w.iter().map(|x| 1.0 + x).collect();
    bits_eq(
        &stored_f32(&m, "layers.4.mtp.hidden_norm"),
        &shifted,
        "mtp.hidden_norm",
    );

    // The router renormalises only when the config says so.
    let copy = d.path().join("copy");
    std::fs::create_dir(&copy).unwrap();
    for f in std::fs::read_dir(&input).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, copy.join(f.file_name().unwrap())).unwrap();
    }
    let cfg_path = copy.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg["norm_topk_prob"] = json!(false);
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    assert!(!read_checkpoint_config(&copy).unwrap().norm_topk_prob);
}

/// A legacy qwen3next GGUF (fused `ssm_in` = transformers' `in_proj_qkvz`,
/// per key head `[q, k, v, z]`, instead of the converter's `attn_qkv` /
/// `attn_gate`) imports to the very same model as the fixture it is
/// rewritten from: every dense tensor and expert byte for byte.
#[test]
fn gguf_qwen3next_legacy_ssm_in_imports_like_the_split_tensors() {
    use slipstream_gguf::{GgufFile, GgufWriter, TensorDecl};
    let dir = tempfile::tempdir().unwrap();
    let src = fixtures_dir().join("gguf_qwen3next_q8_0/model.gguf");
    let f = GgufFile::open(&src).unwrap();
    // 4 key heads of 16, 2 value heads of 16 per key head, hidden 64.
    let (nk, dk, vd) = (4usize, 16usize, 32usize);
    let legacy = dir.path().join("legacy.gguf");
    let mut decls = Vec::new();
    let mut datas: Vec<(String, Vec<u8>)> = Vec::new();
    for t in &f.tensors {
        let Some(base) = t.name.strip_suffix(".attn_qkv.weight") else {
            if !t.name.ends_with(".attn_gate.weight") {
                decls.push(TensorDecl::new(t.name.clone(), &t.dims, t.ty));
                datas.push((t.name.clone(), f.data(t).to_vec()));
            }
            continue;
        };
        let gate = f.tensor(&format!("{base}.attn_gate.weight")).unwrap();
        let rb = t.row_bytes() as usize;
        let (qkv, z) = (f.data(t), f.data(gate));
        let row = |m: &[u8], r: usize| m[r * rb..(r + 1) * rb].to_vec();
        let mut fused = Vec::new();
        for g in 0..nk {
            for r in 0..dk {
                fused.extend(row(qkv, g * dk + r));
            }
            for r in 0..dk {
                fused.extend(row(qkv, nk * dk + g * dk + r));
            }
            for r in 0..vd {
                fused.extend(row(qkv, 2 * nk * dk + g * vd + r));
            }
            for r in 0..vd {
                fused.extend(row(z, g * vd + r));
            }
        }
        let name = format!("{base}.ssm_in.weight");
        let rows = (nk * (2 * dk + 2 * vd)) as u64;
        decls.push(TensorDecl::new(name.clone(), &[t.dims[0], rows], t.ty));
        datas.push((name, fused));
    }
    let mut w = GgufWriter::create(&legacy, &f.metadata, decls, Default::default()).unwrap();
    for (name, b) in &datas {
        w.write_tensor(name, b).unwrap();
    }
    w.finish().unwrap();
    assert!(GgufFile::open(&legacy)
        .unwrap()
        .tensor("blk.0.attn_qkv.weight")
        .is_none());

    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let ra = run(&src, &a, QuantChoice::Q4).unwrap();
    let rb = run(&legacy, &b, QuantChoice::Q4).unwrap();
    assert_eq!(ra.config, rb.config);
    assert!(rb.ignored_tensors.is_empty(), "{:?}", rb.ignored_tensors);
    let (ma, mb) = (SlipModel::open(&a).unwrap(), SlipModel::open(&b).unwrap());
    for d in &ma.manifest.dense {
        let (x, y) = (ma.tensor(&d.name).unwrap(), mb.tensor(&d.name).unwrap());
        assert_eq!(x.qtype, y.qtype, "{}", d.name);
        assert!(x.view().data == y.view().data, "{} differs", d.name);
    }
    assert_eq!(ma.manifest.experts.checksums, mb.manifest.experts.checksums);
}
