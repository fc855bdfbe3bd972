//! Converts a Hugging Face safetensors or MLX checkpoint directory into a
//! `.slip` model (see `slipstream-format`).
//!
//! # Inputs
//! - Hugging Face safetensors (`model.safetensors` or sharded through
//!   `model.safetensors.index.json`), F32 / BF16 / F16, architectures
//!   `qwen3_5_moe` (also the flat `qwen3_5_moe_text`), `qwen3_moe` and
//!   `qwen3_next` (whose fused `linear_attn.in_proj_qkvz` / `in_proj_ba`,
//!   grouped per key head, are split into the canonical `gdn.in_proj_*`
//!   rows; values unchanged).
//!   Routed experts may be fused (`mlp.experts.gate_up_proj [E, 2I, H]`,
//!   `mlp.experts.down_proj [E, H, I]`) or per expert
//!   (`mlp.experts.{e}.{gate,up,down}_proj.weight`).
//! - MLX affine-quantized checkpoints (mlx-lm layout: `.weight` U32 codes,
//!   `.scales`, `.biases`; experts stacked under `mlp.switch_mlp`). Detected by
//!   a `quantization` block in `config.json` or any `.scales` tensor.
//!   Quantized tensors are copied bit-exactly (MLX's little-endian u32 words
//!   are our code layout); their scale dtype (bf16/f16) is kept.
//!
//! # Canonical tensors (all `[rows, cols]`, 1-D as `[1, n]`)
//! `embed`, `final_norm`, `lm_head` (absent when tied and the checkpoint has
//! none); per layer `layers.{l}.` + `input_norm`, `post_attn_norm`,
//! `attn.{q,k,v,o}_proj`, `attn.{q,k}_norm` (full attention),
//! `gdn.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,conv,A_log,dt_bias,norm,out_proj}`
//! (Gated DeltaNet), `moe.router`, `moe.shared_gate`,
//! `moe.shared.{gate,up,down}_proj`. Routed experts go to the expert pool,
//! parts `gate [I,H]`, `up [I,H]`, `down [H,I]`.
//!
//! Norm weights are stored multiplicative in f32: zero-centred `qwen3_5_moe`
//! and `qwen3_next` HF norms (`input_norm`, `post_attn_norm`, `final_norm`, `attn.q_norm`,
//! `attn.k_norm`) become `1 + w` computed in f32; `gdn.norm`, `qwen3_moe`
//! norms and MLX norms (already shifted) are stored as they are.
//! `gdn.conv` is `[conv_dim, K]` f32, element `[c, j]` applied to input
//! `t - (K-1) + j`.
//!
//! # Float tensor storage by [`QuantChoice`]
//! - `f32`: every tensor F32.
//! - `bf16`: matrices BF16; norms, `gdn.conv`, `A_log`, `dt_bias` F32.
//! - `q8`: matrices whose row length is a multiple of 64 at Q8 (group 64,
//!   f16 scales); other matrices F32.
//! - `q4` (default): like `q8` but at Q4, except `moe.router` and
//!   `moe.shared_gate` at Q8 (as MLX does); matrices whose row length is not
//!   a multiple of 64 stay F32.
//!
//! Norms, `gdn.conv`, `A_log` and `dt_bias` are always F32. The rules depend
//! on shapes only, so every layer's experts share one record layout.

// `%` rather than `is_multiple_of`: the workspace MSRV is 1.85.
#![allow(clippy::manual_is_multiple_of)]

mod config;
mod convert;
mod finite;
mod gguf_in_place;
mod gguf_source;
mod source;

pub use gguf_in_place::{
    index_locations, open_gguf_in_place, open_gguf_in_place_with, InPlaceOptions, IndexUse,
};
pub use gguf_source::{gguf_experts_name, gguf_tensor_name, qwen3next_ba_rows};
pub use slipstream_gguf::is_gguf_file;

use std::cell::RefCell;
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Instant;

use rayon::prelude::*;
use safetensors::Dtype;
use serde_json::Value;
use slipstream_core::schema::{self, PartSpec, TensorKind, TensorSpec};
use slipstream_core::{Architecture, ModelConfig, QuantType, ScaleType};
use slipstream_format::{
    ExpertPoolLayout, FormatError, ManifestInfo, Overwrite, SlipWriter, SourceInfo,
};

use crate::config::RawConfig;
use crate::convert::{dtype_bytes, encode, PartSrc, RowPick};
use crate::source::{Checkpoint, SrcTensor};

/// How float source tensors are stored (quantized MLX tensors are always copied).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QuantChoice {
    #[default]
    Q4,
    Q8,
    Bf16,
    F32,
}

impl QuantChoice {
    pub fn name(&self) -> &'static str {
        match self {
            QuantChoice::Q4 => "q4",
            QuantChoice::Q8 => "q8",
            QuantChoice::Bf16 => "bf16",
            QuantChoice::F32 => "f32",
        }
    }
}

impl std::fmt::Display for QuantChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for QuantChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "q4" => Ok(QuantChoice::Q4),
            "q8" => Ok(QuantChoice::Q8),
            "bf16" => Ok(QuantChoice::Bf16),
            "f32" => Ok(QuantChoice::F32),
            _ => Err(format!(
                "unknown quantization {s:?}: expected q4, q8, bf16 or f32"
            )),
        }
    }
}

/// What to convert, where to.
#[derive(Debug, Clone)]
pub struct RepackOptions {
    /// Checkpoint directory (`config.json` + safetensors).
    pub input: PathBuf,
    /// Model directory to create. An existing slipstream model there is
    /// replaced atomically; anything else is refused (see `overwrite`).
    pub output: PathBuf,
    pub quant: QuantChoice,
    /// GGUF input only: convert `Q4_0` / `Q8_0` tensors exactly to affine
    /// 4-bit / 8-bit group 32 (`slipstream_kernels::ggml::affine`: same
    /// dequantized values). Off: kept as GGML blocks, which run faster than
    /// affine group 32 on AVX2 (docs/BENCHMARKS.md).
    pub ggml_to_affine: bool,
    /// What an existing output may be: a verified model, or also a damaged
    /// one (`--force`).
    pub overwrite: Overwrite,
}

/// Kind of checkpoint read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    HfSafetensors,
    Mlx,
    /// A llama.cpp GGUF file (see `gguf_source`).
    Gguf,
}

impl SourceKind {
    pub fn name(&self) -> &'static str {
        match self {
            SourceKind::HfSafetensors => "hf-safetensors",
            SourceKind::Mlx => "mlx",
            SourceKind::Gguf => "gguf",
        }
    }
}

/// Progress of a repack, reported in order from the calling thread.
/// A progress bar of length `total_bytes` advanced by each `bytes_in` ends full.
#[derive(Debug, Clone)]
pub enum ProgressEvent {
    /// The checkpoint has been checked; conversion starts.
    Started {
        total_bytes: u64,
        tensors: usize,
        experts: usize,
        kind: SourceKind,
        architecture: Architecture,
    },
    /// A dense tensor was converted (source bytes consumed).
    Tensor { name: String, bytes_in: u64 },
    /// A routed expert was converted.
    Expert {
        layer: usize,
        expert: usize,
        bytes_in: u64,
    },
    /// Everything converted; syncing files and writing the manifest.
    Finishing,
}

/// Summary of a finished repack.
#[derive(Debug, Clone)]
pub struct RepackReport {
    pub kind: SourceKind,
    pub config: ModelConfig,
    /// Dense tensors written.
    pub tensors_written: usize,
    /// Expert records written (layers x experts).
    pub experts_written: usize,
    /// Source tensor bytes read.
    pub bytes_in: u64,
    /// Bytes of `dense.bin` + `experts.bin`.
    pub bytes_out: u64,
    pub seconds: f64,
    /// `bytes_in / seconds`, in MB/s (10^6 bytes).
    pub mb_per_s: f64,
    /// Checkpoint tensors outside the text model that were skipped
    /// (vision tower, an `mtp.*` head the config does not announce, ...).
    pub ignored_tensors: Vec<String>,
    /// Record layout of the expert pool: `(part, qtype, shape)`.
    pub expert_layout: Vec<(String, QuantType, [usize; 2])>,
}

/// Everything that can go wrong; each message names the file, tensor or field.
#[derive(Debug, thiserror::Error)]
pub enum RepackError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: missing ({what})")]
    MissingFile { path: String, what: String },
    #[error("{path}: {reason}")]
    Corrupt { path: String, reason: String },
    #[error("{path}: {message}")]
    Config { path: String, message: String },
    #[error(
        "unknown architecture: config.json has model_type {model_type:?}; supported: {supported}"
    )]
    UnknownArchitecture {
        model_type: String,
        supported: &'static str,
    },
    #[error("{path}: unsupported configuration: {feature}")]
    UnsupportedConfig { path: String, feature: String },
    #[error("tensor {name} is missing from the checkpoint in {dir}")]
    MissingTensor { name: String, dir: String },
    #[error("tensor {name} has shape {found:?}, expected {expected:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor {name} has dtype {dtype}, which is not supported here ({supported})")]
    Dtype {
        name: String,
        dtype: String,
        supported: &'static str,
    },
    #[error("tensor {name}: {message}")]
    UnexpectedTensor { name: String, message: String },
    #[error("unsupported checkpoint: {0}")]
    Unsupported(String),
    /// The output path would lose data the user did not ask to replace.
    #[error("{0}")]
    Output(String),
    #[error("writing the model: {0}")]
    Format(#[from] FormatError),
}

pub type Result<T> = std::result::Result<T, RepackError>;

const FLOAT_DTYPES: &str = "F32, BF16 or F16";

/// How a float tensor is treated by the storage rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Norm weight: always F32; `shift` adds 1 (zero-centred HF qwen3_5 norms).
    Norm { shift: bool },
    /// Small per-channel parameter (conv, A_log, dt_bias): always F32.
    Small,
    /// Weight matrix; `router` marks tensors kept at Q8 under `--quant q4`.
    Matrix { router: bool },
}

struct DenseJob<'a> {
    name: String,
    rows: usize,
    cols: usize,
    src: PartSrc<'a>,
    qtype: QuantType,
    shift: bool,
    /// The rows of a fused `src` this tensor is (Qwen3-Next's
    /// `in_proj_qkvz` / `in_proj_ba`); `None`: all of `src`.
    pick: Option<RowPick>,
}

impl DenseJob<'_> {
    /// Source bytes this tensor reads (its share of a fused source).
    fn bytes_in(&self) -> u64 {
        match &self.pick {
            Some(p) => self.src.bytes() * self.rows as u64 / p.source_rows().max(1) as u64,
            None => self.src.bytes(),
        }
    }
}

struct LayerPlan<'a> {
    dense: Vec<DenseJob<'a>>,
    /// `[gate, up, down]` per expert.
    experts: Vec<[PartSrc<'a>; 3]>,
}

struct Plan<'a> {
    head: Vec<DenseJob<'a>>,
    layers: Vec<LayerPlan<'a>>,
    tail: Vec<DenseJob<'a>>,
    expert_layout: Vec<(String, QuantType, [usize; 2])>,
    ignored: Vec<String>,
}

/// MLX quantization settings from `config.json`.
struct MlxQuant {
    bits: usize,
    group: usize,
    overrides: serde_json::Map<String, Value>,
}

impl MlxQuant {
    fn from_config(raw: &RawConfig, q: &Value) -> Result<Self> {
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
    fn for_path(&self, path: &str) -> (usize, usize) {
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

struct Ctx<'a> {
    ck: &'a Checkpoint,
    quant: QuantChoice,
    mlx: Option<MlxQuant>,
    used: RefCell<HashSet<String>>,
}

fn shape_err(name: &str, expected: &[usize], found: &[usize]) -> RepackError {
    RepackError::Shape {
        name: name.to_string(),
        expected: expected.to_vec(),
        found: found.to_vec(),
    }
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::F32 | Dtype::BF16 | Dtype::F16)
}

impl<'a> Ctx<'a> {
    fn get(&self, name: &str) -> Result<SrcTensor<'a>> {
        let t = self.ck.require(name)?;
        self.used.borrow_mut().insert(name.to_string());
        Ok(t)
    }

    fn float(&self, name: &str) -> Result<SrcTensor<'a>> {
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
    fn float_shaped(&self, name: &str, shape: &[usize]) -> Result<PartSrc<'a>> {
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
    fn float_qtype(&self, role: Role, cols: usize) -> QuantType {
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

    fn qtype_of(&self, src: &PartSrc, role: Role, cols: usize) -> QuantType {
        match src {
            PartSrc::Quant { qtype, .. } => *qtype,
            PartSrc::Float { .. } => self.float_qtype(role, cols),
        }
    }

    /// MLX-quantized `base.{weight,scales,biases}` with optional leading
    /// expert dim `lead`; returns the qtype and the three tensors.
    fn quantized(
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
    fn linear(&self, base: &str, rows: usize, cols: usize) -> Result<PartSrc<'a>> {
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
    fn stacked(&self, base: &str, e: usize, rows: usize, cols: usize) -> Result<Vec<PartSrc<'a>>> {
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
    fn vector(&self, name: &str, n: usize) -> Result<PartSrc<'a>> {
        self.float_shaped(name, &[n])
    }

    fn job(
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
fn find_prefix(ck: &Checkpoint, arch: Architecture) -> Result<String> {
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
fn ignorable(name: &str) -> bool {
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
fn mtp_prefix(ck: &Checkpoint) -> Option<&'static str> {
    ["mtp.", "model.mtp."]
        .into_iter()
        .find(|p| ck.contains(&format!("{p}fc.weight")))
}

/// MTP layers a checkpoint carries: one more than the largest `k` of its
/// `{prefix}layers.{k}.*` tensors (how llama.cpp's converter counts them
/// for Qwen3-Next, whose config does not declare them).
fn mtp_layers_in(ck: &Checkpoint, prefix: &str) -> usize {
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
fn hf_mtp_name(key: &str) -> Option<&'static str> {
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
fn hf_layer_name(key: &str) -> Option<&'static str> {
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

fn build_plan<'a>(ctx: &Ctx<'a>, cfg: &ModelConfig, hf_shift: bool) -> Result<Plan<'a>> {
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

/// Messages from the converting threads to the writer thread.
enum Msg {
    Dense {
        name: String,
        qtype: QuantType,
        shape: [usize; 2],
        bytes: Vec<u8>,
    },
    Experts {
        layer: usize,
        first: usize,
        records: Vec<[Vec<u8>; 3]>,
    },
    /// The reading side found bad input: the writer stops with this error.
    Failed(RepackError),
}

/// Reads a checkpoint directory's `config.json` as [`repack`] does: the
/// checked config, or the error `repack` would give. (For fuzzing and
/// checks before a long conversion.)
pub fn read_checkpoint_config(dir: &std::path::Path) -> Result<ModelConfig> {
    RawConfig::read(dir)?.model_config()
}

/// Reads a checkpoint directory's safetensors headers as [`repack`] does:
/// each tensor's name, shape and byte length, every extent checked
/// against its file, sorted by name.
pub fn read_checkpoint_tensors(dir: &std::path::Path) -> Result<Vec<(String, Vec<usize>, usize)>> {
    let ck = Checkpoint::open(dir)?;
    let mut out = Vec::new();
    for name in ck.names() {
        let t = ck.require(name)?;
        out.push((name.to_string(), t.shape.to_vec(), t.data.len()));
    }
    out.sort();
    Ok(out)
}

/// Converts `opts.input` into a `.slip` model at `opts.output`, calling
/// `progress` from this thread as work completes.
pub fn repack(opts: &RepackOptions, progress: &dyn Fn(ProgressEvent)) -> Result<RepackReport> {
    // Before reading anything: the output must not destroy the input or
    // anything that is not a model.
    slipstream_outpath::check_disjoint(&opts.input, &opts.output).map_err(RepackError::Output)?;
    slipstream_format::check_model_target(&opts.output, opts.overwrite)?;
    // A file can only be GGUF (a checkpoint is a directory): the GGUF
    // reader names a bad magic. GGUF keeps its own tensor types.
    if opts.input.is_file() {
        return gguf_source::repack_gguf(opts, progress);
    }
    let t0 = Instant::now();
    let raw = RawConfig::read(&opts.input)?;
    if let Some(method) = raw.hf_quant_method() {
        return Err(RepackError::UnsupportedConfig {
            path: raw.path.clone(),
            feature: format!(
                "quantization_config.quant_method {method} (supported: float safetensors or MLX affine)"
            ),
        });
    }
    let mut cfg = raw.model_config()?;
    let ck = Checkpoint::open(&opts.input)?;
    // A config may announce an MTP head its checkpoint does not carry
    // (e.g. converters that drop `mtp.*`): the model is imported without it.
    // A qwen3_next config announces none: the checkpoint's head is counted.
    match mtp_prefix(&ck) {
        None => cfg.mtp_num_layers = 0,
        Some(mp) if cfg.architecture == Architecture::Qwen3Next && cfg.mtp_num_layers == 0 => {
            cfg.mtp_num_layers = mtp_layers_in(&ck, mp);
            cfg.validate().map_err(|e| RepackError::Config {
                path: raw.path.clone(),
                message: format!("with the checkpoint's MTP layers: {e}"),
            })?;
        }
        Some(_) => {}
    }
    let is_mlx = raw.mlx_quantization().is_some() || ck.names().any(|n| n.ends_with(".scales"));
    let kind = if is_mlx {
        SourceKind::Mlx
    } else {
        SourceKind::HfSafetensors
    };
    let mlx = match raw.mlx_quantization() {
        Some(q) => Some(MlxQuant::from_config(&raw, q)?),
        None => None,
    };
    let tok = config::read_tokenizer_info(&opts.input, &raw)?;
    let ctx = Ctx {
        ck: &ck,
        quant: opts.quant,
        mlx,
        used: RefCell::new(HashSet::new()),
    };
    // HF qwen3_5 / qwen3_next norms are zero-centred; MLX already stores 1 + w.
    let hf_shift = cfg.architecture.is_hybrid() && kind == SourceKind::HfSafetensors;
    let plan = build_plan(&ctx, &cfg, hf_shift)?;

    let dense_jobs = plan.head.len()
        + plan.layers.iter().map(|l| l.dense.len()).sum::<usize>()
        + plan.tail.len();
    let n_layers = plan.layers.len();
    let total_bytes: u64 = plan
        .head
        .iter()
        .chain(plan.layers.iter().flat_map(|l| l.dense.iter()))
        .chain(plan.tail.iter())
        .map(|j| j.bytes_in())
        .sum::<u64>()
        + plan
            .layers
            .iter()
            .flat_map(|l| l.experts.iter())
            .map(|p| p.iter().map(|s| s.bytes()).sum::<u64>())
            .sum::<u64>();
    progress(ProgressEvent::Started {
        total_bytes,
        tensors: dense_jobs,
        experts: n_layers * cfg.num_experts,
        kind,
        architecture: cfg.architecture,
    });

    let layout = ExpertPoolLayout {
        num_layers: n_layers,
        num_experts: cfg.num_experts,
        parts: plan.expert_layout.clone(),
        layer_qtypes: Vec::new(),
    };
    let mut writer = SlipWriter::create(&opts.output, layout, opts.overwrite)?;
    let record_bytes = writer.pool().record_bytes.max(1) as usize;
    // Experts converted together: enough to keep every core busy, bounded
    // to ~256 MiB of output per batch.
    let batch = ((256usize << 20) / record_bytes)
        .max(rayon::current_num_threads())
        .clamp(1, cfg.num_experts.max(1));

    let (tx, rx) = mpsc::sync_channel::<Msg>(2);
    let write_result: Result<SlipWriter> = std::thread::scope(|s| {
        let handle = s.spawn(move || -> Result<SlipWriter> {
            for msg in rx {
                match msg {
                    Msg::Dense {
                        name,
                        qtype,
                        shape,
                        bytes,
                    } => {
                        finite::check_finite(&name, qtype, shape, &bytes)?;
                        writer.add_dense(&name, qtype, shape, &bytes)?
                    }
                    Msg::Experts {
                        layer,
                        first,
                        records,
                    } => {
                        for (i, r) in records.iter().enumerate() {
                            let parts = [&r[0][..], &r[1][..], &r[2][..]];
                            finite::check_expert_finite(
                                layer,
                                first + i,
                                &writer.pool().parts.clone(),
                                &parts,
                            )?;
                            writer.write_expert(layer, first + i, &parts)?;
                        }
                    }
                    Msg::Failed(e) => return Err(e),
                }
            }
            Ok(writer)
        });
        // Returns false when the writer thread has stopped (its error wins).
        let send_dense = |job: &DenseJob| -> bool {
            let picked = job.pick.as_ref().map(|p| p.apply(&job.src));
            let src = picked.as_ref().map_or(job.src, |o| o.as_src());
            if let Err(e) = finite::check_source(&job.name, &src) {
                let _ = tx.send(Msg::Failed(e));
                return false;
            }
            let bytes = encode(&src, job.rows, job.cols, job.qtype, job.shift);
            let ok = tx
                .send(Msg::Dense {
                    name: job.name.clone(),
                    qtype: job.qtype,
                    shape: [job.rows, job.cols],
                    bytes,
                })
                .is_ok();
            if ok {
                progress(ProgressEvent::Tensor {
                    name: job.name.clone(),
                    bytes_in: job.bytes_in(),
                });
            }
            ok
        };
        let mut alive = true;
        'outer: {
            for job in &plan.head {
                alive = send_dense(job);
                if !alive {
                    break 'outer;
                }
            }
            for (l, layer) in plan.layers.iter().enumerate() {
                for job in &layer.dense {
                    alive = send_dense(job);
                    if !alive {
                        break 'outer;
                    }
                }
                for first in (0..layer.experts.len()).step_by(batch) {
                    let chunk = &layer.experts[first..(first + batch).min(layer.experts.len())];
                    let records: Result<Vec<[Vec<u8>; 3]>> = chunk
                        .par_iter()
                        .enumerate()
                        .map(|(i, parts)| {
                            for (k, part) in parts.iter().enumerate() {
                                let name = format!(
                                    "expert {} of layer {l}, {}",
                                    first + i,
                                    plan.expert_layout[k].0
                                );
                                finite::check_source(&name, part)?;
                            }
                            Ok(std::array::from_fn(|k| {
                                let (_, q, [r, c]) = plan.expert_layout[k];
                                encode(&parts[k], r, c, q, false)
                            }))
                        })
                        .collect();
                    let records = match records {
                        Ok(r) => r,
                        Err(e) => {
                            let _ = tx.send(Msg::Failed(e));
                            break 'outer;
                        }
                    };
                    alive = tx
                        .send(Msg::Experts {
                            layer: l,
                            first,
                            records,
                        })
                        .is_ok();
                    if !alive {
                        break 'outer;
                    }
                    for (i, parts) in chunk.iter().enumerate() {
                        progress(ProgressEvent::Expert {
                            layer: l,
                            expert: first + i,
                            bytes_in: parts.iter().map(|p| p.bytes()).sum(),
                        });
                    }
                }
            }
            for job in &plan.tail {
                alive = send_dense(job);
                if !alive {
                    break 'outer;
                }
            }
        }
        let _ = alive;
        drop(tx);
        handle.join().unwrap_or_else(|_| {
            Err(RepackError::Unsupported(
                "the writer thread panicked".into(),
            ))
        })
    });
    let mut writer = write_result?;

    progress(ProgressEvent::Finishing);
    let tokenizer = match &tok.tokenizer_json {
        Some(bytes) => {
            writer.add_file(slipstream_format::TOKENIZER_FILE, bytes)?;
            Some(slipstream_format::TOKENIZER_FILE.to_string())
        }
        None => None,
    };
    let manifest = writer.finish(ManifestInfo {
        config: cfg.clone(),
        tokenizer,
        chat_template: tok.chat_template,
        eos_token_ids: tok.eos_token_ids,
        special_tokens: tok.special_tokens,
        generation: tok.generation,
        source: SourceInfo {
            kind: kind.name().into(),
            path: opts.input.display().to_string(),
            quant: opts.quant.name().into(),
        },
    })?;
    let seconds = t0.elapsed().as_secs_f64();
    Ok(RepackReport {
        kind,
        config: cfg,
        tensors_written: manifest.dense.len(),
        experts_written: n_layers * manifest.experts.num_experts,
        bytes_in: total_bytes,
        bytes_out: manifest.dense_file_bytes + manifest.experts.file_bytes(),
        seconds,
        mb_per_s: total_bytes as f64 / 1e6 / seconds.max(1e-9),
        ignored_tensors: plan.ignored,
        expert_layout: plan.expert_layout,
    })
}

/// Canonical names of the dense tensors a repacked model of `cfg` holds
/// (`lm_head` listed only when untied; a tied checkpoint that still has an
/// `lm_head` tensor gets it too). Useful to loaders and tests.
pub fn canonical_dense_names(cfg: &ModelConfig) -> Vec<String> {
    schema::dense_tensors(cfg)
        .into_iter()
        .map(|s| s.name)
        .collect()
}
