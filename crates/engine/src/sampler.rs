//! Token sampling: greedy, temperature, top-k, top-p, min-p, seeded.

use serde::{Deserialize, Serialize};

/// Sampling settings. `temperature <= 0` means greedy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p; 1.0 disables.
    pub top_p: f32,
    /// Drop tokens below `min_p * p(most likely)`; 0 disables.
    pub min_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        }
    }
}

/// A small, fully specified PRNG (SplitMix64) so a seed means the same
/// tokens on every platform and every version of our dependencies.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Draws tokens from logits according to [`SamplingParams`].
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

/// Index of the largest value; ties go to the lowest index. NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = Rng::new(params.seed);
        Sampler { params, rng }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature <= 0.0 || p.top_k == 1 {
            return argmax(logits);
        }
        // Candidates sorted by logit, descending, ties by id.
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| (i as u32, v))
            .collect();
        if cand.is_empty() {
            return argmax(logits);
        }
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.truncate(p.top_k);
        }
        let max = cand[0].1 as f64;
        let t = p.temperature as f64;
        let mut probs: Vec<f64> = cand
            .iter()
            .map(|&(_, v)| ((v as f64 - max) / t).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        for q in probs.iter_mut() {
            *q /= total;
        }
        let mut keep = probs.len();
        if p.min_p > 0.0 {
            let floor = p.min_p as f64 * probs[0];
            keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut n = 0;
            for &q in &probs[..keep] {
                acc += q;
                n += 1;
                if acc >= p.top_p as f64 {
                    break;
                }
            }
            keep = n.max(1);
        }
        let mass: f64 = probs[..keep].iter().sum();
        let mut r = self.rng.next_f64() * mass;
        for (i, &q) in probs[..keep].iter().enumerate() {
            r -= q;
            if r < 0.0 {
                return cand[i].0;
            }
        }
        cand[keep - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_argmax_and_lowest_tie() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.1, 2.0, 2.0, -1.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens_other_seed_differs() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7).sin()).collect();
        let params = SamplingParams {
            temperature: 1.0,
            seed: 7,
            ..Default::default()
        };
        let draw = |params: SamplingParams| {
            let mut s = Sampler::new(params);
            (0..64).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(params.clone()), draw(params.clone()));
        assert_ne!(
            draw(params.clone()),
            draw(SamplingParams { seed: 8, ..params })
        );
    }

    #[test]
    fn top_k_and_top_p_and_min_p_restrict_support() {
        let logits = vec![5.0, 4.0, 3.0, 0.0, -1.0];
        for (k, p, m, allowed) in [
            (2usize, 1.0f32, 0.0f32, vec![0u32, 1]),
            (0, 0.5, 0.0, vec![0]),
            (0, 1.0, 0.2, vec![0, 1]),
        ] {
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.0,
                top_k: k,
                top_p: p,
                min_p: m,
                seed: 1,
            });
            for _ in 0..200 {
                assert!(allowed.contains(&s.sample(&logits)), "k={k} p={p} m={m}");
            }
        }
    }

    #[test]
    fn high_temperature_reaches_every_token() {
        let logits = vec![1.0, 0.5, 0.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 5.0,
            seed: 3,
            ..Default::default()
        });
        let mut seen = [false; 3];
        for _ in 0..300 {
            seen[s.sample(&logits) as usize] = true;
        }
        assert!(seen.iter().all(|&x| x));
    }
}
