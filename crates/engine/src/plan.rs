//! Memory planning: the predicted footprint of a run, the expert slots a
//! memory budget affords, whether expert reads bypass the page cache, and
//! the growth a prefill would add (the memory guard's input).

use slipstream_format::SlipModel;
use slipstream_models::ModelState;

use crate::guard::{self, gb};
use crate::{Engine, EngineError, GrowthPrediction, StoreChoice};

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
        [
            self.slots,
            self.scratch,
            self.state,
            self.activations,
            self.baseline,
        ]
        .into_iter()
        .fold(self.dense, u64::saturating_add)
    }
}

/// The sizes of a model that memory planning needs, in bytes, read once
/// from a manifest ([`ModelSizes::of`]) or written down for a model that
/// does not exist (the planning tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelSizes {
    /// `dense.bin`: every dense tensor, mapped.
    pub dense_bytes: u64,
    /// One expert record as stored (page-aligned stride): one slot.
    pub slot_bytes: u64,
    /// Layers of the expert pool (slots are kept for each, MTP included).
    pub pool_layers: usize,
    /// Routed experts per layer.
    pub experts: usize,
    /// Linear-attention state (conv window and recurrent matrix), all layers.
    pub state_fixed: u64,
    /// f32 K and V of one token, all full-attention layers.
    pub state_per_token: u64,
    /// Widest per-token activations of a prefill chunk.
    pub activations_per_token: u64,
    /// Two f32 logits rows.
    pub logits_bytes: u64,
}

/// Process baseline beside the model: code, allocator, tokenizer, stacks.
const BASELINE_BYTES: u64 = 24 << 20;
/// Expert records of scratch for streamed misses.
const SCRATCH_RECORDS: u64 = 8;

impl ModelSizes {
    /// The sizes of the model `file`.
    pub fn of(file: &SlipModel) -> Self {
        use slipstream_core::config::LayerKind;
        let m = &file.manifest;
        let c = &m.config;
        let mut state_fixed = 0u64;
        let mut state_per_token = 0u64;
        for kind in &c.layer_types {
            match kind {
                LayerKind::FullAttention => {
                    state_per_token += (2 * c.num_key_value_heads * c.head_dim * 4) as u64;
                }
                LayerKind::LinearAttention => {
                    state_fixed +=
                        ((c.linear_conv_kernel.saturating_sub(1)) * c.linear_conv_dim() * 4
                            + c.linear_num_value_heads
                                * c.linear_key_head_dim
                                * c.linear_value_head_dim
                                * 4) as u64;
                }
            }
        }
        // Widest per-token activations: qkv/z projections, router logits.
        let width = (c.hidden_size * 8)
            .max(c.linear_conv_dim() * 2)
            .max(c.num_attention_heads * c.head_dim * 3) as u64;
        ModelSizes {
            dense_bytes: m.dense_file_bytes,
            slot_bytes: m.experts.record_stride,
            pool_layers: m.experts.num_layers,
            experts: c.num_experts,
            state_fixed,
            state_per_token,
            activations_per_token: width * 4,
            logits_bytes: c.vocab_size as u64 * 4 * 2,
        }
    }

    /// One slot in every layer of the pool.
    pub fn slot_bytes_all_layers(&self) -> u64 {
        self.slot_bytes.saturating_mul(self.pool_layers as u64)
    }

    /// The whole expert file.
    pub fn pool_bytes(&self) -> u64 {
        self.slot_bytes_all_layers()
            .saturating_mul(self.experts as u64)
    }

    /// Activations of a prefill chunk of `chunk` tokens (at most `context`).
    fn activation_bytes(&self, context: usize, chunk: usize) -> u64 {
        let tokens = chunk.min(context.max(1)) as u64;
        tokens
            .saturating_mul(self.activations_per_token)
            .saturating_add(self.logits_bytes)
    }

    /// The footprint of a run with `slots` expert slots per layer, a
    /// context of `context` tokens and prefill chunks of `chunk` tokens.
    pub fn footprint(&self, slots: usize, context: usize, chunk: usize) -> FootprintPrediction {
        FootprintPrediction {
            dense: self.dense_bytes,
            slots: self
                .slot_bytes_all_layers()
                .saturating_mul(slots.min(self.experts) as u64),
            scratch: SCRATCH_RECORDS * self.slot_bytes,
            state: self
                .state_fixed
                .saturating_add(self.state_per_token.saturating_mul(context as u64)),
            activations: self.activation_bytes(context, chunk),
            baseline: BASELINE_BYTES,
        }
    }

    /// The most slots per layer (at most every expert) whose predicted
    /// footprint fits `budget` bytes; an error when not even one does.
    pub fn slots_for_budget(
        &self,
        budget: u64,
        context: usize,
        chunk: usize,
    ) -> Result<usize, String> {
        let fixed = self.footprint(0, context, chunk);
        let per_slot = self.slot_bytes_all_layers();
        let room = budget.saturating_sub(fixed.total());
        let slots = (room / per_slot.max(1)) as usize;
        if slots == 0 {
            return Err(format!(
                "a memory budget of {} leaves no room for expert slots: dense weights, state and buffers need {} and one slot per layer {}",
                bytes(budget),
                bytes(fixed.total()),
                bytes(per_slot)
            ));
        }
        Ok(slots.min(self.experts))
    }

    /// Whether expert reads use O_DIRECT (see [`resolve_direct_io`]).
    pub fn direct_io(
        &self,
        mode: slipstream_store::DirectIo,
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
        let experts = self.experts;
        if slots >= experts {
            return choice(
                true,
                format!("auto: all {experts} experts of a layer have slots, a page-cache copy would only duplicate them"),
            );
        }
        let Some(memory) = memory else {
            return choice(false, "auto: memory size unknown, buffered".into());
        };
        let pool = self.pool_bytes();
        let footprint = self.footprint(slots, context, chunk).total();
        let room = memory.saturating_sub(footprint);
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
}

/// Predicts the footprint of a run with `slots` expert slots per layer, a
/// context of `context` tokens and prefill chunks of `chunk` tokens.
pub fn predict_footprint(
    file: &SlipModel,
    slots: usize,
    context: usize,
    chunk: usize,
) -> FootprintPrediction {
    ModelSizes::of(file).footprint(slots, context, chunk)
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
/// buffered 2.42). `memory` is the memory the run may use
/// ([`MachineMemory::usable`], `None`: unknown, keep buffered).
pub fn resolve_direct_io(
    mode: slipstream_store::DirectIo,
    file: &SlipModel,
    slots: usize,
    context: usize,
    chunk: usize,
    memory: Option<u64>,
) -> DirectIoChoice {
    ModelSizes::of(file).direct_io(mode, slots, context, chunk, memory)
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

/// The most slots per layer whose predicted footprint fits `budget`.
pub fn slots_for_budget(
    file: &SlipModel,
    budget: u64,
    context: usize,
    chunk: usize,
) -> Result<usize, String> {
    ModelSizes::of(file).slots_for_budget(budget, context, chunk)
}

/// The memory figures of the machine a run plans on, in bytes, as the
/// caller read them (the `slipstream` command reads `/proc/meminfo` and the
/// cgroup files; this crate reads neither). `None`: not known.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MachineMemory {
    /// Physical memory (`MemTotal`).
    pub total: Option<u64>,
    /// Memory available without swapping (`MemAvailable`: free memory plus
    /// the reclaimable page cache).
    pub available: Option<u64>,
    /// The tightest cgroup memory limit over this process (v1
    /// `memory.limit_in_bytes`, v2 `memory.max`), `None` when unlimited.
    pub cgroup_limit: Option<u64>,
    /// The figures were given (`--assume-memory`), not detected.
    pub assumed: bool,
}

impl MachineMemory {
    /// As if the machine had `bytes` of memory, all available.
    pub fn assume(bytes: u64) -> Self {
        MachineMemory {
            total: Some(bytes),
            available: Some(bytes),
            cgroup_limit: None,
            assumed: true,
        }
    }

    /// The memory a run may plan on: the smaller of the available (else
    /// total) physical memory and the cgroup limit.
    pub fn usable(&self) -> Option<u64> {
        min_known(self.available.or(self.total), self.cgroup_limit)
    }

    /// The memory guard's default limit: 90 % of the smaller of physical
    /// memory and the cgroup limit.
    pub fn guard_limit(&self) -> Option<u64> {
        min_known(self.total, self.cgroup_limit).map(|m| m / 10 * 9)
    }

    /// What was detected, in words.
    pub fn describe(&self) -> String {
        let known = |b: Option<u64>| b.map_or("unknown".to_string(), bytes);
        if self.assumed {
            return format!("assumed {} (--assume-memory)", known(self.usable()));
        }
        format!(
            "detected {} available of {} physical, cgroup limit {}",
            known(self.available),
            known(self.total),
            self.cgroup_limit.map_or("none".to_string(), bytes)
        )
    }
}

/// `b` bytes in words: GB (10^9) from 1 GB, MB (10^6) from 1 MB, else kB.
fn bytes(b: u64) -> String {
    if b >= 1_000_000_000 {
        format!("{:.2} GB", gb(b))
    } else if b >= 1_000_000 {
        format!("{:.1} MB", b as f64 / 1e6)
    } else {
        format!("{:.1} kB", b as f64 / 1e3)
    }
}

fn min_known(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The share of the usable memory automatic sizing leaves free (other
/// processes, allocator slack, the page cache of the dense weights'
/// neighbours), in percent.
pub const SAFETY_MARGIN_PERCENT: u64 = 10;
/// Expert slots per layer when memory is unknown and nothing was asked.
pub const DEFAULT_SLOTS: usize = 64;
/// Prompt tokens per prefill chunk unless memory is short.
pub const DEFAULT_PREFILL_CHUNK: usize = 4096;
/// The smallest chunk automatic sizing picks (smaller ones read the
/// routed experts of every layer more often than they save).
pub const MIN_AUTO_PREFILL_CHUNK: usize = 256;
/// Automatic sizing keeps a chunk's activations within this fraction
/// (1/N) of the planning budget.
const CHUNK_SHARE: u64 = 16;

/// How the expert slots were asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotsRequest {
    /// Every expert read at open (`--resident`).
    Resident,
    /// This many per layer (`--expert-cache-slots`).
    Slots(usize),
    /// What fits this many bytes (`--memory-budget`).
    Budget(u64),
    /// What fits the machine's memory (no flag).
    Auto,
}

/// What a run asks of memory planning: explicit choices win, the rest
/// follows the memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryRequest {
    pub slots: SlotsRequest,
    pub direct_io: slipstream_store::DirectIo,
    /// `--prefill-chunk`; `None`: chosen here.
    pub prefill_chunk: Option<usize>,
    /// Most positions of a sequence (prompt plus reply).
    pub context: usize,
    /// Whether the filesystem under the expert file takes O_DIRECT
    /// (`slipstream_store::supports_direct_io`); where it does not, `auto`
    /// reads buffered.
    pub o_direct_supported: bool,
}

/// The outcome of [`plan_memory`].
#[derive(Debug, Clone)]
pub struct MemoryPlan {
    /// Every expert read at open (`--resident`); `slots` is then every expert.
    pub resident: bool,
    /// Expert slots per layer.
    pub slots: usize,
    pub direct_io: DirectIoChoice,
    pub prefill_chunk: usize,
    /// The predicted footprint of the plan at the full context.
    pub footprint: FootprintPrediction,
    /// One line: what was detected, what was chosen and why.
    pub summary: String,
}

/// Sizes a run of the model `sizes` on a machine with `memory`: the expert
/// slots per layer, direct I/O and the prefill chunk, each from its flag
/// when `request` has one, else from the memory. Planning budget (no slot
/// flag): the usable memory less [`SAFETY_MARGIN_PERCENT`]. A budget that
/// cannot hold the dense weights, the state and one slot per layer is an
/// error naming the figures.
pub fn plan_memory(
    sizes: &ModelSizes,
    memory: &MachineMemory,
    request: &MemoryRequest,
) -> Result<MemoryPlan, String> {
    let context = request.context.max(1);
    let usable = memory.usable();
    let margin = usable.map(|u| u / 100 * SAFETY_MARGIN_PERCENT);
    let planning = usable.zip(margin).map(|(u, m)| u - m);

    let (prefill_chunk, chunk_why) = match request.prefill_chunk {
        Some(0) => return Err("--prefill-chunk must be at least 1".into()),
        Some(n) => (n, "--prefill-chunk".to_string()),
        None => {
            let mut chunk = DEFAULT_PREFILL_CHUNK;
            if let Some(p) = planning {
                while chunk > MIN_AUTO_PREFILL_CHUNK
                    && sizes.activation_bytes(context, chunk) > p / CHUNK_SHARE
                {
                    chunk /= 2;
                }
            }
            let why = if chunk == DEFAULT_PREFILL_CHUNK {
                "default".to_string()
            } else {
                format!("activations within 1/{CHUNK_SHARE} of the budget")
            };
            (chunk, why)
        }
    };

    let experts = sizes.experts.max(1);
    let (resident, slots, slots_why) = match request.slots {
        SlotsRequest::Resident => (true, experts, "--resident".to_string()),
        SlotsRequest::Slots(0) => return Err("--expert-cache-slots must be at least 1".into()),
        SlotsRequest::Slots(n) => (false, n, "--expert-cache-slots".to_string()),
        SlotsRequest::Budget(b) => {
            let n = sizes.slots_for_budget(b, context, prefill_chunk)?;
            (false, n, format!("what fits --memory-budget {}", bytes(b)))
        }
        SlotsRequest::Auto => match planning {
            None => (
                false,
                DEFAULT_SLOTS.min(experts),
                "memory unknown: the default".to_string(),
            ),
            Some(0) => {
                return Err(format!(
                    "memory planning: 0 bytes of usable memory ({}); pass --expert-cache-slots N or --memory-budget SIZE to size the run by hand",
                    memory.describe()
                ))
            }
            Some(p) => {
                let n = sizes.slots_for_budget(p, context, prefill_chunk).map_err(|e| {
                    format!(
                        "memory planning ({}, less a {SAFETY_MARGIN_PERCENT} % margin): {e}; pass --expert-cache-slots N to run anyway",
                        memory.describe()
                    )
                })?;
                let why = if n >= experts {
                    "every expert fits".to_string()
                } else {
                    "what fits".to_string()
                };
                (false, n, why)
            }
        },
    };
    // A --memory-budget counts the page cache too.
    let direct_memory = match request.slots {
        SlotsRequest::Budget(b) => min_known(usable, Some(b)),
        _ => usable,
    };
    let mut direct_io = sizes.direct_io(
        request.direct_io,
        slots,
        context,
        prefill_chunk,
        direct_memory,
    );
    if direct_io.direct
        && request.direct_io == slipstream_store::DirectIo::Auto
        && !request.o_direct_supported
    {
        direct_io.direct = false;
        direct_io.reason = format!(
            "{}; but this filesystem refuses O_DIRECT, so buffered",
            direct_io.reason
        );
    }
    let footprint = sizes.footprint(slots, context, prefill_chunk);
    let store = if resident {
        format!("all {experts} experts resident ({slots_why})")
    } else {
        format!(
            "{slots} of {experts} expert slots per layer ({slots_why}), direct I/O {} ({})",
            if direct_io.direct { "on" } else { "off" },
            direct_io.reason
        )
    };
    let summary = format!(
        "[memory] {}{}; model: dense {}, KV/state {} at {context} tokens, {} per expert slot x {} layers; chose {store}, prompt chunk {prefill_chunk} ({chunk_why}); predicted footprint {}",
        memory.describe(),
        match planning {
            Some(p) if !matches!(request.slots, SlotsRequest::Budget(_)) => format!(
                " -> planning on {} ({SAFETY_MARGIN_PERCENT} % kept free)",
                bytes(p)
            ),
            _ => String::new(),
        },
        bytes(footprint.dense),
        bytes(footprint.state),
        bytes(sizes.slot_bytes),
        sizes.pool_layers,
        bytes(footprint.total()),
    );
    Ok(MemoryPlan {
        resident,
        slots,
        direct_io,
        prefill_chunk,
        footprint,
        summary,
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use slipstream_store::DirectIo;

    const GIB: u64 = 1 << 30;

    /// Qwen3-Next-80B-A3B at 4 bits, roughly: 48 layers of 512 experts of
    /// 1.77 MB (a 43.5 GB expert file), 3 GB of dense weights, 12
    /// full-attention layers of 2 KV heads of 256.
    fn big() -> ModelSizes {
        ModelSizes {
            dense_bytes: 3_000_000_000,
            slot_bytes: 1_769_472,
            pool_layers: 48,
            experts: 512,
            state_fixed: 36 * (3 * 8192 * 4 + 32 * 128 * 128 * 4),
            state_per_token: 12 * 2 * 2 * 256 * 4,
            activations_per_token: 2048 * 8 * 4,
            logits_bytes: 151_936 * 8,
        }
    }

    /// A model far smaller than memory: 1 GB of experts.
    fn small() -> ModelSizes {
        ModelSizes {
            dense_bytes: 200_000_000,
            slot_bytes: 131_072,
            pool_layers: 32,
            experts: 256,
            state_fixed: 1 << 20,
            state_per_token: 16_384,
            activations_per_token: 32_768,
            logits_bytes: 1 << 20,
        }
    }

    fn machine(total: u64, available: u64, cgroup: Option<u64>) -> MachineMemory {
        MachineMemory {
            total: Some(total),
            available: Some(available),
            cgroup_limit: cgroup,
            assumed: false,
        }
    }

    fn auto(context: usize) -> MemoryRequest {
        MemoryRequest {
            slots: SlotsRequest::Auto,
            direct_io: DirectIo::Auto,
            prefill_chunk: None,
            context,
            o_direct_supported: true,
        }
    }

    #[test]
    fn a_cgroup_cap_below_physical_memory_sizes_the_run() {
        let m = big();
        let open = plan_memory(&m, &machine(24 * GIB, 22 * GIB, None), &auto(8192)).unwrap();
        let capped =
            plan_memory(&m, &machine(24 * GIB, 22 * GIB, Some(8 * GIB)), &auto(8192)).unwrap();
        // The planning budget is the cap less the margin; the slots are the
        // most whose footprint fits it.
        let budget = 8 * GIB - 8 * GIB / 100 * SAFETY_MARGIN_PERCENT;
        assert_eq!(
            capped.slots,
            m.slots_for_budget(budget, 8192, capped.prefill_chunk)
                .unwrap()
        );
        assert!(capped.footprint.total() <= budget);
        assert!(
            m.footprint(capped.slots + 1, 8192, capped.prefill_chunk)
                .total()
                > budget
        );
        assert!(capped.slots < open.slots, "{} {}", capped.slots, open.slots);
        assert!(capped.direct_io.direct, "{:?}", capped.direct_io);
        assert!(
            capped.summary.contains("cgroup limit 8.59 GB")
                && capped.summary.contains("of 512 expert slots per layer"),
            "{}",
            capped.summary
        );
        // MemAvailable below the cap wins the other way round.
        let busy =
            plan_memory(&m, &machine(24 * GIB, 6 * GIB, Some(8 * GIB)), &auto(8192)).unwrap();
        assert!(busy.slots < capped.slots);
    }

    #[test]
    fn a_model_smaller_than_memory_gets_a_slot_for_every_expert() {
        let m = small();
        let p = plan_memory(&m, &machine(24 * GIB, 20 * GIB, None), &auto(32768)).unwrap();
        assert_eq!(p.slots, 256);
        assert!(!p.resident);
        // Every expert in a slot: a page-cache copy would only duplicate it.
        assert!(p.direct_io.direct, "{:?}", p.direct_io);
        assert_eq!(p.prefill_chunk, DEFAULT_PREFILL_CHUNK);
        assert!(p.summary.contains("every expert fits"), "{}", p.summary);
    }

    #[test]
    fn a_model_far_larger_than_memory_gets_few_slots_and_direct_io() {
        let m = big();
        let p = plan_memory(&m, &machine(16 * GIB, 15 * GIB, None), &auto(36864)).unwrap();
        assert!(p.slots >= 1 && p.slots < m.experts / 4, "{}", p.slots);
        assert!(p.direct_io.direct, "{:?}", p.direct_io);
        assert!(p.direct_io.reason.contains("cannot cache half"));
        // A filesystem without O_DIRECT keeps buffered reads, and says so.
        let no_direct = MemoryRequest {
            o_direct_supported: false,
            ..auto(36864)
        };
        let p = plan_memory(&m, &machine(16 * GIB, 15 * GIB, None), &no_direct).unwrap();
        assert!(!p.direct_io.direct && p.direct_io.reason.contains("refuses O_DIRECT"));
    }

    #[test]
    fn absurd_memory_is_a_clear_error_not_a_panic() {
        let m = big();
        let err = plan_memory(&m, &machine(0, 0, None), &auto(4096)).unwrap_err();
        assert!(err.contains("0 bytes of usable memory"), "{err}");
        assert!(err.contains("--expert-cache-slots"), "{err}");
        let err = plan_memory(&m, &machine(16 * GIB, 16 * GIB, Some(0)), &auto(4096)).unwrap_err();
        assert!(err.contains("0 bytes"), "{err}");
        // Less than the dense weights: no slot fits, the figures are named.
        let err = plan_memory(&m, &MachineMemory::assume(2 * GIB), &auto(4096)).unwrap_err();
        assert!(
            err.contains("leaves no room for expert slots") && err.contains("--assume-memory"),
            "{err}"
        );
        // Endless memory or an endless context neither overflow nor panic.
        let p = plan_memory(&small(), &MachineMemory::assume(u64::MAX), &auto(4096))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(p.slots, 256);
        let err = plan_memory(
            &small(),
            &MachineMemory::assume(u64::MAX),
            &auto(usize::MAX),
        )
        .unwrap_err();
        assert!(err.contains("leaves no room"), "{err}");
        let err = plan_memory(
            &m,
            &MachineMemory::assume(16 * GIB),
            &MemoryRequest {
                prefill_chunk: Some(0),
                ..auto(4096)
            },
        )
        .unwrap_err();
        assert!(err.contains("--prefill-chunk"), "{err}");
    }

    #[test]
    fn unknown_memory_keeps_the_old_defaults() {
        let p = plan_memory(&big(), &MachineMemory::default(), &auto(4096)).unwrap();
        assert_eq!(p.slots, DEFAULT_SLOTS);
        assert_eq!(p.prefill_chunk, DEFAULT_PREFILL_CHUNK);
        assert!(!p.direct_io.direct && p.direct_io.reason.contains("unknown"));
        assert!(p.summary.contains("memory unknown"), "{}", p.summary);
    }

    #[test]
    fn explicit_flags_win_over_memory() {
        let m = big();
        let tiny = MachineMemory::assume(4 * GIB);
        let p = plan_memory(
            &m,
            &tiny,
            &MemoryRequest {
                slots: SlotsRequest::Slots(300),
                direct_io: DirectIo::Off,
                prefill_chunk: Some(77),
                context: 4096,
                o_direct_supported: true,
            },
        )
        .unwrap();
        assert_eq!((p.slots, p.prefill_chunk), (300, 77));
        assert!(!p.direct_io.direct);
        assert!(
            p.summary.contains("(--expert-cache-slots)"),
            "{}",
            p.summary
        );
        // Explicit slots even where memory is unknown or reads as 0.
        let p = plan_memory(
            &m,
            &machine(0, 0, None),
            &MemoryRequest {
                slots: SlotsRequest::Slots(5),
                ..auto(4096)
            },
        )
        .unwrap();
        assert_eq!(p.slots, 5);
        let err = plan_memory(
            &m,
            &tiny,
            &MemoryRequest {
                slots: SlotsRequest::Slots(0),
                ..auto(4096)
            },
        )
        .unwrap_err();
        assert!(err.contains("at least 1"), "{err}");
        // A budget sizes the slots as given (no margin taken off).
        let budget = 10 * GIB;
        let p = plan_memory(
            &m,
            &machine(64 * GIB, 64 * GIB, None),
            &MemoryRequest {
                slots: SlotsRequest::Budget(budget),
                ..auto(4096)
            },
        )
        .unwrap();
        assert_eq!(
            p.slots,
            m.slots_for_budget(budget, 4096, p.prefill_chunk).unwrap()
        );
        let p = plan_memory(
            &m,
            &tiny,
            &MemoryRequest {
                slots: SlotsRequest::Resident,
                ..auto(4096)
            },
        )
        .unwrap();
        assert!(p.resident && p.slots == 512);
    }

    #[test]
    fn the_prompt_chunk_shrinks_only_where_memory_is_short() {
        let wide = ModelSizes {
            activations_per_token: 1 << 20,
            ..small()
        };
        let roomy = plan_memory(&wide, &MachineMemory::assume(256 * GIB), &auto(8192)).unwrap();
        assert_eq!(roomy.prefill_chunk, DEFAULT_PREFILL_CHUNK);
        // 4096 tokens of 1 MiB activations against a 2 GiB budget: halved
        // until within 1/16 of it (115 MiB: 64 tokens), floored at 256.
        let short = plan_memory(&wide, &MachineMemory::assume(2 * GIB), &auto(8192)).unwrap();
        assert_eq!(short.prefill_chunk, MIN_AUTO_PREFILL_CHUNK);
        let mid = plan_memory(&wide, &MachineMemory::assume(12 * GIB), &auto(8192)).unwrap();
        assert!(
            mid.prefill_chunk > MIN_AUTO_PREFILL_CHUNK && mid.prefill_chunk < DEFAULT_PREFILL_CHUNK,
            "{}",
            mid.prefill_chunk
        );
        assert!(mid.summary.contains("within 1/16"), "{}", mid.summary);
    }

    #[test]
    fn guard_limit_and_usable_memory() {
        let m = machine(24 * GIB, 20 * GIB, Some(8 * GIB));
        assert_eq!(m.usable(), Some(8 * GIB));
        assert_eq!(m.guard_limit(), Some(8 * GIB / 10 * 9));
        let m = machine(24 * GIB, 20 * GIB, None);
        assert_eq!(m.usable(), Some(20 * GIB));
        assert_eq!(m.guard_limit(), Some(24 * GIB / 10 * 9));
        let only_total = MachineMemory {
            total: Some(4 * GIB),
            ..Default::default()
        };
        assert_eq!(only_total.usable(), Some(4 * GIB));
        assert_eq!(MachineMemory::default().usable(), None);
        assert_eq!(MachineMemory::default().guard_limit(), None);
    }
}
