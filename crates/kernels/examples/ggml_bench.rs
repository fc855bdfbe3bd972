//! GGML block kernel timing next to the affine q4 kernel (the kbench
//! pattern): `cargo run --release -p slipstream-kernels --example ggml_bench -- [threads]`.
//!
//! Shapes: a `[64x2048]` that stays in L2 (compute-bound figure), an expert-sized `[512x2048]` cycled over enough distinct matrices
//! (~384 MiB) that every product reads its weights from DRAM, and a
//! head-sized `[248320x2048]`; decode (1 token) and 8- and 32-token prefill
//! on the expert shape (a busy expert), and a 256-token prompt chunk on a
//! dense `[2048x2048]`. Figures are weight bytes read per wall second, best of 3.
use slipstream_core::{QuantType, TensorView};
use slipstream_kernels::ggml::check::SplitMix;
use slipstream_kernels::*;

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("threads"))
        .unwrap_or(1);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    let types = [
        ("affine q4g64", QuantType::Q4),
        ("q4_0", QuantType::Q4_0),
        ("q8_0", QuantType::Q8_0),
        ("q4_k", QuantType::Q4K),
        ("q5_k", QuantType::Q5K),
        ("q6_k", QuantType::Q6K),
    ];
    let only: Option<String> = std::env::args().nth(2);
    let mut rng = SplitMix(1);
    for &(rows, cols, n, total) in &[
        (64usize, 2048usize, 1usize, 0usize),
        (512, 2048, 1, 384 << 20),
        (512, 2048, 8, 64 << 20),
        (512, 2048, 32, 64 << 20),
        (248320, 2048, 1, 0),
        (2048, 2048, 256, 0),
    ] {
        for (name, q) in types {
            if only.as_deref().is_some_and(|o| o != name) {
                continue;
            }
            let one = q.nbytes(rows, cols);
            let count = (total / one).max(1);
            let mut data = vec![0u8; one * count];
            rng.fill(&mut data);
            fix_scales(q, rows, cols, &mut data, &mut rng);
            let ws: Vec<TensorView> = data
                .chunks_exact(one)
                .map(|d| TensorView::new(q, rows, cols, d).expect("view"))
                .collect();
            let x: Vec<f32> = (0..n * cols).map(|_| rng.uniform(-1.0, 1.0)).collect();
            let mut y = vec![0f32; n * rows];
            // About 0.5 GB of weight reads per timed pass.
            let iters = ((0.5e9 / (one * n) as f64) as usize).clamp(2, 4000);
            pool.install(|| {
                let mut best = f64::MAX;
                for _ in 0..3 {
                    let t0 = std::time::Instant::now();
                    for i in 0..iters {
                        matmul(&ws[i % count], &x, n, &mut y);
                    }
                    best = best.min(t0.elapsed().as_secs_f64() / iters as f64);
                }
                println!(
                    "{name:<13} [{rows}x{cols}] n={n:<3} x{count:<4} threads={threads}: {:>9.1} us  {:>6.2} GB/s  {:>6.2} GFLOP/s",
                    best * 1e6,
                    one as f64 / best / 1e9,
                    2.0 * (rows * cols * n) as f64 / best / 1e9
                );
            });
        }
    }
}

/// Replaces the f16 scales of random bytes (`[rows, cols]` matrices back to
/// back) with small finite values: random bytes hold infinities and NaNs.
fn fix_scales(q: QuantType, rows: usize, cols: usize, data: &mut [u8], rng: &mut SplitMix) {
    let f16 = |rng: &mut SplitMix| half::f16::from_f32(rng.uniform(-0.01, 0.01)).to_le_bytes();
    if let Some((_, bb)) = q.ggml_block() {
        let offs: &[usize] = match q {
            QuantType::Q4_0 | QuantType::Q8_0 => &[0],
            QuantType::Q4K | QuantType::Q5K => &[0, 2],
            _ => &[208],
        };
        for b in data.chunks_exact_mut(bb) {
            for &o in offs {
                b[o..o + 2].copy_from_slice(&f16(rng));
            }
        }
    } else if let QuantType::Affine { bits, .. } = q {
        // Per matrix: codes, then scales and biases (all f16).
        let code_bytes = rows * cols * bits as usize / 8;
        for m in data.chunks_exact_mut(q.nbytes(rows, cols)) {
            for p in m[code_bytes..].chunks_exact_mut(2) {
                p.copy_from_slice(&f16(rng));
            }
        }
    }
}
