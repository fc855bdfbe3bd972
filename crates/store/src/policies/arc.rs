//! ARC: Adaptive Replacement Cache (Megiddo & Modha, FAST 2003).

use super::{Lists, NOWHERE};
use crate::policy::Policy;

const T1: u8 = 0;
const T2: u8 = 1;
const B1: u8 = 2;
const B2: u8 = 3;

/// Adaptive Replacement Cache over `c` slots: resident lists T1 (seen once
/// recently) and T2 (seen at least twice), ghost lists B1/B2 of recently
/// evicted ids, and a target size `p` for T1 that a ghost hit in B1 raises
/// and a ghost hit in B2 lowers (by `max(|B2|/|B1|, 1)` resp.
/// `max(|B1|/|B2|, 1)`).
///
/// Adaptation to [`LayerCache`](crate::policy::LayerCache)'s protocol:
/// REPLACE runs in `victim()`, which is not told the missed id, so it evicts
/// the oldest unpinned T1 entry when `|T1| > p` (or T2 has nothing
/// evictable), else the oldest unpinned T2 entry; the `x ∈ B2 && |T1| == p`
/// tie case of the paper takes the T2 branch, and `p` is adapted when the
/// missed id is inserted (so a ghost hit steers the *next* REPLACE). A missed
/// expert that could not be inserted (all slots pinned) adapts `p` like an
/// insert and is remembered in its ghost list (B1 if new).
pub struct Arc {
    lists: Lists,
    c: usize,
    p: f64,
}

impl Arc {
    pub fn new(num_experts: usize, slots: usize) -> Self {
        Arc {
            lists: Lists::new(num_experts, 4),
            c: slots,
            p: 0.0,
        }
    }

    /// Target size of T1 (for tests and inspection).
    pub fn p(&self) -> f64 {
        self.p
    }

    /// Adapts `p` for a miss on `e`; returns the ghost list it was in.
    fn adapt(&mut self, e: u32) -> u8 {
        let (b1, b2) = (self.lists.len(B1) as f64, self.lists.len(B2) as f64);
        match self.lists.of(e) {
            B1 => {
                self.p = (self.p + (b2 / b1).max(1.0)).min(self.c as f64);
                B1
            }
            B2 => {
                self.p = (self.p - (b1 / b2).max(1.0)).max(0.0);
                B2
            }
            _ => NOWHERE,
        }
    }

    /// Keeps |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c by
    /// forgetting the oldest ghosts.
    fn trim(&mut self) {
        let none = |_| false;
        while self.lists.len(T1) + self.lists.len(B1) > self.c {
            let Some(g) = self.lists.oldest(B1, &none) else {
                break;
            };
            self.lists.remove(g);
        }
        let total = |l: &Lists| l.len(T1) + l.len(T2) + l.len(B1) + l.len(B2);
        while total(&self.lists) > 2 * self.c {
            let Some(g) = self
                .lists
                .oldest(B2, &none)
                .or_else(|| self.lists.oldest(B1, &none))
            else {
                break;
            };
            self.lists.remove(g);
        }
    }
}

impl Policy for Arc {
    fn name(&self) -> &'static str {
        "arc"
    }
    fn on_hit(&mut self, e: u32, _count: u32) {
        self.lists.push(e, T2);
    }
    fn victim(&mut self, pinned: &dyn Fn(u32) -> bool) -> Option<u32> {
        let t1 = self.lists.oldest(T1, pinned);
        let t2 = self.lists.oldest(T2, pinned);
        match (t1, t2) {
            (Some(a), Some(_)) if self.lists.len(T1) as f64 > self.p => Some(a),
            (a, None) => a,
            (_, b) => b,
        }
    }
    fn on_insert(&mut self, e: u32, _count: u32) {
        let list = match self.adapt(e) {
            NOWHERE => T1,
            _ => T2,
        };
        self.lists.push(e, list);
        self.trim();
    }
    fn on_evict(&mut self, e: u32) {
        match self.lists.of(e) {
            T1 => self.lists.push(e, B1),
            T2 => self.lists.push(e, B2),
            _ => {}
        }
    }
    fn on_bypass(&mut self, e: u32, _count: u32) {
        let ghost = match self.adapt(e) {
            NOWHERE => B1,
            g => g,
        };
        self.lists.push(e, ghost);
        self.trim();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::testutil::{check_invariants, run};

    #[test]
    fn invariants() {
        check_invariants(&|s| Box::new(Arc::new(16, s)));
    }

    #[test]
    fn scan_resistance_and_ghost_adaptation() {
        // 3 slots. 0 and 1 are used twice (-> T2), then a scan 2,3,4,5
        // goes through T1 only: T2 survives because |T1| > p = 0.
        let seq: Vec<&[u32]> = vec![&[0], &[1], &[0], &[1], &[2], &[3], &[4], &[5], &[0], &[1]];
        let (c, hits) = run(Box::new(Arc::new(8, 3)), 8, 3, &seq);
        assert_eq!(hits[8], vec![true]);
        assert_eq!(hits[9], vec![true]);
        assert_eq!(c.misses, 6);
        // Plain LRU would have lost both 0 and 1 to the scan.
        let (lru, _) = run(crate::policy::PolicyKind::Lru.build(8), 8, 3, &seq);
        assert_eq!(lru.misses, 8);
    }

    #[test]
    fn ghost_hit_in_b1_raises_p() {
        // 2 slots: 0 twice (T2), 1 (T1); 2 evicts 1 (|T1| = 1 > p = 0) to
        // B1; 1 comes back: REPLACE evicts 2 (T1) and the ghost hit in B1
        // raises p to 1 and puts 1 in T2.
        let mut a = Arc::new(8, 2);
        a.on_insert(0, 1);
        a.on_hit(0, 1);
        a.on_insert(1, 1);
        assert_eq!(a.victim(&|_| false), Some(1));
        a.on_evict(1);
        a.on_insert(2, 1);
        assert_eq!(a.lists.of(1), B1);
        assert_eq!(a.victim(&|_| false), Some(2));
        a.on_evict(2);
        a.on_insert(1, 1);
        assert_eq!(a.p(), 1.0);
        assert_eq!((a.lists.of(0), a.lists.of(1), a.lists.of(2)), (T2, T2, B1));
        // With |T1| = 0 = p the next victim comes from T2 (oldest: 0).
        assert_eq!(a.victim(&|_| false), Some(0));
        // And a B2 ghost hit lowers p again.
        a.on_evict(0);
        a.on_insert(3, 1);
        assert_eq!(a.lists.of(0), B2);
        // |T1| = 1 is not above p = 1: T2's oldest (1) goes.
        assert_eq!(a.victim(&|_| false), Some(1));
        a.on_evict(1);
        a.on_insert(0, 1);
        assert_eq!(a.p(), 0.0);
        assert_eq!(a.lists.of(0), T2);
        // Through LayerCache the same sequence leaves 0 and 3 resident.
        let seq: Vec<&[u32]> = vec![&[0], &[0], &[1], &[2], &[1], &[3], &[0]];
        let (c, _) = run(Box::new(Arc::new(8, 2)), 8, 2, &seq);
        let mut r = c.resident();
        r.sort();
        assert_eq!(r, vec![0, 3]);
    }

    #[test]
    fn pinned_entries_are_skipped() {
        let mut a = Arc::new(8, 2);
        a.on_insert(3, 1);
        a.on_insert(5, 1);
        assert_eq!(a.victim(&|e| e == 3), Some(5));
        assert_eq!(a.victim(&|_| true), None);
    }
}
