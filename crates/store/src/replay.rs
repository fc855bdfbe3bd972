//! Trace replay: runs a recorded route trace through one
//! [`LayerCache`] per layer under any policy, in trace order, exactly as the
//! runtime store would (so `aging`/`lfu`/`lru` reproduce the runtime's
//! counters), and reports misses per token.

use crate::policies::{build_online, Belady, POLICY_NAMES};
use crate::policy::{LayerCache, Policy};
use crate::trace::{Phase, TraceHeader, TraceRecord};

/// Which records go through the caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PhaseFilter {
    /// Every record, prefill and decode, as the runtime does.
    #[default]
    All,
    /// Decode records only (as if the caches started cold at generation).
    Decode,
    /// Prefill records only.
    Prefill,
}

impl PhaseFilter {
    pub fn admits(self, phase: Phase) -> bool {
        match self {
            PhaseFilter::All => true,
            PhaseFilter::Decode => phase == Phase::Decode,
            PhaseFilter::Prefill => phase == Phase::Prefill,
        }
    }
}

/// Counters of one replay (all layers together).
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayResult {
    pub policy: String,
    pub slots: usize,
    pub hits: u64,
    pub misses: u64,
    pub decode_hits: u64,
    pub decode_misses: u64,
    pub prefill_hits: u64,
    pub prefill_misses: u64,
    /// Tokens of the replayed decode records: their `tokens` summed over
    /// all records, divided by the number of layers (one per decode step).
    pub decode_tokens: u64,
    /// Likewise for the replayed prefill records.
    pub prefill_tokens: u64,
    /// `decode_misses / decode_tokens`; `None` without decode tokens.
    pub misses_per_decode_token: Option<f64>,
    /// `misses / (decode_tokens + prefill_tokens)`; `None` without tokens.
    pub misses_per_token: Option<f64>,
    /// Misses per layer.
    pub layer_misses: Vec<u64>,
}

/// Expands policy names: `all` becomes every policy of
/// [`POLICY_NAMES`]; duplicates are dropped; unknown names are an error.
pub fn expand_policies<S: AsRef<str>>(names: &[S]) -> Result<Vec<&'static str>, String> {
    let mut out: Vec<&'static str> = Vec::new();
    for name in names {
        let name = name.as_ref();
        let found: Vec<&'static str> = if name == "all" {
            POLICY_NAMES.to_vec()
        } else {
            vec![POLICY_NAMES
                .iter()
                .copied()
                .find(|&p| p == name)
                .ok_or_else(|| {
                    format!(
                        "unknown policy {name:?}: expected all or one of {}",
                        POLICY_NAMES.join(", ")
                    )
                })?]
        };
        for p in found {
            if !out.contains(&p) {
                out.push(p);
            }
        }
    }
    Ok(out)
}

/// Replays `records` (in order) through one `slots`-slot [`LayerCache`] per
/// layer under `policy` (a name of [`POLICY_NAMES`]; `all` is not accepted
/// here, see [`expand_policies`]). `belady` is given each layer's future
/// from the records.
pub fn replay(
    header: &TraceHeader,
    records: &[TraceRecord],
    slots: usize,
    policy: &str,
    phases: PhaseFilter,
) -> Result<ReplayResult, String> {
    // Size by the header, but never index out of bounds on odd records.
    let layers = records
        .iter()
        .map(|r| r.layer + 1)
        .max()
        .unwrap_or(0)
        .max(header.layers);
    let experts = records
        .iter()
        .filter_map(|r| r.experts.iter().max())
        .map(|&e| e as usize + 1)
        .max()
        .unwrap_or(0)
        .max(header.experts);
    let selected = || records.iter().filter(|r| phases.admits(r.phase));

    let build = |layer: usize| -> Result<Box<dyn Policy>, String> {
        if policy == "belady" {
            let future = selected()
                .filter(|r| r.layer == layer)
                .map(|r| r.experts.clone())
                .collect();
            return Ok(Box::new(Belady::new(experts, slots, future)));
        }
        build_online(policy, experts, slots).ok_or_else(|| {
            format!(
                "unknown policy {policy:?}: expected one of {}",
                POLICY_NAMES.join(", ")
            )
        })
    };
    let mut caches = (0..layers)
        .map(|l| Ok(LayerCache::new(build(l)?, experts, slots)))
        .collect::<Result<Vec<_>, String>>()?;

    let mut r = ReplayResult {
        policy: policy.to_string(),
        slots,
        hits: 0,
        misses: 0,
        decode_hits: 0,
        decode_misses: 0,
        prefill_hits: 0,
        prefill_misses: 0,
        decode_tokens: 0,
        prefill_tokens: 0,
        misses_per_decode_token: None,
        misses_per_token: None,
        layer_misses: vec![0; layers],
    };
    let (mut decode_layer_tokens, mut prefill_layer_tokens) = (0u64, 0u64);
    for rec in selected() {
        let c = &mut caches[rec.layer];
        let (h0, m0) = (c.hits, c.misses);
        c.access(&rec.experts, &rec.counts, rec.tokens);
        let (h, m) = (c.hits - h0, c.misses - m0);
        r.layer_misses[rec.layer] += m;
        match rec.phase {
            Phase::Decode => {
                r.decode_hits += h;
                r.decode_misses += m;
                decode_layer_tokens += rec.tokens as u64;
            }
            Phase::Prefill => {
                r.prefill_hits += h;
                r.prefill_misses += m;
                prefill_layer_tokens += rec.tokens as u64;
            }
        }
    }
    r.hits = r.decode_hits + r.prefill_hits;
    r.misses = r.decode_misses + r.prefill_misses;
    let per_layer = layers.max(1) as u64;
    r.decode_tokens = decode_layer_tokens / per_layer;
    r.prefill_tokens = prefill_layer_tokens / per_layer;
    let per = |misses: u64, tokens: u64| (tokens > 0).then(|| misses as f64 / tokens as f64);
    r.misses_per_decode_token = per(r.decode_misses, r.decode_tokens);
    r.misses_per_token = per(r.misses, r.decode_tokens + r.prefill_tokens);
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PolicyKind;

    /// Deterministic splitmix64.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
            z ^ (z >> 31)
        }
        fn unit(&mut self) -> f64 {
            (self.next() >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    /// `experts` experts, top-`k`, `layers` layers: a 64-token prefill in
    /// two chunks, then `steps` decode steps. Popularity is Zipf-ish
    /// (weight 1/(rank+1), a different rank order per layer); each decode
    /// token keeps each of the previous token's experts with probability
    /// 0.5 and draws the rest from the popularity.
    fn synthetic(
        experts: usize,
        k: usize,
        layers: usize,
        steps: usize,
        seed: u64,
    ) -> (TraceHeader, Vec<TraceRecord>) {
        let mut rng = Rng(seed);
        let header = TraceHeader {
            layers,
            experts,
            top_k: k,
        };
        let weights: Vec<Vec<f64>> = (0..layers)
            .map(|l| {
                (0..experts)
                    .map(|e| 1.0 / (((e * 7 + l * 3) % experts) as f64 + 1.0))
                    .collect()
            })
            .collect();
        let draw = |rng: &mut Rng, l: usize, taken: &[u32]| -> u32 {
            let total: f64 = (0..experts)
                .filter(|e| !taken.contains(&(*e as u32)))
                .map(|e| weights[l][e])
                .sum();
            let mut x = rng.unit() * total;
            for (e, w) in weights[l].iter().enumerate() {
                if taken.contains(&(e as u32)) {
                    continue;
                }
                x -= w;
                if x <= 0.0 {
                    return e as u32;
                }
            }
            (0..experts as u32)
                .rev()
                .find(|e| !taken.contains(e))
                .unwrap()
        };
        let pick = |rng: &mut Rng, l: usize, prev: &[u32]| -> Vec<u32> {
            let mut taken: Vec<u32> = prev.iter().copied().filter(|_| rng.unit() < 0.5).collect();
            while taken.len() < k {
                let e = draw(rng, l, &taken);
                taken.push(e);
            }
            taken.sort();
            taken
        };
        let mut records = Vec::new();
        let mut prev = vec![Vec::new(); layers];
        for _chunk in 0..2 {
            for (l, prev) in prev.iter_mut().enumerate() {
                let mut counts = vec![0u32; experts];
                for _ in 0..32 {
                    let t = pick(&mut rng, l, prev);
                    for &e in &t {
                        counts[e as usize] += 1;
                    }
                    *prev = t;
                }
                let experts_used: Vec<u32> = (0..experts as u32)
                    .filter(|&e| counts[e as usize] > 0)
                    .collect();
                records.push(TraceRecord {
                    phase: Phase::Prefill,
                    layer: l,
                    tokens: 32,
                    counts: experts_used.iter().map(|&e| counts[e as usize]).collect(),
                    experts: experts_used,
                });
            }
        }
        for _ in 0..steps {
            for (l, prev) in prev.iter_mut().enumerate() {
                let t = pick(&mut rng, l, prev);
                records.push(TraceRecord {
                    phase: Phase::Decode,
                    layer: l,
                    tokens: 1,
                    counts: vec![1; t.len()],
                    experts: t.clone(),
                });
                *prev = t;
            }
        }
        (header, records)
    }

    #[test]
    fn belady_is_a_lower_bound_and_big_caches_only_miss_cold() {
        let (header, records) = synthetic(16, 4, 2, 500, 42);
        for phases in [PhaseFilter::All, PhaseFilter::Decode] {
            for slots in [1, 2, 4, 8] {
                let best = replay(&header, &records, slots, "belady", phases).unwrap();
                for p in POLICY_NAMES {
                    let r = replay(&header, &records, slots, p, phases).unwrap();
                    assert!(
                        best.misses <= r.misses,
                        "{phases:?} slots {slots}: belady {} > {p} {}",
                        best.misses,
                        r.misses
                    );
                    assert_eq!(r.hits + r.misses, best.hits + best.misses);
                }
            }
            for slots in [16, 20] {
                for l in 0..header.layers {
                    let mut distinct: Vec<u32> = records
                        .iter()
                        .filter(|r| r.layer == l && phases.admits(r.phase))
                        .flat_map(|r| r.experts.iter().copied())
                        .collect();
                    distinct.sort();
                    distinct.dedup();
                    for p in POLICY_NAMES {
                        let r = replay(&header, &records, slots, p, phases).unwrap();
                        assert_eq!(r.layer_misses[l], distinct.len() as u64, "{p} layer {l}");
                    }
                }
            }
        }
    }

    #[test]
    fn runtime_policies_match_a_direct_layer_cache_loop() {
        let (header, records) = synthetic(16, 4, 3, 200, 7);
        for kind in PolicyKind::ALL {
            for slots in [1, 3, 6, 16] {
                let mut caches: Vec<LayerCache> = (0..header.layers)
                    .map(|_| LayerCache::new(kind.build(header.experts), header.experts, slots))
                    .collect();
                let (mut dm, mut pm) = (0, 0);
                for rec in &records {
                    let c = &mut caches[rec.layer];
                    let before = c.misses;
                    c.access(&rec.experts, &rec.counts, rec.tokens);
                    match rec.phase {
                        Phase::Decode => dm += c.misses - before,
                        Phase::Prefill => pm += c.misses - before,
                    }
                }
                let hits: u64 = caches.iter().map(|c| c.hits).sum();
                let misses: u64 = caches.iter().map(|c| c.misses).sum();
                let r = replay(&header, &records, slots, kind.name(), PhaseFilter::All).unwrap();
                assert_eq!((r.hits, r.misses), (hits, misses), "{kind} {slots}");
                assert_eq!((r.decode_misses, r.prefill_misses), (dm, pm));
                assert_eq!((r.decode_tokens, r.prefill_tokens), (200, 64));
                assert_eq!(r.misses_per_decode_token, Some(dm as f64 / 200.0));
                assert_eq!(r.misses_per_token, Some(misses as f64 / 264.0));
            }
        }
    }

    #[test]
    fn names_and_filters() {
        assert_eq!(expand_policies(&["all"]).unwrap(), POLICY_NAMES.to_vec());
        assert_eq!(
            expand_policies(&["lru", "arc", "lru"]).unwrap(),
            vec!["lru", "arc"]
        );
        assert!(expand_policies(&["fifo"]).is_err());
        let (header, records) = synthetic(8, 2, 1, 10, 1);
        assert!(replay(&header, &records, 2, "all", PhaseFilter::All).is_err());
        let r = replay(&header, &records, 2, "lru", PhaseFilter::Prefill).unwrap();
        assert_eq!(
            (r.decode_tokens, r.decode_misses, r.misses_per_decode_token),
            (0, 0, None)
        );
        assert_eq!(r.prefill_tokens, 64);
        let r = replay(&header, &records, 2, "lru", PhaseFilter::Decode).unwrap();
        assert_eq!((r.prefill_tokens, r.decode_tokens), (0, 10));
    }
}
