//! LRFU: Least Recently/Frequently Used (Lee et al., IEEE ToC 2001).

use crate::policy::Policy;

/// Default decay: 0.03 per token, i.e. a reference loses half its weight
/// after 1/0.03 ≈ 33 tokens, close to the aging policy's halving period of
/// 32 tokens.
pub const LRFU_DEFAULT_LAMBDA: f64 = 0.03;

/// Each expert carries a combined recency-frequency value
/// `CRF(e) = Σ_refs count · 2^(-λ·(now − t_ref))`, time counted in tokens
/// (the `tokens` of each batch; one per decode step). The victim is the
/// resident expert of lowest CRF, ties to the lowest id. λ = 0 is LFU
/// (token counts); large λ approaches LRU. CRF history is kept for every
/// expert, resident or not (ids are few).
///
/// CRFs are compared in the log domain, `log2 CRF(e) + λ·t_last(e)`, which
/// is time-invariant and so needs no periodic rescaling.
pub struct Lrfu {
    lambda: f64,
    /// CRF as of `last[e]`.
    crf: Vec<f64>,
    last: Vec<f64>,
    resident: Vec<bool>,
    now: f64,
}

impl Lrfu {
    pub fn new(num_experts: usize, lambda: f64) -> Self {
        Lrfu {
            lambda,
            crf: vec![0.0; num_experts],
            last: vec![0.0; num_experts],
            resident: vec![false; num_experts],
            now: 0.0,
        }
    }

    fn reference(&mut self, e: u32, count: u32) {
        let i = e as usize;
        let decay = (-self.lambda * (self.now - self.last[i])).exp2();
        self.crf[i] = self.crf[i] * decay + count as f64;
        self.last[i] = self.now;
    }

    /// Time-invariant ordering key: log2 of the CRF scaled to time 0.
    fn key(&self, e: u32) -> f64 {
        let i = e as usize;
        self.crf[i].log2() + self.lambda * self.last[i]
    }

    /// The current CRF of `e` (for tests and inspection).
    pub fn crf(&self, e: u32) -> f64 {
        let i = e as usize;
        self.crf[i] * (-self.lambda * (self.now - self.last[i])).exp2()
    }
}

impl Policy for Lrfu {
    fn name(&self) -> &'static str {
        "lrfu"
    }
    fn on_hit(&mut self, e: u32, count: u32) {
        self.reference(e, count);
    }
    fn victim(&mut self, pinned: &dyn Fn(u32) -> bool) -> Option<u32> {
        (0..self.crf.len() as u32)
            .filter(|&e| self.resident[e as usize] && !pinned(e))
            .min_by(|&a, &b| self.key(a).total_cmp(&self.key(b)).then(a.cmp(&b)))
    }
    fn on_insert(&mut self, e: u32, count: u32) {
        self.resident[e as usize] = true;
        self.reference(e, count);
    }
    fn on_evict(&mut self, e: u32) {
        self.resident[e as usize] = false;
    }
    fn on_bypass(&mut self, e: u32, count: u32) {
        self.reference(e, count);
    }
    fn end_batch(&mut self, tokens: u32) {
        self.now += tokens as f64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::testutil::{check_invariants, run};
    use crate::policy::PolicyKind;

    #[test]
    fn invariants() {
        check_invariants(&|_| Box::new(Lrfu::new(16, LRFU_DEFAULT_LAMBDA)));
        check_invariants(&|_| Box::new(Lrfu::new(16, 0.0)));
        check_invariants(&|_| Box::new(Lrfu::new(16, 1.0)));
    }

    #[test]
    fn crf_decays_by_half_per_half_life() {
        let mut l = Lrfu::new(4, 0.5);
        l.on_insert(1, 1);
        l.end_batch(2);
        assert!((l.crf(1) - 0.5).abs() < 1e-12);
        l.on_hit(1, 1);
        assert!((l.crf(1) - 1.5).abs() < 1e-12);
        l.end_batch(2);
        assert!((l.crf(1) - 0.75).abs() < 1e-12);
    }

    #[test]
    fn lambda_spans_lfu_and_lru() {
        // 2 slots: 0 used 5 times, then 1 three times, then 2 arrives.
        // λ = 0 (LFU) evicts 1 (CRF 3 < 5); λ = 1 (LRU) evicts 0, whose
        // CRF (< 2 · 2^-4) is below 1's (> 1).
        let seq: Vec<&[u32]> = vec![&[0], &[0], &[0], &[0], &[0], &[1], &[1], &[1], &[2]];
        let (lfu, _) = run(Box::new(Lrfu::new(4, 0.0)), 4, 2, &seq);
        let mut r = lfu.resident();
        r.sort();
        assert_eq!(r, vec![0, 2]);
        let (lru, _) = run(Box::new(Lrfu::new(4, 1.0)), 4, 2, &seq);
        let mut r = lru.resident();
        r.sort();
        assert_eq!(r, vec![1, 2]);
        // With one expert per token, λ = 1 is exactly LRU (a reference
        // outweighs all older ones together).
        let batches = crate::policies::testutil::random_batches(3, 16, 1, 300);
        let refs: Vec<&[u32]> = batches.iter().map(|b| &b[..]).collect();
        let (a, _) = run(Box::new(Lrfu::new(16, 1.0)), 16, 5, &refs);
        let (b, _) = run(PolicyKind::Lru.build(16), 16, 5, &refs);
        assert_eq!((a.hits, a.misses), (b.hits, b.misses));
    }
}
