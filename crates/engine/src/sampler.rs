//! Token sampling: greedy, temperature, top-k, top-p, min-p, seeded;
//! presence, frequency and repetition penalties.

use std::cmp::Ordering;
use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};
use slipstream_kernels::sample::{self as fixed, DrawParams};

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
    /// Applied to the logits before every draw, greedy ones included.
    #[serde(default)]
    pub penalties: Penalties,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            penalties: Penalties::default(),
        }
    }
}

/// Logit penalties on tokens already seen.
///
/// `presence` and `frequency` follow OpenAI: over the tokens generated so
/// far, `logit -= presence` once per distinct token and `logit -=
/// frequency * count`. `repetition` follows Hugging Face's
/// `RepetitionPenaltyLogitsProcessor` over the prompt and the generated
/// tokens: a positive logit is divided by it, a negative one multiplied.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Penalties {
    /// 0 is off; OpenAI allows [-2, 2].
    pub presence: f32,
    /// 0 is off; OpenAI allows [-2, 2].
    pub frequency: f32,
    /// 1 is off; must be > 0 (above 1 discourages repeats).
    pub repetition: f32,
}

impl Default for Penalties {
    fn default() -> Self {
        Penalties {
            presence: 0.0,
            frequency: 0.0,
            repetition: 1.0,
        }
    }
}

impl Penalties {
    /// Whether any penalty changes logits.
    pub fn is_active(&self) -> bool {
        self.presence != 0.0 || self.frequency != 0.0 || self.repetition != 1.0
    }

    /// Why these penalties cannot be applied, if so.
    pub fn check(&self) -> Result<(), String> {
        for (name, v) in [
            ("presence penalty", self.presence),
            ("frequency penalty", self.frequency),
        ] {
            if !v.is_finite() {
                return Err(format!("{name} must be a finite number, got {v}"));
            }
        }
        if !(self.repetition.is_finite() && self.repetition > 0.0) {
            return Err(format!(
                "repetition penalty must be a finite number > 0, got {}",
                self.repetition
            ));
        }
        Ok(())
    }
}

/// The tokens one generation has seen, to apply [`Penalties`] with.
#[derive(Debug, Clone)]
pub struct PenaltyTracker {
    penalties: Penalties,
    /// Distinct prompt tokens (the repetition penalty's share).
    prompt: HashSet<u32>,
    /// Generated token -> times generated.
    generated: HashMap<u32, u32>,
}

impl PenaltyTracker {
    pub fn new(penalties: Penalties, prompt: &[u32]) -> Self {
        let prompt = if penalties.repetition != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        PenaltyTracker {
            penalties,
            prompt,
            generated: HashMap::new(),
        }
    }

    /// Counts a generated token.
    pub fn record(&mut self, token: u32) {
        *self.generated.entry(token).or_insert(0) += 1;
    }

    /// Penalises `logits` (`[vocab]`); ids outside it are skipped.
    pub fn apply(&self, logits: &mut [f32]) {
        let p = &self.penalties;
        if p.repetition != 1.0 {
            let seen = self
                .prompt
                .iter()
                .chain(self.generated.keys().filter(|t| !self.prompt.contains(t)));
            for &t in seen {
                if let Some(v) = logits.get_mut(t as usize) {
                    *v = if *v > 0.0 {
                        *v / p.repetition
                    } else {
                        *v * p.repetition
                    };
                }
            }
        }
        if p.presence != 0.0 || p.frequency != 0.0 {
            for (&t, &n) in &self.generated {
                if let Some(v) = logits.get_mut(t as usize) {
                    *v -= p.presence + p.frequency * n as f32;
                }
            }
        }
    }
}

impl SamplingParams {
    /// Why these settings cannot be sampled with, if so: the temperature
    /// must be a finite number (0 or below: greedy), top-p within [0, 1],
    /// min-p a finite number >= 0, the penalties as [`Penalties::check`] says.
    pub fn check(&self) -> Result<(), String> {
        if !self.temperature.is_finite() {
            return Err(format!(
                "temperature must be a finite number, got {}",
                self.temperature
            ));
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return Err(format!("top-p must be between 0 and 1, got {}", self.top_p));
        }
        if !(self.min_p.is_finite() && self.min_p >= 0.0) {
            return Err(format!(
                "min-p must be a finite number >= 0, got {}",
                self.min_p
            ));
        }
        self.penalties.check()
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
///
/// The kept set is what the settings say (the k most likely, those within
/// `min_p` of the most likely, the smallest most-likely-first prefix
/// reaching `top_p`), found without sorting the vocabulary: a partial
/// selection finds the top-k boundary and a quickselect on mass the top-p
/// one. The draw walks the kept tokens in id order. Cost per token is a few
/// passes over the logits (1.6-5.2 ms for a 248k vocabulary on one core,
/// against 8-13 ms for a full sort; `cargo run --release -p
/// slipstream-engine --example sampler_bench`).
#[derive(Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// `[vocab]` unnormalised probabilities of the token being drawn (0 outside the kept set).
    weights: Vec<f64>,
    /// (id, logit) candidates for the selections.
    cand: Vec<(u32, f32)>,
    /// Draw as the CUDA backend does ([`Sampler::set_fixed_point`]).
    fixed_point: bool,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("params", &self.params)
            .field("rng", &self.rng)
            .finish_non_exhaustive()
    }
}

/// The largest value by `keep(best, v)`, 8 lanes at a time (a maximum is
/// exact, so the order does not matter); -inf for an empty slice.
#[inline(always)]
fn lane_max(values: &[f32], keep: impl Fn(f32, f32) -> f32) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = values.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = keep(*l, v);
        }
    }
    tail.iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |a, &b| keep(a, b))
}

/// Index of the largest value; ties go to the lowest index. NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    // The largest non-NaN value (`f32::max` ignores NaN), then its index.
    let max = lane_max(logits, f32::max);
    // Only NaN (or nothing): the last index, as a scan that lets NaN lose
    // to anything gives.
    let last = logits.len().saturating_sub(1);
    logits.iter().position(|&v| v == max).unwrap_or(last) as u32
}

/// The most likely finite logit in [`likelier_first`]'s order (largest, +0
/// above -0, lowest index among equals); `None` when none is finite. The
/// maximum in 8 lanes first (exact in any order), then its index.
fn most_likely_finite(logits: &[f32]) -> Option<(u32, f32)> {
    let max = lane_max(logits, |l, v| if v.is_finite() && v > l { v } else { l });
    // The order is `total_cmp`'s, where +0 is above -0.
    let first = |bits: u32| logits.iter().position(|v| v.to_bits() == bits);
    let at = if max == 0.0 {
        first(0).or_else(|| first((-0.0f32).to_bits()))
    } else {
        logits.iter().position(|&v| v == max && v.is_finite())
    };
    at.map(|i| (i as u32, logits[i]))
}

/// Most likely first; ties by the lower id (a total order).
fn likelier_first(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = Rng::new(params.seed);
        Sampler {
            params,
            rng,
            weights: Vec::new(),
            cand: Vec::new(),
            fixed_point: false,
        }
    }

    /// Draws with `slipstream_kernels::sample::draw` (integer weights, the
    /// CUDA backend's draw, which the device computes bit for bit) instead
    /// of the float sums of the CPU path: with it on, a seed gives the
    /// same tokens whether a row is drawn from on the device or here (rows
    /// kept for logprobs, the first token after a prompt). One value of the
    /// generator per drawn token. Vocabularies over `sample::MAX_VOCAB`
    /// stay on the float path.
    pub fn set_fixed_point(&mut self, on: bool) {
        self.fixed_point = on;
    }

    pub fn is_fixed_point(&self) -> bool {
        self.fixed_point
    }

    /// The settings of a fixed-point draw (`temperature > 0`).
    fn draw_params(&self) -> DrawParams {
        let p = &self.params;
        DrawParams {
            temperature: p.temperature,
            top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
            top_p: p.top_p,
            min_p: p.min_p,
        }
    }

    /// The next token's draw for the device: the settings and the
    /// generator's next value (consumed here, as [`Sampler::sample`]
    /// would); `None` when greedy (the device takes the argmax).
    pub fn next_device_draw(&mut self) -> Option<(DrawParams, f64)> {
        (!self.is_greedy()).then(|| (self.draw_params(), self.rng.next_f64()))
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether every draw is the [`argmax`] (temperature 0 or top-k 1):
    /// no random number is consumed, so the argmax may be taken elsewhere.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature <= 0.0 || self.params.top_k == 1
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        if self.fixed_point && logits.len() <= fixed::MAX_VOCAB {
            let u = self.rng.next_f64();
            return fixed::draw(logits, &self.draw_params(), u).unwrap_or_else(|| argmax(logits));
        }
        let Some(mass) = self.weigh_kept(logits) else {
            return argmax(logits);
        };
        let mut r = self.rng.next_f64() * mass;
        let mut last = 0;
        for (i, &w) in self.weights.iter().enumerate() {
            if w > 0.0 {
                last = i;
                r -= w;
                if r < 0.0 {
                    return i as u32;
                }
            }
        }
        last as u32
    }

    /// Fills `weights` with `exp((logit - max) / temperature)` for the kept
    /// tokens and 0 elsewhere; returns their sum, `None` when no logit is
    /// finite.
    fn weigh_kept(&mut self, logits: &[f32]) -> Option<f64> {
        let p = &self.params;
        let finite = |v: f32| v.is_finite();
        let top = most_likely_finite(logits)?;
        // The least likely token kept so far; tokens after it (most likely
        // first) are dropped.
        let mut boundary: Option<(u32, f32)> = None;
        let kept = |b: &Option<(u32, f32)>, i: usize, v: f32| {
            finite(v) && b.is_none_or(|b| likelier_first(&(i as u32, v), &b) != Ordering::Greater)
        };
        if p.top_k > 0 {
            fill_candidates(&mut self.cand, logits, |_, v| finite(v));
            if p.top_k < self.cand.len() {
                let (_, kth, _) = self
                    .cand
                    .select_nth_unstable_by(p.top_k - 1, likelier_first);
                boundary = Some(*kth);
            }
        }
        let max = top.1 as f64;
        let t = p.temperature as f64;
        self.weights.clear();
        self.weights
            .extend(logits.iter().enumerate().map(|(i, &v)| {
                if kept(&boundary, i, v) {
                    ((v as f64 - max) / t).exp()
                } else {
                    0.0
                }
            }));
        let total: f64 = self.weights.iter().sum();
        // min-p: a threshold on the weight (the most likely token weighs 1
        // and is always kept, also when min-p is above 1).
        if p.min_p > 0.0 {
            let floor = p.min_p as f64;
            for (i, w) in self.weights.iter_mut().enumerate() {
                if *w < floor && i != top.0 as usize {
                    *w = 0.0;
                }
            }
        }
        if p.top_p < 1.0 {
            let goal = p.top_p as f64 * total;
            let weights = &self.weights;
            fill_candidates(&mut self.cand, logits, |i, _| weights[i] > 0.0);
            let cut = cut_by_mass(&mut self.cand, &self.weights, goal);
            if let Some(b) = cut {
                for (i, (w, &v)) in self.weights.iter_mut().zip(logits).enumerate() {
                    if !kept(&Some(b), i, v) {
                        *w = 0.0;
                    }
                }
            }
        }
        if p.min_p > 0.0 || p.top_p < 1.0 {
            Some(self.weights.iter().sum())
        } else {
            Some(total)
        }
    }
}

/// Fills `cand` with the (id, logit) pairs that `keep(id, logit)` accepts.
fn fill_candidates(cand: &mut Vec<(u32, f32)>, logits: &[f32], keep: impl Fn(usize, f32) -> bool) {
    cand.clear();
    cand.extend(
        logits
            .iter()
            .enumerate()
            .filter(|&(i, &v)| keep(i, v))
            .map(|(i, &v)| (i as u32, v)),
    );
}

/// The least likely token of the shortest most-likely-first prefix of
/// `cand` whose weights reach `goal` (`None`: the whole set falls short, by
/// rounding). A quickselect on mass: each step splits at the median and goes
/// to the half that holds the crossing, so it reads about 2n candidates
/// whatever the distribution's shape.
fn cut_by_mass(cand: &mut [(u32, f32)], weights: &[f64], mut goal: f64) -> Option<(u32, f32)> {
    let weight = |c: &(u32, f32)| weights[c.0 as usize];
    let mut part = cand;
    while part.len() > 64 {
        let mid = part.len() / 2;
        part.select_nth_unstable_by(mid, likelier_first);
        let (likelier, rest) = part.split_at_mut(mid + 1);
        let mass: f64 = likelier.iter().map(weight).sum();
        if mass >= goal {
            part = likelier;
        } else {
            goal -= mass;
            part = rest;
        }
    }
    part.sort_unstable_by(likelier_first);
    let mut acc = 0.0;
    part.iter()
        .find(|c| {
            acc += weight(c);
            acc >= goal
        })
        .copied()
}

/// The full-sort form of the kept set ([`Sampler`] is tested against it and
/// `sampler_bench` times it): candidates sorted most likely first, cut by
/// top-k, min-p and top-p in that order; returns `(id, weight)` most likely
/// first, weights normalised to sum to 1 over the top-k set.
pub fn kept_by_sorting(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f64)> {
    let mut cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .map(|(i, &v)| (i as u32, v))
        .collect();
    if cand.is_empty() {
        return Vec::new();
    }
    cand.sort_by(likelier_first);
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
    cand.iter()
        .zip(probs)
        .take(keep)
        .map(|(&(i, _), q)| (i, q))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn check_refuses_settings_that_cannot_sample() {
        let ok = SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            min_p: 0.05,
            ..Default::default()
        };
        assert!(ok.check().is_ok());
        assert!(SamplingParams::default().check().is_ok());
        for bad in [
            SamplingParams {
                temperature: f32::NAN,
                ..ok.clone()
            },
            SamplingParams {
                temperature: f32::INFINITY,
                ..ok.clone()
            },
            SamplingParams {
                top_p: 1.5,
                ..ok.clone()
            },
            SamplingParams {
                top_p: -0.1,
                ..ok.clone()
            },
            SamplingParams {
                top_p: f32::NAN,
                ..ok.clone()
            },
            SamplingParams {
                min_p: -1.0,
                ..ok.clone()
            },
            SamplingParams {
                min_p: f32::NAN,
                ..ok.clone()
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn penalties_match_a_hand_reference() {
        // prompt [0, 1], generated [2, 2, 3]; vocab 5.
        let logits = [2.0f32, -1.0, 3.0, 0.5, 1.0];
        let run = |p: Penalties| {
            let mut t = PenaltyTracker::new(p, &[0, 1]);
            for tok in [2, 2, 3] {
                t.record(tok);
            }
            let mut l = logits;
            t.apply(&mut l);
            l
        };
        // Presence 0.5, frequency 0.25: token 2 (twice) -0.5-0.5, token 3 -0.5-0.25.
        let l = run(Penalties {
            presence: 0.5,
            frequency: 0.25,
            repetition: 1.0,
        });
        assert_eq!(l, [2.0, -1.0, 2.0, -0.25, 1.0]);
        // Repetition 2 over prompt and generated: positive halved, negative doubled, once each.
        let l = run(Penalties {
            repetition: 2.0,
            ..Penalties::default()
        });
        assert_eq!(l, [1.0, -2.0, 1.5, 0.25, 1.0]);
        // Both: repetition first, then the OpenAI penalties.
        let l = run(Penalties {
            presence: 1.0,
            frequency: 0.0,
            repetition: 2.0,
        });
        assert_eq!(l, [1.0, -2.0, 0.5, -0.75, 1.0]);
        // Off: unchanged.
        assert_eq!(run(Penalties::default()), logits);
        assert!(!Penalties::default().is_active());
        // An id outside the logits is skipped, not a panic.
        let mut t = PenaltyTracker::new(
            Penalties {
                repetition: 1.5,
                presence: 1.0,
                ..Penalties::default()
            },
            &[99],
        );
        t.record(77);
        let mut l = logits;
        t.apply(&mut l);
        assert_eq!(l, logits);
    }

    #[test]
    fn penalty_check_refuses_what_cannot_apply() {
        assert!(Penalties::default().check().is_ok());
        for bad in [
            Penalties {
                repetition: 0.0,
                ..Default::default()
            },
            Penalties {
                repetition: f32::NAN,
                ..Default::default()
            },
            Penalties {
                presence: f32::INFINITY,
                ..Default::default()
            },
            Penalties {
                frequency: f32::NAN,
                ..Default::default()
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?} accepted");
        }
    }

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
                ..Default::default()
            });
            for _ in 0..200 {
                assert!(allowed.contains(&s.sample(&logits)), "k={k} p={p} m={m}");
            }
        }
    }

    /// Logits with ties, masked (-inf) and NaN entries, as models give.
    fn logits_strategy() -> impl Strategy<Value = Vec<f32>> {
        prop::collection::vec(
            prop_oneof![
                8 => (-40i32..40).prop_map(|v| v as f32 * 0.25),
                4 => -10.0f32..10.0,
                1 => Just(f32::NEG_INFINITY),
                1 => Just(f32::NAN),
            ],
            1..300,
        )
    }

    fn params_strategy() -> impl Strategy<Value = SamplingParams> {
        (
            prop_oneof![Just(0.3f32), Just(0.8), Just(1.0), Just(2.5)],
            prop_oneof![Just(0usize), 2usize..80],
            prop_oneof![Just(1.0f32), 0.05f32..0.999, Just(0.0)],
            prop_oneof![Just(0.0f32), 0.001f32..0.5, Just(1.0), Just(1.5)],
            any::<u64>(),
        )
            .prop_map(|(temperature, top_k, top_p, min_p, seed)| SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                seed,
                ..Default::default()
            })
    }

    proptest! {
        /// The selection finds the full sort's kept set with its
        /// probabilities, and every draw comes from it.
        #[test]
        fn kept_set_matches_the_full_sort(
            logits in logits_strategy(),
            params in params_strategy(),
        ) {
            let reference = kept_by_sorting(&logits, &params);
            let mut s = Sampler::new(params.clone());
            let kept_mass = s.weigh_kept(&logits);
            prop_assert_eq!(kept_mass.is_some(), !reference.is_empty());
            let Some(kept_mass) = kept_mass else {
                return Ok(());
            };
            let total: f64 = reference.iter().map(|&(i, _)| s.weights[i as usize]).sum();
            let mass: f64 = s.weights.iter().sum();
            prop_assert_eq!(kept_mass, mass, "returned mass is not the weights' sum");
            prop_assert!((total - mass).abs() <= 1e-12 * mass, "weight outside the kept set");
            let scale = reference.iter().map(|r| r.1).sum::<f64>() / mass;
            for &(i, q) in &reference {
                let w = s.weights[i as usize] * scale;
                prop_assert!((w - q).abs() <= 1e-12 * q.max(1e-300), "token {i}: {w} vs {q}");
            }
            for _ in 0..8 {
                let t = s.sample(&logits);
                prop_assert!(reference.iter().any(|&(i, _)| i == t), "drew {t} outside the kept set");
            }
        }
    }

    proptest! {
        /// The fixed-point draw (the CUDA backend's) keeps the full sort's
        /// set, less tokens weighing under 2^-44 of the most likely, with
        /// its weights to 1e-12, and draws only from it.
        #[test]
        fn fixed_point_kept_set_matches_the_full_sort(
            logits in logits_strategy(),
            params in params_strategy(),
        ) {
            let reference = kept_by_sorting(&logits, &params);
            let mut s = Sampler::new(params.clone());
            s.set_fixed_point(true);
            let fixed = fixed::kept_weights(&logits, &s.draw_params());
            prop_assert_eq!(fixed.is_some(), !reference.is_empty());
            let Some(fixed) = fixed else {
                return Ok(());
            };
            let top_q = reference[0].1;
            for &(i, q) in &reference {
                let rel = q / top_q;
                let w = fixed[i as usize] as f64 / fixed::WEIGHT_ONE;
                prop_assert!(
                    (w - rel).abs() <= 1e-12 * rel + 1.0 / fixed::WEIGHT_ONE,
                    "token {}: weight {} vs {}", i, w, rel
                );
            }
            let outside = fixed
                .iter()
                .enumerate()
                .filter(|&(i, &w)| w > 0 && !reference.iter().any(|r| r.0 as usize == i))
                .count();
            prop_assert_eq!(outside, 0, "weight outside the kept set");
            for _ in 0..8 {
                let t = s.sample(&logits);
                prop_assert!(fixed[t as usize] > 0, "drew {} outside the kept set", t);
            }
        }
    }

    /// The scan `argmax` replaced: ties to the lowest index, NaN never wins.
    fn argmax_by_scan(logits: &[f32]) -> u32 {
        let mut best = 0usize;
        for (i, &v) in logits.iter().enumerate() {
            if v > logits[best] || logits[best].is_nan() {
                best = i;
            }
        }
        best as u32
    }

    proptest! {
        #[test]
        fn argmax_and_top_match_the_scans(
            logits in prop::collection::vec(
                prop_oneof![
                    4 => (-6i32..6).prop_map(|v| v as f32),
                    1 => Just(f32::NEG_INFINITY),
                    1 => Just(f32::INFINITY),
                    2 => Just(f32::NAN),
                    1 => Just(-0.0f32),
                ],
                0..40,
            ),
        ) {
            prop_assert_eq!(argmax(&logits), argmax_by_scan(&logits), "{:?}", logits);
            let top = logits
                .iter()
                .enumerate()
                .filter(|(_, v)| v.is_finite())
                .map(|(i, &v)| (i as u32, v))
                .min_by(likelier_first);
            prop_assert_eq!(most_likely_finite(&logits), top, "{:?}", logits);
        }
    }

    #[test]
    fn draws_follow_the_kept_probabilities() {
        let logits = vec![2.0, 1.0, 0.5, f32::NEG_INFINITY, 1.5, -3.0, 0.0, 1.0];
        for params in [
            SamplingParams {
                temperature: 0.7,
                seed: 5,
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.3,
                top_p: 0.8,
                seed: 6,
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.0,
                top_k: 4,
                min_p: 0.3,
                seed: 7,
                ..Default::default()
            },
        ] {
            let expect = kept_by_sorting(&logits, &params);
            let mass: f64 = expect.iter().map(|e| e.1).sum();
            for fixed_point in [false, true] {
                let mut s = Sampler::new(params.clone());
                s.set_fixed_point(fixed_point);
                let n = 40_000;
                let mut count = vec![0usize; logits.len()];
                for _ in 0..n {
                    count[s.sample(&logits) as usize] += 1;
                }
                for (i, c) in count.iter().enumerate() {
                    let q = expect
                        .iter()
                        .find(|e| e.0 as usize == i)
                        .map_or(0.0, |e| e.1 / mass);
                    let f = *c as f64 / n as f64;
                    assert!(
                        (f - q).abs() < 0.01,
                        "{params:?} fixed point {fixed_point}: token {i} drawn {f}, expected {q}"
                    );
                }
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
