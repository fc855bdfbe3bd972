//! SIEVE (Zhang et al., NSDI 2024): a FIFO queue with a visited bit and a
//! moving hand.

use crate::policy::Policy;

/// New entries join the head of one FIFO queue with `visited = false`; a
/// hit sets `visited`. To evict, the hand walks from where it stopped
/// towards the head (wrapping to the tail), clearing `visited` bits, and
/// stops at the first unvisited entry: the victim. The hand then rests on
/// the entry after it. Pinned entries are passed over untouched. One batch
/// is one reference.
pub struct Sieve {
    /// Tail (oldest) first.
    queue: Vec<u32>,
    visited: Vec<bool>,
    /// Index into `queue` of the next entry the hand examines.
    hand: usize,
}

impl Sieve {
    pub fn new(num_experts: usize) -> Self {
        Sieve {
            queue: Vec::new(),
            visited: vec![false; num_experts],
            hand: 0,
        }
    }
}

impl Policy for Sieve {
    fn name(&self) -> &'static str {
        "sieve"
    }
    fn on_hit(&mut self, e: u32, _count: u32) {
        self.visited[e as usize] = true;
    }
    fn victim(&mut self, pinned: &dyn Fn(u32) -> bool) -> Option<u32> {
        let n = self.queue.len();
        if self.hand >= n {
            self.hand = 0;
        }
        // Two rounds suffice: the first clears every unpinned visited bit.
        for _ in 0..2 * n {
            let e = self.queue[self.hand];
            if !pinned(e) {
                if !self.visited[e as usize] {
                    return Some(e);
                }
                self.visited[e as usize] = false;
            }
            self.hand = (self.hand + 1) % n;
        }
        None
    }
    fn on_insert(&mut self, e: u32, _count: u32) {
        self.queue.push(e);
        self.visited[e as usize] = false;
    }
    fn on_evict(&mut self, e: u32) {
        if let Some(i) = self.queue.iter().position(|&x| x == e) {
            self.queue.remove(i);
            if i < self.hand {
                self.hand -= 1;
            }
            if self.hand >= self.queue.len() {
                self.hand = 0;
            }
        }
        self.visited[e as usize] = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::testutil::{check_invariants, run};

    #[test]
    fn invariants() {
        check_invariants(&|_| Box::new(Sieve::new(16)));
    }

    #[test]
    fn hand_checked_sequence() {
        // 3 slots. Queue (tail first) 0,1,2; 0 and 2 visited.
        // [3]: hand at 0: clear 0, 1 unvisited -> evict 1; hand rests on 2.
        //      queue 0,2,3.
        // [1]: hand at 2: clear 2, 3 unvisited -> evict 3; hand wraps to 0.
        //      queue 0,2,1.
        // [4]: hand at 0 (cleared) -> evict 0. queue 2,1,4.
        let seq: Vec<&[u32]> = vec![&[0], &[1], &[2], &[0, 2], &[3], &[1], &[4]];
        let (c, _) = run(Box::new(Sieve::new(8)), 8, 3, &seq);
        let mut r = c.resident();
        r.sort();
        assert_eq!(r, vec![1, 2, 4]);
        let mut s = Sieve::new(8);
        for e in [0, 1, 2] {
            s.on_insert(e, 1);
        }
        s.on_hit(0, 1);
        s.on_hit(2, 1);
        assert_eq!(s.victim(&|_| false), Some(1));
        s.on_evict(1);
        s.on_insert(3, 1);
        assert_eq!(s.queue, vec![0, 2, 3]);
        assert_eq!(s.queue[s.hand], 2);
        assert_eq!(s.victim(&|_| false), Some(3));
        s.on_evict(3);
        assert_eq!(s.hand, 0);
    }

    #[test]
    fn pinned_visited_entries_keep_their_bit() {
        let mut s = Sieve::new(8);
        s.on_insert(0, 1);
        s.on_insert(1, 1);
        s.on_hit(0, 1);
        s.on_hit(1, 1);
        assert_eq!(s.victim(&|e| e == 1), Some(0));
        assert!(s.visited[1]);
        assert_eq!(s.victim(&|_| true), None);
        assert_eq!(s.victim(&|e| e == 0), Some(1));
    }
}
