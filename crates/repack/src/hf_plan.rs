//! The plan of a Hugging Face or MLX checkpoint's conversion: which source
//! tensor becomes which canonical tensor or expert part, and how it is stored
//! ([`build_plan`]); the storage rules are in the crate's documentation.

use std::cell::RefCell;
use std::collections::HashSet;

use safetensors::Dtype;
use serde_json::Value;
use slipstream_core::schema::{self, PartSpec, TensorKind, TensorSpec};
use slipstream_core::{Architecture, ModelConfig, QuantType, ScaleType};

use crate::config::RawConfig;
use crate::convert::{dtype_bytes, PartSrc, RowPick};
use crate::source::{Checkpoint, SrcTensor};
use crate::{QuantChoice, RepackError, Result};
pub(crate) const FLOAT_DTYPES: &str = "F32, BF16 or F16";

/// How a float tensor is treated by the storage rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Norm weight: always F32; `shift` adds 1 (zero-centred HF qwen3_5 norms).
    Norm { shift: bool },
    /// Small per-channel parameter (conv, A_log, dt_bias): always F32.
    Small,
    /// Weight matrix; `router` marks tensors kept at Q8 under `--quant q4`.
    Matrix { router: bool },
}

pub(crate) struct DenseJob<'a> {
    pub(crate) name: String,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) src: PartSrc<'a>,
    pub(crate) qtype: QuantType,
    pub(crate) shift: bool,
    /// The rows of a fused `src` this tensor is (Qwen3-Next's
    /// `in_proj_qkvz` / `in_proj_ba`); `None`: all of `src`.
    pub(crate) pick: Option<RowPick>,
}

impl DenseJob<'_> {
    /// Source bytes this tensor reads (its share of a fused source).
    pub(crate) fn bytes_in(&self) -> u64 {
        match &self.pick {
            Some(p) => self.src.bytes() * self.rows as u64 / p.source_rows().max(1) as u64,
            None => self.src.bytes(),
        }
    }
}

pub(crate) struct LayerPlan<'a> {
    pub(crate) dense: Vec<DenseJob<'a>>,
    /// `[gate, up, down]` per expert.
    pub(crate) experts: Vec<[PartSrc<'a>; 3]>,
}

pub(crate) struct Plan<'a> {
    pub(crate) head: Vec<DenseJob<'a>>,
    pub(crate) layers: Vec<LayerPlan<'a>>,
    pub(crate) tail: Vec<DenseJob<'a>>,
    pub(crate) expert_layout: Vec<(String, QuantType, [usize; 2])>,
    pub(crate) ignored: Vec<String>,
}

/// MLX quantization settings from `config.json`.
pub(crate) struct MlxQuant {
    pub(crate) bits: usize,
    pub(crate) group: usize,
    pub(crate) overrides: serde_json::Map<String, Value>,
}

impl MlxQuant {
    pub(crate) fn from_config(raw: &RawConfig, q: &Value) -> Result<Self> {
        if let Some(mode) = q.get("mode").and_then(|m| m.as_str()) {
            if mode != "affine" {
                return Err(RepackError::UnsupportedConfig {
                    path: raw.path.clone(),
                    feature: format!("MLX quantization mode {mode:?} (only \"affine\")"),
                });
            }
        }
        let obj = q.as_object().cloned().unwrap_or_default();
        Ok(MlxQuant {
            bits: q.get("bits").and_then(|v| v.as_u64()).unwrap_or(4) as usize,
            group: q.get("group_size").and_then(|v| v.as_u64()).unwrap_or(64) as usize,
            overrides: obj,
        })
    }

    /// `(bits, group)` the config announces for a module path.
    pub(crate) fn for_path(&self, path: &str) -> (usize, usize) {
        match self.overrides.get(path) {
            Some(Value::Object(o)) => (
                o.get("bits")
                    .and_then(|v| v.as_u64())
                    .map_or(self.bits, |b| b as usize),
                o.get("group_size")
                    .and_then(|v| v.as_u64())
                    .map_or(self.group, |g| g as usize),
            ),
            _ => (self.bits, self.group),
        }
    }
}

pub(crate) struct Ctx<'a> {
    pub(crate) ck: &'a Checkpoint,
    pub(crate) quant: QuantChoice,
    pub(crate) mlx: Option<MlxQuant>,
    pub(crate) used: RefCell<HashSet<String>>,
}

pub(crate) fn shape_err(name: &str, expected: &[usize], found: &[usize]) -> RepackError {
    RepackError::Shape {
        name: name.to_string(),
        expected: expected.to_vec(),
        found: found.to_vec(),
    }
}

pub(crate) fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::F32 | Dtype::BF16 | Dtype::F16)
}

impl<'a> Ctx<'a> {
    pub(crate) fn get(&self, name: &str) -> Result<SrcTensor<'a>> {
        let t = self.ck.require(name)?;
        self.used.borrow_mut().insert(name.to_string());
        Ok(t)
    }

    pub(crate) fn float(&self, name: &str) -> Result<SrcTensor<'a>> {
        let t = self.get(name)?;
        if !is_float(t.dtype) {
            return Err(RepackError::Dtype {
                name: name.to_string(),
                dtype: t.dtype.to_string(),
                supported: FLOAT_DTYPES,
            });
        }
        Ok(t)
    }

    /// A float tensor of exactly `shape`.
    pub(crate) fn float_shaped(&self, name: &str, shape: &[usize]) -> Result<PartSrc<'a>> {
        let t = self.float(name)?;
        if t.shape != shape {
            return Err(shape_err(name, shape, t.shape));
        }
        Ok(PartSrc::Float {
            dtype: t.dtype,
            data: t.data,
        })
    }

    /// Storage type of a float tensor of `role` with rows of `cols`.
    pub(crate) fn float_qtype(&self, role: Role, cols: usize) -> QuantType {
        match role {
            Role::Norm { .. } | Role::Small => QuantType::F32,
            Role::Matrix { router } => match self.quant {
                QuantChoice::F32 => QuantType::F32,
                QuantChoice::Bf16 => QuantType::Bf16,
                _ if cols % 64 != 0 => QuantType::F32,
                QuantChoice::Q8 => QuantType::Q8,
                QuantChoice::Q4 if router => QuantType::Q8,
                QuantChoice::Q4 => QuantType::Q4,
            },
        }
    }

    pub(crate) fn qtype_of(&self, src: &PartSrc, role: Role, cols: usize) -> QuantType {
        match src {
            PartSrc::Quant { qtype, .. } => *qtype,
            PartSrc::Float { .. } => self.float_qtype(role, cols),
        }
    }

    /// MLX-quantized `base.{weight,scales,biases}` with optional leading
    /// expert dim `lead`; returns the qtype and the three tensors.
    pub(crate) fn quantized(
        &self,
        base: &str,
        lead: Option<usize>,
        rows: usize,
        cols: usize,
    ) -> Result<(QuantType, [SrcTensor<'a>; 3])> {
        let wname = format!("{base}.weight");
        let sname = format!("{base}.scales");
        let bname = format!("{base}.biases");
        let w = self.get(&wname)?;
        let s = self.get(&sname)?;
        let b = self.get(&bname)?;
        let (cfg_bits, cfg_group) = self.mlx.as_ref().map_or((4, 64), |q| q.for_path(base));
        let with_lead = |last: usize| -> Vec<usize> {
            let mut v: Vec<usize> = lead.into_iter().collect();
            v.push(rows);
            v.push(last);
            v
        };
        if w.dtype != Dtype::U32 {
            return Err(RepackError::Dtype {
                name: wname,
                dtype: w.dtype.to_string(),
                supported: "U32 packed codes for an MLX quantized weight",
            });
        }
        // Bits and group follow from the shapes; the config's values are
        // what we report when the shapes fit neither.
        let expected_w = with_lead(cols * cfg_bits / 32);
        let lead_ok = |shape: &[usize]| {
            shape.len() == expected_w.len()
                && shape[..shape.len() - 1] == expected_w[..expected_w.len() - 1]
        };
        if !lead_ok(w.shape) {
            return Err(shape_err(&wname, &expected_w, w.shape));
        }
        let wl = *w.shape.last().unwrap();
        let bits = [cfg_bits, 4, 8]
            .into_iter()
            .find(|&bits| (bits == 4 || bits == 8) && wl * 32 == cols * bits)
            .ok_or_else(|| shape_err(&wname, &expected_w, w.shape))?;
        let expected_s = with_lead(cols / cfg_group.max(1));
        if !lead_ok(s.shape) {
            return Err(shape_err(&sname, &expected_s, s.shape));
        }
        let sl = *s.shape.last().unwrap();
        if sl == 0 || cols % sl != 0 {
            return Err(shape_err(&sname, &expected_s, s.shape));
        }
        let group = cols / sl;
        let scale = match s.dtype {
            Dtype::BF16 => ScaleType::Bf16,
            Dtype::F16 => ScaleType::F16,
            other => {
                return Err(RepackError::Dtype {
                    name: sname,
                    dtype: other.to_string(),
                    supported: "BF16 or F16 scales",
                })
            }
        };
        if b.dtype != s.dtype {
            return Err(RepackError::Dtype {
                name: bname,
                dtype: b.dtype.to_string(),
                supported: "the same dtype as the scales",
            });
        }
        if b.shape != s.shape {
            return Err(shape_err(&bname, s.shape, b.shape));
        }
        let qtype = QuantType::Affine {
            bits: bits as u8,
            group: group as u32,
            scale,
        };
        qtype
            .check_cols(cols)
            .map_err(|e| RepackError::UnexpectedTensor {
                name: wname.clone(),
                message: e.to_string(),
            })?;
        Ok((qtype, [w, s, b]))
    }

    /// A linear layer's weight `[rows, cols]` at `base` (`base.weight`, plus
    /// `.scales`/`.biases` when MLX-quantized).
    pub(crate) fn linear(&self, base: &str, rows: usize, cols: usize) -> Result<PartSrc<'a>> {
        if self.ck.contains(&format!("{base}.scales")) {
            let (qtype, [w, s, b]) = self.quantized(base, None, rows, cols)?;
            Ok(PartSrc::Quant {
                qtype,
                codes: w.data,
                scales: s.data,
                biases: b.data,
            })
        } else {
            self.float_shaped(&format!("{base}.weight"), &[rows, cols])
        }
    }

    /// Stacked experts `base.weight [E, rows, cols]` (MLX `switch_mlp`), split per expert.
    pub(crate) fn stacked(
        &self,
        base: &str,
        e: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<PartSrc<'a>>> {
        if self.ck.contains(&format!("{base}.scales")) {
            let (qtype, [w, s, b]) = self.quantized(base, Some(e), rows, cols)?;
            let (cw, cs, cb) = (w.data.len() / e, s.data.len() / e, b.data.len() / e);
            Ok((0..e)
                .map(|i| PartSrc::Quant {
                    qtype,
                    codes: &w.data[i * cw..(i + 1) * cw],
                    scales: &s.data[i * cs..(i + 1) * cs],
                    biases: &b.data[i * cb..(i + 1) * cb],
                })
                .collect())
        } else {
            let name = format!("{base}.weight");
            let PartSrc::Float { dtype, data } = self.float_shaped(&name, &[e, rows, cols])? else {
                unreachable!()
            };
            let per = rows * cols * dtype_bytes(dtype);
            Ok((0..e)
                .map(|i| PartSrc::Float {
                    dtype,
                    data: &data[i * per..(i + 1) * per],
                })
                .collect())
        }
    }

    /// A 1-D float tensor of `n` elements.
    pub(crate) fn vector(&self, name: &str, n: usize) -> Result<PartSrc<'a>> {
        self.float_shaped(name, &[n])
    }

    pub(crate) fn job(
        &self,
        name: String,
        rows: usize,
        cols: usize,
        src: PartSrc<'a>,
        role: Role,
    ) -> DenseJob<'a> {
        let qtype = self.qtype_of(&src, role, cols);
        let shift = matches!(role, Role::Norm { shift: true });
        DenseJob {
            name,
            rows,
            cols,
            src,
            qtype,
            shift,
            pick: None,
        }
    }
}

/// Finds the text model's key prefix from where `embed_tokens` lives.
pub(crate) fn find_prefix(ck: &Checkpoint, arch: Architecture) -> Result<String> {
    for p in [
        "model.language_model.",
        "language_model.model.",
        "model.",
        "",
    ] {
        if ck.contains(&format!("{p}embed_tokens.weight")) {
            return Ok(p.to_string());
        }
    }
    let p = match arch {
        Architecture::Qwen35Moe => "model.language_model.",
        Architecture::Qwen3Moe | Architecture::Qwen3Next => "model.",
    };
    Err(RepackError::MissingTensor {
        name: format!("{p}embed_tokens.weight"),
        dir: ck.dir.display().to_string(),
    })
}

/// Tensors we skip on purpose: not part of the text model.
pub(crate) fn ignorable(name: &str) -> bool {
    name.starts_with("mtp.")
        || name.contains("visual.")
        || name.starts_with("vision_tower.")
        || name.contains(".vision_tower.")
        || name.starts_with("multi_modal_projector.")
        || name.ends_with("rotary_emb.inv_freq")
}

/// Where an official checkpoint keeps its MTP head: `mtp.` (Qwen3.5/3.6,
/// Qwen3-Next), or `model.mtp.` (accepted by llama.cpp's converter too);
/// `None` without one.
pub(crate) fn mtp_prefix(ck: &Checkpoint) -> Option<&'static str> {
    ["mtp.", "model.mtp."]
        .into_iter()
        .find(|p| ck.contains(&format!("{p}fc.weight")))
}

/// MTP layers a checkpoint carries: one more than the largest `k` of its
/// `{prefix}layers.{k}.*` tensors (how llama.cpp's converter counts them
/// for Qwen3-Next, whose config does not declare them).
pub(crate) fn mtp_layers_in(ck: &Checkpoint, prefix: &str) -> usize {
    let lp = format!("{prefix}layers.");
    ck.names()
        .filter_map(|n| n.strip_prefix(lp.as_str()))
        .filter_map(|rest| rest.split('.').next()?.parse::<usize>().ok())
        .map(|k| k + 1)
        .max()
        .unwrap_or(0)
}

/// Qwen3-Next's fused Gated DeltaNet projections: for a canonical
/// `gdn.in_proj_{qkv,z,b,a}` key, the fused checkpoint module
/// (`in_proj_qkvz` or `in_proj_ba`, rows grouped by key head) and the rows
/// of it that make the canonical tensor (see [`RowPick`]). Per key head
/// `in_proj_qkvz` holds `[q dk, k dk, v r*dv, z r*dv]` and `in_proj_ba`
/// holds `[b r, a r]`, `r` value heads per key head (transformers'
/// `Qwen3NextGatedDeltaNet.fix_query_key_value_ordering`).
pub(crate) fn qwen3_next_fused(cfg: &ModelConfig, key: &str) -> Option<(&'static str, RowPick)> {
    let nk = cfg.linear_num_key_heads;
    let dk = cfg.linear_key_head_dim;
    let r = cfg.linear_num_value_heads.checked_div(nk)?;
    let vd = r * cfg.linear_value_head_dim;
    let qkvz = |takes| RowPick {
        groups: nk,
        group_rows: 2 * dk + 2 * vd,
        takes,
    };
    let ba = |takes| RowPick {
        groups: nk,
        group_rows: 2 * r,
        takes,
    };
    Some(match key {
        "gdn.in_proj_qkv" => (
            "linear_attn.in_proj_qkvz",
            qkvz(vec![(0, dk), (dk, dk), (2 * dk, vd)]),
        ),
        "gdn.in_proj_z" => ("linear_attn.in_proj_qkvz", qkvz(vec![(2 * dk + vd, vd)])),
        "gdn.in_proj_b" => ("linear_attn.in_proj_ba", ba(vec![(0, r)])),
        "gdn.in_proj_a" => ("linear_attn.in_proj_ba", ba(vec![(r, r)])),
        _ => return None,
    })
}

/// The checkpoint name (under [`mtp_prefix`]) of an MTP-only canonical key:
/// a `.weight`-less module path for `fc`, full names for the norms.
pub(crate) fn hf_mtp_name(key: &str) -> Option<&'static str> {
    Some(match key {
        "mtp.fc" => "fc",
        "mtp.embed_norm" => "pre_fc_norm_embedding.weight",
        "mtp.hidden_norm" => "pre_fc_norm_hidden.weight",
        "mtp.final_norm" => "norm.weight",
        _ => return None,
    })
}

/// Where a canonical layer tensor (by [`TensorSpec::key`]) lives in a HF or
/// MLX checkpoint, under `layers.{l}.`: a `.weight`-less module path for
/// matrices (quantized MLX adds `.scales`/`.biases`), the full name otherwise.
pub(crate) fn hf_layer_name(key: &str) -> Option<&'static str> {
    Some(match key {
        "input_norm" => "input_layernorm.weight",
        "post_attn_norm" => "post_attention_layernorm.weight",
        "attn.q_proj" => "self_attn.q_proj",
        "attn.k_proj" => "self_attn.k_proj",
        "attn.v_proj" => "self_attn.v_proj",
        "attn.o_proj" => "self_attn.o_proj",
        "attn.q_norm" => "self_attn.q_norm.weight",
        "attn.k_norm" => "self_attn.k_norm.weight",
        "gdn.in_proj_qkv" => "linear_attn.in_proj_qkv",
        "gdn.in_proj_z" => "linear_attn.in_proj_z",
        "gdn.in_proj_b" => "linear_attn.in_proj_b",
        "gdn.in_proj_a" => "linear_attn.in_proj_a",
        "gdn.conv" => "linear_attn.conv1d.weight",
        "gdn.A_log" => "linear_attn.A_log",
        "gdn.dt_bias" => "linear_attn.dt_bias",
        "gdn.norm" => "linear_attn.norm.weight",
        "gdn.out_proj" => "linear_attn.out_proj",
        "moe.router" => "mlp.gate",
        "moe.shared_gate" => "mlp.shared_expert_gate",
        "moe.shared.gate_proj" => "mlp.shared_expert.gate_proj",
        "moe.shared.up_proj" => "mlp.shared_expert.up_proj",
        "moe.shared.down_proj" => "mlp.shared_expert.down_proj",
        _ => return None,
    })
}

pub(crate) fn build_plan<'a>(ctx: &Ctx<'a>, cfg: &ModelConfig, hf_shift: bool) -> Result<Plan<'a>> {
    let ck = ctx.ck;
    let p = find_prefix(ck, cfg.architecture)?;
    let h = cfg.hidden_size;
    let norm = Role::Norm { shift: hf_shift };
    let mat = Role::Matrix { router: false };
    let router = Role::Matrix { router: true };

    let job = |s: &TensorSpec, src: PartSrc<'a>, role: Role| {
        ctx.job(s.name.clone(), s.shape[0], s.shape[1], src, role)
    };
    let e = schema::embed_tensor(cfg);
    let head = vec![job(
        &e,
        ctx.linear(&format!("{p}embed_tokens"), e.shape[0], e.shape[1])?,
        mat,
    )];

    let [gate_part, up_part, down_part] = schema::expert_parts(cfg);
    let e_count = cfg.num_experts;
    let inter = cfg.moe_intermediate_size;
    let mut layers = Vec::new();
    // MTP layers (after the main ones) live under `mtp.layers.{k}.`.
    let mp = mtp_prefix(ck).unwrap_or("mtp.");
    for l in 0..cfg.total_layers() {
        let lp = match l.checked_sub(cfg.num_layers()) {
            None => format!("{p}layers.{l}."),
            Some(k) => format!("{mp}layers.{k}."),
        };
        let mut dense = Vec::new();
        for spec in schema::layer_tensors(cfg, l) {
            if cfg.architecture == Architecture::Qwen3Next {
                if let Some((fused, pick)) = qwen3_next_fused(cfg, spec.key) {
                    let [rows, cols] = spec.shape;
                    debug_assert_eq!(pick.rows().len(), rows);
                    let src = ctx.linear(&format!("{lp}{fused}"), pick.source_rows(), cols)?;
                    let mut j = job(&spec, src, mat);
                    j.pick = Some(pick);
                    dense.push(j);
                    continue;
                }
            }
            let hf = match hf_mtp_name(spec.key) {
                Some(name) => format!("{mp}{name}"),
                None => {
                    let hf = hf_layer_name(spec.key).ok_or_else(|| {
                        RepackError::Unsupported(format!(
                            "no checkpoint tensor is known for canonical {}",
                            spec.name
                        ))
                    })?;
                    format!("{lp}{hf}")
                }
            };
            let [rows, cols] = spec.shape;
            let (src, role) = match spec.kind {
                TensorKind::Matrix => (ctx.linear(&hf, rows, cols)?, mat),
                TensorKind::Router => (ctx.linear(&hf, rows, cols)?, router),
                // The gated `gdn.norm` is plain `w` even where the other
                // HF norms are zero-centred.
                TensorKind::Norm => (
                    ctx.vector(&hf, cols)?,
                    Role::Norm {
                        shift: hf_shift && spec.key != "gdn.norm",
                    },
                ),
                // HF [C, 1, K], MLX [C, K, 1]: the same bytes as [C, K].
                TensorKind::Small if spec.key == "gdn.conv" => {
                    let ct = ctx.float(&hf)?;
                    if ct.shape != [rows, 1, cols] && ct.shape != [rows, cols, 1] {
                        return Err(shape_err(&hf, &[rows, 1, cols], ct.shape));
                    }
                    let conv = PartSrc::Float {
                        dtype: ct.dtype,
                        data: ct.data,
                    };
                    (conv, Role::Small)
                }
                TensorKind::Small => (ctx.vector(&hf, cols)?, Role::Small),
            };
            dense.push(job(&spec, src, role));
        }
        let m = format!("{lp}mlp.");

        // Routed experts, in whichever layout the checkpoint has.
        let experts: Vec<[PartSrc<'a>; 3]> = if ck
            .contains(&format!("{m}switch_mlp.gate_proj.weight"))
        {
            let sw = format!("{m}switch_mlp.");
            let [gr, gc] = gate_part.shape;
            let [ur, uc] = up_part.shape;
            let [dr, dc] = down_part.shape;
            let g = ctx.stacked(&format!("{sw}gate_proj"), e_count, gr, gc)?;
            let u = ctx.stacked(&format!("{sw}up_proj"), e_count, ur, uc)?;
            let d = ctx.stacked(&format!("{sw}down_proj"), e_count, dr, dc)?;
            (0..e_count).map(|i| [g[i], u[i], d[i]]).collect()
        } else if ck.contains(&format!("{m}experts.gate_up_proj")) {
            let gu_name = format!("{m}experts.gate_up_proj");
            let PartSrc::Float { dtype, data } =
                ctx.float_shaped(&gu_name, &[e_count, 2 * inter, h])?
            else {
                unreachable!()
            };
            let dn_name = format!("{m}experts.down_proj");
            let PartSrc::Float {
                dtype: ddt,
                data: ddata,
            } = ctx.float_shaped(&dn_name, &[e_count, h, inter])?
            else {
                unreachable!()
            };
            let half = inter * h * dtype_bytes(dtype);
            let dper = h * inter * dtype_bytes(ddt);
            (0..e_count)
                .map(|i| {
                    let gu = &data[i * 2 * half..(i + 1) * 2 * half];
                    [
                        PartSrc::Float {
                            dtype,
                            data: &gu[..half],
                        },
                        PartSrc::Float {
                            dtype,
                            data: &gu[half..],
                        },
                        PartSrc::Float {
                            dtype: ddt,
                            data: &ddata[i * dper..(i + 1) * dper],
                        },
                    ]
                })
                .collect()
        } else {
            if !ck.contains(&format!("{m}experts.0.gate_proj.weight")) {
                return Err(RepackError::MissingTensor {
                    name: format!(
                        "{m}experts.0.gate_proj.weight (nor the fused {m}experts.gate_up_proj, nor MLX {m}switch_mlp.gate_proj.weight)"
                    ),
                    dir: ck.dir.display().to_string(),
                });
            }
            let mut v = Vec::with_capacity(e_count);
            for i in 0..e_count {
                let x = format!("{m}experts.{i}.");
                let part = |name: &str, s: &PartSpec| {
                    ctx.linear(&format!("{x}{name}"), s.shape[0], s.shape[1])
                };
                v.push([
                    part("gate_proj", &gate_part)?,
                    part("up_proj", &up_part)?,
                    part("down_proj", &down_part)?,
                ]);
            }
            v
        };
        layers.push(LayerPlan { dense, experts });
    }

    let fnorm = schema::final_norm_tensor(cfg);
    let mut tail = vec![job(
        &fnorm,
        ctx.vector(&format!("{p}norm.weight"), fnorm.shape[1])?,
        norm,
    )];
    let lm_base = ["lm_head", "language_model.lm_head", "model.lm_head"]
        .into_iter()
        .find(|b| ck.contains(&format!("{b}.weight")));
    match lm_base {
        Some(b) => {
            let lm = schema::lm_head_tensor(cfg);
            tail.push(job(&lm, ctx.linear(b, lm.shape[0], lm.shape[1])?, mat))
        }
        None if cfg.tie_word_embeddings => {}
        None => {
            return Err(RepackError::MissingTensor {
                name: "lm_head.weight (tie_word_embeddings is false)".into(),
                dir: ck.dir.display().to_string(),
            })
        }
    }

    // One record layout for the whole pool.
    let part_specs = [gate_part, up_part, down_part];
    let layout_of = |parts: &[PartSrc; 3]| -> Vec<(String, QuantType, [usize; 2])> {
        part_specs
            .iter()
            .zip(parts)
            .map(|(spec, part)| {
                (
                    spec.name.to_string(),
                    ctx.qtype_of(part, Role::Matrix { router: false }, spec.shape[1]),
                    spec.shape,
                )
            })
            .collect()
    };
    let expert_layout = layout_of(&layers[0].experts[0]);
    for (l, layer) in layers.iter().enumerate() {
        for (e, parts) in layer.experts.iter().enumerate() {
            let here = layout_of(parts);
            if here != expert_layout {
                let show = |lay: &[(String, QuantType, [usize; 2])]| {
                    lay.iter()
                        .map(|(n, q, _)| format!("{n} {}", q.name()))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                return Err(RepackError::Unsupported(format!(
                    "expert {e} of layer {l} is stored as [{}] but expert 0 of layer 0 as [{}]; \
                     the expert pool needs one layout for all experts",
                    show(&here),
                    show(&expert_layout)
                )));
            }
        }
    }

    // Anything left over inside the text layers is a weight we would drop.
    let used = ctx.used.borrow();
    let mut ignored = Vec::new();
    for name in ck.names() {
        if used.contains(name) {
            continue;
        }
        if ignorable(name) || !name.starts_with(p.as_str()) {
            ignored.push(name.to_string());
            continue;
        }
        return Err(RepackError::UnexpectedTensor {
            name: name.to_string(),
            message: format!(
                "not part of the {} model as slipstream understands it (an unsupported variant?)",
                cfg.architecture.name()
            ),
        });
    }
    ignored.sort();
    Ok(Plan {
        head,
        layers,
        tail,
        expert_layout,
        ignored,
    })
}
