//! Replacement policies beyond the runtime's three ([`PolicyKind`]), for the
//! trace replayer (`slipstream replay`): ARC, LRFU, S3-FIFO, SIEVE,
//! W-TinyLFU, and Belady's offline optimum.
//!
//! All of them implement [`Policy`], so they run through the very
//! [`LayerCache::access`](crate::policy::LayerCache::access) the runtime
//! uses. Conventions shared by all:
//!
//! - Queue-based policies (ARC, S3-FIFO, SIEVE) treat one batch as one
//!   reference to each of its experts; frequency-based ones (LRFU,
//!   W-TinyLFU, like aging/lfu) count the tokens that requested an expert.
//!   In decode, both are the same.
//! - Ties are broken deterministically: within a queue by insertion order
//!   (insertions within a batch happen in ascending id order), otherwise by
//!   the lowest id.
//! - `victim` never returns a pinned expert (one of the current batch), and
//!   returns `None` when every resident expert is pinned.

mod arc;
mod belady;
mod lrfu;
mod s3fifo;
mod sieve;
mod tinylfu;

pub use arc::Arc;
pub use belady::Belady;
pub use lrfu::{Lrfu, LRFU_DEFAULT_LAMBDA};
pub use s3fifo::S3Fifo;
pub use sieve::Sieve;
pub use tinylfu::WTinyLfu;

use crate::policy::{Policy, PolicyKind};

/// Every policy name the replayer knows, in table order.
pub const POLICY_NAMES: [&str; 9] = [
    "aging",
    "lfu",
    "lru",
    "arc",
    "lrfu",
    "s3-fifo",
    "sieve",
    "w-tinylfu",
    "belady",
];

/// An online policy by name, for a layer of `num_experts` experts and
/// `slots` slots. `None` for unknown names and for `belady`, which needs the
/// future (see [`Belady::new`]).
pub fn build_online(name: &str, num_experts: usize, slots: usize) -> Option<Box<dyn Policy>> {
    Some(match name {
        "aging" => PolicyKind::Aging.build(num_experts),
        "lfu" => PolicyKind::Lfu.build(num_experts),
        "lru" => PolicyKind::Lru.build(num_experts),
        "arc" => Box::new(Arc::new(num_experts, slots)),
        "lrfu" => Box::new(Lrfu::new(num_experts, LRFU_DEFAULT_LAMBDA)),
        "s3-fifo" => Box::new(S3Fifo::new(num_experts, slots)),
        "sieve" => Box::new(Sieve::new(num_experts)),
        "w-tinylfu" => Box::new(WTinyLfu::new(num_experts, slots)),
        _ => return None,
    })
}

/// Several ordered lists over a small id space: each expert is in at most
/// one list; a list's order is the order of the stamps given at `push`
/// (oldest = least recently pushed). Lookups are linear scans, which is
/// cheap for at most a few hundred experts.
#[derive(Debug, Clone)]
pub(crate) struct Lists {
    list: Vec<u8>,
    stamp: Vec<u64>,
    len: Vec<usize>,
    clock: u64,
}

pub(crate) const NOWHERE: u8 = u8::MAX;

impl Lists {
    pub fn new(num_experts: usize, lists: usize) -> Self {
        Lists {
            list: vec![NOWHERE; num_experts],
            stamp: vec![0; num_experts],
            len: vec![0; lists],
            clock: 0,
        }
    }

    /// Which list `e` is in, `NOWHERE` if none.
    pub fn of(&self, e: u32) -> u8 {
        self.list[e as usize]
    }

    pub fn len(&self, l: u8) -> usize {
        self.len[l as usize]
    }

    /// Moves `e` to the newest end of list `l`.
    pub fn push(&mut self, e: u32, l: u8) {
        self.remove(e);
        self.clock += 1;
        self.list[e as usize] = l;
        self.stamp[e as usize] = self.clock;
        self.len[l as usize] += 1;
    }

    pub fn remove(&mut self, e: u32) {
        let old = self.list[e as usize];
        if old != NOWHERE {
            self.len[old as usize] -= 1;
            self.list[e as usize] = NOWHERE;
        }
    }

    /// The oldest member of list `l` for which `skip` is false.
    pub fn oldest(&self, l: u8, skip: &dyn Fn(u32) -> bool) -> Option<u32> {
        if self.len(l) == 0 {
            return None;
        }
        (0..self.list.len() as u32)
            .filter(|&e| self.list[e as usize] == l && !skip(e))
            .min_by_key(|&e| self.stamp[e as usize])
    }
}

#[cfg(test)]
pub(crate) mod testutil {
    use crate::policy::{LayerCache, Outcome, Policy};

    /// Runs single-token batches through a cache; returns per-batch
    /// outcomes' hit flags and the cache.
    pub fn run(
        policy: Box<dyn Policy>,
        experts: usize,
        slots: usize,
        batches: &[&[u32]],
    ) -> (LayerCache, Vec<Vec<bool>>) {
        let mut c = LayerCache::new(policy, experts, slots);
        let mut hits = Vec::new();
        for b in batches {
            let out = c.access(b, &vec![1; b.len()], 1);
            hits.push(
                out.iter()
                    .map(|o| matches!(o, Outcome::Hit { .. }))
                    .collect(),
            );
        }
        (c, hits)
    }

    /// Random batches (ascending, distinct) from a fixed-seed LCG.
    pub fn random_batches(seed: u64, experts: u32, per_batch: usize, n: usize) -> Vec<Vec<u32>> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                let mut ids: Vec<u32> = (0..per_batch)
                    .map(|_| {
                        s = s
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        // Skewed: square of a uniform favours low ids.
                        let u = (s >> 33) % 1024;
                        ((u * u * experts as u64) / (1024 * 1024)) as u32
                    })
                    .collect();
                ids.sort();
                ids.dedup();
                ids
            })
            .collect()
    }

    /// Checks the LayerCache invariants for a policy on random batches:
    /// capacity respected, hits exactly the resident experts, and (with
    /// `slots >= experts`) only cold misses.
    pub fn check_invariants(build: &dyn Fn(usize) -> Box<dyn Policy>) {
        for slots in [0, 1, 2, 3, 5, 8, 16] {
            let batches = random_batches(7 + slots as u64, 16, 4, 400);
            let mut c = LayerCache::new(build(slots), 16, slots);
            let mut seen = [false; 16];
            let mut cold = 0;
            for b in &batches {
                let before = c.resident();
                let out = c.access(b, &vec![1; b.len()], 1);
                for (id, o) in b.iter().zip(&out) {
                    assert_eq!(matches!(o, Outcome::Hit { .. }), before.contains(id));
                    if !seen[*id as usize] {
                        seen[*id as usize] = true;
                        cold += 1;
                    }
                }
                assert!(c.resident().len() <= slots);
                // Every expert of the batch that fits is resident afterwards
                // only if the policy admitted it; at least the hits stay.
                for (id, o) in b.iter().zip(&out) {
                    if matches!(o, Outcome::Hit { .. }) {
                        assert!(c.resident().contains(id));
                    }
                }
            }
            if slots >= 16 {
                assert_eq!(c.misses, cold, "slots {slots}: only cold misses");
            }
        }
    }
}
