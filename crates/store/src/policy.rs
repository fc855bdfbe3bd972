//! Replacement policies for one layer's expert slots, and the slot
//! bookkeeping they drive.
//!
//! The same code decides hits and misses in the runtime store and in the
//! trace replayer, which is why a replay reproduces the runtime's counters
//! exactly: [`LayerCache::access`] is a pure function of the request
//! sequence.

/// A replacement policy for the slots of one layer. All decisions must be
/// deterministic (ties broken by a fixed rule).
pub trait Policy: Send {
    fn name(&self) -> &'static str;
    /// A resident expert was requested by `count` tokens of the batch.
    fn on_hit(&mut self, expert: u32, count: u32);
    /// Whether a missed expert enters the cache, replacing `victim` if any.
    /// Policies with an admission filter may refuse (the expert is then
    /// streamed through a scratch buffer).
    fn admit(&mut self, _expert: u32, _count: u32, _victim: Option<u32>) -> bool {
        true
    }
    /// The resident expert to evict, never one for which `pinned` is true;
    /// `None` when every resident expert is pinned.
    fn victim(&mut self, pinned: &dyn Fn(u32) -> bool) -> Option<u32>;
    /// A missed expert was inserted (requested by `count` tokens).
    fn on_insert(&mut self, expert: u32, count: u32);
    /// A resident expert left the cache.
    fn on_evict(&mut self, expert: u32);
    /// A missed expert was streamed without being admitted.
    fn on_bypass(&mut self, _expert: u32, _count: u32) {}
    /// The batch is over; `tokens` tokens went through this layer.
    fn end_batch(&mut self, _tokens: u32) {}
}

/// The policies the runtime offers (`--expert-cache-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum PolicyKind {
    /// LFU whose counts halve every 32 tokens.
    #[default]
    Aging,
    /// LFU with counts kept for the life of the process.
    Lfu,
    /// Least recently used.
    Lru,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 3] = [PolicyKind::Aging, PolicyKind::Lfu, PolicyKind::Lru];

    pub fn name(&self) -> &'static str {
        match self {
            PolicyKind::Aging => "aging",
            PolicyKind::Lfu => "lfu",
            PolicyKind::Lru => "lru",
        }
    }

    /// A fresh policy for a layer of `num_experts` experts.
    pub fn build(&self, num_experts: usize) -> Box<dyn Policy> {
        match self {
            PolicyKind::Aging => Box::new(Frequency::new(num_experts, Some(AGING_PERIOD), "aging")),
            PolicyKind::Lfu => Box::new(Frequency::new(num_experts, None, "lfu")),
            PolicyKind::Lru => Box::new(Lru::new(num_experts)),
        }
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        PolicyKind::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown expert cache policy {s:?}: expected aging, lfu or lru"))
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Tokens between two halvings of the aging policy's counts.
pub const AGING_PERIOD: u64 = 32;

/// Least frequently used, optionally with periodic halving ("aging").
/// Counts grow by the number of tokens that requested the expert; ties go to
/// the least recently used, then the lowest id.
pub struct Frequency {
    counts: Vec<u64>,
    last_use: Vec<u64>,
    resident: Vec<bool>,
    clock: u64,
    tokens: u64,
    halve_every: Option<u64>,
    name: &'static str,
}

impl Frequency {
    pub fn new(num_experts: usize, halve_every: Option<u64>, name: &'static str) -> Self {
        Frequency {
            counts: vec![0; num_experts],
            last_use: vec![0; num_experts],
            resident: vec![false; num_experts],
            clock: 0,
            tokens: 0,
            halve_every,
            name,
        }
    }

    fn touch(&mut self, e: u32, count: u32) {
        self.clock += 1;
        self.counts[e as usize] += count as u64;
        self.last_use[e as usize] = self.clock;
    }
}

impl Policy for Frequency {
    fn name(&self) -> &'static str {
        self.name
    }
    fn on_hit(&mut self, e: u32, count: u32) {
        self.touch(e, count);
    }
    fn victim(&mut self, pinned: &dyn Fn(u32) -> bool) -> Option<u32> {
        (0..self.counts.len() as u32)
            .filter(|&e| self.resident[e as usize] && !pinned(e))
            .min_by_key(|&e| (self.counts[e as usize], self.last_use[e as usize], e))
    }
    fn on_insert(&mut self, e: u32, count: u32) {
        self.resident[e as usize] = true;
        self.touch(e, count);
    }
    fn on_evict(&mut self, e: u32) {
        self.resident[e as usize] = false;
    }
    fn on_bypass(&mut self, e: u32, count: u32) {
        self.touch(e, count);
    }
    fn end_batch(&mut self, tokens: u32) {
        let Some(period) = self.halve_every else {
            return;
        };
        let before = self.tokens / period;
        self.tokens += tokens as u64;
        for _ in before..self.tokens / period {
            for c in self.counts.iter_mut() {
                *c /= 2;
            }
        }
    }
}

/// Least recently used; ties (same batch) go to the lowest id.
pub struct Lru {
    last_use: Vec<u64>,
    resident: Vec<bool>,
    clock: u64,
}

impl Lru {
    pub fn new(num_experts: usize) -> Self {
        Lru {
            last_use: vec![0; num_experts],
            resident: vec![false; num_experts],
            clock: 0,
        }
    }
}

impl Policy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn on_hit(&mut self, e: u32, _count: u32) {
        self.clock += 1;
        self.last_use[e as usize] = self.clock;
    }
    fn victim(&mut self, pinned: &dyn Fn(u32) -> bool) -> Option<u32> {
        (0..self.last_use.len() as u32)
            .filter(|&e| self.resident[e as usize] && !pinned(e))
            .min_by_key(|&e| (self.last_use[e as usize], e))
    }
    fn on_insert(&mut self, e: u32, count: u32) {
        self.resident[e as usize] = true;
        self.on_hit(e, count);
    }
    fn on_evict(&mut self, e: u32) {
        self.resident[e as usize] = false;
    }
}

/// What happened to one requested expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Resident in `slot`.
    Hit { slot: usize },
    /// Must be read; into `slot` (evicting `evicted`), or streamed through a
    /// scratch buffer when `slot` is `None`.
    Miss {
        slot: Option<usize>,
        evicted: Option<u32>,
    },
}

/// Slots of one layer: which expert each holds, driven by a [`Policy`].
pub struct LayerCache {
    policy: Box<dyn Policy>,
    /// `slot_of[expert]`
    slot_of: Vec<Option<usize>>,
    /// `holder[slot]`
    holder: Vec<Option<u32>>,
    pub hits: u64,
    pub misses: u64,
}

impl LayerCache {
    pub fn new(policy: Box<dyn Policy>, num_experts: usize, slots: usize) -> Self {
        LayerCache {
            policy,
            slot_of: vec![None; num_experts],
            holder: vec![None; slots],
            hits: 0,
            misses: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.holder.len()
    }

    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// The slot holding `expert`, if resident.
    pub fn slot_of(&self, expert: u32) -> Option<usize> {
        self.slot_of.get(expert as usize).copied().flatten()
    }

    /// Experts resident now, by slot order (slots held for a background
    /// read that has not landed are not counted).
    pub fn resident(&self) -> Vec<u32> {
        self.holder
            .iter()
            .enumerate()
            .filter_map(|(s, h)| h.filter(|&e| self.slot_of[e as usize] == Some(s)))
            .collect()
    }

    /// Holds a free slot for a background read of `expert`, which is not
    /// resident: no request takes the slot, but the expert is not a hit
    /// until [`LayerCache::commit_fill`]. `None` when the expert is resident
    /// or no slot is free. Never evicts, so it cannot change what later
    /// requests would evict while slots stay free.
    pub fn reserve_fill(&mut self, expert: u32) -> Option<usize> {
        if self.slot_of.get(expert as usize)?.is_some() {
            return None;
        }
        let slot = self.holder.iter().position(|h| h.is_none())?;
        self.holder[slot] = Some(expert);
        Some(slot)
    }

    /// The background read into `slot` (from [`LayerCache::reserve_fill`])
    /// landed: `expert` is resident from now on. Counts neither a hit nor a
    /// miss, and tells the policy of an insert requested by no token.
    pub fn commit_fill(&mut self, expert: u32, slot: usize) {
        if self.holder.get(slot) == Some(&Some(expert)) && self.slot_of[expert as usize].is_none() {
            self.slot_of[expert as usize] = Some(slot);
            self.policy.on_insert(expert, 0);
        }
    }

    /// The background read into `slot` failed: the slot is free again.
    pub fn cancel_fill(&mut self, slot: usize) {
        if let Some(Some(e)) = self.holder.get(slot).copied() {
            if self.slot_of[e as usize] != Some(slot) {
                self.holder[slot] = None;
            }
        }
    }

    /// Decides hits and misses for one batch (`experts` distinct, ascending,
    /// `counts` tokens per expert) and updates the slots. Hits are settled
    /// first; then each miss in id order takes a free slot or evicts the
    /// policy's victim, never an expert of this batch; when none is
    /// evictable (or the policy refuses admission) the miss is streamed.
    pub fn access(&mut self, experts: &[u32], counts: &[u32], tokens: u32) -> Vec<Outcome> {
        let mut out = vec![Outcome::Hit { slot: 0 }; experts.len()];
        let mut pinned = vec![false; self.slot_of.len()];
        for (i, (&e, &c)) in experts.iter().zip(counts).enumerate() {
            if let Some(slot) = self.slot_of[e as usize] {
                self.policy.on_hit(e, c);
                pinned[e as usize] = true;
                out[i] = Outcome::Hit { slot };
                self.hits += 1;
            }
        }
        for (i, (&e, &c)) in experts.iter().zip(counts).enumerate() {
            if self.slot_of[e as usize].is_some() {
                continue;
            }
            self.misses += 1;
            let free = self.holder.iter().position(|h| h.is_none());
            let (slot, evicted) = match free {
                Some(s) if self.policy.admit(e, c, None) => (Some(s), None),
                Some(_) => (None, None),
                None => match self.policy.victim(&|x| pinned[x as usize]) {
                    Some(v) if self.policy.admit(e, c, Some(v)) => {
                        let s = self.slot_of[v as usize].take().expect("victim is resident");
                        self.policy.on_evict(v);
                        self.holder[s] = None;
                        (Some(s), Some(v))
                    }
                    _ => (None, None),
                },
            };
            match slot {
                Some(s) => {
                    self.holder[s] = Some(e);
                    self.slot_of[e as usize] = Some(s);
                    self.policy.on_insert(e, c);
                    pinned[e as usize] = true;
                }
                None => self.policy.on_bypass(e, c),
            }
            out[i] = Outcome::Miss { slot, evicted };
        }
        self.policy.end_batch(tokens);
        out
    }

    /// Forgets a resident expert (its bytes turned out bad).
    pub fn invalidate(&mut self, expert: u32) {
        if let Some(s) = self.slot_of[expert as usize].take() {
            self.holder[s] = None;
            self.policy.on_evict(expert);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(kind: PolicyKind, slots: usize, batches: &[&[u32]]) -> (u64, u64) {
        let mut c = LayerCache::new(kind.build(8), 8, slots);
        for b in batches {
            let counts = vec![1; b.len()];
            c.access(b, &counts, 1);
        }
        (c.hits, c.misses)
    }

    #[test]
    fn lru_evicts_least_recent() {
        // 2 slots: 0,1 | 0 (hit) | 2 evicts 1 | 1 misses (evicts 0)
        let mut c = LayerCache::new(PolicyKind::Lru.build(8), 8, 2);
        c.access(&[0, 1], &[1, 1], 1);
        c.access(&[0], &[1], 1);
        assert_eq!(
            c.access(&[2], &[1], 1),
            vec![Outcome::Miss {
                slot: Some(1),
                evicted: Some(1)
            }]
        );
        assert_eq!(c.resident(), vec![0, 2]);
    }

    #[test]
    fn lfu_keeps_frequent_and_aging_forgets() {
        // Expert 0 used 40 times early, then 1 and 2 alternate with 1 slot... use 2 slots.
        let mut early: Vec<&[u32]> = vec![&[0]; 40];
        let late: Vec<&[u32]> = [&[1u32][..], &[2u32][..]].repeat(100);
        early.extend(late);
        let (_, lfu_misses) = run(PolicyKind::Lfu, 2, &early);
        let (_, aging_misses) = run(PolicyKind::Aging, 2, &early);
        // LFU keeps 0 forever and thrashes 1/2 in the other slot; aging lets 0 go.
        assert!(
            aging_misses < lfu_misses,
            "aging {aging_misses} lfu {lfu_misses}"
        );
        assert_eq!(aging_misses, 3 + aging_misses - 3);
    }

    #[test]
    fn batch_larger_than_cache_streams_the_rest() {
        let mut c = LayerCache::new(PolicyKind::Aging.build(8), 8, 1);
        let out = c.access(&[1, 3, 5], &[1, 1, 1], 1);
        assert_eq!(
            out[0],
            Outcome::Miss {
                slot: Some(0),
                evicted: None
            }
        );
        assert_eq!(
            out[1],
            Outcome::Miss {
                slot: None,
                evicted: None
            }
        );
        assert_eq!(
            out[2],
            Outcome::Miss {
                slot: None,
                evicted: None
            }
        );
        // Next batch: 1 is a hit; 3 can't evict 1 (pinned) so it streams.
        let out = c.access(&[1, 3], &[1, 1], 1);
        assert_eq!(out[0], Outcome::Hit { slot: 0 });
        assert_eq!(
            out[1],
            Outcome::Miss {
                slot: None,
                evicted: None
            }
        );
    }

    #[test]
    fn fills_hold_their_slot_until_committed() {
        let mut c = LayerCache::new(PolicyKind::Aging.build(4), 4, 4);
        c.access(&[1], &[1], 1);
        assert_eq!(c.reserve_fill(1), None, "resident experts are not filled");
        let s2 = c.reserve_fill(2).unwrap();
        let s3 = c.reserve_fill(3).unwrap();
        assert_eq!(c.resident(), vec![1]);
        // A request for another expert takes the remaining free slot, not a
        // held one.
        let out = c.access(&[0], &[1], 1);
        let Outcome::Miss { slot: Some(s0), .. } = out[0] else {
            panic!("{out:?}")
        };
        assert!(s0 != s2 && s0 != s3);
        c.commit_fill(2, s2);
        c.cancel_fill(s3);
        assert_eq!(c.access(&[2], &[1], 1), vec![Outcome::Hit { slot: s2 }]);
        let mut now = c.resident();
        now.sort();
        assert_eq!(now, vec![0, 1, 2]);
        assert_eq!((c.hits, c.misses), (1, 2));
        assert_eq!(c.reserve_fill(3), Some(s3));
    }

    #[test]
    fn cache_never_exceeds_capacity_and_hits_are_resident() {
        let mut seed = 12345u64;
        for kind in PolicyKind::ALL {
            for slots in [1, 2, 3, 5] {
                let mut c = LayerCache::new(kind.build(8), 8, slots);
                for _ in 0..300 {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let mut ids: Vec<u32> = (0..3)
                        .map(|k| ((seed >> (20 + 8 * k)) % 8) as u32)
                        .collect();
                    ids.sort();
                    ids.dedup();
                    let before = c.resident();
                    let out = c.access(&ids, &vec![1; ids.len()], 1);
                    for (id, o) in ids.iter().zip(&out) {
                        assert_eq!(matches!(o, Outcome::Hit { .. }), before.contains(id));
                    }
                    assert!(c.resident().len() <= slots);
                }
            }
        }
    }
}
