//! Synthetic `.slip` models: random weights written directly in the layout
//! `slipstream repack --quant q4` produces from a real checkpoint (same
//! canonical names, shapes and storage types), with a router skew that
//! imitates a real model's expert popularity and token-to-token persistence
//! using only the model's own weights. See `docs/SYNTH.md`.
//!
//! # How the skew is built (weights only; the architecture is unchanged)
//! Channels `0..64` of the residual stream (quantization group 0) are a
//! control block. The embedding sets channel 0 to a constant [`C0`] for every
//! token and channels `1..64` to 0; every matrix that writes into the
//! residual stream (`o_proj`, `gdn.out_proj`, expert and shared `down`) has
//! rows `0..64` zero, so the block stays exactly `[C0, 0, ..]` through all
//! layers, and every matrix that reads the stream has group 0 zero except
//! where channel 0 is wanted. RMSNorm weights on channel 0 undo the
//! residual stream's growth so normed inputs carry channel 0 ≈ 1.
//! - **Popularity**: router row `e` of layer `l` has weight
//!   `popularity * z[l][e]` on channel 0, `z` standard normal per layer
//!   (a log-normal expert popularity, different in every layer).
//! - **Persistence**: "context heads" whose output varies slowly along the
//!   sequence. Gated DeltaNet layers: the first key heads read only
//!   channel 0, so q and k are the same constant direction and the delta
//!   rule reduces exactly to an exponential moving average of the value
//!   vectors (memory `exp(g)(1-beta)` ≈ 0.94, ~17 tokens); z is constant.
//!   Full-attention layers: KV head 0 and its query heads read only
//!   channel 0 in their rotary dims, so q = k is constant and the score is
//!   a pure RoPE recency kernel: a local average over the last tokens.
//!   Their output columns are scaled by `persistence`, so the router sees a
//!   slowly varying component.

#![allow(clippy::manual_is_multiple_of)]

pub mod gen;
pub mod gguf_export;
pub mod measure;

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Instant;

use rayon::prelude::*;
use slipstream_core::config::LayerKind;
use slipstream_core::schema::{self, TensorKind, TensorSpec};
use slipstream_core::{Architecture, ModelConfig, QuantType};
use slipstream_format::{ExpertPoolLayout, ManifestInfo, SlipWriter, SourceInfo};

use gen::{affine, derive_seed, f32_bytes, Group, Rng, GROUP};

/// Value of control channel 0 in every token's embedding.
pub const C0: f32 = 1.0;
/// Standard deviation of the other embedding channels.
pub const EMBED_STD: f32 = 1.0;
/// Calibrated defaults (see docs/SYNTH.md).
pub const DEFAULT_POPULARITY: f32 = 0.58;
pub const DEFAULT_PERSISTENCE: f32 = 0.75;
/// Growth of the residual stream's mean square per residual addition,
/// measured on the presets (used to keep normed channel 0 near 1).
pub const RESIDUAL_GROWTH: f32 = 0.1;
/// Peak RoPE recency score (nats) of the full-attention context heads.
const RECENCY_SCORE: f32 = 24.0;
/// Per-step decay `exp(g)` of the DeltaNet context heads.
const CONTEXT_DECAY: f32 = 0.99;
/// Pre-sigmoid beta of the DeltaNet context heads (sigmoid(-3) = 0.047).
const CONTEXT_BETA_LOGIT: f32 = -3.0;
/// z of the DeltaNet context heads (silu(3) = 2.86, constant).
const CONTEXT_Z: f32 = 3.0;

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error(transparent)]
    Format(#[from] slipstream_format::FormatError),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, SynthError>;

/// Model shapes to imitate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// Qwen3.5/3.6 35B-A3B (`qwen3_5_moe`).
    Qwen36_35bA3b,
    /// Qwen3 30B-A3B (`qwen3_moe`).
    Qwen3_30bA3b,
    /// Qwen3-Next 80B-A3B (`qwen3_next`): 48 layers, 512 experts top-10.
    Qwen3Next80bA3b,
    /// Qwen3.5 122B-A10B (`qwen3_5_moe`): 48 layers, hidden 3072; some
    /// shapes are inferred (see [`preset_config`]).
    Qwen35_122bA10b,
}

impl Preset {
    pub fn name(&self) -> &'static str {
        match self {
            Preset::Qwen36_35bA3b => "qwen3.6-35b-a3b",
            Preset::Qwen3_30bA3b => "qwen3-30b-a3b",
            Preset::Qwen3Next80bA3b => "qwen3-next-80b-a3b",
            Preset::Qwen35_122bA10b => "qwen3.5-122b-a10b",
        }
    }

    /// Every preset, for listings and tests.
    pub const ALL: [Preset; 4] = [
        Preset::Qwen36_35bA3b,
        Preset::Qwen3_30bA3b,
        Preset::Qwen3Next80bA3b,
        Preset::Qwen35_122bA10b,
    ];
}

impl std::str::FromStr for Preset {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "qwen3.6-35b-a3b" | "qwen3.5-35b-a3b" | "qwen36-35b-a3b" | "35b" => {
                Ok(Preset::Qwen36_35bA3b)
            }
            "qwen3-30b-a3b" | "30b" => Ok(Preset::Qwen3_30bA3b),
            "qwen3-next-80b-a3b" | "80b" => Ok(Preset::Qwen3Next80bA3b),
            "qwen3.5-122b-a10b" | "122b" => Ok(Preset::Qwen35_122bA10b),
            _ => Err(format!(
                "unknown preset {s:?}: expected one of {}",
                Preset::ALL.map(|p| p.name()).join(", ")
            )),
        }
    }
}

/// The config of a preset, optionally cut to its first `layers` layers.
///
/// Sources: the 35B and 30B presets are the published `config.json`s.
/// `qwen3-next-80b-a3b` is `Qwen/Qwen3-Next-80B-A3B-Instruct`'s published
/// `config.json`; every value but two equals transformers 5.23.0's
/// `Qwen3NextConfig` defaults, which mirror that model: the defaults have
/// `max_position_embeddings` 32768 where the model card gives 262144, and
/// only the generic rope theta 1e4 where the config gives 1e7. Its MTP
/// layer (the checkpoint has one) is opt-in here as for the 35B preset.
/// `qwen3.5-122b-a10b`: published (model card and vendor pages) are 48
/// layers, hidden 3072, 32 query heads, 256 experts with 8 routed plus 1
/// shared, vocabulary 248320, context 262144, full attention every 4th
/// layer. Not readable offline, so taken from `Qwen3_5MoeTextConfig`'s
/// defaults (2 KV heads, head dim 256, 16 linear key heads of 128, value
/// head dim 128, rope theta 1e7, partial rotary 0.25) and chosen to give
/// the published 122B total / 10B active parameters: 64 linear value heads
/// and expert / shared-expert intermediate 1024 (docs/BENCHMARKS.md says
/// so beside its figures).
pub fn preset_config(preset: Preset, layers: Option<usize>) -> ModelConfig {
    let mut c = match preset {
        Preset::Qwen36_35bA3b => qwen36_35b(),
        Preset::Qwen3_30bA3b => ModelConfig {
            architecture: Architecture::Qwen3Moe,
            vocab_size: 151936,
            layer_types: vec![LayerKind::FullAttention; 48],
            max_position_embeddings: 40960,
            num_attention_heads: 32,
            num_key_value_heads: 4,
            head_dim: 128,
            rotary_dim: 128,
            rope_theta: 1e6,
            attn_output_gate: false,
            linear_num_key_heads: 0,
            linear_key_head_dim: 0,
            linear_num_value_heads: 0,
            linear_value_head_dim: 0,
            linear_conv_kernel: 0,
            num_experts: 128,
            moe_intermediate_size: 768,
            shared_expert_intermediate_size: 0,
            ..qwen36_35b()
        },
        // The 35B's attention and linear-attention layout (partial rotary
        // factor 0.25 of head dim 256 included) with more layers and experts.
        Preset::Qwen3Next80bA3b => ModelConfig {
            architecture: Architecture::Qwen3Next,
            vocab_size: 151936,
            layer_types: LayerKind::interleaved(48, 4),
            num_experts: 512,
            num_experts_per_tok: 10,
            ..qwen36_35b()
        },
        // Published: hidden, query heads, layers, experts, vocabulary. The
        // rest is inferred (see the doc comment): the 35B's attention and
        // linear key heads, wider value heads and experts.
        Preset::Qwen35_122bA10b => ModelConfig {
            hidden_size: 3072,
            layer_types: LayerKind::interleaved(48, 4),
            num_attention_heads: 32,
            linear_num_value_heads: 64,
            moe_intermediate_size: 1024,
            shared_expert_intermediate_size: 1024,
            ..qwen36_35b()
        },
    };
    if let Some(n) = layers {
        c.layer_types.truncate(n.max(1));
    }
    c
}

/// Qwen3.6-35B-A3B's published `config.json` (the other presets are
/// written as their differences from it).
fn qwen36_35b() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Qwen35Moe,
        vocab_size: 248320,
        hidden_size: 2048,
        rms_norm_eps: 1e-6,
        layer_types: LayerKind::interleaved(40, 4),
        tie_word_embeddings: false,
        max_position_embeddings: 262144,
        num_attention_heads: 16,
        num_key_value_heads: 2,
        head_dim: 256,
        rotary_dim: 64,
        rope_theta: 1e7,
        attn_output_gate: true,
        linear_num_key_heads: 16,
        linear_key_head_dim: 128,
        linear_num_value_heads: 32,
        linear_value_head_dim: 128,
        linear_conv_kernel: 4,
        num_experts: 256,
        num_experts_per_tok: 8,
        moe_intermediate_size: 512,
        shared_expert_intermediate_size: 512,
        norm_topk_prob: true,
        mtp_num_layers: 0,
    }
}

/// Router skew. `Skew::UNIFORM` is a plain random model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Skew {
    /// Std of the per-layer router logit bias (log-normal popularity).
    pub popularity: f32,
    /// Gain of the context heads' output (token-to-token persistence);
    /// 0 disables the context heads entirely.
    pub persistence: f32,
}

impl Skew {
    pub const UNIFORM: Skew = Skew {
        popularity: 0.0,
        persistence: 0.0,
    };
    pub const DEFAULT: Skew = Skew {
        popularity: DEFAULT_POPULARITY,
        persistence: DEFAULT_PERSISTENCE,
    };
}

/// What to write.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    pub config: ModelConfig,
    pub seed: u64,
    pub skew: Skew,
    pub output: PathBuf,
    /// Informational, recorded in the manifest's source.
    pub preset_name: String,
    /// Experts generated per batch (parallel), written in order.
    pub batch: usize,
    /// What an existing output may be: a verified model of the same format,
    /// or also a damaged one (`--force`).
    pub overwrite: slipstream_format::Overwrite,
}

/// Storage of the generated matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SynthQuant {
    /// Affine 4-bit group 64 (router and shared-expert gate at 8 bits), as
    /// `slipstream repack --quant q4` writes.
    #[default]
    Q4,
    /// GGML Q4_0 (blocks of 32, f16 scale); router and shared-expert gate
    /// f32, as llama.cpp's own Q4_0 keeps `ffn_gate_inp*` unquantized. The
    /// same bytes in a `.slip` and in a GGUF (`gguf_export`).
    Q4_0,
}

impl SynthQuant {
    pub fn name(&self) -> &'static str {
        match self {
            SynthQuant::Q4 => "q4",
            SynthQuant::Q4_0 => "q4_0",
        }
    }

    /// Storage type of a dense tensor of `kind`: matrices at 4 bits,
    /// routers at 8, norms and small parameters f32.
    pub fn qtype_of(&self, kind: TensorKind) -> QuantType {
        match kind {
            TensorKind::Matrix => self.qtype(4),
            TensorKind::Router => self.qtype(8),
            TensorKind::Norm | TensorKind::Small => QuantType::F32,
        }
    }

    /// Storage type of a matrix generated at `bits` (4, or 8 for the router).
    pub fn qtype(&self, bits: u8) -> QuantType {
        match (self, bits) {
            (SynthQuant::Q4, 4) => QuantType::Q4,
            (SynthQuant::Q4, _) => QuantType::Q8,
            (SynthQuant::Q4_0, 4) => QuantType::Q4_0,
            (SynthQuant::Q4_0, _) => QuantType::F32,
        }
    }
}

impl std::str::FromStr for SynthQuant {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "q4" => Ok(SynthQuant::Q4),
            "q4_0" => Ok(SynthQuant::Q4_0),
            _ => Err(format!(
                "unknown synth quantization {s:?}: expected q4 or q4_0"
            )),
        }
    }
}

/// Progress, reported from the calling thread.
#[derive(Debug, Clone)]
pub enum SynthEvent {
    Started { total_bytes: u64 },
    Bytes(u64),
    Finishing,
}

/// Summary of a written model.
#[derive(Debug, Clone)]
pub struct SynthReport {
    pub bytes_out: u64,
    pub dense_bytes: u64,
    pub expert_bytes: u64,
    pub seconds: f64,
    pub mb_per_s: f64,
    pub model_hash: String,
}

/// The expert record layout of a config (Q4 gate, up, down).
pub fn expert_layout(cfg: &ModelConfig) -> ExpertPoolLayout {
    expert_layout_q(cfg, SynthQuant::Q4)
}

/// The expert record layout of a config at `quant`.
pub fn expert_layout_q(cfg: &ModelConfig, quant: SynthQuant) -> ExpertPoolLayout {
    let q = quant.qtype(4);
    ExpertPoolLayout {
        num_layers: cfg.total_layers(),
        num_experts: cfg.num_experts,
        parts: schema::expert_parts(cfg)
            .iter()
            .map(|p| (p.name.to_string(), q, p.shape))
            .collect(),
        layer_qtypes: Vec::new(),
    }
}

/// Estimated RMS of the residual stream after `adds` residual additions.
fn rms_estimate(cfg: &ModelConfig, adds: usize) -> f32 {
    let h = cfg.hidden_size as f32;
    let base = (C0 * C0 + (h - GROUP as f32) * EMBED_STD * EMBED_STD) / h;
    (base + RESIDUAL_GROWTH * adds as f32).sqrt()
}

/// One dense tensor ready to write.
pub(crate) struct Dense {
    pub name: String,
    pub qtype: QuantType,
    pub shape: [usize; 2],
    pub bytes: Vec<u8>,
}

/// The canonical tensors of one layer, looked up by key.
pub(crate) struct Specs(Vec<TensorSpec>);

impl Specs {
    fn get(&self, key: &str) -> Result<&TensorSpec> {
        schema::find(&self.0, key)
            .ok_or_else(|| SynthError::Invalid(format!("this layer kind has no tensor {key}")))
    }
}

pub(crate) struct Gen<'a> {
    pub cfg: &'a ModelConfig,
    pub seed: u64,
    pub skew: Skew,
    pub quant: SynthQuant,
}

impl Gen<'_> {
    fn s(&self, name: &str) -> u64 {
        derive_seed(self.seed, name, 0, 0)
    }

    fn q(&self, t: &TensorSpec, bits: u8, spec: &(dyn Fn(usize, usize) -> Group + Sync)) -> Dense {
        let [rows, cols] = t.shape;
        let bytes = self.matrix(rows, cols, bits, self.s(&t.name), true, spec);
        Dense {
            name: t.name.clone(),
            qtype: self.quant.qtype(bits),
            shape: t.shape,
            bytes,
        }
    }

    /// A matrix in this generator's storage (see [`SynthQuant`]).
    fn matrix(
        &self,
        rows: usize,
        cols: usize,
        bits: u8,
        seed: u64,
        parallel: bool,
        spec: &(dyn Fn(usize, usize) -> Group + Sync),
    ) -> Vec<u8> {
        match self.quant {
            SynthQuant::Q4 => affine(rows, cols, bits, seed, parallel, spec),
            SynthQuant::Q4_0 if bits == 4 => gguf_export::q4_0(rows, cols, seed, parallel, spec),
            SynthQuant::Q4_0 => gguf_export::f32_matrix(rows, cols, seed, parallel, spec),
        }
    }

    fn f(&self, t: &TensorSpec, v: Vec<f32>) -> Dense {
        assert_eq!(v.len(), t.shape[0] * t.shape[1]);
        Dense {
            name: t.name.clone(),
            qtype: QuantType::F32,
            shape: t.shape,
            bytes: f32_bytes(&v),
        }
    }

    fn context(&self) -> bool {
        self.skew.persistence > 0.0
    }

    /// A matrix reading the residual stream: random, group 0 zero.
    fn reader(&self, t: &TensorSpec, bits: u8) -> Dense {
        let h = t.shape[1];
        let std = 1.0 / (h as f32).sqrt();
        self.q(t, bits, &|_, g| {
            if g == 0 {
                Group::Zero
            } else {
                Group::Rand(std)
            }
        })
    }

    /// A matrix writing the residual stream: rows 0..64 zero; column group
    /// `g` scaled by `gain(g)`.
    fn writer(&self, t: &TensorSpec, gain: &(dyn Fn(usize) -> f32 + Sync)) -> Dense {
        let std = 1.0 / (t.shape[1] as f32).sqrt();
        self.q(t, 4, &|r, g| {
            let k = gain(g);
            if r < GROUP || k == 0.0 {
                Group::Zero
            } else {
                Group::Rand(std * k)
            }
        })
    }

    fn norm(&self, t: &TensorSpec, c0: f32) -> Dense {
        let mut v = vec![1.0f32; t.shape[1]];
        v[0] = c0;
        self.f(t, v)
    }

    pub(crate) fn embed(&self) -> Dense {
        self.q(&schema::embed_tensor(self.cfg), 4, &|_, g| {
            if g == 0 {
                Group::First(C0)
            } else {
                Group::Rand(EMBED_STD)
            }
        })
    }

    fn attention(&self, t: &Specs) -> Result<Vec<Dense>> {
        let c = self.cfg;
        let h = c.hidden_size;
        let (nh, nkv, hd, rd) = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.rotary_dim,
        );
        let per_head = hd * if c.attn_output_gate { 2 } else { 1 };
        let q_per_kv = nh / nkv;
        let ctx = self.context();
        let std = 1.0 / (h as f32).sqrt();
        // Context heads: query heads of KV head 0 read only channel 0 in
        // their rotary dims; so does KV head 0's key.
        // Row `within` of a context head (`None` for other rows), group `g`.
        let spec = |context_row: Option<usize>, g: usize| match context_row {
            Some(within) if within < rd && g == 0 => Group::First(1.0),
            Some(_) => Group::Zero,
            None if g == 0 => Group::Zero,
            None => Group::Rand(std),
        };
        let q = self.q(t.get("attn.q_proj")?, 4, &|r, g| {
            let (head, within) = (r / per_head, r % per_head);
            spec((ctx && head < q_per_kv && within < hd).then_some(within), g)
        });
        let k = self.q(t.get("attn.k_proj")?, 4, &|r, g| {
            spec((ctx && r < hd).then_some(r), g)
        });
        let v = self.reader(t.get("attn.v_proj")?, 4);
        let pers = self.skew.persistence;
        let o = self.writer(t.get("attn.o_proj")?, &|g| {
            if ctx && g * GROUP < q_per_kv * hd {
                pers
            } else {
                1.0
            }
        });
        // Shared q/k norm: the rotary dims of a context head carry a score
        // of RECENCY_SCORE at distance 0 (q = k, scale 1/sqrt(hd)).
        // A context q after RMSNorm has value sqrt(hd/rd) in each rotary
        // dim; score(0) = rd * (hd/rd) * w^2 / sqrt(hd) = sqrt(hd) w^2.
        let w = (RECENCY_SCORE / (hd as f32).sqrt()).sqrt();
        let mut qn = vec![1.0f32; hd];
        if ctx {
            qn[..rd].fill(w);
        }
        Ok(vec![
            q,
            k,
            v,
            o,
            self.f(t.get("attn.q_norm")?, qn.clone()),
            self.f(t.get("attn.k_norm")?, qn),
        ])
    }

    fn gdn(&self, l: usize, t: &Specs) -> Result<Vec<Dense>> {
        let c = self.cfg;
        let h = c.hidden_size;
        let (nk, dk, nv, dv, kk) = (
            c.linear_num_key_heads,
            c.linear_key_head_dim,
            c.linear_num_value_heads,
            c.linear_value_head_dim,
            c.linear_conv_kernel,
        );
        let ratio = nv / nk;
        let ctx = self.context();
        // Context key heads (1/8 of them, at least one) and their value heads.
        let ctx_k = if ctx { (nk / 8).max(1) } else { 0 };
        let ctx_v = ctx_k * ratio;
        let std = 1.0 / (h as f32).sqrt();
        let p = |s: &str| format!("layers.{l}.gdn.{s}");
        let qk_ctx = |r: usize| {
            let kh = if r < nk * dk {
                Some(r / dk)
            } else if r < 2 * nk * dk {
                Some((r - nk * dk) / dk)
            } else {
                None
            };
            kh.is_some_and(|kh| kh < ctx_k)
        };
        let v_ctx = |r: usize| r >= 2 * nk * dk && (r - 2 * nk * dk) / dv < ctx_v;
        let conv_dim = c.linear_conv_dim();
        let qkv = self.q(t.get("gdn.in_proj_qkv")?, 4, &|r, g| {
            if qk_ctx(r) {
                if g == 0 {
                    Group::First(1.0)
                } else {
                    Group::Zero
                }
            } else if g == 0 {
                Group::Zero
            } else {
                Group::Rand(std)
            }
        });
        let head_const = |head: usize, g: usize, v: f32| {
            if head < ctx_v {
                Some(if g == 0 { Group::First(v) } else { Group::Zero })
            } else {
                None
            }
        };
        let z = self.q(t.get("gdn.in_proj_z")?, 4, &|r, g| {
            head_const(r / dv, g, CONTEXT_Z).unwrap_or(if g == 0 {
                Group::Zero
            } else {
                Group::Rand(std)
            })
        });
        let b = self.q(t.get("gdn.in_proj_b")?, 4, &|r, g| {
            head_const(r, g, CONTEXT_BETA_LOGIT).unwrap_or(if g == 0 {
                Group::Zero
            } else {
                Group::Rand(std)
            })
        });
        let a = self.q(t.get("gdn.in_proj_a")?, 4, &|r, g| {
            if r < ctx_v || g == 0 {
                Group::Zero
            } else {
                Group::Rand(std)
            }
        });
        let mut rng = Rng::new(self.s(&p("small")));
        let mut conv = vec![0.0f32; conv_dim * kk];
        for (r, taps) in conv.chunks_mut(kk).enumerate() {
            if qk_ctx(r) || v_ctx(r) {
                taps[kk - 1] = 1.0;
            } else {
                for t in taps.iter_mut() {
                    *t = 0.5 * rng.normal();
                }
            }
        }
        // Context heads: exp(g) = CONTEXT_DECAY with a = 0, dt_bias = 0:
        // g = -exp(A_log) * ln 2.
        let ctx_alog = (-CONTEXT_DECAY.ln() / std::f32::consts::LN_2).ln();
        let a_log: Vec<f32> = (0..nv)
            .map(|j| {
                if j < ctx_v {
                    ctx_alog
                } else {
                    (1.0 + 15.0 * rng.uniform()).ln()
                }
            })
            .collect();
        let dt_bias: Vec<f32> = (0..nv)
            .map(|j| {
                if j < ctx_v {
                    0.0
                } else {
                    rng.uniform() * 2.0 - 1.0
                }
            })
            .collect();
        let pers = self.skew.persistence;
        let out = self.writer(t.get("gdn.out_proj")?, &|g| {
            if g * GROUP < ctx_v * dv {
                pers
            } else {
                1.0
            }
        });
        Ok(vec![
            qkv,
            z,
            b,
            a,
            self.f(t.get("gdn.conv")?, conv),
            self.f(t.get("gdn.A_log")?, a_log),
            self.f(t.get("gdn.dt_bias")?, dt_bias),
            self.f(t.get("gdn.norm")?, vec![1.0; dv]),
            out,
        ])
    }

    pub(crate) fn layer(&self, l: usize) -> Result<Vec<Dense>> {
        let c = self.cfg;
        let h = c.hidden_size;
        let mut v = Vec::new();
        // Normed channel 0 ≈ 1 at the mixer and at the MoE.
        let in_c0 = rms_estimate(c, 2 * l) / C0;
        let post_c0 = rms_estimate(c, 2 * l + 1) / C0;
        let t = Specs(schema::layer_tensors(c, l));
        let kind = c
            .layer_kind(l)
            .ok_or_else(|| SynthError::Invalid(format!("layer {l} is beyond the model")))?;
        let is_mtp = l >= c.num_layers();
        if is_mtp {
            // The MTP projection: both normed inputs at unit scale, a
            // random map of the concatenation into the residual stream.
            v.push(self.norm(t.get("mtp.embed_norm")?, 1.0));
            v.push(self.norm(t.get("mtp.hidden_norm")?, 1.0));
            v.push(self.reader(t.get("mtp.fc")?, 4));
        }
        v.push(self.norm(t.get("input_norm")?, in_c0));
        match kind {
            LayerKind::FullAttention => v.extend(self.attention(&t)?),
            LayerKind::LinearAttention => v.extend(self.gdn(l, &t)?),
        }
        v.push(self.norm(t.get("post_attn_norm")?, post_c0));
        // Router: popularity bias on channel 0.
        let e = c.num_experts;
        let mut rng = Rng::new(self.s(&format!("layers.{l}.popularity")));
        let bias: Vec<f32> = (0..e)
            .map(|_| self.skew.popularity * rng.normal())
            .collect();
        let std = 1.0 / (h as f32).sqrt();
        v.push(self.q(t.get("moe.router")?, 8, &|r, g| {
            if g == 0 {
                if bias[r] == 0.0 {
                    Group::Zero
                } else {
                    Group::First(bias[r])
                }
            } else {
                Group::Rand(std)
            }
        }));
        if c.shared_expert_intermediate_size > 0 {
            v.push(self.reader(t.get("moe.shared_gate")?, 8));
            v.push(self.reader(t.get("moe.shared.gate_proj")?, 4));
            v.push(self.reader(t.get("moe.shared.up_proj")?, 4));
            v.push(self.writer(t.get("moe.shared.down_proj")?, &|_| 1.0));
        }
        if is_mtp {
            v.push(self.norm(t.get("mtp.final_norm")?, 0.0));
        }
        Ok(v)
    }

    pub(crate) fn head_tail(&self) -> Vec<Dense> {
        let mut v = vec![self.norm(&schema::final_norm_tensor(self.cfg), 0.0)];
        if !self.cfg.tie_word_embeddings {
            v.push(self.reader(&schema::lm_head_tensor(self.cfg), 4));
        }
        v
    }

    /// One expert record's parts (gate, up, down), generated sequentially.
    pub(crate) fn expert(&self, layer: usize, expert: usize) -> [Vec<u8>; 3] {
        std::array::from_fn(|k| self.expert_part(layer, expert, k))
    }

    /// Part `k` (0 gate, 1 up, 2 down) of one expert; each part has its own stream.
    pub(crate) fn expert_part(&self, layer: usize, expert: usize, k: usize) -> Vec<u8> {
        let [_, up, down] = schema::expert_parts(self.cfg);
        let [i, h] = up.shape;
        let base = derive_seed(self.seed, "expert", layer as u64, expert as u64);
        let sh = 1.0 / (h as f32).sqrt();
        let si = 1.0 / (i as f32).sqrt();
        let read = |_: usize, g: usize| {
            if g == 0 {
                Group::Zero
            } else {
                Group::Rand(sh)
            }
        };
        match k {
            0 | 1 => self.matrix(i, h, 4, base ^ (k as u64 + 1), false, &read),
            _ => self.matrix(down.shape[0], down.shape[1], 4, base ^ 3, false, &|r, _| {
                if r < GROUP {
                    Group::Zero
                } else {
                    Group::Rand(si)
                }
            }),
        }
    }
}

/// Checks that a config can be synthesized (control block, heads).
pub(crate) fn check(cfg: &ModelConfig) -> Result<()> {
    cfg.validate()
        .map_err(|e| SynthError::Invalid(e.to_string()))?;
    let bad = |m: &str| Err(SynthError::Invalid(m.to_string()));
    if cfg.hidden_size % GROUP != 0 || cfg.hidden_size < 2 * GROUP {
        return bad("hidden size must be a multiple of 64 and at least 128");
    }
    if cfg.moe_intermediate_size % GROUP != 0 || cfg.shared_expert_intermediate_size % GROUP != 0 {
        return bad("intermediate sizes must be multiples of 64");
    }
    let has_full = cfg.layer_types.contains(&LayerKind::FullAttention);
    if has_full && (cfg.head_dim % GROUP != 0 || cfg.rotary_dim == 0) {
        return bad("head_dim must be a multiple of 64 with a rotary part");
    }
    if cfg.layer_types.contains(&LayerKind::LinearAttention)
        && (cfg.linear_value_head_dim % GROUP != 0 || cfg.linear_key_head_dim % GROUP != 0)
    {
        return bad("linear head dims must be multiples of 64");
    }
    Ok(())
}

/// Writes a synthetic model. `progress` is called from this thread.
pub fn synthesize(opts: &SynthOptions, progress: &dyn Fn(SynthEvent)) -> Result<SynthReport> {
    synthesize_q(opts, SynthQuant::Q4, progress)
}

/// [`synthesize`] with the matrices stored as `quant`.
pub fn synthesize_q(
    opts: &SynthOptions,
    quant: SynthQuant,
    progress: &dyn Fn(SynthEvent),
) -> Result<SynthReport> {
    let t0 = Instant::now();
    let cfg = &opts.config;
    check(cfg)?;
    let g = Gen {
        cfg,
        seed: opts.seed,
        skew: opts.skew,
        quant,
    };
    let layout = expert_layout_q(cfg, quant);
    let mut w = SlipWriter::create(&opts.output, layout, opts.overwrite)?;
    let record_bytes = w.pool().record_bytes;
    // MTP layers (dense and experts) follow the main ones.
    let n_layers = cfg.total_layers();
    let expert_total = record_bytes * (n_layers * cfg.num_experts) as u64;

    // Dense byte count up front (for the progress bar): from the shapes.
    let dense_total = dense_bytes_estimate_q(cfg, quant);
    progress(SynthEvent::Started {
        total_bytes: dense_total + expert_total,
    });
    let mut dense_bytes = 0u64;
    let mut put = |w: &mut SlipWriter, d: Dense| -> Result<()> {
        w.add_dense(&d.name, d.qtype, d.shape, &d.bytes)?;
        dense_bytes += d.bytes.len() as u64;
        progress(SynthEvent::Bytes(d.bytes.len() as u64));
        Ok(())
    };
    put(&mut w, g.embed())?;
    for l in 0..n_layers {
        for d in g.layer(l)? {
            put(&mut w, d)?;
        }
    }
    for d in g.head_tail() {
        put(&mut w, d)?;
    }

    // Experts: batches generated in parallel on a producer thread, written
    // in order here.
    let batch = opts.batch.max(1);
    let e_count = cfg.num_experts;
    type Batch = (usize, usize, Vec<[Vec<u8>; 3]>);
    let (tx, rx) = mpsc::sync_channel::<Batch>(2);
    let gref = &g;
    let result: Result<()> = std::thread::scope(|s| {
        s.spawn(move || {
            for l in 0..n_layers {
                let mut first = 0;
                while first < e_count {
                    let end = (first + batch).min(e_count);
                    let recs: Vec<[Vec<u8>; 3]> = (first..end)
                        .into_par_iter()
                        .map(|e| gref.expert(l, e))
                        .collect();
                    if tx.send((l, first, recs)).is_err() {
                        return;
                    }
                    first = end;
                }
            }
        });
        for (l, first, recs) in rx.iter() {
            for (i, r) in recs.iter().enumerate() {
                w.write_expert(l, first + i, &[&r[0], &r[1], &r[2]])?;
                progress(SynthEvent::Bytes(record_bytes));
            }
        }
        Ok(())
    });
    result?;
    progress(SynthEvent::Finishing);
    let source = SourceInfo {
        kind: "synthetic".into(),
        path: format!(
            "slipstream synth --preset {} --layers {}{} --seed {} --skew-popularity {} --skew-persistence {}",
            opts.preset_name,
            cfg.num_layers(),
            if cfg.mtp_num_layers > 0 {
                format!(" --mtp-layers {}", cfg.mtp_num_layers)
            } else {
                String::new()
            },
            opts.seed,
            opts.skew.popularity,
            opts.skew.persistence
        ),
        quant: quant.name().into(),
    };
    let manifest = w.finish(ManifestInfo {
        config: cfg.clone(),
        tokenizer: None,
        chat_template: None,
        eos_token_ids: Vec::new(),
        special_tokens: Default::default(),
        generation: None,
        source,
    })?;
    let seconds = t0.elapsed().as_secs_f64();
    let bytes_out = manifest.dense_file_bytes + manifest.experts.file_bytes();
    Ok(SynthReport {
        bytes_out,
        dense_bytes,
        expert_bytes: expert_total,
        seconds,
        mb_per_s: bytes_out as f64 / 1e6 / seconds.max(1e-9),
        model_hash: manifest.model_hash,
    })
}

/// Bytes of the dense tensors of `cfg` (payload, without alignment).
pub fn dense_bytes_estimate(cfg: &ModelConfig) -> u64 {
    dense_bytes_estimate_q(cfg, SynthQuant::Q4)
}

/// Bytes of the dense tensors of `cfg` stored as `quant`.
pub fn dense_bytes_estimate_q(cfg: &ModelConfig, quant: SynthQuant) -> u64 {
    schema::dense_tensors(cfg)
        .iter()
        .map(|t| quant.qtype_of(t.kind).nbytes(t.shape[0], t.shape[1]) as u64)
        .sum()
}

/// Convenience: writes `preset` with `layers` to `output`.
pub fn options(
    preset: Preset,
    layers: Option<usize>,
    seed: u64,
    skew: Skew,
    output: &Path,
) -> SynthOptions {
    SynthOptions {
        config: preset_config(preset, layers),
        seed,
        skew,
        output: output.to_path_buf(),
        preset_name: preset.name().to_string(),
        batch: 32,
        overwrite: Default::default(),
    }
}
