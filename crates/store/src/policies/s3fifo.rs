//! S3-FIFO (Yang et al., SOSP 2023): a small FIFO for new entries, a main
//! FIFO with 2-bit frequency reinsertion, and a ghost FIFO of ids.

use super::Lists;
use crate::policy::Policy;

const S: u8 = 0;
const M: u8 = 1;
const G: u8 = 2;

/// Share of the slots the small queue aims for.
pub const S3FIFO_SMALL_FRACTION: f64 = 0.10;
/// Ghost entries, as a share of the slots (libCacheSim's default).
pub const S3FIFO_GHOST_FRACTION: f64 = 0.90;
/// Frequency bits saturate here (2 bits).
pub const S3FIFO_MAX_FREQ: u8 = 3;

/// S3-FIFO over `slots` slots shared by the small queue S (target 10%, at
/// least 1) and the main queue M; the ghost queue G remembers up to 90% of
/// `slots` ids evicted from S.
///
/// - Hit: `freq = min(freq + 1, 3)` (one batch is one reference).
/// - Miss: inserted into M if the id is in G, else into S, with `freq = 0`.
/// - Eviction (`victim()`, only when all slots are full): from S if
///   `|S| >= target`, else from M (falling back to the other queue when
///   one has nothing evictable). From S: the oldest entry moves to M (freq
///   reset) if it was hit while in S, else it is the victim (and goes to G).
///   From M: the oldest entry with `freq > 0` is reinserted with `freq - 1`,
///   else it is the victim. Pinned entries are skipped in place.
/// - The ghost queue is trimmed after the missed id's ghost status has been
///   read (as libCacheSim does), so an id evicted by the same miss's
///   eviction cannot push it out.
/// - A miss that cannot be inserted (all slots pinned) is remembered in G.
pub struct S3Fifo {
    lists: Lists,
    freq: Vec<u8>,
    small_target: usize,
    ghost_cap: usize,
}

impl S3Fifo {
    pub fn new(num_experts: usize, slots: usize) -> Self {
        S3Fifo {
            lists: Lists::new(num_experts, 3),
            freq: vec![0; num_experts],
            small_target: ((slots as f64 * S3FIFO_SMALL_FRACTION).round() as usize).max(1),
            ghost_cap: ((slots as f64 * S3FIFO_GHOST_FRACTION).round() as usize).max(1),
        }
    }

    fn evict_small(&mut self, pinned: &dyn Fn(u32) -> bool) -> Option<u32> {
        loop {
            let t = self.lists.oldest(S, pinned)?;
            if self.freq[t as usize] >= 1 {
                self.freq[t as usize] = 0;
                self.lists.push(t, M);
            } else {
                return Some(t);
            }
        }
    }

    fn evict_main(&mut self, pinned: &dyn Fn(u32) -> bool) -> Option<u32> {
        loop {
            let t = self.lists.oldest(M, pinned)?;
            if self.freq[t as usize] > 0 {
                self.freq[t as usize] -= 1;
                self.lists.push(t, M);
            } else {
                return Some(t);
            }
        }
    }

    fn trim_ghosts(&mut self) {
        while self.lists.len(G) > self.ghost_cap {
            let Some(g) = self.lists.oldest(G, &|_| false) else {
                break;
            };
            self.lists.remove(g);
        }
    }
}

impl Policy for S3Fifo {
    fn name(&self) -> &'static str {
        "s3-fifo"
    }
    fn on_hit(&mut self, e: u32, _count: u32) {
        let f = &mut self.freq[e as usize];
        *f = (*f + 1).min(S3FIFO_MAX_FREQ);
    }
    fn victim(&mut self, pinned: &dyn Fn(u32) -> bool) -> Option<u32> {
        if self.lists.len(S) >= self.small_target {
            self.evict_small(pinned).or_else(|| self.evict_main(pinned))
        } else {
            self.evict_main(pinned).or_else(|| self.evict_small(pinned))
        }
    }
    fn on_insert(&mut self, e: u32, _count: u32) {
        let queue = if self.lists.of(e) == G { M } else { S };
        self.lists.push(e, queue);
        self.freq[e as usize] = 0;
        self.trim_ghosts();
    }
    fn on_evict(&mut self, e: u32) {
        match self.lists.of(e) {
            S => self.lists.push(e, G),
            M => self.lists.remove(e),
            _ => {}
        }
        self.freq[e as usize] = 0;
    }
    fn on_bypass(&mut self, e: u32, _count: u32) {
        self.lists.push(e, G);
        self.trim_ghosts();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::testutil::{check_invariants, run};

    #[test]
    fn invariants() {
        check_invariants(&|s| Box::new(S3Fifo::new(16, s)));
    }

    #[test]
    fn hand_checked_sequence() {
        // 3 slots: small target 1, ghost 3.
        // [3]: S = 0,1,2 full; 0 was hit -> moves to M; 1 is the victim (-> G).
        // [1]: ghost hit: evicts 2 from S (-> G), 1 enters M.
        // [4], [5]: S turns over (3, then 4 to G); [0] hits in M (freq 1).
        // [2]: evicts 5 from S; 2 is still a ghost -> M; S is now empty.
        // [6]: |S| < target: from M, 0 (freq 1) is reinserted, 1 is evicted.
        let seq: Vec<&[u32]> = vec![
            &[0],
            &[1],
            &[2],
            &[0],
            &[3],
            &[1],
            &[4],
            &[0],
            &[5],
            &[2],
            &[6],
        ];
        let (c, hits) = run(Box::new(S3Fifo::new(8, 3)), 8, 3, &seq);
        let mut r = c.resident();
        r.sort();
        assert_eq!(r, vec![0, 2, 6]);
        assert_eq!((c.hits, c.misses), (2, 9));
        assert_eq!(hits[7], vec![true]);
    }

    #[test]
    fn freq_saturates_and_pinned_skipped() {
        let mut p = S3Fifo::new(8, 10);
        p.on_insert(1, 1);
        for _ in 0..10 {
            p.on_hit(1, 1);
        }
        assert_eq!(p.freq[1], S3FIFO_MAX_FREQ);
        p.on_insert(2, 1);
        // S = 1 (hit), 2: 1 moves to M, 2 is the victim.
        assert_eq!(p.victim(&|_| false), Some(2));
        // With 2 pinned: nothing evictable in S; M's 1 (freq reset by the
        // move) goes.
        assert_eq!(p.victim(&|e| e == 2), Some(1));
        assert_eq!(p.victim(&|_| true), None);
    }
}
