//! Memory planning: the predicted footprint of a run, the expert slots a
//! memory budget affords, whether expert reads bypass the page cache, and
//! the growth a prefill would add (the memory guard's input).

use slipstream_format::SlipModel;
use slipstream_models::ModelState;

use crate::{guard, Engine, EngineError, GrowthPrediction, StoreChoice};

pub use slipstream_core::size::parse_size;

/// Predicted peak footprint of a streaming run, in bytes, by part.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FootprintPrediction {
    /// Dense weights (mapped, all pages touched).
    pub dense: u64,
    /// Expert slots, all layers.
    pub slots: u64,
    /// Scratch buffers for streamed misses.
    pub scratch: u64,
    /// KV cache and linear-attention state at `context` tokens.
    pub state: u64,
    /// Activations of one prefill chunk (rough upper bound).
    pub activations: u64,
    /// Process baseline: code, allocator, tokenizer, thread stacks.
    pub baseline: u64,
}

impl FootprintPrediction {
    pub fn total(&self) -> u64 {
        self.dense + self.slots + self.scratch + self.state + self.activations + self.baseline
    }
}

/// Predicts the footprint of a run with `slots` expert slots per layer, a
/// context of `context` tokens and prefill chunks of `chunk` tokens.
pub fn predict_footprint(
    file: &SlipModel,
    slots: usize,
    context: usize,
    chunk: usize,
) -> FootprintPrediction {
    let m = &file.manifest;
    let c = &m.config;
    let stride = m.experts.record_stride;
    // Slots are kept for every layer of the pool, MTP layers included.
    let layers = m.experts.num_layers as u64;
    let mut state = 0u64;
    for kind in &c.layer_types {
        state += match kind {
            slipstream_core::config::LayerKind::FullAttention => {
                // f32 K and V per token.
                (2 * c.num_key_value_heads * c.head_dim * 4 * context) as u64
            }
            slipstream_core::config::LayerKind::LinearAttention => {
                ((c.linear_conv_kernel - 1) * c.linear_conv_dim() * 4
                    + c.linear_num_value_heads
                        * c.linear_key_head_dim
                        * c.linear_value_head_dim
                        * 4) as u64
            }
        };
    }
    let tokens = chunk.min(context.max(1)) as u64;
    // Widest per-token activations: qkv/z projections, router logits, logits.
    let width = (c.hidden_size * 8)
        .max(c.linear_conv_dim() * 2)
        .max(c.num_attention_heads * c.head_dim * 3) as u64;
    let activations = tokens * width * 4 + c.vocab_size as u64 * 4 * 2;
    FootprintPrediction {
        dense: m.dense_file_bytes,
        slots: layers * slots.min(c.num_experts) as u64 * stride,
        scratch: 8 * stride,
        state,
        activations,
        baseline: 24 << 20,
    }
}

/// The outcome of `--direct-io auto` (or an explicit choice), with the
/// reason in words for the run's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirectIoChoice {
    pub direct: bool,
    pub reason: String,
}

/// Decides whether expert reads use O_DIRECT.
///
/// Buffered reads leave each read expert in the page cache, a free second
/// cache level below the slots, but only while memory has room for it: when
/// every expert has a slot the copy is pure duplication, and when the
/// memory left beside the predicted footprint (dense weights, slots, state
/// at `context` tokens, buffers) cannot hold half of the expert file, the
/// cache turns over without hits and squeezes the mapped dense weights out
/// (measured on the 35B model: 256 slots buffered prefilled 25-40 % slower
/// than 64 slots; at an 8 GB cap direct I/O decoded 3.26 tok/s against
/// buffered 2.42). `memory` is the smaller of physical memory and the cgroup
/// limit (`None`: unknown, keep buffered).
pub fn resolve_direct_io(
    mode: slipstream_store::DirectIo,
    file: &SlipModel,
    slots: usize,
    context: usize,
    chunk: usize,
    memory: Option<u64>,
) -> DirectIoChoice {
    use slipstream_store::DirectIo;
    let choice = |direct: bool, reason: String| DirectIoChoice { direct, reason };
    match mode {
        DirectIo::On => return choice(true, "--direct-io on".into()),
        DirectIo::Off => return choice(false, "--direct-io off".into()),
        DirectIo::Auto => {}
    }
    let m = &file.manifest;
    let experts = m.config.num_experts;
    if slots >= experts {
        return choice(
            true,
            format!("auto: all {experts} experts of a layer have slots, a page-cache copy would only duplicate them"),
        );
    }
    let Some(memory) = memory else {
        return choice(false, "auto: memory size unknown, buffered".into());
    };
    let pool = m.experts.record_stride * (m.experts.num_layers * experts) as u64;
    let footprint = predict_footprint(file, slots, context, chunk).total();
    let room = memory.saturating_sub(footprint);
    let gb = |b: u64| b as f64 / 1e9;
    if room < pool / 2 {
        choice(
            true,
            format!(
                "auto: {:.2} GB of memory beside the predicted {:.2} GB footprint cannot cache half of the {:.2} GB expert file",
                gb(room),
                gb(footprint),
                gb(pool)
            ),
        )
    } else {
        choice(
            false,
            format!(
                "auto: the page cache ({:.2} GB beside the predicted {:.2} GB footprint) caches experts below the slots",
                gb(room),
                gb(footprint)
            ),
        )
    }
}

/// [`resolve_direct_io`] against this machine: the decision sees the
/// smaller of [`available_memory`] and `budget` (a memory budget counts the
/// page cache too), and `auto` falls back to buffered reads where the
/// filesystem under the expert file refuses O_DIRECT.
pub fn settle_direct_io(
    mode: slipstream_store::DirectIo,
    file: &SlipModel,
    slots: usize,
    context: usize,
    chunk: usize,
    budget: Option<u64>,
) -> DirectIoChoice {
    let memory = match (available_memory(), budget) {
        (Some(m), Some(b)) => Some(m.min(b)),
        (m, b) => m.or(b),
    };
    let mut choice = resolve_direct_io(mode, file, slots, context, chunk, memory);
    if choice.direct
        && mode == slipstream_store::DirectIo::Auto
        && !slipstream_store::supports_direct_io(file.experts_path())
    {
        choice.direct = false;
        choice.reason = format!(
            "{}; but this filesystem refuses O_DIRECT, so buffered",
            choice.reason
        );
    }
    choice
}

/// VRAM expert slots per layer that `budget` bytes of VRAM hold: the budget
/// split evenly over the layers, in whole expert records, at least one and
/// at most every expert.
pub fn vram_slots_for_budget(file: &SlipModel, budget: u64) -> usize {
    let c = &file.manifest.config;
    let record = file.manifest.experts.record_bytes.max(1);
    let per_layer = budget / (c.num_layers().max(1) as u64);
    ((per_layer / record) as usize).clamp(1, c.num_experts.max(1))
}

/// The memory a run may use: the smaller of physical memory and the cgroup
/// limit, `None` when neither is known.
pub fn available_memory() -> Option<u64> {
    match (guard::physical_memory_bytes(), guard::cgroup_limit_bytes()) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The most slots per layer whose predicted footprint fits `budget`.
pub fn slots_for_budget(
    file: &SlipModel,
    budget: u64,
    context: usize,
    chunk: usize,
) -> Result<usize, String> {
    let fixed = predict_footprint(file, 0, context, chunk);
    let per_slot = file.manifest.experts.record_stride * file.manifest.experts.num_layers as u64;
    let room = budget.saturating_sub(fixed.total());
    let slots = (room / per_slot.max(1)) as usize;
    if slots == 0 {
        return Err(format!(
            "a memory budget of {:.2} GB leaves no room for expert slots: dense weights, state and buffers need {:.2} GB and one slot per layer {:.2} GB",
            budget as f64 / 1e9,
            fixed.total() as f64 / 1e9,
            per_slot as f64 / 1e9
        ));
    }
    Ok(slots.min(file.manifest.config.num_experts))
}

impl Engine {
    /// Predicted footprint growth of prefilling `tokens` more tokens into
    /// `state` (see [`guard`] for what is counted).
    pub fn predict_prefill_growth(
        &self,
        state: &ModelState,
        tokens: usize,
        keep_all_logits: bool,
    ) -> GrowthPrediction {
        use slipstream_models::state::LayerState;
        let c = &self.model.config;
        let mut st = 0u64;
        for l in &state.layers {
            match l {
                LayerState::Attn(a) => {
                    let need = (a.len() + tokens) * a.kv_dim;
                    let cap = a.k.capacity();
                    if need > cap {
                        // Vec growth: a new buffer of max(2*cap, need) while
                        // the old one is still held, for K and for V.
                        st += 2 * 4 * need.max(2 * cap) as u64;
                    }
                }
                LayerState::Linear(s) if state.tokens.is_empty() => {
                    st += 4 * (s.conv.len() + s.recurrent.len()) as u64;
                }
                LayerState::Linear(_) => {}
            }
        }
        let chunk = self.config.prefill_chunk.max(1).min(tokens) as u64;
        let width = (c.hidden_size * (c.num_experts_per_tok + 8))
            .max(c.linear_conv_dim() * 2)
            .max(c.num_attention_heads * c.head_dim * 3)
            + c.moe_intermediate_size
                .max(c.shared_expert_intermediate_size)
                * 2;
        let mut act = chunk * width as u64 * 4 + c.vocab_size as u64 * 4 * 2;
        if keep_all_logits {
            act += tokens as u64 * c.vocab_size as u64 * 4 * 2;
        }
        GrowthPrediction {
            state: st,
            activations: act,
            unfilled_slots: self.store.inner.unfilled_slot_bytes(),
            dense_untouched: self.dense_untouched_bytes(),
        }
    }

    /// Dense weight bytes not yet in this process's resident set: the
    /// mapping's `Rss` where `/proc/self/smaps` tells, else all of them until
    /// a forward pass has run.
    fn dense_untouched_bytes(&self) -> u64 {
        let (addr, len) = self.file.dense_mapping();
        match guard::mapping_rss_bytes(addr) {
            Some(rss) if len > 0 => (len as u64).saturating_sub(rss),
            _ if self.dense_touched => 0,
            _ => self.file.manifest.dense_file_bytes,
        }
    }

    /// The memory guard: refuses to prefill `remaining` tokens (the next
    /// chunk being `chunk_tokens` of them) when footprint + predicted growth
    /// exceeds the limit.
    pub(crate) fn guard_chunk(
        &self,
        state: &ModelState,
        remaining: usize,
        chunk_tokens: usize,
        total: usize,
        keep_all: bool,
    ) -> Result<(), EngineError> {
        let Some(limit) = self.memory_limit else {
            return Ok(());
        };
        let Some(footprint) = guard::current_rss_bytes() else {
            return Ok(());
        };
        let growth = self.predict_prefill_growth(state, remaining, keep_all);
        if footprint.saturating_add(growth.total()) > limit {
            let msg = guard::refusal(
                chunk_tokens,
                total - remaining,
                total,
                footprint,
                &growth,
                limit,
            );
            tracing::debug!("{msg}");
            return Err(EngineError::Memory(msg));
        }
        Ok(())
    }

    /// Predicted peak footprint of this engine at `context` tokens.
    pub fn predicted_footprint(&self, context: usize) -> FootprintPrediction {
        let slots = match &self.config.store {
            StoreChoice::Resident => self.model.config.num_experts,
            StoreChoice::Streaming(sc) => sc.slots,
        };
        predict_footprint(&self.file, slots, context, self.config.prefill_chunk)
    }
}
