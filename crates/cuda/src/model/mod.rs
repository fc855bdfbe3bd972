//! [`CudaModel`]: the CUDA [`Backend`] of the decoder stack.
//!
//! Dense weights are uploaded to VRAM once; activations, the KV cache and
//! the Gated DeltaNet states live in device memory. Routed experts sit in a
//! per-layer VRAM cache whose hits and misses are decided by the store's
//! own [`LayerCache`] (same policies as the host store); misses are fetched
//! through the host [`ExpertSource`] (RAM tier or SSD), staged in pinned
//! memory and copied on a second stream while the shared expert runs. The
//! only host round trip per layer is the routing decision (expert ids),
//! and none at all when every expert is resident in VRAM: then the router
//! kernel writes the experts' bases table from a per-layer expert ->
//! address table and the host queues a whole token without waiting
//! (device routing; the ids are read back once per pass for the counters).
//!
//! With device routing a pass holds up to [`CudaTuning::pass_tokens`]
//! tokens (at most [`PASS_TOKENS`]): a prompt runs
//! in passes of that many, the dense 4-bit weights read once per 16 tokens
//! and each routed expert's gate/up once per pass instead of once per
//! token, the attention queries in one launch pair over the KV cache the
//! pass appended to; with host routing (experts streaming into VRAM) one
//! token per pass. Either way each token gets the same operations, so the
//! same bits. [`Transformer::run`] splits prompts into passes.

mod backend;
mod expert_cache;
mod graph;
mod mixer;
mod readback;
mod routing;
mod state;
mod verify;
mod weights;

use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{result, CudaEvent, PinnedHostSlice};
use slipstream_core::{ExpertRequest, ExpertSource, QuantType};
use slipstream_models::blocks::{Linear, MoeTimes, Route};
use slipstream_models::state::LayerState;
use slipstream_models::transformer::Mixer;
use slipstream_models::{Backend, ModelError, NormKind, Transformer};
use slipstream_store::policy::{LayerCache, Outcome};
use slipstream_store::PolicyKind;

use slipstream_kernels::sample::{DrawParams, MAX_VOCAB};

// The submodules take these with `use super::*`.
use crate::options::PASS_TOKENS;
use crate::{
    AttnIo, CudaError, CudaTuning, DBuf, DWeight, DevPtr, ExpertsIo, GdnConv, GdnForm, GdnStep,
    Gpu, Mapped, Position, PromptPrecision, QkPrep, Result, RouteBases, SampleScratch,
    TensorCoreUse, WDesc,
};

use graph::{PassGraph, PassMode};
use verify::VerifyTrail;
use weights::{DLayer, DMixer};

/// Largest attention scratch grown for a pass's queries (bytes).
const QUERY_SCRATCH_MAX: usize = 64 << 20;

/// Settings of the CUDA backend.
#[derive(Debug, Clone, Default)]
pub struct CudaOptions {
    /// Device ordinal.
    pub device: usize,
    /// VRAM expert slots per layer; `None` = every expert (fully resident).
    pub vram_slots: Option<usize>,
    /// Pinned host-RAM expert slots per layer between VRAM and the host
    /// store (`None`: no pinned tier; misses stage through a small buffer).
    pub ram_slots: Option<usize>,
    /// Eviction policy of the VRAM and RAM slots.
    pub policy: PolicyKind,
    /// Kernel and pass tuning (the CLI's `SLIPSTREAM_CUDA_*` variables).
    pub tuning: CudaTuning,
}

/// Counters of the CUDA backend, per run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CudaStats {
    /// Routed-expert requests found in VRAM.
    pub vram_hits: u64,
    /// Requests copied from the host tier.
    pub vram_misses: u64,
    /// Bytes copied host to device for experts.
    pub h2d_bytes: u64,
    /// Host time spent waiting for routing decisions (the per-layer round trip).
    pub route_wait_ns: u64,
    /// Host time inside the host store (reads, staging copies).
    pub fetch_ns: u64,
    /// VRAM misses served by the pinned RAM tier.
    pub ram_hits: u64,
    /// VRAM misses that went to the host store (RAM tier present or not).
    pub store_reads: u64,
    /// Tokens run.
    pub tokens: u64,
    /// Passes whose layers ran as one replayed CUDA graph.
    pub graph_replays: u64,
    /// CUDA graphs captured (the first pass, and again after a KV cache grew).
    pub graph_captures: u64,
}

/// Which preallocated activation buffer an activation lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DAct {
    X,
    Xn,
    T,
    Tn,
}

/// The CUDA backend of one model and one sequence.
pub struct CudaModel {
    pub gpu: Gpu,
    layers: Vec<DLayer>,
    embed: DWeight,
    lm_head: DWeight,
    final_norm: DBuf,
    acts: [DBuf; 4],
    /// Scratch buffers sized for a pass of up to [`PASS_TOKENS`] tokens.
    scratch: Scratch,
    /// The seeded draw's memory (`None`: a vocabulary over
    /// `sample::MAX_VOCAB`, drawn on the host).
    sample_scratch: Option<SampleScratch>,
    /// Pinned host staging: expert records, then the bases table.
    staging: PinnedHostSlice<u8>,
    bases_host: PinnedHostSlice<u64>,
    route_host: PinnedHostSlice<f32>,
    /// Pinned host copy of one row of logits (`[vocab]` f32): a generated
    /// token's logits come back through it, not through pageable memory.
    logits_host: PinnedHostSlice<f32>,
    /// Mapped host words the router kernel publishes the routing decision
    /// into (ids, weights, then a sequence number): the host polls them
    /// instead of a copy + event. `None` (fallback, or
    /// [`CudaTuning::route_mapped`] off): copy + event.
    route_pub: Option<Mapped>,
    route_seq: u32,
    /// Every expert of every layer sits in VRAM for good (after
    /// [`CudaModel::preload`] of a full cache): the router kernel writes the
    /// experts' bases table itself and the host queues the whole token
    /// without waiting for routing decisions.
    device_routing: bool,
    /// The last pass routed on the device and its ids are not counted yet.
    routes_pending: bool,
    /// With device routing, run each pass's body as one CUDA graph
    /// ([`CudaTuning::graphs`]).
    graphs: bool,
    graph: Option<PassGraph>,
    mode: PassMode,
    /// A mixer output (in `scratch.mixed`) not yet added into this residual.
    pending_residual: Option<DAct>,
    /// The residual stream at the end of the last complete pass (what
    /// [`CudaModel::next_token`] takes the last row of).
    pass_out: Option<DAct>,
    copy_done: Option<CudaEvent>,
    /// Expert part templates (base 0) and their offsets in a record.
    parts: [(WDesc, u64, usize); 3],
    rec_bytes: usize,
    top_k: usize,
    num_experts: usize,
    hidden: usize,
    vocab: usize,
    eps: f32,
    renorm: bool,
    /// Tokens the device state holds.
    pos: usize,
    /// Tokens of the current pass.
    pass_n: usize,
    /// The most tokens of a pass with device routing (<= PASS_TOKENS).
    pass_tokens: usize,
    /// Tokens of the pass whose device routes are still to be counted.
    routes_n: usize,
    /// Which passes run on the tensor cores.
    tc_use: TensorCoreUse,
    /// The prompt's products on tensor cores: 8-bit or exact.
    prompt_precision: PromptPrecision,
    /// [`CudaTuning::device_routing`]: a full cache may route on the device.
    device_routing_allowed: bool,
    /// The next passes are the prompt's ([`CudaModel::set_prompt_pass`]).
    prompt_pass: bool,
    /// The verify pass being recorded or last recorded, with its buffers
    /// ([`CudaModel::begin_verify`]).
    verify: Option<VerifyTrail>,
    /// While `Some`: every final-normed row is read back into it
    /// ([`CudaModel::collect_hidden`]).
    hidden_rows: Option<Vec<f32>>,
    pub stats: CudaStats,
}

/// The device scratch of a pass of up to [`PASS_TOKENS`] tokens (f32
/// unless noted; `[PASS_TOKENS, width]` where a row per token).
struct Scratch {
    /// Attention: the q (with its gate), k and v projections, the query
    /// after norm and RoPE, its gate, the attention output, and the split
    /// attention's partials ([`Gpu::attn_scratch_f32`], grown for a pass).
    q_all: DBuf,
    k_all: DBuf,
    v_all: DBuf,
    q: DBuf,
    gate: DBuf,
    attn: DBuf,
    att_scratch: DBuf,
    /// A mixer's output before it is added into the residual.
    mixed: DBuf,
    /// Gated DeltaNet: the qkv, z, b and a projections, the convolution's
    /// output and the recurrence's.
    qkv: DBuf,
    z: DBuf,
    b: DBuf,
    a: DBuf,
    conv: DBuf,
    core: DBuf,
    /// MoE: router logits `[E]` per token, one token's routing (ids then
    /// weights, `2 k` words), the routed experts' gate/up outputs
    /// `[k, I]` per token, the shared expert's gate/up and output, its
    /// sigmoid gate (one per token), and the routed experts' bases table
    /// (`3 k` u64 per token: gate, up, down).
    logits: DBuf,
    route: DBuf,
    h: DBuf,
    sh_h: DBuf,
    sh_out: DBuf,
    sg: DBuf,
    bases: DBuf,
    /// `[PASS_TOKENS * k]` i32: pair p's token row, p / k.
    xrow: DBuf,
    /// `[PASS_TOKENS]` i32: 0, 1, 2, ... (the shared expert's one pair per token).
    xrow_id: DBuf,
    /// The token id, then its position (one-token passes; graphs read both).
    ids: DBuf,
    /// `[PASS_TOKENS]` i32: the token ids of a longer pass.
    pass_ids: DBuf,
    /// A longer pass's (token, rank) pairs grouped by expert: offsets
    /// `[E + 1]` and pairs `[PASS_TOKENS * k]` (i32).
    grp_off: DBuf,
    grp_list: DBuf,
    /// Logits rows `[vocab]` (one row; `head` grows it for more).
    vocab: DBuf,
    /// The device argmax's output (one i32), then the seeded draw's.
    argmax: DBuf,
    /// Scratch expert records for misses that take no slot (top_k of them).
    spill: DBuf,
    /// With device routing: `[layers, 2 n k]` words for a pass of n tokens,
    /// each layer's ids `[n, k]` then weights `[n, k]`, read back once per
    /// pass for the counters.
    route_all: DBuf,
}

fn align(n: usize) -> usize {
    n.div_ceil(256) * 256
}

fn err(e: CudaError) -> ModelError {
    ModelError::Weight(format!("CUDA: {e}"))
}

impl CudaModel {
    /// Marks the next passes as the prompt's (`true`) or as generated
    /// tokens' (`false`): with [`TensorCoreUse::Prompt`] this picks their
    /// kernels.
    pub fn set_prompt_pass(&mut self, prompt: bool) {
        self.prompt_pass = prompt;
    }

    /// The arithmetic of the prompt's 4-bit products: the configured
    /// precision where prompts run on tensor cores, else exact.
    pub fn prompt_precision(&self) -> PromptPrecision {
        if self.gpu.tc_capable && self.tc_use != TensorCoreUse::Never {
            self.prompt_precision
        } else {
            PromptPrecision::Exact
        }
    }

    /// Bytes of one expert record in VRAM.
    pub fn record_bytes(&self) -> usize {
        self.rec_bytes
    }

    /// VRAM expert slots per layer.
    pub fn slots(&self) -> usize {
        self.layers.first().map_or(0, |l| l.cache.capacity())
    }

    /// One line for logs.
    pub fn describe(&self) -> String {
        let ram = self
            .layers
            .first()
            .and_then(|l| l.ram.as_ref())
            .map_or("no pinned RAM tier".to_string(), |r| {
                format!("{} pinned RAM slots per layer", r.0.capacity())
            });
        let tc = match self.tc_use {
            _ if !self.gpu.tc_capable => "off (they need sm_80)",
            TensorCoreUse::Never => "off",
            TensorCoreUse::Prompt => "prompt passes",
            TensorCoreUse::Always => "every pass",
        };
        let precision = match self.tc_use {
            _ if !self.gpu.tc_capable => "",
            TensorCoreUse::Never => "",
            _ => match self.prompt_precision {
                PromptPrecision::Int8 => " (prompt in int8)",
                PromptPrecision::Exact => " (prompt exact)",
            },
        };
        format!(
            "cuda on {}: {} VRAM expert slots per layer ({:.1} MB each), {ram}; \
             programmatic dependent launch {}; tensor-core 4-bit kernels: {tc}{precision}",
            self.gpu.name,
            self.slots(),
            self.rec_bytes as f64 / 1e6,
            if self.gpu.pdl { "on" } else { "off" }
        )
    }

    /// `r`, ending a capture in progress when it is an error.
    pub(super) fn guard<T>(&mut self, r: Result<T>) -> std::result::Result<T, ModelError> {
        if r.is_err() {
            self.abort_capture();
        }
        r.map_err(err)
    }

    pub(super) fn act(&self, a: DAct) -> &DBuf {
        &self.acts[a as usize]
    }

    /// Clears the device state (a new sequence).
    pub(super) fn reset(&mut self) -> Result<()> {
        for l in &self.layers {
            if let DMixer::Gdn(g) = &l.mixer {
                for b in [&g.conv_state, &g.rec_state] {
                    self.gpu.ctx.bind_to_thread()?;
                    // SAFETY: the range is the whole allocation.
                    unsafe {
                        result::memset_d8_async(
                            b.ptr.raw(),
                            0,
                            b.bytes,
                            self.gpu.stream.cu_stream(),
                        )?
                    };
                }
            }
        }
        self.pos = 0;
        self.end_verify_recording();
        Ok(())
    }
}
