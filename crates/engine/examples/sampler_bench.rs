//! Time per sampled token at a real vocabulary size: the sampler's
//! selections against the full sort it replaced (`kept_by_sorting` plus a
//! draw), on flat logits (a random-weight model) and peaked ones (a trained
//! model's usual shape); and the fixed-point draw of the CUDA backend as
//! the host computes it (`Sampler::set_fixed_point`: its scalar reference,
//! used for rows that are on the host anyway).
//!
//! `cargo run --release -p slipstream-engine --example sampler_bench [-- VOCAB]`

use std::time::Instant;

use slipstream_engine::sampler::{kept_by_sorting, Rng};
use slipstream_engine::{Sampler, SamplingParams};

/// Median of `rounds` timings of `f`, in milliseconds.
fn median_ms(rounds: usize, mut f: impl FnMut()) -> f64 {
    let mut t: Vec<f64> = (0..rounds)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[rounds / 2]
}

fn main() {
    let vocab: usize = std::env::args()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(248_320);
    let mut rng = Rng::new(1);
    let mut normal = || {
        // Box-Muller from two uniforms.
        let (a, b) = (rng.next_f64().max(1e-300), rng.next_f64());
        ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
    };
    let flat: Vec<f32> = (0..vocab).map(|_| normal()).collect();
    let peaked: Vec<f32> = (0..vocab).map(|_| 3.0 * normal()).collect();
    let settings = [
        ("temperature 1", 1.0, 0, 1.0, 0.0),
        ("temperature 0.7, top-p 0.95", 0.7, 0, 0.95, 0.0),
        ("temperature 0.8, top-k 40", 0.8, 40, 1.0, 0.0),
        ("temperature 1, min-p 0.05", 1.0, 0, 1.0, 0.05),
        ("greedy", 0.0, 0, 1.0, 0.0),
    ];
    println!("vocabulary {vocab}, one thread, median of 15 rounds of 4 draws");
    println!(
        "| logits | setting | selection ms/token | full sort ms/token | speed-up | fixed point ms/token |\n| --- | --- | ---: | ---: | ---: | ---: |"
    );
    for (name, logits) in [("flat", &flat), ("peaked", &peaked)] {
        for (label, temperature, top_k, top_p, min_p) in settings {
            let params = SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                seed: 9,
                ..Default::default()
            };
            let mut sampler = Sampler::new(params.clone());
            let fast = median_ms(15, || {
                for _ in 0..4 {
                    std::hint::black_box(sampler.sample(logits));
                }
            }) / 4.0;
            let mut draw = Rng::new(9);
            let sorted = median_ms(15, || {
                for _ in 0..4 {
                    let kept = if temperature <= 0.0 {
                        vec![(slipstream_engine::sampler::argmax(logits), 1.0)]
                    } else {
                        kept_by_sorting(logits, &params)
                    };
                    let mut r = draw.next_f64();
                    let pick = kept
                        .iter()
                        .find(|k| {
                            r -= k.1;
                            r < 0.0
                        })
                        .map_or(kept[kept.len() - 1].0, |k| k.0);
                    std::hint::black_box(pick);
                }
            }) / 4.0;
            let mut fixed_point = Sampler::new(params.clone());
            fixed_point.set_fixed_point(true);
            let fixed = median_ms(15, || {
                for _ in 0..4 {
                    std::hint::black_box(fixed_point.sample(logits));
                }
            }) / 4.0;
            println!(
                "| {name} | {label} | {fast:.3} | {sorted:.3} | {:.1}x | {fixed:.3} |",
                sorted / fast
            );
        }
    }
}
