//! W-TinyLFU (Einziger, Friedman & Manes, ToS 2017; Caffeine's policy): a
//! small LRU window in front of a segmented-LRU main cache, with admission
//! to main decided by estimated frequency.

use super::{Lists, NOWHERE};
use crate::policy::Policy;

const W: u8 = 0;
const PROBATION: u8 = 1;
const PROTECTED: u8 = 2;

/// Share of the slots for the window (at least one slot).
pub const TINYLFU_WINDOW_FRACTION: f64 = 0.01;
/// Share of the main cache for its protected segment.
pub const TINYLFU_PROTECTED_FRACTION: f64 = 0.80;
/// Frequency counters are halved after this many increments per slot.
pub const TINYLFU_SAMPLE_PER_SLOT: u64 = 10;
/// Counters saturate here (Caffeine's 4-bit count-min counters).
pub const TINYLFU_MAX_COUNT: u32 = 15;

/// W-TinyLFU over `slots` slots: window LRU (1%, at least 1), main SLRU of
/// probation + protected (80% of main).
///
/// Frequencies are exact per-expert counters (ids are few, so no sketch),
/// incremented by the tokens requesting the expert on every request, hit or
/// miss, saturating at 15; once `10 × slots` increments have been counted,
/// every counter and the increment count are halved (the "reset").
///
/// A missed expert always enters the window. When that pushes the window
/// over its size, its oldest entry (the candidate) competes with main's
/// victim (oldest of probation, else of protected): the candidate enters
/// probation only if its frequency is strictly higher, else the candidate
/// is the one evicted. In [`LayerCache`](crate::policy::LayerCache) terms
/// this contest runs in `victim()`; the winner's move to probation happens
/// when the loser is evicted. A probation hit moves the entry to protected,
/// demoting protected's oldest to probation when protected is full. While
/// slots are free, window overflow moves to probation without a contest.
pub struct WTinyLfu {
    lists: Lists,
    freq: Vec<u32>,
    additions: u64,
    sample: u64,
    window_cap: usize,
    protected_cap: usize,
    /// (candidate, main victim): when the main victim is evicted, the
    /// candidate moves from the window to probation.
    pending: Option<(u32, u32)>,
}

impl WTinyLfu {
    pub fn new(num_experts: usize, slots: usize) -> Self {
        let window_cap = ((slots as f64 * TINYLFU_WINDOW_FRACTION).round() as usize).max(1);
        let main = slots.saturating_sub(window_cap);
        WTinyLfu {
            lists: Lists::new(num_experts, 3),
            freq: vec![0; num_experts],
            additions: 0,
            sample: TINYLFU_SAMPLE_PER_SLOT * slots.max(1) as u64,
            window_cap,
            protected_cap: (main as f64 * TINYLFU_PROTECTED_FRACTION) as usize,
            pending: None,
        }
    }

    /// The frequency estimate of `e`.
    pub fn frequency(&self, e: u32) -> u32 {
        self.freq[e as usize]
    }

    fn record(&mut self, e: u32, count: u32) {
        let f = &mut self.freq[e as usize];
        let new = f.saturating_add(count).min(TINYLFU_MAX_COUNT);
        self.additions += (new - *f) as u64;
        *f = new;
        if self.additions >= self.sample {
            for f in self.freq.iter_mut() {
                *f /= 2;
            }
            self.additions /= 2;
        }
    }

    fn main_victim(&self, pinned: &dyn Fn(u32) -> bool) -> Option<u32> {
        self.lists
            .oldest(PROBATION, pinned)
            .or_else(|| self.lists.oldest(PROTECTED, pinned))
    }
}

impl Policy for WTinyLfu {
    fn name(&self) -> &'static str {
        "w-tinylfu"
    }
    fn on_hit(&mut self, e: u32, count: u32) {
        self.record(e, count);
        match self.lists.of(e) {
            W => self.lists.push(e, W),
            PROBATION | PROTECTED => {
                self.lists.push(e, PROTECTED);
                while self.lists.len(PROTECTED) > self.protected_cap {
                    let Some(d) = self.lists.oldest(PROTECTED, &|_| false) else {
                        break;
                    };
                    self.lists.push(d, PROBATION);
                }
            }
            _ => {}
        }
    }
    fn victim(&mut self, pinned: &dyn Fn(u32) -> bool) -> Option<u32> {
        self.pending = None;
        let mv = self.main_victim(pinned);
        if self.lists.len(W) >= self.window_cap {
            if let Some(cand) = self.lists.oldest(W, pinned) {
                return match mv {
                    Some(mv) if self.freq[cand as usize] > self.freq[mv as usize] => {
                        self.pending = Some((cand, mv));
                        Some(mv)
                    }
                    _ => Some(cand),
                };
            }
        }
        mv.or_else(|| self.lists.oldest(W, pinned))
    }
    fn on_insert(&mut self, e: u32, count: u32) {
        self.pending = None;
        self.record(e, count);
        self.lists.push(e, W);
        while self.lists.len(W) > self.window_cap {
            let Some(o) = self.lists.oldest(W, &|_| false) else {
                break;
            };
            self.lists.push(o, PROBATION);
        }
    }
    fn on_evict(&mut self, e: u32) {
        self.lists.remove(e);
        if let Some((cand, mv)) = self.pending.take() {
            if mv == e && self.lists.of(cand) == W {
                self.lists.push(cand, PROBATION);
            }
        }
        debug_assert_eq!(self.lists.of(e), NOWHERE);
    }
    fn on_bypass(&mut self, e: u32, count: u32) {
        self.record(e, count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::testutil::{check_invariants, run};

    #[test]
    fn invariants() {
        check_invariants(&|s| Box::new(WTinyLfu::new(16, s)));
    }

    #[test]
    fn hand_checked_sequence() {
        // 3 slots: window 1, probation + protected 2 (protected 1).
        // [0] [1] [2]: 0 and 1 overflow the window into probation.
        // [0] [0]: 0 to protected (freq 3).
        // [3]: candidate 2 (freq 1) vs main victim 1 (freq 1): rejected, 2 goes.
        // [3]: hit in window (freq 2).
        // [4]: candidate 3 (freq 2) beats 1 (freq 1): 1 goes, 3 to probation.
        // [5]: candidate 4 (freq 1) loses to 3 (freq 2): 4 goes.
        let seq: Vec<&[u32]> = vec![&[0], &[1], &[2], &[0], &[0], &[3], &[3], &[4], &[5]];
        let (c, _) = run(Box::new(WTinyLfu::new(8, 3)), 8, 3, &seq);
        let mut r = c.resident();
        r.sort();
        assert_eq!(r, vec![0, 3, 5]);
        assert_eq!((c.hits, c.misses), (3, 6));
    }

    #[test]
    fn counters_saturate_and_halve() {
        let mut p = WTinyLfu::new(4, 1); // sample: 10 increments
        p.on_bypass(0, 6);
        p.on_bypass(1, 4);
        assert_eq!((p.frequency(0), p.frequency(1), p.additions), (3, 2, 5));
        p.on_bypass(2, 100);
        // Saturates at 15 (+15 increments), which triggers a reset.
        assert_eq!(p.frequency(2), 7);
        assert_eq!(p.frequency(0), 1);
    }

    #[test]
    fn pinned_candidate_is_skipped() {
        let mut p = WTinyLfu::new(8, 2);
        p.on_insert(0, 1); // window 0
        p.on_insert(1, 1); // window 1, probation 0
        assert_eq!(p.victim(&|e| e == 1), Some(0));
        assert_eq!(p.victim(&|_| true), None);
    }
}
