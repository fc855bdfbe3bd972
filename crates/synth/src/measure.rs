//! Measuring a model's routing: run it greedily over a prompt, record every
//! layer's routed experts, and replay them through per-layer caches (LRU,
//! Belady). Used for calibration and tests; needs no expert store.

use std::path::Path;

use slipstream_core::{BoxError, ExpertRequest, ExpertSource, ExpertWeights};
use slipstream_format::SlipModel;
use slipstream_models::Logits;

use crate::gen::Rng;

/// Reads each requested expert from the file (page cache) and verifies it.
struct FileExperts<'a> {
    file: &'a SlipModel,
    buf: Vec<u8>,
}

impl ExpertSource for FileExperts<'_> {
    fn with_experts(
        &mut self,
        request: &ExpertRequest<'_>,
        compute: &mut dyn FnMut(u32, ExpertWeights<'_>),
    ) -> Result<(), BoxError> {
        for &e in request.experts {
            self.file
                .read_expert(request.layer, e as usize, &mut self.buf)?;
            let w = self
                .file
                .expert_views(request.layer, e as usize, &self.buf)?;
            compute(e, w);
        }
        Ok(())
    }
}

/// One layer's access: the distinct experts of a batch.
#[derive(Debug, Clone)]
pub struct Access {
    pub decode: bool,
    pub layer: usize,
    pub experts: Vec<u32>,
}

/// What a greedy run routed.
#[derive(Debug, Clone)]
pub struct RouteRun {
    pub layers: usize,
    pub experts: usize,
    pub tokens: Vec<u32>,
    /// In order: prefill (one access per layer), then one per layer per
    /// decode forward pass.
    pub accesses: Vec<Access>,
    /// Decode forward passes (generated tokens - 1, as the engine counts).
    pub decode_steps: usize,
    pub all_finite: bool,
    /// Largest |logit| seen.
    pub max_abs_logit: f32,
}

/// Random prompt ids in `0..vocab` from `seed`.
pub fn random_prompt(vocab: usize, n: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

/// Runs `prompt` (one prefill chunk) then `max_new` greedy tokens.
pub fn run_routes(model: &Path, prompt: &[u32], max_new: usize) -> Result<RouteRun, BoxError> {
    let file = SlipModel::open(model)?;
    let cfg = file.manifest.config.clone();
    let m = slipstream_models::load(&cfg, &file)?;
    let mut src = FileExperts {
        file: &file,
        buf: vec![0u8; file.expert_buf_bytes()],
    };
    let mut state = m.new_state();
    let mut accesses = Vec::new();
    let mut all_finite = true;
    let mut max_abs = 0f32;
    let mut check = |l: &[f32]| {
        for &v in l {
            if !v.is_finite() {
                all_finite = false;
            } else {
                max_abs = max_abs.max(v.abs());
            }
        }
    };
    let mut logits = {
        let mut obs = |layer: usize, routes: &[slipstream_models::Route]| {
            let mut set: Vec<u32> = routes.iter().flat_map(|r| r.experts.clone()).collect();
            set.sort_unstable();
            set.dedup();
            accesses.push(Access {
                decode: false,
                layer,
                experts: set,
            });
        };
        m.forward(&mut state, prompt, &mut src, Logits::Last, Some(&mut obs))?
    };
    check(&logits);
    let mut tokens = Vec::new();
    let mut decode_steps = 0;
    while tokens.len() < max_new {
        let next = argmax(&logits);
        tokens.push(next);
        if tokens.len() == max_new {
            break;
        }
        let mut obs = |layer: usize, routes: &[slipstream_models::Route]| {
            let mut set = routes[0].experts.clone();
            set.sort_unstable();
            accesses.push(Access {
                decode: true,
                layer,
                experts: set,
            });
        };
        logits = m.forward(&mut state, &[next], &mut src, Logits::Last, Some(&mut obs))?;
        check(&logits);
        decode_steps += 1;
    }
    Ok(RouteRun {
        layers: cfg.num_layers(),
        experts: cfg.num_experts,
        tokens,
        accesses,
        decode_steps,
        all_finite,
        max_abs_logit: max_abs,
    })
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Cache replay results, per decode step summed over the run's layers.
#[derive(Debug, Clone, Copy)]
pub struct CacheStats {
    pub lru_misses_per_token: f64,
    pub belady_misses_per_token: f64,
    /// Distinct experts requested per decode step, all layers.
    pub requests_per_token: f64,
}

/// Replays `run` through per-layer caches of `slots` experts.
pub fn replay(run: &RouteRun, slots: usize) -> CacheStats {
    let mut lru_misses = 0u64;
    let mut bel_misses = 0u64;
    let mut requests = 0u64;
    for layer in 0..run.layers {
        let seq: Vec<&Access> = run.accesses.iter().filter(|a| a.layer == layer).collect();
        // LRU.
        let mut last = vec![u64::MAX; run.experts]; // MAX = not resident
        let mut resident = 0usize;
        for (t, a) in seq.iter().enumerate() {
            let t = t as u64;
            for &e in &a.experts {
                let e = e as usize;
                if last[e] != u64::MAX {
                    last[e] = t;
                    continue;
                }
                if a.decode {
                    lru_misses += 1;
                }
                if resident < slots {
                    resident += 1;
                } else {
                    // Evict the least recently used one not used by this access.
                    let victim = (0..run.experts)
                        .filter(|&x| last[x] != u64::MAX && last[x] < t)
                        .min_by_key(|&x| last[x]);
                    match victim {
                        Some(v) => last[v] = u64::MAX,
                        None => continue, // batch larger than the cache: not kept
                    }
                }
                last[e] = t;
            }
            if a.decode {
                requests += a.experts.len() as u64;
            }
        }
        // Belady: evict the resident expert whose next use is farthest.
        let mut uses: Vec<Vec<usize>> = vec![Vec::new(); run.experts];
        for (t, a) in seq.iter().enumerate() {
            for &e in &a.experts {
                uses[e as usize].push(t);
            }
        }
        let next_use = |e: usize, t: usize| -> usize {
            let u = &uses[e];
            let i = u.partition_point(|&x| x <= t);
            u.get(i).copied().unwrap_or(usize::MAX)
        };
        let mut res = vec![false; run.experts];
        let mut count = 0usize;
        for (t, a) in seq.iter().enumerate() {
            for &e in &a.experts {
                let e = e as usize;
                if res[e] {
                    continue;
                }
                if a.decode {
                    bel_misses += 1;
                }
                if count < slots {
                    count += 1;
                    res[e] = true;
                    continue;
                }
                let in_access = |x: usize| a.experts.binary_search(&(x as u32)).is_ok();
                let victim = (0..run.experts)
                    .filter(|&x| res[x] && !in_access(x))
                    .max_by_key(|&x| next_use(x, t));
                if let Some(v) = victim {
                    if next_use(v, t) > next_use(e, t) {
                        res[v] = false;
                        res[e] = true;
                    }
                }
            }
        }
    }
    let steps = run.decode_steps.max(1) as f64;
    CacheStats {
        lru_misses_per_token: lru_misses as f64 / steps,
        belady_misses_per_token: bel_misses as f64 / steps,
        requests_per_token: requests as f64 / steps,
    }
}
