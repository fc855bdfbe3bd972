//! Quick kernel timing: `cargo run --release -p slipstream-kernels --example kbench -- [threads] [exact|int16] [q4|q4_0|q8_0|q4_k|q5_k|q6_k]`
//! (weight type last: `q4`, the affine 4-bit group-64 layout, by default;
//! the others are GGML block types, with f32 activations).
//! Decode attention of one KV head's 8 query heads (hd 256) at several
//! context lengths: `... --example kbench -- attn`.
//! GGML blocks against their exact affine group-32 conversion (what
//! `repack` writes for a GGUF), interleaved rounds, one thread, CPU-time
//! medians: `... --example kbench -- convert [q4_0|q8_0] [rounds]`.
//! GGML blocks with exact f32 against int8 activations
//! (`Activations::Int8`), same weights and inputs, interleaved rounds, one
//! thread, CPU-time medians: `... --example kbench -- int8 [q4_0|q8_0|q4_k|q5_k|q6_k] [rounds]`.
use rand::{Rng, SeedableRng};
use slipstream_core::{QuantType, TensorView};
use slipstream_kernels::*;

fn main() {
    if std::env::args().nth(1).as_deref() == Some("attn") {
        return attention();
    }
    if std::env::args().nth(1).as_deref() == Some("attn-prompt") {
        return prompt_attention();
    }
    if std::env::args().nth(1).as_deref() == Some("convert") {
        return convert();
    }
    if std::env::args().nth(1).as_deref() == Some("int8") {
        return int8();
    }
    let threads: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(1);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    // Activation mode from the second argument: `exact` (default), `int16`
    // (affine weights) or `int8` (GGML block weights).
    let act = match std::env::args().nth(2).as_deref() {
        Some("int16") => Activations::Int16,
        Some("int8") => Activations::Int8,
        _ => Activations::Exact,
    };
    let q = match std::env::args().nth(3).as_deref() {
        None | Some("q4") => QuantType::Q4,
        Some("q4_0") => QuantType::Q4_0,
        Some("q8_0") => QuantType::Q8_0,
        Some("q4_k") => QuantType::Q4K,
        Some("q5_k") => QuantType::Q5K,
        Some("q6_k") => QuantType::Q6K,
        Some(o) => panic!("unknown weight type {o}"),
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    for &(rows, cols, n) in &[
        (64usize, 2048usize, 1usize),
        (512, 2048, 1),
        (2048, 512, 1),
        (512, 2048, 8),
        (512, 2048, 16),
        (512, 2048, 64),
        (2048, 2048, 256),
        (65536, 2048, 1),
    ] {
        let data = if q.is_ggml() {
            ggml_weights(&mut rng, q, rows, cols)
        } else {
            let mut data = vec![0u8; q.nbytes(rows, cols)];
            rng.fill(&mut data[..]);
            let code_bytes = rows * cols / 2;
            for p in data[code_bytes..].chunks_exact_mut(2) {
                let v = half::f16::from_f32(rng.random_range(-0.01f32..0.01));
                p.copy_from_slice(&v.to_le_bytes());
            }
            data
        };
        let w = TensorView::new(q, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..n * cols)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let mut y = vec![0f32; n * rows];
        let bytes = data.len() as f64;
        let iters = ((2e9 / bytes / n as f64) as usize).clamp(3, 20000);
        pool.install(|| {
            let mut best = f64::MAX;
            let mut best_cpu = f64::MAX;
            for _ in 0..3 {
                let c0 = cpu_ns();
                let t0 = std::time::Instant::now();
                for _ in 0..iters {
                    matmul_act(Isa::detect(), act, &w, &x, n, &mut y);
                }
                best = best.min(t0.elapsed().as_secs_f64() / iters as f64);
                best_cpu = best_cpu.min((cpu_ns() - c0) as f64 * 1e-9 / iters as f64);
            }
            if threads == 1 {
                println!("   cpu-time: {:.1} us, {:.2} GB/s weights/cpu-s, {:.2} GFLOP/cpu-s", best_cpu * 1e6, bytes / best_cpu / 1e9, 2.0 * (rows * cols * n) as f64 / best_cpu / 1e9);
            }
            println!(
                "{} [{rows}x{cols}] n={n} threads={threads}: {:.1} us, {:.2} GB/s weights, {:.2} GFLOP/s",
                q.name(),
                best * 1e6,
                bytes / best / 1e9,
                2.0 * (rows * cols * n) as f64 / best / 1e9
            );
        });
    }
}

/// `[rows, cols]` GGML blocks of `q`: 256 random rows quantized, repeated
/// (quantizing every row of the largest shape would take longer than the
/// timing).
fn ggml_weights(rng: &mut rand::rngs::StdRng, q: QuantType, rows: usize, cols: usize) -> Vec<u8> {
    let base = rows.min(256);
    let values: Vec<f32> = (0..base * cols)
        .map(|_| rng.random_range(-0.05f32..0.05))
        .collect();
    let block = ggml::quantize(&values, q);
    let mut data = Vec::with_capacity(q.nbytes(rows, cols));
    while data.len() < q.nbytes(rows, cols) {
        let n = block.len().min(q.nbytes(rows, cols) - data.len());
        data.extend_from_slice(&block[..n]);
    }
    data
}

/// `attention::attend_tokens` for one token at the 35B model's shape (8 query heads per KV
/// head, head dim 256, 2 KV heads per cache row): time per call and the
/// rate at which it reads the K and V rows.
fn attention() {
    let (group, hd, nkv) = (8usize, 256usize, 2usize);
    let stride = nkv * hd;
    let mut rng = rand::rngs::StdRng::seed_from_u64(2);
    let q: Vec<f32> = (0..group * hd)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    for keys in [256usize, 1024, 4096, 16384] {
        let (k, v) = (
            uniform(&mut rng, keys * stride),
            uniform(&mut rng, keys * stride),
        );
        let mut scores = vec![0f32; group * keys];
        let mut out = vec![0f32; group * hd];
        let best = best_of_3((400_000 / keys).max(3), &mut || {
            let kv = attention::KvRows {
                k: &k,
                v: &v,
                stride,
                hd,
            };
            attention::attend_tokens(
                Isa::detect(),
                &q,
                &kv,
                1,
                keys,
                0.0625,
                &mut scores,
                &mut out,
            );
            std::hint::black_box(&out);
        });
        let bytes = (2 * keys * hd * 4) as f64;
        println!(
            "attend one token, keys={keys}: {:.1} us, {:.2} GB/s of K and V",
            best * 1e6,
            bytes / best / 1e9
        );
    }
}

/// `len` values uniform in [-1, 1).
fn uniform(rng: &mut rand::rngs::StdRng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Seconds per call of `f`, the best of 3 rounds of `iters` calls.
fn best_of_3(iters: usize, f: &mut dyn FnMut()) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t0 = std::time::Instant::now();
        for _ in 0..iters {
            f();
        }
        best = best.min(t0.elapsed().as_secs_f64() / iters as f64);
    }
    best
}

/// Prompt attention of one KV head's 8 query heads (hd 256) for a block of
/// 8 consecutive tokens deep in a context, one thread: the whole kernel, and
/// its softmax alone over the same number of scores. Figures are the
/// kernel's multiply-adds (QK and PV) per wall second, best of 3.
fn prompt_attention() {
    let (group, hd, nkv, tokens) = (8usize, 256usize, 2usize, 8usize);
    let stride = nkv * hd;
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let q: Vec<f32> = (0..tokens * group * hd)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    for first_keys in [1024usize, 8192, 32768] {
        let keys = first_keys + tokens - 1;
        let (k, v) = (
            uniform(&mut rng, keys * stride),
            uniform(&mut rng, keys * stride),
        );
        let kv = attention::KvRows {
            k: &k,
            v: &v,
            stride,
            hd,
        };
        let mut scores = vec![0f32; tokens * group * keys];
        let mut out = vec![0f32; tokens * group * hd];
        let iters = (200_000 / keys).max(3);
        let whole = best_of_3(iters, &mut || {
            attention::attend_tokens(
                Isa::detect(),
                &q,
                &kv,
                tokens,
                first_keys,
                0.0625,
                &mut scores,
                &mut out,
            );
            std::hint::black_box(&out);
        });
        let soft = best_of_3(iters, &mut || {
            for row in scores.chunks_exact_mut(keys) {
                softmax::softmax_on(Isa::detect(), row);
            }
            std::hint::black_box(&scores);
        });
        let flops = (tokens * group * keys * hd * 4) as f64;
        println!(
            "attend_tokens tokens={tokens} keys={keys}: {:.0} us, {:.1} GFLOP/s; softmax alone {:.0} us ({:.0} %)",
            whole * 1e6,
            flops / whole / 1e9,
            soft * 1e6,
            100.0 * soft / whole
        );
    }
}

/// GGML `Q4_0` / `Q8_0` against the same weights converted exactly to
/// affine group 32 (`ggml::affine::to_affine`), same shapes, decode (1
/// token) and prompt (256 tokens) products. Rounds alternate the two
/// layouts so both see the same machine noise; each prints the median CPU
/// time per product over the rounds (the thread's schedstat time).
fn convert() {
    let q = match std::env::args().nth(2).as_deref() {
        None | Some("q4_0") => QuantType::Q4_0,
        Some("q8_0") => QuantType::Q8_0,
        Some(o) => panic!("convert takes q4_0 or q8_0, not {o}"),
    };
    let (rounds, pool) = rounds_on_one_thread();
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    println!(
        "isa: {:?}; {rounds} interleaved rounds, median CPU time per product",
        Isa::detect()
    );
    for &(rows, cols, n) in &[
        (512usize, 2048usize, 1usize),
        (2048, 512, 1),
        (4096, 2048, 1),
        (512, 2048, 256),
        (2048, 512, 256),
    ] {
        let data = ggml_weights(&mut rng, q, rows, cols);
        let (aq, adata) = ggml::affine::to_affine(q, &data).expect("exact conversion");
        let w = [
            TensorView::new(q, rows, cols, &data).unwrap(),
            TensorView::new(aq, rows, cols, &adata).unwrap(),
        ];
        let x: Vec<f32> = (0..n * cols)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let mut y = vec![0f32; n * rows];
        let iters = ((2e9 / data.len() as f64 / n as f64) as usize).clamp(5, 20000);
        let [g, a] = interleaved_medians(&pool, rounds, iters, |k| matmul(&w[k], &x, n, &mut y));
        println!(
            "[{rows}x{cols}] n={n}: {} {g:.1} us, {} {a:.1} us, ratio {:.2}x",
            q.name(),
            aq.name(),
            g / a
        );
    }
}

/// One GGML type with exact f32 and with int8 activations, same weights and
/// inputs: decode (1 token) and a 256-token prompt on `[2048x2048]` and
/// `[8192x2048]`. Rounds alternate the two modes; each prints the median
/// CPU time per product (the thread's schedstat time).
fn int8() {
    let q = match std::env::args().nth(2).as_deref() {
        None | Some("q4_0") => QuantType::Q4_0,
        Some("q8_0") => QuantType::Q8_0,
        Some("q4_k") => QuantType::Q4K,
        Some("q5_k") => QuantType::Q5K,
        Some("q6_k") => QuantType::Q6K,
        Some(o) => panic!("int8 takes a GGML type, not {o}"),
    };
    let (rounds, pool) = rounds_on_one_thread();
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let isa = Isa::detect();
    println!(
        "isa: {isa:?}; {} exact vs int8, {rounds} interleaved rounds, median CPU time per product",
        q.name()
    );
    for &(rows, cols, n) in &[
        (2048usize, 2048usize, 1usize),
        (8192, 2048, 1),
        (2048, 2048, 256),
        (8192, 2048, 256),
    ] {
        let data = ggml_weights(&mut rng, q, rows, cols);
        let w = TensorView::new(q, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..n * cols)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let mut y = vec![0f32; n * rows];
        let iters = ((1e9 / data.len() as f64 / n as f64) as usize).clamp(2, 20000);
        let acts = [Activations::Exact, Activations::Int8];
        let [e, i] = interleaved_medians(&pool, rounds, iters, |k| {
            matmul_act(isa, acts[k], &w, &x, n, &mut y)
        });
        println!(
            "[{rows}x{cols}] n={n}: exact {e:.1} us, int8 {i:.1} us, speed-up {:.2}x",
            e / i
        );
    }
}

/// The round count (third argument, default 9) and a one-thread pool, for
/// the interleaved comparisons.
fn rounds_on_one_thread() -> (usize, rayon::ThreadPool) {
    let rounds = std::env::args()
        .nth(3)
        .map(|s| s.parse().expect("rounds: a whole number"))
        .unwrap_or(9);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a one-thread pool");
    (rounds, pool)
}

/// Runs variant 0 and variant 1 of `product` `iters` times each, alternating
/// for `rounds` rounds on `pool` so both see the same machine noise; returns
/// each variant's median CPU time per call in microseconds.
fn interleaved_medians(
    pool: &rayon::ThreadPool,
    rounds: usize,
    iters: usize,
    mut product: impl FnMut(usize) + Send,
) -> [f64; 2] {
    let mut times = [Vec::new(), Vec::new()];
    pool.install(|| {
        for _ in 0..rounds {
            for (k, t) in times.iter_mut().enumerate() {
                let c0 = cpu_ns();
                for _ in 0..iters {
                    product(k);
                }
                t.push((cpu_ns() - c0) as f64 * 1e-3 / iters as f64);
            }
        }
    });
    times.map(|mut v| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    })
}

fn cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}
