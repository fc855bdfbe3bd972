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

use crate::options::PASS_TOKENS;
use crate::{
    CudaError, CudaTuning, DBuf, DWeight, GdnForm, Gpu, Mapped, Position, Result, RouteBases,
    SampleScratch, TensorCoreUse, WDesc,
};

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

/// How the current pass's layers reach the device (device routing only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PassMode {
    /// Each kernel launched on its own.
    Plain,
    /// Launches recorded into a CUDA graph, launched at the last layer.
    Capture,
    /// The recorded graph launched once; the layers launch nothing.
    Replay,
}

/// A pass's body (embedding to the last layer's experts) captured as one
/// CUDA graph: ~17 launches per layer become one, and the GPU runs them
/// without the per-launch gaps. Its kernels take the position from device
/// memory, so it replays at every position whose keys fit the KV caches it
/// captured.
struct PassGraph {
    exec: cudarc::driver::CudaGraph,
    /// Smallest KV capacity over the attention layers at capture (rows).
    kv_cap: usize,
}

/// Which preallocated activation buffer an activation lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DAct {
    X,
    Xn,
    T,
    Tn,
}

struct DAttn {
    q: DWeight,
    k: DWeight,
    v: DWeight,
    o: DWeight,
    q_norm: DBuf,
    k_norm: DBuf,
    inv_freq: DBuf,
    half: usize,
    dims: (usize, usize, usize),
    gated: bool,
    eps: f32,
    kc: DBuf,
    vc: DBuf,
    /// Rows the caches hold.
    cap: usize,
}

struct DGdn {
    qkv: DWeight,
    z: DWeight,
    b: DWeight,
    a: DWeight,
    out: DWeight,
    conv: DBuf,
    a_log: DBuf,
    dt_bias: DBuf,
    norm: DBuf,
    conv_state: DBuf,
    rec_state: DBuf,
    c: usize,
    kernel: usize,
    dims: (usize, usize, usize, usize),
    eps: f32,
}

enum DMixer {
    Attn(Box<DAttn>),
    Gdn(Box<DGdn>),
}

struct DShared {
    /// `[gate; PASS_TOKENS]` then `[up; PASS_TOKENS]` device addresses: the
    /// bases table of a launch with one pair per token of a pass.
    bases: DBuf,
    gate: DWeight,
    up: DWeight,
    down: DWeight,
    sgate: DWeight,
}

struct DLayer {
    input_norm: DBuf,
    post_norm: DBuf,
    mixer: DMixer,
    router: DWeight,
    shared: Option<DShared>,
    cache: LayerCache,
    slots: DBuf,
    /// The pinned RAM tier: its slot bookkeeping and `slots * rec` bytes.
    ram: Option<(LayerCache, PinnedHostSlice<u8>)>,
    /// With device routing: `[num_experts]` u64, each expert's VRAM record.
    addr_table: Option<DBuf>,
}

/// The CUDA backend of one model and one sequence.
pub struct CudaModel {
    pub gpu: Gpu,
    layers: Vec<DLayer>,
    embed: DWeight,
    lm_head: DWeight,
    final_norm: DBuf,
    acts: [DBuf; 4],
    // Scratch (f32 unless noted).
    s_q_all: DBuf,
    s_k_all: DBuf,
    s_v_all: DBuf,
    s_q: DBuf,
    s_gate: DBuf,
    s_attn: DBuf,
    s_att_scratch: DBuf,
    s_mixed: DBuf,
    s_qkv: DBuf,
    s_z: DBuf,
    s_b: DBuf,
    s_a: DBuf,
    s_conv: DBuf,
    s_core: DBuf,
    s_logits: DBuf,
    s_route: DBuf,
    s_h: DBuf,
    s_sh_h: DBuf,
    s_sh_out: DBuf,
    s_sg: DBuf,
    s_bases: DBuf,
    /// `[PASS_TOKENS * k]` i32: pair p's token row, p / k.
    s_xrow: DBuf,
    /// `[PASS_TOKENS]` i32: 0, 1, 2, ... (the shared expert's one pair per token).
    s_xrow_id: DBuf,
    /// The token id, then its position (one-token passes; graphs read both).
    s_ids: DBuf,
    /// `[PASS_TOKENS]` i32: the token ids of a longer pass.
    s_pass_ids: DBuf,
    /// A longer pass's (token, rank) pairs grouped by expert: offsets
    /// `[E + 1]` and pairs `[PASS_TOKENS * k]` (i32).
    s_grp_off: DBuf,
    s_grp_list: DBuf,
    s_vocab: DBuf,
    /// The device argmax's output (one i32), then the seeded draw's.
    s_argmax: DBuf,
    /// The seeded draw's memory (`None`: a vocabulary over
    /// `sample::MAX_VOCAB`, drawn on the host).
    sample_scratch: Option<SampleScratch>,
    /// Scratch expert records for misses that take no slot (top_k of them).
    s_spill: DBuf,
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
    /// With device routing: `[layers, 2 n k]` words for a pass of n tokens,
    /// each layer's ids `[n, k]` then weights `[n, k]`, read back once per
    /// pass for the counters.
    s_route_all: DBuf,
    /// The last pass routed on the device and its ids are not counted yet.
    routes_pending: bool,
    /// With device routing, run each pass's body as one CUDA graph
    /// ([`CudaTuning::graphs`]).
    graphs: bool,
    graph: Option<PassGraph>,
    mode: PassMode,
    /// A mixer output (in `s_mixed`) not yet added into this residual.
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
    /// [`CudaTuning::device_routing`]: a full cache may route on the device.
    device_routing_allowed: bool,
    /// The next passes are the prompt's ([`CudaModel::set_prompt_pass`]).
    prompt_pass: bool,
    pub stats: CudaStats,
}

fn align(n: usize) -> usize {
    n.div_ceil(256) * 256
}

fn err(e: CudaError) -> ModelError {
    ModelError::Weight(format!("CUDA: {e}"))
}

impl CudaModel {
    /// Uploads the dense weights of `m` and sizes the VRAM expert cache.
    /// `parts` are the expert record parts (gate, up, down) as the `.slip`
    /// manifest describes them: quant type and `[rows, cols]`.
    pub fn new(
        m: &Transformer,
        parts: [(QuantType, [usize; 2]); 3],
        opts: &CudaOptions,
    ) -> Result<CudaModel> {
        let tuning = &opts.tuning;
        let mut gpu = Gpu::new(opts.device, tuning)?;
        gpu.gdn_rows = tuning.gdn_form == GdnForm::Rows;
        let c = &m.config;
        let (h, e, k) = (c.hidden_size, c.num_experts, c.num_experts_per_tok);
        let up_w = |l: &Linear| gpu.upload_weight(&l.w.view());
        let mut offs = 0usize;
        let mut tmpl = [(WDesc::default(), 0u64, 0usize); 3];
        for (i, (q, shape)) in parts.iter().enumerate() {
            let nb = q.nbytes(shape[0], shape[1]);
            tmpl[i] = (WDesc::new(*q, shape[0], shape[1], 0)?, offs as u64, nb);
            offs += align(nb);
        }
        let rec_bytes = offs;
        let inter = parts[0].1[0];
        if parts[1].1 != [inter, h] || parts[2].1 != [h, inter] || parts[0].1 != [inter, h] {
            return Err(CudaError::Invalid(
                "expert parts do not match the config's shapes".into(),
            ));
        }
        let slots = opts.vram_slots.unwrap_or(e).clamp(1, e);
        let mut layers = Vec::with_capacity(m.layers.len());
        let mut max_c = 0usize;
        let mut max_core = 0usize;
        let mut max_q = 0usize;
        let mut max_kv = 0usize;
        let mut max_nv = 0usize;
        let mut shared_inter = 0usize;
        for layer in &m.layers {
            let mixer = match &layer.mixer {
                Mixer::Attention(a) => {
                    let (nh, nkv, hd) = (a.num_heads, a.num_kv_heads, a.head_dim);
                    max_q = max_q.max(a.q_proj.out_dim()).max(nh * hd);
                    max_kv = max_kv.max(nkv * hd);
                    let cap = 256;
                    DMixer::Attn(Box::new(DAttn {
                        q: up_w(&a.q_proj)?,
                        k: up_w(&a.k_proj)?,
                        v: up_w(&a.v_proj)?,
                        o: up_w(&a.o_proj)?,
                        q_norm: gpu.upload_f32(&a.q_norm)?,
                        k_norm: gpu.upload_f32(&a.k_norm)?,
                        inv_freq: gpu.upload_f32(&a.rope.inv_freq)?,
                        half: a.rope.inv_freq.len(),
                        dims: (nh, nkv, hd),
                        gated: a.output_gate,
                        eps: a.eps,
                        kc: gpu.alloc(cap * nkv * hd * 4)?,
                        vc: gpu.alloc(cap * nkv * hd * 4)?,
                        cap,
                    }))
                }
                Mixer::Linear(g) => {
                    let cd = g.conv_dim();
                    max_c = max_c.max(cd);
                    max_core = max_core.max(g.num_v_heads * g.v_dim);
                    max_nv = max_nv.max(g.num_v_heads);
                    DMixer::Gdn(Box::new(DGdn {
                        qkv: up_w(&g.in_proj_qkv)?,
                        z: up_w(&g.in_proj_z)?,
                        b: up_w(&g.in_proj_b)?,
                        a: up_w(&g.in_proj_a)?,
                        out: up_w(&g.out_proj)?,
                        conv: gpu.upload_f32(&g.conv)?,
                        a_log: gpu.upload_f32(&g.a_log)?,
                        dt_bias: gpu.upload_f32(&g.dt_bias)?,
                        norm: gpu.upload_f32(&g.norm)?,
                        conv_state: gpu.alloc((g.kernel - 1) * cd * 4)?,
                        rec_state: gpu.alloc(g.num_v_heads * g.k_dim * g.v_dim * 4)?,
                        c: cd,
                        kernel: g.kernel,
                        dims: (g.num_k_heads, g.k_dim, g.num_v_heads, g.v_dim),
                        eps: g.eps,
                    }))
                }
            };
            let shared = match &layer.moe.shared {
                Some((mlp, sg)) => {
                    shared_inter = shared_inter.max(mlp.gate_proj.out_dim());
                    let gate = up_w(&mlp.gate_proj)?;
                    let up = up_w(&mlp.up_proj)?;
                    let table: Vec<u64> = [gate.desc.codes; PASS_TOKENS]
                        .into_iter()
                        .chain([up.desc.codes; PASS_TOKENS])
                        .collect();
                    let bytes: Vec<u8> = table.iter().flat_map(|a| a.to_le_bytes()).collect();
                    Some(DShared {
                        bases: gpu.upload(&bytes)?,
                        gate,
                        up,
                        down: up_w(&mlp.down_proj)?,
                        sgate: up_w(sg)?,
                    })
                }
                None => None,
            };
            layers.push(DLayer {
                input_norm: gpu.upload_f32(&layer.input_norm)?,
                post_norm: gpu.upload_f32(&layer.post_attn_norm)?,
                mixer,
                router: up_w(&layer.moe.router)?,
                shared,
                cache: LayerCache::new(opts.policy.build(e), e, slots),
                slots: gpu.alloc(slots * rec_bytes)?,
                addr_table: None,
                ram: match opts.ram_slots {
                    Some(r) => {
                        let r = r.clamp(1, e);
                        // SAFETY: pinned host memory, written only by the
                        // host between copies (ordered by `copy_done`).
                        let mem = unsafe { gpu.ctx.alloc_pinned::<u8>(r * rec_bytes)? };
                        Some((LayerCache::new(opts.policy.build(e), e, r), mem))
                    }
                    None => None,
                },
            });
        }
        let f = |n: usize| gpu.alloc(n.max(1) * 4);
        // Scratch for a pass of up to PASS_TOKENS tokens.
        let fp = |n: usize| f(n * PASS_TOKENS);
        let i32s = |v: Vec<i32>| -> Result<DBuf> {
            gpu.upload(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
        };
        let nh_max = m
            .layers
            .iter()
            .filter_map(|l| match &l.mixer {
                Mixer::Attention(a) => Some((a.num_heads, a.head_dim)),
                _ => None,
            })
            .fold((1, 1), |a, b| (a.0.max(b.0), a.1.max(b.1)));
        // SAFETY: pinned host allocations; only touched through the slices
        // cudarc hands out, after the copies reading them completed.
        let (staging, bases_host, route_host, logits_host) = unsafe {
            (
                gpu.ctx.alloc_pinned::<u8>((k + 1) * rec_bytes)?,
                gpu.ctx.alloc_pinned::<u64>(3 * k)?,
                gpu.ctx.alloc_pinned::<f32>(2 * k)?,
                gpu.ctx.alloc_pinned::<f32>(c.vocab_size)?,
            )
        };
        Ok(CudaModel {
            acts: [fp(h)?, fp(h)?, fp(h)?, fp(h)?],
            s_q_all: fp(max_q)?,
            s_k_all: fp(max_kv)?,
            s_v_all: fp(max_kv)?,
            s_q: fp(max_q)?,
            s_gate: fp(max_q)?,
            s_attn: fp(max_q)?,
            s_att_scratch: f(Gpu::attn_scratch_f32(nh_max.0, nh_max.1, 256))?,
            s_mixed: fp(h)?,
            s_qkv: fp(max_c)?,
            s_z: fp(max_core)?,
            s_b: fp(max_nv)?,
            s_a: fp(max_nv)?,
            s_conv: fp(max_c)?,
            s_core: fp(max_core)?,
            s_logits: fp(e)?,
            s_route: f(2 * k)?,
            s_h: fp(k * inter)?,
            s_sh_h: fp(shared_inter)?,
            s_sh_out: fp(h)?,
            s_sg: fp(1)?,
            s_bases: gpu.alloc(3 * k * PASS_TOKENS * 8)?,
            s_xrow: i32s(
                (0..k * PASS_TOKENS)
                    .map(|p| (p / k.max(1)) as i32)
                    .collect(),
            )?,
            s_xrow_id: i32s((0..PASS_TOKENS as i32).collect())?,
            s_ids: gpu.alloc(16)?,
            s_pass_ids: gpu.alloc(PASS_TOKENS * 4)?,
            s_grp_off: f(e + 1)?,
            s_grp_list: fp(k)?,
            // One row; `head` grows it for more (outside any graph).
            s_vocab: f(c.vocab_size)?,
            s_argmax: f(1)?,
            sample_scratch: if c.vocab_size <= MAX_VOCAB {
                Some(gpu.sample_scratch(c.vocab_size)?)
            } else {
                None
            },
            s_spill: gpu.alloc(k * rec_bytes)?,
            embed: gpu.upload_weight(&m.embed.view())?,
            lm_head: gpu.upload_weight(&m.lm_head.view())?,
            final_norm: gpu.upload_f32(&m.final_norm)?,
            staging,
            bases_host,
            route_host,
            logits_host,
            route_pub: if !tuning.route_mapped {
                None
            } else {
                // Where mapping fails, the copy + event path stays.
                gpu.alloc_mapped(2 * k + 1).ok()
            },
            route_seq: 0,
            device_routing: false,
            graphs: tuning.graphs,
            graph: None,
            mode: PassMode::Plain,
            pending_residual: None,
            pass_out: None,
            s_route_all: fp(2 * k * m.layers.len().max(1))?,
            routes_pending: false,
            copy_done: None,
            parts: tmpl,
            rec_bytes,
            top_k: k,
            num_experts: e,
            hidden: h,
            vocab: c.vocab_size,
            eps: c.rms_norm_eps,
            renorm: c.norm_topk_prob,
            pos: 0,
            pass_n: 1,
            pass_tokens: tuning.pass_tokens.clamp(1, PASS_TOKENS),
            routes_n: 0,
            tc_use: tuning.tensor_core_passes,
            device_routing_allowed: tuning.device_routing,
            prompt_pass: false,
            stats: CudaStats::default(),
            layers,
            gpu,
        })
    }

    /// Marks the next passes as the prompt's (`true`) or as generated
    /// tokens' (`false`): with [`TensorCoreUse::Prompt`] this picks their
    /// kernels.
    pub fn set_prompt_pass(&mut self, prompt: bool) {
        self.prompt_pass = prompt;
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
        format!(
            "cuda on {}: {} VRAM expert slots per layer ({:.1} MB each), {ram}; \
             programmatic dependent launch {}; tensor-core 4-bit kernels: {tc}",
            self.gpu.name,
            self.slots(),
            self.rec_bytes as f64 / 1e6,
            if self.gpu.pdl { "on" } else { "off" }
        )
    }

    /// The position of the current pass in device memory (written with the
    /// token id in `embed`), for an attention layer whose KV cache holds
    /// `cap` rows.
    fn device_pos(&self, cap: usize) -> Position {
        Position::Device {
            ptr: self.s_ids.ptr + 4,
            cap,
        }
    }

    /// Decides how this pass's body runs (see [`PassMode`]); before a
    /// capture, grows every KV cache for `position` (growing allocates and
    /// synchronises, which a capture may not).
    fn choose_mode(&mut self, position: usize) -> Result<()> {
        self.mode = PassMode::Plain;
        if !(self.device_routing && self.graphs) {
            return Ok(());
        }
        if self.graph.as_ref().is_some_and(|g| position < g.kv_cap) {
            self.mode = PassMode::Replay;
            return Ok(());
        }
        for l in 0..self.layers.len() {
            self.ensure_kv(l, position + 1)?;
        }
        self.graph = None;
        self.mode = PassMode::Capture;
        Ok(())
    }

    /// Ends a capture that failed midway, so the stream takes work again.
    fn abort_capture(&mut self) {
        if self.mode == PassMode::Capture {
            // The graph (if any) is dropped: it is incomplete.
            let _ = self
                .gpu
                .stream
                .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
            self.mode = PassMode::Plain;
        }
    }

    /// Ends the capture of the pass's body and launches it.
    fn finish_capture(&mut self) -> Result<()> {
        let kv_cap = self
            .layers
            .iter()
            .filter_map(|l| match &l.mixer {
                DMixer::Attn(a) => Some(a.cap),
                DMixer::Gdn(_) => None,
            })
            .min()
            .unwrap_or(usize::MAX);
        self.mode = PassMode::Plain;
        let exec = self
            .gpu
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))?
            .ok_or_else(|| CudaError::Invalid("the pass's graph capture came back empty".into()))?;
        exec.launch()?;
        self.graph = Some(PassGraph { exec, kv_cap });
        self.stats.graph_captures += 1;
        Ok(())
    }

    /// `r`, ending a capture in progress when it is an error.
    fn guard<T>(&mut self, r: Result<T>) -> std::result::Result<T, ModelError> {
        if r.is_err() {
            self.abort_capture();
        }
        r.map_err(err)
    }

    fn act(&self, a: DAct) -> &DBuf {
        &self.acts[a as usize]
    }

    /// Clears the device state (a new sequence).
    fn reset(&mut self) -> Result<()> {
        for l in &self.layers {
            if let DMixer::Gdn(g) = &l.mixer {
                for b in [&g.conv_state, &g.rec_state] {
                    self.gpu.ctx.bind_to_thread()?;
                    // SAFETY: the range is the whole allocation.
                    unsafe {
                        result::memset_d8_async(b.ptr, 0, b.bytes, self.gpu.stream.cu_stream())?
                    };
                }
            }
        }
        self.pos = 0;
        Ok(())
    }

    /// Grows the KV caches of layer `l` to hold `need` rows (copying).
    fn ensure_kv(&mut self, l: usize, need: usize) -> Result<()> {
        let gpu = &self.gpu;
        if let DMixer::Attn(a) = &mut self.layers[l].mixer {
            if need > a.cap {
                let cap = need.next_power_of_two().max(2 * a.cap);
                let row = a.dims.1 * a.dims.2 * 4;
                let kc = gpu.alloc(cap * row)?;
                let vc = gpu.alloc(cap * row)?;
                gpu.ctx.bind_to_thread()?;
                // SAFETY: both copies stay inside the old (smaller) buffers
                // and the new ones; ordered on the compute stream.
                unsafe {
                    result::memcpy_dtod_async(
                        kc.ptr,
                        a.kc.ptr,
                        a.cap * row,
                        gpu.stream.cu_stream(),
                    )?;
                    result::memcpy_dtod_async(
                        vc.ptr,
                        a.vc.ptr,
                        a.cap * row,
                        gpu.stream.cu_stream(),
                    )?;
                }
                gpu.sync()?;
                a.kc = kc;
                a.vc = vc;
                a.cap = cap;
                // A captured graph holds the old buffers' addresses.
                self.graph = None;
                let need_s = Gpu::attn_scratch_f32(a.dims.0, a.dims.2, cap);
                if self.s_att_scratch.len_f32() < need_s {
                    self.s_att_scratch = gpu.alloc(need_s * 4)?;
                }
            }
        }
        Ok(())
    }

    /// Grows the attention scratch so a pass's `n` queries of layer `l`
    /// run in one launch pair, up to [`QUERY_SCRATCH_MAX`] bytes (longer
    /// contexts run the queries in batches). One-token passes never grow
    /// it, so a captured graph's scratch address stays valid; growing
    /// drops the graph all the same.
    fn ensure_query_scratch(&mut self, l: usize, n: usize) -> Result<()> {
        let DMixer::Attn(a) = &self.layers[l].mixer else {
            return Ok(());
        };
        let per_query = Gpu::attn_scratch_f32(a.dims.0, a.dims.2, self.pos + n);
        let want = (n * per_query).min((QUERY_SCRATCH_MAX / 4).max(per_query));
        if self.s_att_scratch.len_f32() < want {
            self.s_att_scratch = self.gpu.alloc(want * 4)?;
            self.graph = None;
        }
        Ok(())
    }

    fn attention(&mut self, l: usize, x: DAct, xn: DAct) -> Result<()> {
        let n = self.pass_n;
        self.ensure_kv(l, self.pos + n)?;
        if n > 1 {
            self.ensure_query_scratch(l, n)?;
        }
        let g = &self.gpu;
        let DMixer::Attn(a) = &self.layers[l].mixer else {
            unreachable!()
        };
        let xn = self.act(xn).ptr;
        let (q_all, k_all, v_all) = (self.s_q_all.ptr, self.s_k_all.ptr, self.s_v_all.ptr);
        // One token: the position comes from device memory (so the
        // launches replay in a graph) and the attention grid covers the
        // cache's capacity. A longer pass: the host's positions.
        let at = if n == 1 {
            self.device_pos(a.cap)
        } else {
            Position::Host(self.pos)
        };
        g.matvec_many(
            &[&a.q.desc, &a.k.desc, &a.v.desc],
            xn,
            &[q_all, k_all, v_all],
            n,
        )?;
        g.qk_prep(
            q_all,
            k_all,
            v_all,
            a.q_norm.ptr,
            a.k_norm.ptr,
            a.inv_freq.ptr,
            a.half,
            a.dims,
            a.gated,
            a.eps,
            at,
            n,
            self.s_q.ptr,
            self.s_gate.ptr,
            a.kc.ptr,
            a.vc.ptr,
        )?;
        // Each query over the keys up to its own position (causal): the
        // pass's keys are all in the cache already. As many queries per
        // launch pair as the scratch holds. The prompt's tokens run on the
        // tensor-core kernels at every pass length (one token per pass
        // included, so their bits never depend on the pass length); the
        // generated tokens on the decode kernels.
        let on_tc =
            self.prompt_pass && g.tensor_cores && g.prompt_attention_on_tensor_cores(a.dims.2);
        let row = (a.dims.0 * a.dims.2 * 4) as u64;
        let per_query = if on_tc {
            Gpu::prompt_attn_scratch_f32(a.dims.0, a.dims.2, self.pos + n)
        } else {
            Gpu::attn_scratch_f32(a.dims.0, a.dims.2, self.pos + n)
        };
        let batch = (self.s_att_scratch.len_f32() / per_query).clamp(1, n);
        for t0 in (0..n).step_by(batch) {
            let m = batch.min(n - t0);
            let off = t0 as u64 * row;
            let gate = if a.gated { self.s_gate.ptr + off } else { 0 };
            if on_tc {
                g.attention_prompt(
                    self.s_q.ptr + off,
                    a.kc.ptr,
                    a.vc.ptr,
                    self.pos + t0,
                    m,
                    a.dims,
                    gate,
                    &self.s_att_scratch,
                    self.s_attn.ptr + off,
                )?;
                continue;
            }
            let at_t = match at {
                Position::Host(p) => Position::Host(p + t0),
                device => device,
            };
            g.attention_causal(
                self.s_q.ptr + off,
                a.kc.ptr,
                a.vc.ptr,
                at_t,
                m,
                a.dims,
                gate,
                &self.s_att_scratch,
                self.s_attn.ptr + off,
            )?;
        }
        g.matvec(&a.o.desc, self.s_attn.ptr, self.s_mixed.ptr, n)?;
        self.defer_residual(x);
        Ok(())
    }

    fn gdn(&mut self, l: usize, x: DAct, xn: DAct) -> Result<()> {
        let n = self.pass_n;
        let g = &self.gpu;
        let DMixer::Gdn(d) = &self.layers[l].mixer else {
            unreachable!()
        };
        let xn = self.act(xn).ptr;
        g.matvec_many(
            &[&d.qkv.desc, &d.z.desc, &d.b.desc, &d.a.desc],
            xn,
            &[self.s_qkv.ptr, self.s_z.ptr, self.s_b.ptr, self.s_a.ptr],
            n,
        )?;
        g.gdn_conv(
            self.s_qkv.ptr,
            n,
            d.conv.ptr,
            d.c,
            d.kernel,
            d.conv_state.ptr,
            self.s_conv.ptr,
        )?;
        g.gdn_step(
            self.s_conv.ptr,
            self.s_z.ptr,
            self.s_b.ptr,
            self.s_a.ptr,
            d.a_log.ptr,
            d.dt_bias.ptr,
            d.norm.ptr,
            d.rec_state.ptr,
            n,
            d.dims,
            d.eps,
            self.s_core.ptr,
        )?;
        g.matvec(&d.out.desc, self.s_core.ptr, self.s_mixed.ptr, n)?;
        self.defer_residual(x);
        Ok(())
    }

    /// The mixer's output in `s_mixed` is added into the residual `x` by
    /// the norm that follows (one launch for add + norm, same bits);
    /// [`CudaModel::flush_residual`] adds it on its own when anything else
    /// comes first.
    fn defer_residual(&mut self, x: DAct) {
        self.pending_residual = Some(x);
    }

    /// Adds a deferred mixer output into its residual now.
    fn flush_residual(&mut self) -> Result<()> {
        match self.pending_residual.take() {
            Some(x) => self
                .gpu
                .add(self.act(x).ptr, self.s_mixed.ptr, self.hidden * self.pass_n),
            None => Ok(()),
        }
    }

    /// The MoE of layer `l` for one token: router on the device, ids to
    /// the host (the round trip), shared expert launched meanwhile, VRAM
    /// cache settled, misses fetched and copied, then all routed experts in
    /// two launches that also add the result into the residual `x`.
    fn moe(
        &mut self,
        l: usize,
        x: DAct,
        xn: DAct,
        experts: &mut dyn ExpertSource,
        routes: &mut Vec<Route>,
        times: &mut MoeTimes,
    ) -> Result<std::result::Result<(), slipstream_core::BoxError>> {
        if self.device_routing {
            self.moe_device(l, x, xn, times)?;
            return Ok(Ok(()));
        }
        let t0 = Instant::now();
        let (k, e) = (self.top_k, self.num_experts);
        let xn_p = self.act(xn).ptr;
        let x_p = self.act(x).ptr;
        self.route_seq = self.route_seq.wrapping_add(1).max(1);
        let seq = self.route_seq;
        {
            self.router(l, xn_p, 1)?;
            let g = &self.gpu;
            g.router_topk(
                self.s_logits.ptr,
                e,
                k,
                self.renorm,
                self.s_route.ptr,
                self.s_route.f32_at(k),
                1,
                self.route_pub.as_ref().map(|m| (m, seq)),
                None,
            )?;
            if self.route_pub.is_none() {
                g.ctx.bind_to_thread()?;
                // SAFETY: `route_host` is pinned and holds 2k f32; it is read
                // only after `routed` below has completed.
                unsafe {
                    let dst = std::slice::from_raw_parts_mut(self.route_host.as_mut_ptr()?, 2 * k);
                    result::memcpy_dtoh_async(dst, self.s_route.ptr, g.stream.cu_stream())?;
                }
            }
        }
        // Without the mapped buffer: a device-to-host copy and an event.
        let routed = match self.route_pub {
            Some(_) => None,
            None => Some(
                self.gpu
                    .stream
                    .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?,
            ),
        };
        // The shared expert runs on the device while the host settles the cache.
        self.shared_expert(l, xn_p, 1)?;
        let t_wait = Instant::now();
        let (ids, wts): (Vec<u32>, Vec<f32>) = match (&self.route_pub, routed) {
            (Some(m), _) => {
                m.wait_for(2 * k, seq, &self.gpu.stream)?;
                (
                    (0..k).map(|i| m.read(i)).collect(),
                    (0..k).map(|i| f32::from_bits(m.read(k + i))).collect(),
                )
            }
            (None, Some(ev)) => {
                ev.synchronize()?;
                // SAFETY: the event covers the copy into `route_host`.
                let host = unsafe { std::slice::from_raw_parts(self.route_host.as_ptr()?, 2 * k) };
                (
                    host[..k].iter().map(|v| v.to_bits()).collect(),
                    host[k..].to_vec(),
                )
            }
            (None, None) => unreachable!("an event is recorded when there is no mapped buffer"),
        };
        self.stats.route_wait_ns += t_wait.elapsed().as_nanos() as u64;
        if ids.iter().any(|&i| i as usize >= e) {
            return Err(CudaError::Invalid(format!(
                "router returned an expert id outside 0..{e}"
            )));
        }
        routes.push(Route {
            experts: ids.clone(),
            weights: wts,
        });
        let router_ns = t0.elapsed().as_nanos() as u64;

        // Settle hits and misses on the distinct experts in id order.
        let mut distinct = ids.clone();
        distinct.sort_unstable();
        distinct.dedup();
        let counts: Vec<u32> = distinct
            .iter()
            .map(|d| ids.iter().filter(|&&i| i == *d).count() as u32)
            .collect();
        let layer = &mut self.layers[l];
        let outcomes = layer.cache.access(&distinct, &counts, 1);
        let mut addr = vec![0u64; e];
        let mut missing: Vec<(u32, u64)> = Vec::new();
        let mut spill = 0usize;
        for (&d, o) in distinct.iter().zip(&outcomes) {
            let a = match *o {
                Outcome::Hit { slot } => {
                    self.stats.vram_hits += 1;
                    layer.slots.ptr + (slot * self.rec_bytes) as u64
                }
                Outcome::Miss { slot, .. } => {
                    self.stats.vram_misses += 1;
                    let a = match slot {
                        Some(s) => layer.slots.ptr + (s * self.rec_bytes) as u64,
                        None => {
                            spill += 1;
                            self.s_spill.ptr + ((spill - 1) * self.rec_bytes) as u64
                        }
                    };
                    missing.push((d, a));
                    a
                }
            };
            addr[d as usize] = a;
        }
        let mut fetch_ns = 0u64;
        if !missing.is_empty() {
            let ncounts: Vec<u32> = missing
                .iter()
                .map(|m| counts[distinct.iter().position(|x| *x == m.0).unwrap_or(0)])
                .collect();
            match self.fetch(l, &missing, &ncounts, experts)? {
                Ok(ns) => fetch_ns = ns,
                Err(er) => return Ok(Err(er)),
            }
        }
        // Bases in rank order: gate, up, down addresses.
        {
            // SAFETY: `bases_host` is pinned (3k u64); the previous copy out
            // of it completed before `routed` (same stream, earlier).
            let b = unsafe { std::slice::from_raw_parts_mut(self.bases_host.as_mut_ptr()?, 3 * k) };
            for (r, &id) in ids.iter().enumerate() {
                let a = addr[id as usize];
                b[r] = a + self.parts[0].1;
                b[k + r] = a + self.parts[1].1;
                b[2 * k + r] = a + self.parts[2].1;
            }
            let g = &self.gpu;
            g.ctx.bind_to_thread()?;
            // SAFETY: 3k u64 into `s_bases` (3k + 3 u64).
            unsafe { result::memcpy_htod_async(self.s_bases.ptr, &b[..], g.stream.cu_stream())? };
        }
        self.routed_experts(l, xn_p, x_p, self.s_route.f32_at(k), 1)?;
        times.router_ns += router_ns;
        times.wait_ns += fetch_ns;
        times.routed_ffn_ns += t0.elapsed().as_nanos() as u64 - router_ns - fetch_ns;
        Ok(Ok(()))
    }

    /// Layer `l`'s router logits into `s_logits` and (with a shared
    /// expert) its gate into `s_sg`: one launch where both run on the
    /// generic kernel (each the bits of its own launch).
    fn router(&self, l: usize, xn_p: u64, n: usize) -> Result<()> {
        let layer = &self.layers[l];
        match &layer.shared {
            Some(sh) => self.gpu.matvec_many(
                &[&layer.router.desc, &sh.sgate.desc],
                xn_p,
                &[self.s_logits.ptr, self.s_sg.ptr],
                n,
            ),
            None => self
                .gpu
                .matvec(&layer.router.desc, xn_p, self.s_logits.ptr, n),
        }
    }

    /// Launches layer `l`'s shared expert (if any) on the `n` rows at
    /// `xn_p` into `s_sh_out` (its gate comes with the router).
    fn shared_expert(&self, l: usize, xn_p: u64, n: usize) -> Result<()> {
        let Some(sh) = &self.layers[l].shared else {
            return Ok(());
        };
        let g = &self.gpu;
        let sb = sh.bases.ptr;
        g.moe_gate_up(
            &sh.gate.desc,
            &sh.up.desc,
            sb,
            sb + 8 * PASS_TOKENS as u64,
            self.s_xrow_id.ptr,
            xn_p,
            self.s_sh_h.ptr,
            n,
        )?;
        g.matvec(&sh.down.desc, self.s_sh_h.ptr, self.s_sh_out.ptr, n)
    }

    /// Layer `l`'s shared expert output and gate (0, 0 without one).
    fn shared_out(&self, l: usize) -> (u64, u64) {
        if self.layers[l].shared.is_some() {
            (self.s_sh_out.ptr, self.s_sg.ptr)
        } else {
            (0, 0)
        }
    }

    /// Launches the routed experts of layer `l` for `n` tokens over the
    /// bases table in `s_bases` (`[gate; n k]`, `[up; n k]`, `[down; n k]`)
    /// with the routing weights at `wts` (`[n, k]`), adding their (and the
    /// shared expert's) output into the residual at `x_p`.
    fn routed_experts(&self, l: usize, xn_p: u64, x_p: u64, wts: u64, n: usize) -> Result<()> {
        let k = self.top_k;
        let bp = self.s_bases.ptr;
        let shared = self.shared_out(l);
        let table = 8 * (k * n) as u64;
        self.gpu.moe_experts(
            [&self.parts[0].0, &self.parts[1].0, &self.parts[2].0],
            [bp, bp + table, bp + 2 * table],
            self.s_xrow.ptr,
            xn_p,
            self.s_h.ptr,
            wts,
            k,
            shared,
            x_p,
            n,
        )
    }

    /// The MoE of layer `l` with device routing: router, bases table,
    /// shared and routed experts queued back to back, no host round trip.
    /// The same kernels on the same addresses as the host-routed path, so
    /// the same bits.
    fn moe_device(&mut self, l: usize, x: DAct, xn: DAct, times: &mut MoeTimes) -> Result<()> {
        let t0 = Instant::now();
        let (k, e) = (self.top_k, self.num_experts);
        let (xn_p, x_p) = (self.act(xn).ptr, self.act(x).ptr);
        let n = self.pass_n;
        // Layer l's ids `[n, k]` then weights `[n, k]` (layers packed for
        // this pass's n, so the read-back covers only what was written).
        let ids = self.s_route_all.f32_at(2 * k * n * l);
        let wts = self.s_route_all.f32_at(2 * k * n * l + n * k);
        let layer = &self.layers[l];
        let Some(addr) = &layer.addr_table else {
            return Err(CudaError::Invalid(format!(
                "device routing without layer {l}'s expert table"
            )));
        };
        let bases = RouteBases {
            addr: addr.ptr,
            offsets: [self.parts[0].1, self.parts[1].1, self.parts[2].1],
            out: self.s_bases.ptr,
        };
        self.router(l, xn_p, n)?;
        let g = &self.gpu;
        g.router_topk(
            self.s_logits.ptr,
            e,
            k,
            self.renorm,
            ids,
            wts,
            n,
            None,
            Some(&bases),
        )?;
        let router_ns = t0.elapsed().as_nanos() as u64;
        self.shared_expert(l, xn_p, n)?;
        // A longer pass loads each routed expert's gate/up once for all
        // its pairs (same bits as the per-pair launch).
        let grouped = n > 1
            && g.moe_experts_grouped(
                [&self.parts[0].0, &self.parts[1].0, &self.parts[2].0],
                &bases,
                ids,
                e,
                (&self.s_grp_off, &self.s_grp_list),
                self.s_xrow.ptr,
                xn_p,
                self.s_h.ptr,
                wts,
                k,
                self.shared_out(l),
                x_p,
                n,
            )?;
        if !grouped {
            self.routed_experts(l, xn_p, x_p, wts, n)?;
        }
        self.routes_pending = true;
        self.routes_n = n;
        times.router_ns += router_ns;
        times.routed_ffn_ns += t0.elapsed().as_nanos() as u64 - router_ns;
        Ok(())
    }

    /// Counts the last device-routed pass's experts (every one a VRAM hit)
    /// from the ids its router kernels left in `s_route_all` (one read,
    /// which waits for the pass).
    fn collect_device_routes(&mut self) -> Result<()> {
        if !self.routes_pending {
            return Ok(());
        }
        self.routes_pending = false;
        let (k, e, n) = (self.top_k, self.num_experts, self.routes_n);
        let per_layer = 2 * k * n;
        let words = self
            .gpu
            .read_i32(&self.s_route_all, per_layer * self.layers.len())?;
        for (l, layer) in self.layers.iter_mut().enumerate() {
            // The distinct experts of the pass (as a host-routed pass of
            // these tokens would count its cache accesses).
            let mut ids: Vec<i32> = words[per_layer * l..][..n * k].to_vec();
            if ids.iter().any(|&i| i < 0 || i as usize >= e) {
                return Err(CudaError::Invalid(format!(
                    "router returned an expert id outside 0..{e} in layer {l}"
                )));
            }
            ids.sort_unstable();
            ids.dedup();
            self.stats.vram_hits += ids.len() as u64;
            layer.cache.hits += ids.len() as u64;
        }
        Ok(())
    }

    /// Whether the router kernels write the experts' bases table themselves
    /// (see [`CudaModel::preload`]).
    pub fn device_routing(&self) -> bool {
        self.device_routing
    }

    /// Whether each pass's layers run as one replayed CUDA graph (device
    /// routing, unless [`CudaTuning::graphs`] is off).
    pub fn pass_graphs(&self) -> bool {
        self.device_routing && self.graphs
    }

    /// Brings `missing` experts of layer `l` (id, VRAM destination; 0 =
    /// none, RAM tier only) to the device: RAM-tier hits are copied straight
    /// from pinned memory; the rest are read through the host store into
    /// their RAM-tier slot (or the staging buffer) and copied from there.
    /// Copies run on the copy stream; the compute stream waits for them. At
    /// most `top_k + 1` experts per call. Returns the host time spent.
    fn fetch(
        &mut self,
        l: usize,
        missing: &[(u32, u64)],
        counts: &[u32],
        experts: &mut dyn ExpertSource,
    ) -> Result<std::result::Result<u64, slipstream_core::BoxError>> {
        if missing.len() > self.top_k + 1 {
            return Err(CudaError::Invalid(
                "too many experts for the staging buffer".into(),
            ));
        }
        let t_f = Instant::now();
        if let Some(ev) = self.copy_done.take() {
            ev.synchronize()?; // staging and RAM slots free to write again
        }
        let rec = self.rec_bytes;
        let cs = self.gpu.copy_stream.cu_stream();
        let stage_ptr = self.staging.as_mut_ptr()?;
        self.gpu.ctx.bind_to_thread()?;
        let mut bytes = 0u64;
        // (id, VRAM destination, host bytes to fill) for the host store.
        let mut from_store: Vec<(u32, u64, *mut u8)> = Vec::new();
        let mut store_counts = Vec::new();
        match self.layers[l].ram.as_mut() {
            Some((cache, mem)) => {
                let ids: Vec<u32> = missing.iter().map(|m| m.0).collect();
                let base = mem.as_mut_ptr()?;
                for (i, o) in cache.access(&ids, counts, 1).into_iter().enumerate() {
                    let (id, dst) = missing[i];
                    match o {
                        Outcome::Hit { slot } => {
                            self.stats.ram_hits += 1;
                            if dst != 0 {
                                // SAFETY: slot < capacity: `rec` bytes inside
                                // the pinned tier; the device range is a
                                // whole expert slot.
                                unsafe {
                                    let src = std::slice::from_raw_parts(base.add(slot * rec), rec);
                                    result::memcpy_htod_async(dst, src, cs)?;
                                }
                                bytes += rec as u64;
                            }
                        }
                        Outcome::Miss { slot, .. } => {
                            // SAFETY: inside the tier (slot < capacity) or
                            // the staging buffer (i < k + 1 records).
                            let host = unsafe {
                                match slot {
                                    Some(sl) => base.add(sl * rec),
                                    None => stage_ptr.add(i * rec),
                                }
                            };
                            from_store.push((id, dst, host));
                            store_counts.push(counts[i]);
                        }
                    }
                }
            }
            None => {
                for (i, &(id, dst)) in missing.iter().enumerate() {
                    // SAFETY: i < k + 1 records of staging.
                    from_store.push((id, dst, unsafe { stage_ptr.add(i * rec) }));
                    store_counts.push(counts[i]);
                }
            }
        }
        if !from_store.is_empty() {
            self.stats.store_reads += from_store.len() as u64;
            let need: Vec<u32> = from_store.iter().map(|m| m.0).collect();
            let req = ExpertRequest {
                layer: l,
                experts: &need,
                counts: &store_counts,
                tokens: 1,
            };
            if let Err(er) = experts.begin(&req) {
                return Ok(Err(er));
            }
            let parts = self.parts;
            let mut copy_err: Option<CudaError> = None;
            let res = experts.with_experts(&req, &mut |id, w| {
                let Some(&(_, dst, host)) = from_store.iter().find(|m| m.0 == id) else {
                    return;
                };
                for (pi, view) in [w.gate, w.up, w.down].iter().enumerate() {
                    let (_, off, nb) = parts[pi];
                    if view.data.len() != nb {
                        copy_err = Some(CudaError::Invalid(format!(
                            "expert {id} of layer {l}: part {pi} has {} bytes, expected {nb}",
                            view.data.len()
                        )));
                        return;
                    }
                    // SAFETY: `host` is a whole record (`rec` bytes) of
                    // pinned memory, not read by any copy in flight (event
                    // above); part `pi` lies at `off..off + nb` inside it.
                    unsafe {
                        let s = std::slice::from_raw_parts_mut(host.add(off as usize), nb);
                        s.copy_from_slice(view.data);
                        if dst != 0 {
                            if let Err(e2) = result::memcpy_htod_async(dst + off, &s[..], cs) {
                                copy_err = Some(e2.into());
                            }
                            bytes += nb as u64;
                        }
                    }
                }
            });
            if let Err(er) = res {
                return Ok(Err(er));
            }
            if let Some(ce) = copy_err {
                return Err(ce);
            }
        }
        self.stats.h2d_bytes += bytes;
        let ev = self
            .gpu
            .copy_stream
            .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        self.gpu.stream.wait(&ev)?;
        self.copy_done = Some(ev);
        let ns = t_f.elapsed().as_nanos() as u64;
        self.stats.fetch_ns += ns;
        Ok(Ok(ns))
    }

    /// Fills a full RAM tier, and every VRAM slot when VRAM holds every
    /// expert, in id order through the ordinary miss path, so decode figures
    /// carry no first-use copies. Returns the experts loaded into VRAM; the
    /// counters are reset afterwards.
    pub fn preload(
        &mut self,
        experts: &mut dyn ExpertSource,
    ) -> Result<std::result::Result<usize, slipstream_core::BoxError>> {
        let mut n = 0;
        let k = self.top_k;
        for l in 0..self.layers.len() {
            // A full RAM tier is filled first (from the host store).
            let ram_cap = self.layers[l].ram.as_ref().map_or(0, |r| r.0.capacity());
            if ram_cap >= self.num_experts && self.layers[l].cache.capacity() < self.num_experts {
                let ids: Vec<u32> = (0..self.num_experts as u32).collect();
                for chunk in ids.chunks(k) {
                    let miss: Vec<(u32, u64)> = chunk.iter().map(|&e| (e, 0)).collect();
                    let ones = vec![1u32; chunk.len()];
                    if let Err(e) = self.fetch(l, &miss, &ones, experts)? {
                        return Ok(Err(e));
                    }
                }
            }
            let cap = self.layers[l].cache.capacity().min(self.num_experts);
            if cap < self.num_experts {
                continue;
            }
            let ids: Vec<u32> = (0..cap as u32).collect();
            for chunk in ids.chunks(k) {
                let ones = vec![1u32; chunk.len()];
                let layer = &mut self.layers[l];
                let outcomes = layer.cache.access(chunk, &ones, 1);
                let mut missing = Vec::new();
                for (&e, o) in chunk.iter().zip(&outcomes) {
                    if let Outcome::Miss { slot: Some(s), .. } = *o {
                        missing.push((e, layer.slots.ptr + (s * self.rec_bytes) as u64));
                    }
                }
                if missing.is_empty() {
                    continue;
                }
                n += missing.len();
                let counts = vec![1u32; missing.len()];
                if let Err(e) = self.fetch(l, &missing, &counts, experts)? {
                    return Ok(Err(e));
                }
            }
        }
        self.gpu.copy_stream.synchronize()?;
        self.stats = CudaStats::default();
        self.enable_device_routing()?;
        Ok(Ok(n))
    }

    /// Turns device routing on when every layer holds every expert in VRAM
    /// ([`CudaTuning::device_routing`] off keeps the host round trip):
    /// uploads each layer's expert -> record address table. A full cache
    /// never evicts, so the tables stay valid.
    fn enable_device_routing(&mut self) -> Result<()> {
        if !self.device_routing_allowed {
            return Ok(());
        }
        let e = self.num_experts;
        let mut tables = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let mut addr = Vec::with_capacity(e * 8);
            for id in 0..e as u32 {
                let Some(slot) = layer.cache.slot_of(id) else {
                    return Ok(());
                };
                let a = layer.slots.ptr + (slot * self.rec_bytes) as u64;
                addr.extend_from_slice(&a.to_le_bytes());
            }
            tables.push(addr);
        }
        for (layer, addr) in self.layers.iter_mut().zip(tables) {
            layer.addr_table = Some(self.gpu.upload(&addr)?);
        }
        self.device_routing = !self.layers.is_empty();
        Ok(())
    }

    /// Copies `n` words from `src` into `logits_host` and waits once: the
    /// pass's pending routes are read behind the same synchronisation
    /// (their read waits for the stream, which runs the copy first).
    fn land_in_host(&mut self, src: u64, n: usize) -> Result<()> {
        let g = &self.gpu;
        g.ctx.bind_to_thread()?;
        let host = self.logits_host.as_mut_slice()?;
        if n > host.len() {
            return Err(CudaError::Invalid(format!(
                "{n} words for a host buffer of {}",
                host.len()
            )));
        }
        // SAFETY: `src` holds at least `n` words (the callers' buffers) and
        // `host` at least `n`; the pinned buffer lives as long as `self`,
        // and is read only after the stream is synchronised.
        unsafe { result::memcpy_dtoh_async(&mut host[..n], src, g.stream.cu_stream()) }?;
        if self.routes_pending {
            self.collect_device_routes()
        } else {
            self.gpu.sync()
        }
    }

    /// The first row of `s_vocab` (`[vocab]`).
    fn read_logits_row(&mut self) -> Result<Vec<f32>> {
        self.land_in_host(self.s_vocab.ptr, self.vocab)?;
        Ok(self.logits_host.as_slice()?[..self.vocab].to_vec())
    }

    /// The device's choice of token (`s_argmax`).
    fn read_choice(&mut self) -> Result<i32> {
        self.land_in_host(self.s_argmax.ptr, 1)?;
        Ok(self.logits_host.as_slice()?[0].to_bits() as i32)
    }

    /// Whether [`CudaModel::next_token`] can draw with a temperature (the
    /// vocabulary fits the seeded draw's integer sums).
    pub fn draws_on_device(&self) -> bool {
        self.sample_scratch.is_some()
    }

    /// The next token after a pass run without logits (`Logits::None`):
    /// the final norm, the output head and the choice on the device, so 4
    /// bytes come back instead of a row of logits. `draw: None` takes the
    /// argmax (ties to the lowest id, NaN never wins, all NaN: the last id,
    /// as the engine's `argmax`); `Some((settings, u))` the seeded draw,
    /// the token `slipstream_kernels::sample::draw` picks from the same row
    /// (the argmax when no logit is finite). The row stays on the device
    /// for [`CudaModel::last_logits`].
    pub fn next_token(
        &mut self,
        m: &Transformer,
        draw: Option<(DrawParams, f64)>,
    ) -> std::result::Result<u32, ModelError> {
        let Some(x) = self.pass_out else {
            return Err(ModelError::State(
                "next_token needs a pass completed just before it".into(),
            ));
        };
        let n = self.pass_n;
        let rows = self.tail(m, &x, n, 1)?;
        let xn = self.norm(m, &rows, NormKind::Final, 1)?;
        let xn_p = self.act(xn).ptr;
        let r = self
            .gpu
            .matvec(&self.lm_head.desc, xn_p, self.s_vocab.ptr, 1);
        self.guard(r)?;
        self.choose_in_vocab(draw)
    }

    /// The argmax of `s_vocab`'s first row, or the seeded draw from it
    /// (the argmax when no logit is finite), read back as a token id.
    fn choose_in_vocab(
        &mut self,
        draw: Option<(DrawParams, f64)>,
    ) -> std::result::Result<u32, ModelError> {
        let (logits, out) = (self.s_vocab.ptr, self.s_argmax.ptr);
        let r = self
            .gpu
            .argmax(logits, self.vocab, out)
            .and_then(|()| match (draw, &self.sample_scratch) {
                (Some((p, u)), Some(s)) => self.gpu.sample(logits, self.vocab, &p, u, s, out),
                (Some(_), None) => Err(CudaError::Invalid(format!(
                    "a vocabulary of {} is over the device draw's {MAX_VOCAB}",
                    self.vocab
                ))),
                (None, _) => Ok(()),
            })
            .and_then(|()| self.read_choice());
        let id = self.guard(r)?;
        u32::try_from(id)
            .ok()
            .filter(|&t| (t as usize) < self.vocab)
            .ok_or_else(|| ModelError::State(format!("the device chose token {id}")))
    }

    /// The seeded draw from a row of logits the host holds (`[vocab]`:
    /// the first token after a prompt, rows kept for logprobs): the row
    /// goes to the device and the same kernels as [`CudaModel::next_token`]
    /// draw from it, so the token is the one `sample::draw` gives (the
    /// argmax when no logit is finite) at a fraction of the host
    /// reference's time.
    pub fn draw_row(
        &mut self,
        row: &[f32],
        p: DrawParams,
        u: f64,
    ) -> std::result::Result<u32, ModelError> {
        if row.len() != self.vocab {
            return Err(ModelError::State(format!(
                "a row of {} logits for a vocabulary of {}",
                row.len(),
                self.vocab
            )));
        }
        let r = self.gpu.write_f32(&self.s_vocab, row);
        self.guard(r)?;
        self.choose_in_vocab(Some((p, u)))
    }

    /// The logits row [`CudaModel::next_token`] last chose from (`[vocab]`).
    pub fn last_logits(&mut self) -> std::result::Result<Vec<f32>, ModelError> {
        let r = self.read_logits_row();
        self.guard(r)
    }
}

impl Backend for CudaModel {
    type Act = DAct;

    fn max_pass_tokens(&self) -> usize {
        if self.device_routing {
            self.pass_tokens
        } else {
            1
        }
    }

    fn begin_pass(&mut self, position: usize, n: usize) -> std::result::Result<(), ModelError> {
        self.abort_capture();
        // A residual left by a pass that failed midway belongs to no pass.
        self.pending_residual = None;
        self.pass_out = None;
        self.collect_device_routes().map_err(err)?;
        if position == 0 {
            self.reset().map_err(err)?;
        } else if position != self.pos {
            return Err(ModelError::State(format!(
                "the CUDA backend holds {} tokens of state, the pass starts at {position} \
                 (restoring snapshots needs --backend cpu)",
                self.pos
            )));
        }
        if n == 0 || n > self.max_pass_tokens() {
            return Err(ModelError::State(format!(
                "the CUDA backend runs 1..={} tokens per pass here, got {n}",
                self.max_pass_tokens()
            )));
        }
        self.pass_n = n;
        self.gpu.tensor_cores = match self.tc_use {
            TensorCoreUse::Never => false,
            TensorCoreUse::Prompt => self.prompt_pass,
            TensorCoreUse::Always => true,
        };
        // The pass graph holds the generated tokens' kernels: a prompt pass
        // on other kernels (tensor cores: the prompt attention takes its
        // position from the host) runs without it.
        if n > 1 || (self.prompt_pass && self.tc_use != TensorCoreUse::Never) {
            self.mode = PassMode::Plain;
            return Ok(());
        }
        self.choose_mode(position).map_err(err)
    }

    fn embed(&mut self, _m: &Transformer, tokens: &[u32]) -> std::result::Result<DAct, ModelError> {
        if tokens.len() != self.pass_n {
            return Err(ModelError::State(format!(
                "the pass was begun for {} tokens, got {}",
                self.pass_n,
                tokens.len()
            )));
        }
        if let &[_, _, ..] = tokens {
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            let r = self.gpu.write(&self.s_pass_ids, 0, &bytes).and_then(|()| {
                self.gpu.embed_rows(
                    &self.embed.desc,
                    self.s_pass_ids.ptr,
                    self.act(DAct::X).ptr,
                    tokens.len(),
                )
            });
            self.guard(r)?;
            return Ok(DAct::X);
        }
        let id = tokens[0];
        // The token id, then its position (read by the attention kernels).
        let words = [f32::from_bits(id), f32::from_bits(self.pos as u32)];
        self.gpu.write_f32(&self.s_ids, &words).map_err(err)?;
        let r = match self.mode {
            PassMode::Replay => match &self.graph {
                Some(g) => g.exec.launch().map_err(CudaError::from),
                None => Err(CudaError::Invalid("graph replay without a graph".into())),
            },
            PassMode::Capture => self
                .gpu
                .stream
                .begin_capture(
                    cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )
                .map_err(CudaError::from)
                .and_then(|()| {
                    self.gpu
                        .embed_rows(&self.embed.desc, self.s_ids.ptr, self.act(DAct::X).ptr, 1)
                }),
            PassMode::Plain => {
                self.gpu
                    .embed_rows(&self.embed.desc, self.s_ids.ptr, self.act(DAct::X).ptr, 1)
            }
        };
        self.guard(r)?;
        if self.mode == PassMode::Replay {
            self.stats.graph_replays += 1;
        }
        Ok(DAct::X)
    }

    fn norm(
        &mut self,
        _m: &Transformer,
        x: &DAct,
        which: NormKind,
        n: usize,
    ) -> std::result::Result<DAct, ModelError> {
        let w = match which {
            NormKind::Input(l) => self.layers[l].input_norm.ptr,
            NormKind::PostAttn(l) => self.layers[l].post_norm.ptr,
            NormKind::Final => self.final_norm.ptr,
        };
        let out = match x {
            DAct::X | DAct::Xn => DAct::Xn,
            DAct::T | DAct::Tn => DAct::Tn,
        };
        if self.mode == PassMode::Replay && which != NormKind::Final {
            return Ok(out);
        }
        let r = if self.pending_residual == Some(*x) {
            self.pending_residual = None;
            self.gpu.add_rms_norm(
                self.act(*x).ptr,
                self.s_mixed.ptr,
                w,
                self.act(out).ptr,
                n,
                self.hidden,
                self.eps,
            )
        } else {
            self.flush_residual().and_then(|()| {
                self.gpu.rms_norm(
                    self.act(*x).ptr,
                    w,
                    self.act(out).ptr,
                    n,
                    self.hidden,
                    self.eps,
                )
            })
        };
        self.guard(r)?;
        Ok(out)
    }

    fn mixer(
        &mut self,
        _m: &Transformer,
        l: usize,
        x: &mut DAct,
        xn: &DAct,
        _n: usize,
        _state: &mut LayerState,
    ) -> std::result::Result<(), ModelError> {
        if self.mode == PassMode::Replay {
            return Ok(());
        }
        let r = match self.layers[l].mixer {
            DMixer::Attn(_) => self.attention(l, *x, *xn),
            DMixer::Gdn(_) => self.gdn(l, *x, *xn),
        };
        self.guard(r)
    }

    fn moe(
        &mut self,
        _m: &Transformer,
        l: usize,
        x: &mut DAct,
        xn: &DAct,
        _n: usize,
        experts: &mut dyn ExpertSource,
        routes: &mut Vec<Route>,
        times: &mut MoeTimes,
    ) -> std::result::Result<(), ModelError> {
        let last = l + 1 == self.layers.len();
        match self.mode {
            // The graph's router kernels leave the ids for the counters.
            PassMode::Replay => {
                self.routes_pending = true;
                self.routes_n = 1;
            }
            _ => {
                let r = self.flush_residual();
                self.guard(r)?;
                let r = self.moe(l, *x, *xn, experts, routes, times);
                if let Err(e) = self.guard(r)? {
                    self.abort_capture();
                    return Err(ModelError::Store(e));
                }
                if last && self.mode == PassMode::Capture {
                    let r = self.finish_capture();
                    self.guard(r)?;
                }
            }
        }
        if last {
            self.mode = PassMode::Plain;
            self.pass_out = Some(*x);
            self.pos += self.pass_n;
            self.stats.tokens += self.pass_n as u64;
        }
        Ok(())
    }

    fn head(
        &mut self,
        _m: &Transformer,
        xn: &DAct,
        n: usize,
        rows: usize,
    ) -> std::result::Result<Vec<f32>, ModelError> {
        if rows > n || n > PASS_TOKENS {
            return Err(ModelError::State(format!(
                "logits of {rows} rows of a {n}-row activation"
            )));
        }
        let xn_p = self.act(*xn).ptr + ((n - rows) * self.hidden * 4) as u64;
        if self.s_vocab.len_f32() < rows * self.vocab {
            self.s_vocab = self.gpu.alloc(rows * self.vocab * 4).map_err(err)?;
        }
        self.gpu
            .matvec(&self.lm_head.desc, xn_p, self.s_vocab.ptr, rows)
            .map_err(err)?;
        if rows > 1 {
            let logits = self
                .gpu
                .read_f32(&self.s_vocab, 0, rows * self.vocab)
                .map_err(err)?;
            self.collect_device_routes().map_err(err)?;
            return Ok(logits);
        }
        // One row: through pinned memory, one synchronisation per
        // generated token.
        self.read_logits_row().map_err(err)
    }

    fn tail(
        &mut self,
        _m: &Transformer,
        x: &DAct,
        n: usize,
        rows: usize,
    ) -> std::result::Result<DAct, ModelError> {
        if rows > n || n > PASS_TOKENS {
            return Err(ModelError::State(format!(
                "the last {rows} rows of a {n}-row activation"
            )));
        }
        let r = self.flush_residual();
        self.guard(r)?;
        let g = &self.gpu;
        let row = (self.hidden * 4) as u64;
        let (src, dst) = (
            self.act(*x).ptr + (n - rows) as u64 * row,
            self.act(DAct::T).ptr,
        );
        g.ctx.bind_to_thread().map_err(|e| err(e.into()))?;
        // SAFETY: both buffers hold PASS_TOKENS rows of `hidden` f32 and
        // rows <= n <= PASS_TOKENS (checked above).
        unsafe {
            result::memcpy_dtod_async(dst, src, rows * self.hidden * 4, g.stream.cu_stream())
        }
        .map_err(|e| err(e.into()))?;
        Ok(DAct::T)
    }
}
