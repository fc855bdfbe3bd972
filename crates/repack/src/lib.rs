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
mod gguf_tokenizer;
mod hf_plan;
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
use slipstream_core::schema;
use slipstream_core::{Architecture, ModelConfig, QuantType};
use slipstream_format::{
    ExpertPoolLayout, FormatError, ManifestInfo, Overwrite, SlipWriter, SourceInfo,
};

use crate::config::RawConfig;
use crate::convert::encode;
use crate::hf_plan::{build_plan, mtp_layers_in, mtp_prefix, Ctx, DenseJob, MlxQuant};
use crate::source::Checkpoint;

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

impl RepackReport {
    /// The one-line summary `slipstream repack` prints for a repack of
    /// `input` into `output`.
    pub fn summary(&self, input: &std::path::Path, output: &std::path::Path) -> String {
        format!(
            "repacked {} ({}, {}) -> {}: {} tensors, {} experts, {:.1} MB in, {:.1} MB out, {:.2} s, {:.0} MB/s",
            input.display(),
            self.kind.name(),
            self.config.architecture.name(),
            output.display(),
            self.tensors_written,
            self.experts_written,
            self.bytes_in as f64 / 1e6,
            self.bytes_out as f64 / 1e6,
            self.seconds,
            self.mb_per_s
        )
    }
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
