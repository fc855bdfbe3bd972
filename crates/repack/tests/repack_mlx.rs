//! Repacks MLX 4-bit checkpoints: quantized tensors copied bit for bit,
//! the rest converted as from Hugging Face.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::*;
use safetensors::Dtype;
use serde_json::json;
use slipstream_core::{QuantType, ScaleType};
use slipstream_format::SlipModel;
use slipstream_repack::*;

// ------------------------------------------------------------ MLX

struct MlxModel {
    dense: BTreeMap<String, MlxQ>,
    experts: Vec<[MlxQ; 3]>,
    floats: FloatMap,
}

fn mlx_checkpoint(input: &Path, t: &Tiny) -> MlxModel {
    let p = "language_model.model.";
    let h = t.hidden;
    let mut raw = BTreeMap::new();
    let mut dense = BTreeMap::new();
    let mut floats = FloatMap::new();
    let mut q = |canon: &str,
                 base: String,
                 shape: &[usize],
                 bits: usize,
                 raw: &mut BTreeMap<String, Raw>| {
        let m = MlxQ::random(&base, shape, bits, 64);
        m.insert(&base, raw);
        dense.insert(canon.to_string(), m);
    };
    q(
        "embed",
        format!("{p}embed_tokens"),
        &[t.vocab, h],
        4,
        &mut raw,
    );
    q(
        "lm_head",
        "language_model.lm_head".into(),
        &[t.vocab, h],
        4,
        &mut raw,
    );
    let mut fl = |canon: &str,
                  name: String,
                  shape: &[usize],
                  dtype: Dtype,
                  raw: &mut BTreeMap<String, Raw>| {
        let mut v = values(&name, shape.iter().product());
        if dtype == Dtype::BF16 {
            v = v
                .iter()
                .map(|x| half::bf16::from_f32(1.0 + x).to_f32())
                .collect();
        }
        raw.insert(
            name.clone(),
            Raw {
                dtype,
                shape: shape.to_vec(),
                data: to_bytes(&v, dtype),
            },
        );
        floats.insert(canon.to_string(), (shape.to_vec(), v));
    };
    fl(
        "final_norm",
        format!("{p}norm.weight"),
        &[h],
        Dtype::BF16,
        &mut raw,
    );
    let mut experts = Vec::new();
    let mut quant_cfg = serde_json::Map::new();
    quant_cfg.insert("group_size".into(), json!(64));
    quant_cfg.insert("bits".into(), json!(4));
    quant_cfg.insert("mode".into(), json!("affine"));
    for (l, full) in t.full.iter().enumerate() {
        let lp = format!("{p}layers.{l}.");
        let c = |s: &str| format!("layers.{l}.{s}");
        fl(
            &c("input_norm"),
            format!("{lp}input_layernorm.weight"),
            &[h],
            Dtype::BF16,
            &mut raw,
        );
        fl(
            &c("post_attn_norm"),
            format!("{lp}post_attention_layernorm.weight"),
            &[h],
            Dtype::BF16,
            &mut raw,
        );
        if *full {
            let a = format!("{lp}self_attn.");
            q(
                &c("attn.q_proj"),
                format!("{a}q_proj"),
                &[t.heads * t.head_dim * 2, h],
                4,
                &mut raw,
            );
            q(
                &c("attn.k_proj"),
                format!("{a}k_proj"),
                &[t.kv_heads * t.head_dim, h],
                4,
                &mut raw,
            );
            q(
                &c("attn.v_proj"),
                format!("{a}v_proj"),
                &[t.kv_heads * t.head_dim, h],
                4,
                &mut raw,
            );
            q(
                &c("attn.o_proj"),
                format!("{a}o_proj"),
                &[h, t.heads * t.head_dim],
                4,
                &mut raw,
            );
            fl(
                &c("attn.q_norm"),
                format!("{a}q_norm.weight"),
                &[t.head_dim],
                Dtype::BF16,
                &mut raw,
            );
            fl(
                &c("attn.k_norm"),
                format!("{a}k_norm.weight"),
                &[t.head_dim],
                Dtype::BF16,
                &mut raw,
            );
        } else {
            let g = format!("{lp}linear_attn.");
            q(
                &c("gdn.in_proj_qkv"),
                format!("{g}in_proj_qkv"),
                &[t.conv_dim(), h],
                4,
                &mut raw,
            );
            q(
                &c("gdn.in_proj_z"),
                format!("{g}in_proj_z"),
                &[t.nv * t.dv, h],
                4,
                &mut raw,
            );
            q(
                &c("gdn.in_proj_b"),
                format!("{g}in_proj_b"),
                &[t.nv, h],
                4,
                &mut raw,
            );
            q(
                &c("gdn.in_proj_a"),
                format!("{g}in_proj_a"),
                &[t.nv, h],
                4,
                &mut raw,
            );
            q(
                &c("gdn.out_proj"),
                format!("{g}out_proj"),
                &[h, t.nv * t.dv],
                4,
                &mut raw,
            );
            fl(
                &c("gdn.conv"),
                format!("{g}conv1d.weight"),
                &[t.conv_dim(), t.kernel, 1],
                Dtype::BF16,
                &mut raw,
            );
            fl(
                &c("gdn.A_log"),
                format!("{g}A_log"),
                &[t.nv],
                Dtype::F32,
                &mut raw,
            );
            fl(
                &c("gdn.dt_bias"),
                format!("{g}dt_bias"),
                &[t.nv],
                Dtype::BF16,
                &mut raw,
            );
            fl(
                &c("gdn.norm"),
                format!("{g}norm.weight"),
                &[t.dv],
                Dtype::BF16,
                &mut raw,
            );
        }
        let m = format!("{lp}mlp.");
        q(
            &c("moe.router"),
            format!("{m}gate"),
            &[t.experts, h],
            8,
            &mut raw,
        );
        q(
            &c("moe.shared_gate"),
            format!("{m}shared_expert_gate"),
            &[1, h],
            8,
            &mut raw,
        );
        quant_cfg.insert(format!("{m}gate"), json!({"group_size": 64, "bits": 8}));
        quant_cfg.insert(
            format!("{m}shared_expert_gate"),
            json!({"group_size": 64, "bits": 8}),
        );
        q(
            &c("moe.shared.gate_proj"),
            format!("{m}shared_expert.gate_proj"),
            &[t.shared, h],
            4,
            &mut raw,
        );
        q(
            &c("moe.shared.up_proj"),
            format!("{m}shared_expert.up_proj"),
            &[t.shared, h],
            4,
            &mut raw,
        );
        q(
            &c("moe.shared.down_proj"),
            format!("{m}shared_expert.down_proj"),
            &[h, t.shared],
            4,
            &mut raw,
        );
        let sw = |x: &str, shape: &[usize], raw: &mut BTreeMap<String, Raw>| {
            let base = format!("{m}switch_mlp.{x}");
            let q = MlxQ::random(&base, shape, 4, 64);
            q.insert(&base, raw);
            q
        };
        experts.push([
            sw("gate_proj", &[t.experts, t.inter, h], &mut raw),
            sw("up_proj", &[t.experts, t.inter, h], &mut raw),
            sw("down_proj", &[t.experts, h, t.inter], &mut raw),
        ]);
    }
    save(input, &raw, 2);
    let mut cfg = t.qwen35_config();
    cfg.as_object_mut()
        .unwrap()
        .insert("quantization".into(), serde_json::Value::Object(quant_cfg));
    write_json(&input.join("config.json"), &cfg);
    MlxModel {
        dense,
        experts,
        floats,
    }
}

#[test]
fn mlx_4bit_is_copied_bit_exactly() {
    let d = tmp();
    let input = d.path().join("in");
    let t = Tiny::qwen35();
    let mlx = mlx_checkpoint(&input, &t);
    let out = d.path().join("out");
    let r = run(&input, &out, QuantChoice::Q4).unwrap();
    assert_eq!(r.kind, SourceKind::Mlx);
    let m = SlipModel::open(&out).unwrap();
    assert_eq!(m.manifest.source.kind, "mlx");
    assert_eq!(m.manifest.dense.len(), mlx.dense.len() + mlx.floats.len());
    for (canon, q) in &mlx.dense {
        let tt = m.tensor(canon).unwrap();
        assert_eq!(
            tt.qtype,
            QuantType::Affine {
                bits: q.bits as u8,
                group: 64,
                scale: ScaleType::Bf16
            },
            "{canon}"
        );
        assert_eq!(tt.view().data, &q.stored()[..], "{canon} bytes");
    }
    // Float tensors: as stored (norms already shifted: no +1), conv [C, K].
    for (canon, (_, vals)) in &mlx.floats {
        bits_eq(&stored_f32(&m, canon), vals, canon);
    }
    let conv = m.tensor("layers.0.gdn.conv").unwrap();
    assert_eq!((conv.rows, conv.cols), (t.conv_dim(), t.kernel));
    let pool = &m.manifest.experts;
    let mut buf = vec![0u8; pool.record_stride as usize];
    for (l, parts) in mlx.experts.iter().enumerate() {
        for e in 0..t.experts {
            m.read_expert(l, e, &mut buf).unwrap();
            let w = m.expert_views(l, e, &buf).unwrap();
            for (k, view) in [w.gate, w.up, w.down].iter().enumerate() {
                assert_eq!(
                    view.qtype,
                    QuantType::Affine {
                        bits: 4,
                        group: 64,
                        scale: ScaleType::Bf16
                    }
                );
                assert_eq!(
                    view.data,
                    &parts[k].stored_slice(e, t.experts)[..],
                    "layer {l} expert {e} part {k}"
                );
            }
        }
    }
    // --quant does not touch quantized tensors.
    let out2 = d.path().join("out2");
    run(&input, &out2, QuantChoice::F32).unwrap();
    let m2 = SlipModel::open(&out2).unwrap();
    assert_eq!(
        m2.tensor("embed").unwrap().view().data,
        m.tensor("embed").unwrap().view().data
    );
    assert_eq!(m2.manifest.model_hash, m.manifest.model_hash);
}
