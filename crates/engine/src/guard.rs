//! The memory guard: before each prefill chunk the engine reads the process
//! footprint and refuses the chunk when the footprint plus the predicted
//! growth would exceed the limit, so a prompt the machine cannot hold is a
//! clear error instead of an OOM kill.
//!
//! The prediction ([`GrowthPrediction`]) counts:
//! - `state`: KV rows of every full-attention layer for all prompt tokens
//!   still to prefill in this call (so an over-long prompt is refused before
//!   its first chunk, not half way), plus the linear layers' fixed state when
//!   the state is still fresh (its pages are untouched until the first token);
//! - `activations`: buffers of one chunk (projections, routed-expert outputs
//!   per rank, logits rows), and the logits rows kept for every remaining
//!   token when all logits were asked for;
//! - `unfilled_slots`: expert slot memory not yet holding an expert, as the
//!   store reports it *now*. This is counted once: as slots fill, the
//!   footprint grows and this term shrinks by the same amount. (The reference
//!   extrapolated the first chunk's slot filling as a per-chunk rate and
//!   refused long prompts at large slot counts; footnote 11 of the seed.)
//! - `dense_untouched`: the part of the mapped dense weights not yet in this
//!   process's resident set (`Rss` of the mapping in `/proc/self/smaps`;
//!   opening a model verifies every dense tensor through the mapping, so this
//!   is usually near zero; counting the whole file again refused 80 slots of
//!   the 35B model under an 8 GiB cap that fit).
//!
//! The footprint is `VmRSS` from `/proc/self/status`; the limit is
//! [`crate::EngineConfig::memory_limit`] (the `slipstream` command passes 90 %
//! of the smaller of `MemTotal` and the cgroup limit,
//! [`crate::MachineMemory::guard_limit`]). Where `/proc/self/status` does not
//! exist (not Linux) the guard is off.

/// Predicted growth of the footprint before a prefill chunk, by part.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct GrowthPrediction {
    pub state: u64,
    pub activations: u64,
    pub unfilled_slots: u64,
    pub dense_untouched: u64,
}

impl GrowthPrediction {
    pub fn total(&self) -> u64 {
        self.state + self.activations + self.unfilled_slots + self.dense_untouched
    }
}

fn status_kb(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// Bytes of the mapping that contains address `addr` that are in this
/// process's resident set (its `Rss` in `/proc/self/smaps`), `None` when
/// unknown.
pub fn mapping_rss_bytes(addr: usize) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in smaps.lines() {
        let head = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = head.split_once('-') {
            if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                inside = (a..b).contains(&addr);
                continue;
            }
        }
        if inside {
            if let Some(rest) = line.strip_prefix("Rss:") {
                let kb = rest.split_whitespace().next()?.parse::<u64>().ok()?;
                return Some(kb * 1024);
            }
        }
    }
    None
}

/// Resident set size of this process now (`VmRSS`), `None` when unknown.
pub fn current_rss_bytes() -> Option<u64> {
    status_kb("VmRSS:")
}

pub(crate) fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

/// The guard's refusal message.
pub(crate) fn refusal(
    chunk_tokens: usize,
    done: usize,
    total: usize,
    footprint: u64,
    growth: &GrowthPrediction,
    limit: u64,
) -> String {
    format!(
        "memory guard: refusing prefill chunk of {chunk_tokens} tokens (prompt tokens {}..{} of {total}): \
         footprint {:.3} GB + predicted growth {:.3} GB (KV/state {:.3}, activations {:.3}, unfilled expert slots {:.3}, untouched dense weights {:.3}) \
         exceeds the memory limit of {:.3} GB; raise --memory-limit, use fewer expert slots or a smaller --prefill-chunk, or shorten the prompt",
        done,
        done + chunk_tokens,
        gb(footprint),
        gb(growth.total()),
        gb(growth.state),
        gb(growth.activations),
        gb(growth.unfilled_slots),
        gb(growth.dense_untouched),
        gb(limit)
    )
}
