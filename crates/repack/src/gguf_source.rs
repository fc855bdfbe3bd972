//! GGUF (llama.cpp) input: architectures `qwen35moe`, `qwen3next` and `qwen3moe`.
//!
//! Tensor bytes are kept in their ggml type (F32, F16, BF16, Q8_0, Q4_0,
//! Q4_K, Q5_K, Q6_K: our `QuantType`s of the same names hold the exact ggml
//! block bytes), so nothing is requantized. Routed experts come from the
//! stacked `ffn_{gate,up,down}_exps` tensors (ggml dims `[cols, rows, E]`):
//! expert `e` is the `e`-th contiguous slab of each, copied into one record.
//!
//! llama.cpp's `convert_hf_to_gguf.py` changes some values; we undo each
//! change exactly where it is exact and say so where it is not:
//! - norms are stored `1 + w` for qwen3.5 (our canonical form too: kept);
//!   `ssm_norm` and qwen3 norms are plain `w` (kept);
//! - `ssm_a = -exp(A_log)`: `A_log = ln(-ssm_a)`, computed in f64 and rounded
//!   to f32 (within an ulp of the original A_log, not always bit-identical);
//! - `ssm_conv1d` squeezed to `[conv_dim, K]` (our layout: kept);
//! - qwen35moe value heads reordered from grouped (by key head) to tiled
//!   order: the V rows of `attn_qkv`, the rows of `attn_gate` (z),
//!   `ssm_beta`, `ssm_alpha`, the entries of `ssm_a` and `ssm_dt.bias`, the V
//!   channels of `ssm_conv1d` and the columns of `ssm_out` are permuted back.
//!   Rows of block-quantized tensors are independent block sequences and
//!   move whole. Columns of a block-quantized `ssm_out` move as whole blocks
//!   when a value head spans whole blocks (Q4_0/Q8_0 with head dim a multiple
//!   of 32); otherwise that one tensor is dequantized to f32 and permuted.
//! - qwen3next: the converter splits `in_proj_qkvz` into `attn_qkv` and
//!   `attn_gate` in transformers' head order (no reordering: kept), but
//!   keeps `in_proj_ba` fused as `ssm_ba` (`[b r, a r]` rows per key head):
//!   its rows are split into `gdn.in_proj_b` / `gdn.in_proj_a`, whole rows
//!   of any type. Older ("legacy") qwen3next files hold `ssm_in`, the fused
//!   `in_proj_qkvz` in transformers' per-key-head order, instead of
//!   `attn_qkv` / `attn_gate` (llama.cpp still reads both): its rows are
//!   split as repack splits the checkpoint's.
//!
//! With `ggml_to_affine`, `Q4_0` and `Q8_0` tensors (dense and expert parts)
//! are converted exactly to affine 4-bit / 8-bit group 32 (same f32 values,
//! see `slipstream_kernels::ggml::affine`); a tensor (for experts: a part
//! over all layers) with a block whose bias would leave the f16 range keeps
//! its GGML blocks. Off by default: group 32 is slower than the GGML kernels
//! on AVX2 (docs/BENCHMARKS.md).
//!
//! The tokenizer is rebuilt as a `tokenizer.json` from `tokenizer.ggml.*`
//! (`gpt2` BPE only: tokens, merges, token types; pre-tokenizer regex by
//! `tokenizer.ggml.pre`), the chat template from `tokenizer.chat_template`.

use std::borrow::Cow;
use std::time::Instant;

use slipstream_core::config::{LayerKind, MAX_CONFIG_COUNT};
use slipstream_core::schema::{self, PartSpec, TensorKind, TensorSpec};
use slipstream_core::{Architecture, ModelConfig, QuantType, TensorView};
use slipstream_format::{ExpertPoolLayout, ManifestInfo, SlipWriter, SourceInfo};
use slipstream_gguf::{GgmlType, GgufFile, TensorInfo, Value};

use slipstream_kernels::ggml::affine as ggml_affine;

pub(crate) use crate::gguf_tokenizer::{check_tokenizer, tokenizer};
use crate::{ProgressEvent, RepackError, RepackOptions, RepackReport, Result, SourceKind};

const SUPPORTED_TYPES: &str = "F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K or Q6_K";

fn qtype_of(t: GgmlType) -> Option<QuantType> {
    Some(match t {
        GgmlType::F32 => QuantType::F32,
        GgmlType::F16 => QuantType::F16,
        GgmlType::BF16 => QuantType::Bf16,
        GgmlType::Q4_0 => QuantType::Q4_0,
        GgmlType::Q8_0 => QuantType::Q8_0,
        GgmlType::Q4_K => QuantType::Q4K,
        GgmlType::Q5_K => QuantType::Q5K,
        GgmlType::Q6_K => QuantType::Q6K,
        _ => return None,
    })
}

/// Source index of each grouped-order head: the inverse of the converter's
/// `_reorder_v_heads` (grouped `[nk, r]` -> tiled `[r, nk]`). Output head
/// `h = k * r + j` is read from tiled position `j * nk + k`.
pub(crate) fn untile_heads(nk: usize, r: usize) -> Vec<usize> {
    (0..nk * r).map(|h| (h % r) * nk + h / r).collect()
}

pub(crate) struct Src<'a> {
    pub f: &'a GgufFile,
    pub path: String,
    /// Names of the tensors read so far (the rest is reported as ignored).
    pub read: std::cell::RefCell<std::collections::HashSet<String>>,
}

impl<'a> Src<'a> {
    fn corrupt(&self, reason: String) -> RepackError {
        RepackError::Corrupt {
            path: self.path.clone(),
            reason,
        }
    }

    fn meta(&self, key: &str) -> Option<&'a Value> {
        self.f.get(key)
    }

    fn usize_req(&self, key: &str) -> Result<usize> {
        match self.meta(key) {
            Some(v) => match v.as_u64() {
                Some(x) if x <= MAX_CONFIG_COUNT => Ok(x as usize),
                Some(x) => Err(RepackError::Config {
                    path: self.path.clone(),
                    message: format!(
                        "metadata {key} = {x} is beyond any model (at most {MAX_CONFIG_COUNT})"
                    ),
                }),
                None => Err(RepackError::Config {
                    path: self.path.clone(),
                    message: format!("metadata {key} = {v:?} is not a non-negative integer"),
                }),
            },
            None => Err(RepackError::Config {
                path: self.path.clone(),
                message: format!("metadata {key} is missing"),
            }),
        }
    }

    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        if self.meta(key).is_some() {
            self.usize_req(key)
        } else {
            Ok(default)
        }
    }

    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.meta(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| RepackError::Config {
                path: self.path.clone(),
                message: format!("metadata {key} = {v:?} is not a number"),
            }),
        }
    }

    fn tensor(&self, name: &str) -> Result<&'a TensorInfo> {
        self.read.borrow_mut().insert(name.to_string());
        self.f
            .tensor(name)
            .ok_or_else(|| RepackError::MissingTensor {
                name: name.to_string(),
                dir: self.path.clone(),
            })
    }

    /// A tensor of ggml dims `dims`, with its stored type.
    fn shaped(&self, name: &str, dims: &[usize]) -> Result<(&'a TensorInfo, QuantType)> {
        let t = self.tensor(name)?;
        let found: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
        // A trailing 1 (e.g. ffn_gate_inp_shexp [H, 1]) is the same tensor as [H].
        let strip = |v: &[usize]| -> Vec<usize> {
            let mut v = v.to_vec();
            while v.len() > 1 && v.last() == Some(&1) {
                v.pop();
            }
            v
        };
        if strip(&found) != strip(dims) {
            return Err(RepackError::Shape {
                name: name.to_string(),
                expected: dims.to_vec(),
                found,
            });
        }
        let q = qtype_of(t.ty).ok_or_else(|| RepackError::Dtype {
            name: name.to_string(),
            dtype: t.ty.name().to_string(),
            supported: SUPPORTED_TYPES,
        })?;
        Ok((t, q))
    }

    fn bytes(&self, t: &TensorInfo) -> &'a [u8] {
        self.f.data(t)
    }

    /// A float tensor (F32/F16/BF16) of `n` elements decoded to f32.
    fn floats(&self, name: &str, dims: &[usize]) -> Result<Vec<f32>> {
        let (t, q) = self.shaped(name, dims)?;
        let n: usize = dims.iter().product();
        let b = self.bytes(t);
        let mut out = vec![0f32; n];
        match q {
            QuantType::F32 | QuantType::F16 | QuantType::Bf16 => {
                let view = TensorView::new(q, 1, n, b)
                    .map_err(|e| self.corrupt(format!("{name}: {e}")))?;
                slipstream_kernels::dequantize_row(&view, 0, &mut out);
            }
            _ => {
                return Err(RepackError::Dtype {
                    name: name.to_string(),
                    dtype: t.ty.name().to_string(),
                    supported: "F32, F16 or BF16 for a norm or per-channel parameter",
                })
            }
        }
        Ok(out)
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Rows of a `[rows, row_bytes]` byte matrix permuted: out row `i` = in row `src[i]`.
fn permute_rows(bytes: &[u8], row_bytes: usize, src: &[usize]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    for &s in src {
        out.extend_from_slice(&bytes[s * row_bytes..(s + 1) * row_bytes]);
    }
    out
}

/// Row permutation moving whole heads of `d` rows: grouped order from tiled,
/// applied to rows `start..start + nk*r*d` (others stay).
fn head_rows(total: usize, start: usize, nk: usize, r: usize, d: usize) -> Vec<usize> {
    let heads = untile_heads(nk, r);
    let mut src: Vec<usize> = (0..total).collect();
    for (h, &sh) in heads.iter().enumerate() {
        for i in 0..d {
            src[start + h * d + i] = start + sh * d + i;
        }
    }
    src
}

/// One dense tensor ready to write: borrowed from the file when kept as
/// stored (`stored_at`: its offset in the file), else converted.
pub(crate) struct Dense<'s> {
    pub name: String,
    pub qtype: QuantType,
    pub shape: [usize; 2],
    pub bytes: Cow<'s, [u8]>,
    pub bytes_in: u64,
    pub stored_at: Option<u64>,
}

fn arch_of(src: &Src) -> Result<(Architecture, &'static str)> {
    let a = src
        .meta("general.architecture")
        .and_then(|v| v.as_str())
        .unwrap_or("");
    match a {
        "qwen35moe" => Ok((Architecture::Qwen35Moe, "qwen35moe")),
        "qwen3moe" => Ok((Architecture::Qwen3Moe, "qwen3moe")),
        "qwen3next" => Ok((Architecture::Qwen3Next, "qwen3next")),
        other => Err(RepackError::Config {
            path: src.path.clone(),
            message: format!(
                "GGUF general.architecture {other:?} is not supported (supported: qwen35moe, qwen3next, qwen3moe)"
            ),
        }),
    }
}

pub(crate) fn model_config(src: &Src) -> Result<ModelConfig> {
    let (arch, a) = arch_of(src)?;
    // qwen35moe and qwen3next: hybrid layers, gated attention, shared expert.
    let qwen35 = arch.is_hybrid();
    let k = |s: &str| format!("{a}.{s}");
    let blocks = src.usize_req(&k("block_count"))?;
    let nextn = src.usize_or(&k("nextn_predict_layers"), 0)?;
    let n_layers = blocks
        .checked_sub(nextn)
        .ok_or_else(|| RepackError::Config {
            path: src.path.clone(),
            message: format!("{a}.nextn_predict_layers = {nextn} exceeds block_count = {blocks}"),
        })?;
    let hidden = src.usize_req(&k("embedding_length"))?;
    let heads = src.usize_req(&k("attention.head_count"))?;
    let kv = src.usize_or(&k("attention.head_count_kv"), heads)?;
    let head_dim = src.usize_or(&k("attention.key_length"), hidden / heads.max(1))?;
    let embd = src.tensor("token_embd.weight")?;
    let vocab = embd.dims.get(1).copied().unwrap_or(0) as usize;
    let layer_types: Vec<LayerKind> = if qwen35 {
        match src
            .meta(&k("attention.recurrent_layers"))
            .and_then(|v| v.as_array())
        {
            Some(items) => {
                let v: Vec<LayerKind> = items
                    .iter()
                    .take(n_layers)
                    .map(|b| {
                        if b.as_bool() == Some(true) {
                            LayerKind::LinearAttention
                        } else {
                            LayerKind::FullAttention
                        }
                    })
                    .collect();
                if v.len() != n_layers {
                    return Err(RepackError::Config {
                        path: src.path.clone(),
                        message: format!(
                            "{} has {} entries for {n_layers} layers",
                            k("attention.recurrent_layers"),
                            v.len()
                        ),
                    });
                }
                v
            }
            None => {
                let interval = src.usize_or(&k("full_attention_interval"), 4)?.max(1);
                LayerKind::interleaved(n_layers, interval)
            }
        }
    } else {
        vec![LayerKind::FullAttention; n_layers]
    };
    let has_linear = layer_types.contains(&LayerKind::LinearAttention);
    let (nk, nv, dk, dv, kern) = if has_linear {
        let nv = src.usize_req(&k("ssm.time_step_rank"))?;
        let inner = src.usize_req(&k("ssm.inner_size"))?;
        (
            src.usize_req(&k("ssm.group_count"))?,
            nv,
            src.usize_req(&k("ssm.state_size"))?,
            inner / nv.max(1),
            src.usize_req(&k("ssm.conv_kernel"))?,
        )
    } else {
        (0, 0, 0, 0, 0)
    };
    let cfg = ModelConfig {
        architecture: arch,
        vocab_size: vocab,
        hidden_size: hidden,
        rms_norm_eps: src.f64_or(&k("attention.layer_norm_rms_epsilon"), 1e-6)? as f32,
        tie_word_embeddings: src.f.tensor("output.weight").is_none(),
        max_position_embeddings: src.usize_or(&k("context_length"), 32768)?,
        num_attention_heads: heads,
        num_key_value_heads: kv,
        head_dim,
        rotary_dim: src.usize_or(&k("rope.dimension_count"), head_dim)?,
        rope_theta: src.f64_or(&k("rope.freq_base"), 10000.0)?,
        attn_output_gate: qwen35,
        linear_num_key_heads: nk,
        linear_key_head_dim: dk,
        linear_num_value_heads: nv,
        linear_value_head_dim: dv,
        linear_conv_kernel: kern,
        layer_types,
        num_experts: src.usize_req(&k("expert_count"))?,
        num_experts_per_tok: src.usize_req(&k("expert_used_count"))?,
        moe_intermediate_size: src.usize_req(&k("expert_feed_forward_length"))?,
        shared_expert_intermediate_size: if qwen35 {
            src.usize_req(&k("expert_shared_feed_forward_length"))?
        } else {
            0
        },
        // llama.cpp renormalises qwen3moe's and qwen3next's top-k unless
        // told otherwise.
        norm_topk_prob: arch == Architecture::Qwen35Moe
            || src
                .meta(&k("expert_weights_norm"))
                .and_then(|v| v.as_bool())
                .unwrap_or(true),
        // llama.cpp's converter appends the MTP layers as `blk.{n_layers}..`
        // with `nextn.*` tensors (none with `--no-mtp`).
        mtp_num_layers: if qwen35
            && nextn > 0
            && src
                .f
                .tensor(&format!("blk.{n_layers}.nextn.eh_proj.weight"))
                .is_some()
        {
            nextn
        } else {
            0
        },
    };
    cfg.validate().map_err(|e| RepackError::Config {
        path: src.path.clone(),
        message: e.to_string(),
    })?;
    Ok(cfg)
}

/// The llama.cpp name of a canonical dense tensor in a GGUF of `cfg`'s
/// architecture (`blk.{l}.` for layer tensors), or `None` for a tensor
/// llama.cpp has no name for. The GGUF importer reads by it and the
/// synthetic GGUF writer writes by it.
///
/// qwen3next keeps `gdn.in_proj_b` and `gdn.in_proj_a` in one fused
/// `ssm_ba` (see [`qwen3next_ba_rows`]): both keys name it.
pub fn gguf_tensor_name(cfg: &ModelConfig, spec: &TensorSpec) -> Option<String> {
    let qwen35 = cfg.architecture.is_hybrid();
    let next = cfg.architecture == Architecture::Qwen3Next;
    let g = match spec.key {
        "embed" => "token_embd.weight",
        "lm_head" => "output.weight",
        "final_norm" => "output_norm.weight",
        "input_norm" => "attn_norm.weight",
        "post_attn_norm" if qwen35 => "post_attention_norm.weight",
        "post_attn_norm" => "ffn_norm.weight",
        "attn.q_proj" => "attn_q.weight",
        "attn.k_proj" => "attn_k.weight",
        "attn.v_proj" => "attn_v.weight",
        "attn.o_proj" => "attn_output.weight",
        "attn.q_norm" => "attn_q_norm.weight",
        "attn.k_norm" => "attn_k_norm.weight",
        "gdn.in_proj_qkv" => "attn_qkv.weight",
        "gdn.in_proj_z" => "attn_gate.weight",
        "gdn.in_proj_b" | "gdn.in_proj_a" if next => "ssm_ba.weight",
        "gdn.in_proj_b" => "ssm_beta.weight",
        "gdn.in_proj_a" => "ssm_alpha.weight",
        "gdn.conv" => "ssm_conv1d.weight",
        "gdn.A_log" => "ssm_a",
        "gdn.dt_bias" => "ssm_dt.bias",
        "gdn.norm" => "ssm_norm.weight",
        "gdn.out_proj" => "ssm_out.weight",
        "moe.router" => "ffn_gate_inp.weight",
        "moe.shared_gate" => "ffn_gate_inp_shexp.weight",
        "moe.shared.gate_proj" => "ffn_gate_shexp.weight",
        "moe.shared.up_proj" => "ffn_up_shexp.weight",
        "moe.shared.down_proj" => "ffn_down_shexp.weight",
        // MTP layers (`_QwenMtpMixin` in llama.cpp's conversion/qwen.py).
        "mtp.fc" => "nextn.eh_proj.weight",
        "mtp.embed_norm" => "nextn.enorm.weight",
        "mtp.hidden_norm" => "nextn.hnorm.weight",
        "mtp.final_norm" => "nextn.shared_head_norm.weight",
        _ => return None,
    };
    Some(match spec.layer {
        Some(l) => format!("blk.{l}.{g}"),
        None => g.to_string(),
    })
}

/// The rows of qwen3next's fused `ssm_ba` (`[nk, 2r]` rows: per key head
/// `r` rows of b, then `r` rows of a) that make `gdn.in_proj_b` (`b`
/// true) or `gdn.in_proj_a`, in value-head order. The synthetic GGUF
/// writer interleaves by the same rows.
pub fn qwen3next_ba_rows(cfg: &ModelConfig, b: bool) -> Vec<usize> {
    let nk = cfg.linear_num_key_heads;
    let r = cfg.linear_num_value_heads.checked_div(nk).unwrap_or(0);
    let off = if b { 0 } else { r };
    (0..nk)
        .flat_map(|k| (0..r).map(move |j| k * 2 * r + off + j))
        .collect()
}

/// The llama.cpp name of layer `l`'s stacked routed-expert tensor for
/// expert part `part` (`gate`, `up`, `down`); ggml dims `[cols, rows, E]`.
pub fn gguf_experts_name(l: usize, part: &PartSpec) -> String {
    format!("blk.{l}.ffn_{}_exps.weight", part.name)
}

/// Everything dense, in canonical order.
type Job<'s> = Box<dyn Fn() -> Result<Dense<'s>> + 's>;

pub(crate) fn dense_tensors<'s>(
    src: &'s Src<'s>,
    cfg: &ModelConfig,
) -> Result<Vec<(String, Job<'s>)>> {
    let h = cfg.hidden_size;
    let mut jobs: Vec<(String, Job<'s>)> = Vec::new();

    // A tensor copied as stored: ggml dims [cols, rows].
    let copy = move |gname: String, out: String, rows: usize, cols: usize| -> Job<'s> {
        Box::new(move || {
            let (t, q) = src.shaped(&gname, &[cols, rows])?;
            let b = src.bytes(t);
            Ok(Dense {
                name: out.clone(),
                qtype: q,
                shape: [rows, cols],
                bytes: Cow::Borrowed(b),
                bytes_in: b.len() as u64,
                stored_at: Some(t.offset),
            })
        })
    };
    // A 1-D float tensor as f32 `[1, n]`, optionally transformed.
    let vector = move |gname: String,
                       out: String,
                       n: usize,
                       f: fn(Vec<f32>) -> Result<Vec<f32>>,
                       perm: Option<Vec<usize>>|
          -> Job<'s> {
        Box::new(move || {
            let vals = src.floats(&gname, &[n])?;
            let vals = f(vals)?;
            let vals = match &perm {
                Some(p) => p.iter().map(|&i| vals[i]).collect(),
                None => vals,
            };
            Ok(Dense {
                name: out.clone(),
                qtype: QuantType::F32,
                shape: [1, n],
                bytes: Cow::Owned(f32_bytes(&vals)),
                bytes_in: src.tensor(&gname)?.nbytes,
                stored_at: None,
            })
        })
    };
    // Rows permuted (whole rows, any type).
    let rows_perm = move |gname: String,
                          out: String,
                          rows: usize,
                          cols: usize,
                          src_rows: Vec<usize>|
          -> Job<'s> {
        Box::new(move || {
            let (t, q) = src.shaped(&gname, &[cols, rows])?;
            let b = src.bytes(t);
            let rb = q.nbytes(1, cols);
            Ok(Dense {
                name: out.clone(),
                qtype: q,
                shape: [rows, cols],
                bytes: Cow::Owned(permute_rows(b, rb, &src_rows)),
                bytes_in: b.len() as u64,
                stored_at: None,
            })
        })
    };
    fn ident(x: Vec<f32>) -> Result<Vec<f32>> {
        Ok(x)
    }

    fn a_log(a: Vec<f32>) -> Result<Vec<f32>> {
        a.iter()
            .map(|&x| {
                if x < 0.0 {
                    Ok((-(x as f64)).ln() as f32)
                } else {
                    Err(RepackError::UnexpectedTensor {
                        name: "ssm_a".into(),
                        message: format!("value {x} is not negative (ssm_a = -exp(A_log))"),
                    })
                }
            })
            .collect()
    }

    let (nk, nv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads);
    let (dk, dv) = (cfg.linear_key_head_dim, cfg.linear_value_head_dim);
    // qwen35moe GGUFs hold value heads in tiled order (see module doc); `r`
    // value heads per key head (only read in Gated DeltaNet layers, where
    // the config guarantees nk > 0).
    let r = nv.checked_div(nk).unwrap_or(0);
    let qk = 2 * nk * dk;
    let next = cfg.architecture == Architecture::Qwen3Next;
    for spec in schema::dense_tensors(cfg) {
        let gname = gguf_tensor_name(cfg, &spec).ok_or_else(|| {
            RepackError::Unsupported(format!(
                "no GGUF tensor is known for canonical {}",
                spec.name
            ))
        })?;
        let out = spec.name.clone();
        let [rows, cols] = spec.shape;
        let job: Job<'s> = match spec.key {
            // qwen3next: heads in transformers' order; b and a fused.
            "gdn.in_proj_b" | "gdn.in_proj_a" if next => {
                let src_rows = qwen3next_ba_rows(cfg, spec.key == "gdn.in_proj_b");
                Box::new(move || {
                    let (t, q) = src.shaped(&gname, &[cols, 2 * rows])?;
                    let b = src.bytes(t);
                    Ok(Dense {
                        name: out.clone(),
                        qtype: q,
                        shape: [rows, cols],
                        bytes: Cow::Owned(permute_rows(b, q.nbytes(1, cols), &src_rows)),
                        bytes_in: b.len() as u64 / 2,
                        stored_at: None,
                    })
                })
            }
            "gdn.conv" if next => {
                let (conv_dim, kk) = (rows, cols);
                Box::new(move || {
                    let vals = src.floats(&gname, &[kk, conv_dim])?;
                    Ok(Dense {
                        name: out.clone(),
                        qtype: QuantType::F32,
                        shape: [conv_dim, kk],
                        bytes: Cow::Owned(f32_bytes(&vals)),
                        bytes_in: src.tensor(&gname)?.nbytes,
                        stored_at: None,
                    })
                })
            }
            // Legacy qwen3next: q, k, v and z rows from the fused `ssm_in`.
            "gdn.in_proj_qkv" | "gdn.in_proj_z"
                if next && src.f.tensor(&gname).is_none() && spec.layer.is_some() =>
            {
                let l = spec.layer.unwrap_or_default();
                let fused = format!("blk.{l}.ssm_in.weight");
                let (_, pick) =
                    crate::hf_plan::qwen3_next_fused(cfg, spec.key).ok_or_else(|| {
                        RepackError::Unsupported(format!("no split known for {}", spec.name))
                    })?;
                let src_rows = pick.rows();
                let total = pick.source_rows();
                Box::new(move || {
                    let (t, q) = src.shaped(&fused, &[cols, total])?;
                    let b = src.bytes(t);
                    Ok(Dense {
                        name: out.clone(),
                        qtype: q,
                        shape: [rows, cols],
                        bytes: Cow::Owned(permute_rows(b, q.nbytes(1, cols), &src_rows)),
                        bytes_in: b.len() as u64 * rows as u64 / total.max(1) as u64,
                        stored_at: None,
                    })
                })
            }
            "gdn.A_log" if next => vector(gname, out, cols, a_log, None),
            "gdn.in_proj_qkv" | "gdn.in_proj_z" | "gdn.dt_bias" | "gdn.out_proj" if next => {
                if spec.kind == TensorKind::Small {
                    vector(gname, out, cols, ident, None)
                } else {
                    copy(gname, out, rows, cols)
                }
            }
            "gdn.in_proj_qkv" => rows_perm(gname, out, rows, cols, head_rows(rows, qk, nk, r, dv)),
            "gdn.in_proj_z" => rows_perm(gname, out, rows, cols, head_rows(rows, 0, nk, r, dv)),
            "gdn.in_proj_b" | "gdn.in_proj_a" => {
                rows_perm(gname, out, rows, cols, head_rows(rows, 0, nk, r, 1))
            }
            // Conv: ggml [K, conv_dim] = our [conv_dim, K]; always f32.
            "gdn.conv" => {
                let (conv_dim, kk) = (rows, cols);
                let perm = head_rows(conv_dim, qk, nk, r, dv);
                Box::new(move || {
                    let vals = src.floats(&gname, &[kk, conv_dim])?;
                    let b = f32_bytes(&vals);
                    Ok(Dense {
                        name: out.clone(),
                        qtype: QuantType::F32,
                        shape: [conv_dim, kk],
                        bytes: Cow::Owned(permute_rows(&b, 4 * kk, &perm)),
                        bytes_in: src.tensor(&gname)?.nbytes,
                        stored_at: None,
                    })
                })
            }
            "gdn.A_log" => vector(gname, out, cols, a_log, Some(untile_heads(nk, r))),
            "gdn.dt_bias" => vector(gname, out, cols, ident, Some(untile_heads(nk, r))),
            "gdn.out_proj" => Box::new(move || out_proj(src, &gname, &out, h, nk, r, dv)),
            // Everything else as stored; norms as f32.
            _ if spec.kind == TensorKind::Norm => vector(gname, out, cols, ident, None),
            _ => copy(gname, out, rows, cols),
        };
        jobs.push((spec.name, job));
    }
    Ok(jobs)
}

/// `ssm_out` `[H, nv*dv]` with its columns (value heads) back in grouped order.
fn out_proj<'s>(
    src: &Src<'s>,
    gname: &str,
    out: &str,
    h: usize,
    nk: usize,
    r: usize,
    dv: usize,
) -> Result<Dense<'s>> {
    let cols = nk * r * dv;
    let (t, q) = src.shaped(gname, &[cols, h])?;
    let b = src.bytes(t);
    let heads = untile_heads(nk, r);
    // Unit that moves whole: one element, or one block when a head spans whole blocks.
    let (unit_elems, unit_bytes) = match q {
        QuantType::F32 => (1, 4),
        QuantType::F16 | QuantType::Bf16 => (1, 2),
        _ => match q.ggml_block() {
            Some((be, bb)) if dv % be == 0 => (be, bb),
            _ => (0, 0),
        },
    };
    if let Some(units) = dv.checked_div(unit_elems) {
        let per_head = units * unit_bytes;
        let row_bytes = q.nbytes(1, cols);
        let mut o = Vec::with_capacity(b.len());
        for row in b.chunks_exact(row_bytes) {
            for &sh in &heads {
                o.extend_from_slice(&row[sh * per_head..(sh + 1) * per_head]);
            }
        }
        return Ok(Dense {
            name: out.to_string(),
            qtype: q,
            shape: [h, cols],
            bytes: Cow::Owned(o),
            bytes_in: b.len() as u64,
            stored_at: None,
        });
    }
    // A value head does not span whole blocks (e.g. K-quants with head dim
    // 128): the column permutation cannot keep the block encoding, so this
    // one tensor is dequantized to f32 (exact values, 4 bytes each).
    let view = TensorView::new(q, h, cols, b).map_err(|e| src.corrupt(format!("{gname}: {e}")))?;
    let mut row = vec![0f32; cols];
    let mut vals = Vec::with_capacity(h * cols);
    for rr in 0..h {
        slipstream_kernels::dequantize_row(&view, rr, &mut row);
        for &sh in &heads {
            vals.extend_from_slice(&row[sh * dv..(sh + 1) * dv]);
        }
    }
    Ok(Dense {
        name: out.to_string(),
        qtype: QuantType::F32,
        shape: [h, cols],
        bytes: Cow::Owned(f32_bytes(&vals)),
        bytes_in: b.len() as u64,
        stored_at: None,
    })
}

/// Each layer's stacked routed-expert tensors (gate, up, down) with their
/// types; ggml dims `[cols, rows, E]`. The pool holds the MTP layers'
/// experts after the main layers'.
pub(crate) fn expert_tensors<'s>(
    src: &Src<'s>,
    cfg: &ModelConfig,
) -> Result<Vec<[(&'s TensorInfo, QuantType); 3]>> {
    let parts = schema::expert_parts(cfg);
    let mut exps = Vec::with_capacity(cfg.total_layers());
    for l in 0..cfg.total_layers() {
        let part = |k: usize| {
            let [rows, cols] = parts[k].shape;
            src.shaped(
                &gguf_experts_name(l, &parts[k]),
                &[cols, rows, cfg.num_experts],
            )
        };
        exps.push([part(0)?, part(1)?, part(2)?]);
    }
    Ok(exps)
}

/// The expert pool of the stored types: layer 0's as `parts`, and every
/// layer's in `layer_qtypes` when they differ between layers (K-quant
/// mixes such as Q4_K_M, which keeps some layers' `down` as Q6_K).
pub(crate) fn pool_layout(
    cfg: &ModelConfig,
    exps: &[[(&TensorInfo, QuantType); 3]],
) -> ExpertPoolLayout {
    let parts = schema::expert_parts(cfg);
    let types: Vec<Vec<QuantType>> = exps.iter().map(|p| p.map(|x| x.1).to_vec()).collect();
    let uniform = types.windows(2).all(|w| w[0] == w[1]);
    ExpertPoolLayout {
        num_layers: exps.len(),
        num_experts: cfg.num_experts,
        parts: (0..3)
            .map(|k| {
                let q = types.first().map_or(QuantType::F32, |t| t[k]);
                (parts[k].name.to_string(), q, parts[k].shape)
            })
            .collect(),
        layer_qtypes: if uniform { Vec::new() } else { types },
    }
}

/// Converts a GGUF file into a `.slip` model.
pub(crate) fn repack_gguf(
    opts: &RepackOptions,
    progress: &dyn Fn(ProgressEvent),
) -> Result<RepackReport> {
    let t0 = Instant::now();
    let path = opts.input.display().to_string();
    let f = GgufFile::open(&opts.input).map_err(|e| RepackError::Corrupt {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    let src = Src {
        f: &f,
        path: path.clone(),
        read: Default::default(),
    };
    let cfg = model_config(&src)?;
    let e_count = cfg.num_experts;
    // The pool holds the MTP layers' experts after the main layers'.
    let n_layers = cfg.total_layers();
    // Before any tensor work: the tokenizer must build.
    let tok = tokenizer(&f);
    if let Some(json) = &tok.tokenizer_json {
        check_tokenizer(json, cfg.vocab_size, &path)?;
    }

    let exps = expert_tensors(&src, &cfg)?;
    let mut layout = pool_layout(&cfg, &exps);
    // A part converts to affine only when every layer's blocks do (one
    // layout for the pool).
    if opts.ggml_to_affine {
        for (k, part) in layout.parts.iter_mut().enumerate() {
            if let Some(q) = ggml_affine::affine_of(part.1) {
                if exps.iter().all(|p| {
                    p[k].1 == part.1 && ggml_affine::converts_exactly(part.1, src.bytes(p[k].0))
                }) {
                    part.1 = q;
                    for types in &mut layout.layer_qtypes {
                        types[k] = q;
                    }
                }
            }
        }
    }

    let jobs = dense_tensors(&src, &cfg)?;
    let expert_bytes: u64 = exps
        .iter()
        .flat_map(|p| p.iter().map(|(t, _)| t.nbytes))
        .sum();
    let dense_guess: u64 = f
        .tensors
        .iter()
        .filter(|t| !t.name.contains("_exps"))
        .map(|t| t.nbytes)
        .sum();
    let total_bytes = expert_bytes + dense_guess;
    progress(ProgressEvent::Started {
        total_bytes,
        tensors: jobs.len(),
        experts: n_layers * e_count,
        kind: SourceKind::Gguf,
        architecture: cfg.architecture,
    });
    let expert_layout = layout.parts.clone();
    let mut w = SlipWriter::create(&opts.output, layout, opts.overwrite)?;
    let mut bytes_in = 0u64;
    let mut li = 0usize;
    // Experts of a layer go right after its dense tensors; the layers left
    // after the last dense tensor (`None`) are written at the end.
    let layer_of = |n: &str| {
        n.strip_prefix("layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|s| s.parse::<usize>().ok())
    };
    for next in jobs.iter().map(Some).chain([None]) {
        let experts_due =
            |li: usize| next.is_none_or(|(name, _)| layer_of(name).is_none_or(|l| l > li));
        while li < n_layers && experts_due(li) {
            write_layer_experts(
                &src,
                &mut w,
                li,
                &exps[li],
                e_count,
                progress,
                &mut bytes_in,
            )?;
            li += 1;
        }
        let Some((_, job)) = next else { break };
        let mut d = job()?;
        if opts.ggml_to_affine {
            if let Some((q, b)) = ggml_affine::to_affine(d.qtype, &d.bytes) {
                (d.qtype, d.bytes) = (q, Cow::Owned(b));
            }
        }
        crate::finite::check_finite(&d.name, d.qtype, d.shape, &d.bytes)?;
        w.add_dense(&d.name, d.qtype, d.shape, &d.bytes)?;
        bytes_in += d.bytes_in;
        progress(ProgressEvent::Tensor {
            name: d.name,
            bytes_in: d.bytes_in,
        });
    }
    // Anything we did not read is reported (e.g. rope_freqs, or nextn
    // tensors a file has but its metadata does not announce): llama.cpp files may carry extras we do not need.
    let read = src.read.borrow();
    let ignored: Vec<String> = f
        .tensors
        .iter()
        .filter(|t| !read.contains(&t.name))
        .map(|t| t.name.clone())
        .collect();
    drop(read);

    progress(ProgressEvent::Finishing);
    let tokenizer_file = match &tok.tokenizer_json {
        Some(b) => {
            w.add_file(slipstream_format::TOKENIZER_FILE, b)?;
            Some(slipstream_format::TOKENIZER_FILE.to_string())
        }
        None => None,
    };
    let manifest = w.finish(ManifestInfo {
        config: cfg.clone(),
        tokenizer: tokenizer_file,
        chat_template: tok.chat_template,
        eos_token_ids: tok.eos_token_ids,
        special_tokens: tok.special_tokens,
        generation: tok.generation,
        source: SourceInfo {
            kind: SourceKind::Gguf.name().into(),
            path: path.clone(),
            quant: if opts.ggml_to_affine {
                "as stored; Q4_0/Q8_0 as affine group 32".into()
            } else {
                "as stored".into()
            },
        },
    })?;
    let seconds = t0.elapsed().as_secs_f64();
    Ok(RepackReport {
        kind: SourceKind::Gguf,
        config: cfg,
        tensors_written: manifest.dense.len(),
        experts_written: n_layers * e_count,
        bytes_in,
        bytes_out: manifest.dense_file_bytes + manifest.experts.file_bytes(),
        seconds,
        mb_per_s: bytes_in as f64 / 1e6 / seconds.max(1e-9),
        ignored_tensors: ignored,
        expert_layout,
    })
}

fn write_layer_experts(
    src: &Src,
    w: &mut SlipWriter,
    l: usize,
    parts: &[(&TensorInfo, QuantType); 3],
    e_count: usize,
    progress: &dyn Fn(ProgressEvent),
    bytes_in: &mut u64,
) -> Result<()> {
    let data: Vec<&[u8]> = parts.iter().map(|(t, _)| src.bytes(t)).collect();
    let per: Vec<usize> = data.iter().map(|d| d.len() / e_count).collect();
    let pool = w.pool().parts_of(l).to_vec();
    for e in 0..e_count {
        let stored: Vec<&[u8]> = (0..3)
            .map(|k| &data[k][e * per[k]..(e + 1) * per[k]])
            .collect();
        // Parts the pool holds as affine were checked to convert exactly.
        let mut converted: Vec<Option<Vec<u8>>> = vec![None, None, None];
        for k in 0..3 {
            if pool[k].qtype != parts[k].1 {
                let (_, b) = ggml_affine::to_affine(parts[k].1, stored[k]).ok_or_else(|| {
                    src.corrupt(format!(
                        "blk.{l} expert {e} {}: blocks changed while converting",
                        pool[k].name
                    ))
                })?;
                converted[k] = Some(b);
            }
        }
        let p: Vec<&[u8]> = (0..3)
            .map(|k| converted[k].as_deref().unwrap_or(stored[k]))
            .collect();
        crate::finite::check_expert_finite(l, e, &pool, &p)?;
        w.write_expert(l, e, &p)?;
        let n: u64 = per.iter().map(|&x| x as u64).sum();
        *bytes_in += n;
        progress(ProgressEvent::Expert {
            layer: l,
            expert: e,
            bytes_in: n,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
