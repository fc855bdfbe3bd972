use crate::quantize::{from_f32, quantize_affine, to_f32};
use crate::*;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use slipstream_core::tensor::scale_to_f32;
use slipstream_core::ScaleType;

fn all_qtypes() -> Vec<QuantType> {
    let mut v = vec![QuantType::F32, QuantType::F16, QuantType::Bf16];
    for bits in [4u8, 8] {
        for scale in [ScaleType::F16, ScaleType::Bf16] {
            for group in [8u32, 24, 32, 64, 128] {
                v.push(QuantType::Affine { bits, group, scale });
            }
        }
    }
    v
}

/// A random weight case: qtype, rows, cols, byte offset, seed.
fn case() -> impl Strategy<Value = (QuantType, usize, usize, usize, u64)> {
    (
        proptest::sample::select(all_qtypes()),
        1usize..70,
        1usize..300,
        0usize..4,
        any::<u64>(),
    )
        .prop_map(|(q, rows, c, off, seed)| {
            let cols = match q {
                QuantType::Affine { group, .. } => group as usize * (1 + c % 4),
                _ => c,
            };
            (q, rows, cols, off, seed)
        })
}

fn rand_vals(rng: &mut impl Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Bits of the AVX2 and the AVX-512 forms of a 4-bit product (the GEMM path
/// when `gemm`, else the matrix-vector blocks) on random weights `[rows,
/// group * ncols]` and `n` tokens, over rows `rows / 3..rows`; two empty
/// vectors when the CPU lacks AVX-512.
#[cfg(target_arch = "x86_64")]
fn avx512_and_avx2(
    gemm: bool,
    group: u32,
    scale: ScaleType,
    rows: usize,
    ncols: usize,
    n: usize,
    seed: u64,
) -> (Vec<u32>, Vec<u32>) {
    if !Isa::Avx512.is_supported() {
        return (Vec::new(), Vec::new());
    }
    let q = QuantType::Affine {
        bits: 4,
        group,
        scale,
    };
    let cols = group as usize * ncols;
    let buf = weight_bytes(q, rows, cols, 0, seed);
    let w = TensorView::new(q, rows, cols, &buf).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x512);
    let x = rand_vals(&mut rng, n * cols);
    let toks: Vec<Token> = (0..n)
        .map(|t| Token::new(&w, &x[t * cols..(t + 1) * cols], Activations::Exact))
        .collect();
    let r0 = rows / 3;
    let bf16 = scale == ScaleType::Bf16;
    let g = group as usize;
    let mut want = vec![0f32; (rows - r0) * n];
    let mut got = vec![1f32; (rows - r0) * n];
    // SAFETY: `Isa::Avx512` (checked above) includes AVX2, FMA and F16C.
    unsafe {
        if gemm {
            crate::avx2::q4_gemm_rows(&w, r0, rows, &toks, &mut want, bf16, g);
            crate::avx512::q4_gemm_rows(&w, r0, rows, &toks, &mut got, bf16, g);
        } else {
            crate::avx2::q4_rows(&w, r0, rows, &toks, &mut want, bf16, g);
            crate::avx512::q4_rows(&w, r0, rows, &toks, &mut got, bf16, g);
        }
    }
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    (bits(&want), bits(&got))
}

/// Builds weight bytes at byte offset `off` of a fresh buffer (unaligned).
fn weight_bytes(q: QuantType, rows: usize, cols: usize, off: usize, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let vals: Vec<f32> = (0..rows * cols)
        .map(|i| {
            // Mix scales so groups differ a lot.
            let g = 1.0 + (i / 32 % 5) as f32 * 3.0;
            rng.random_range(-1.0f32..1.0) * g
        })
        .collect();
    let mut buf = vec![0u8; off];
    buf.extend(from_f32(&vals, rows, cols, q));
    buf
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn simd_matches_scalar_and_matmul_is_matvec(
        (q, rows, cols, off, seed) in case(),
        n in prop_oneof![1usize..9, 9usize..140],
    ) {
        let buf = weight_bytes(q, rows, cols, off, seed);
        let w = TensorView::new(q, rows, cols, &buf[off..]).unwrap();
        let dense = to_f32(&w);
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
        let x = rand_vals(&mut rng, n * cols);

        for isa in Isa::available() {
            let mut yb = vec![0f32; n * rows];
            matmul_with(isa, &w, &x, n, &mut yb);
            for t in 0..n {
                let xt = &x[t * cols..(t + 1) * cols];
                let mut y = vec![0f32; rows];
                matvec_with(isa, &w, xt, &mut y);
                let yt = &yb[t * rows..(t + 1) * rows];
                for r in 0..rows {
                    prop_assert_eq!(y[r].to_bits(), yt[r].to_bits(),
                        "{:?} {:?} t={} r={}", isa, q, t, r);
                }
                let mut ys = vec![0f32; rows];
                scalar::matvec(&w, xt, &mut ys);
                for r in 0..rows {
                    let wr = &dense[r * cols..(r + 1) * cols];
                    let mag: f32 = wr.iter().zip(xt).map(|(a, b)| (a * b).abs()).sum();
                    let exact: f64 = wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let tol = 1e-4 * mag + 1e-6;
                    prop_assert!((y[r] - ys[r]).abs() <= tol,
                        "{:?} {:?} r={} simd={} scalar={} tol={}", isa, q, r, y[r], ys[r], tol);
                    prop_assert!((ys[r] as f64 - exact).abs() <= tol as f64,
                        "{:?} r={} scalar={} exact={}", q, r, ys[r], exact);
                }
            }
            // The scalar module's matmul agrees bit for bit with its matvec too.
            if isa == Isa::Scalar {
                let mut y2 = vec![0f32; n * rows];
                scalar::matmul(&w, &x, n, &mut y2);
                prop_assert_eq!(
                    y2.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    yb.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
            }
        }
    }

    /// The AVX-512 GEMM path gives the AVX2 GEMM path's bits (which the test
    /// above ties to the matvec), for ragged rows, tokens and row ranges.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_gemm_equals_avx2_gemm(
        group in proptest::sample::select(vec![16u32, 32, 48, 64, 128]),
        scale in proptest::sample::select(vec![ScaleType::F16, ScaleType::Bf16]),
        rows in 1usize..80,
        ncols in 1usize..12,
        n in 1usize..40,
        seed in any::<u64>(),
    ) {
        let (want, got) = avx512_and_avx2(true, group, scale, rows, ncols, n, seed);
        prop_assert_eq!(want, got);
    }

    /// The AVX-512 matrix-vector blocks give the AVX2 blocks' bits, for one
    /// to seven tokens (the matvec and 4-token blocks) and ragged row ranges.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_matvec_equals_avx2_matvec(
        group in proptest::sample::select(vec![16u32, 32, 48, 64, 128]),
        scale in proptest::sample::select(vec![ScaleType::F16, ScaleType::Bf16]),
        rows in 1usize..80,
        ncols in 1usize..12,
        n in 1usize..8,
        seed in any::<u64>(),
    ) {
        let (want, got) = avx512_and_avx2(false, group, scale, rows, ncols, n, seed);
        prop_assert_eq!(want, got);
    }

    #[test]
    fn dequantize_row_matches_to_f32((q, rows, cols, off, seed) in case()) {
        let buf = weight_bytes(q, rows, cols, off, seed);
        let w = TensorView::new(q, rows, cols, &buf[off..]).unwrap();
        let dense = to_f32(&w);
        let mut out = vec![0f32; cols];
        for r in 0..rows {
            dequantize_row(&w, r, &mut out);
            prop_assert_eq!(&out[..], &dense[r * cols..(r + 1) * cols]);
        }
        if let QuantType::Affine { bits, group, scale } = q {
            // to_f32 is exactly scale * q + bias from the stored bytes.
            let (codes, s, b) = w.affine_parts();
            let group = group as usize;
            for (i, &d) in dense.iter().enumerate() {
                let code = if bits == 4 { (codes[i / 2] >> ((i & 1) * 4)) & 0xF } else { codes[i] };
                let g = i / group;
                let sv = scale_to_f32(scale, [s[2 * g], s[2 * g + 1]]);
                let bv = scale_to_f32(scale, [b[2 * g], b[2 * g + 1]]);
                prop_assert_eq!(d.to_bits(), (sv * code as f32 + bv).to_bits());
            }
        } else {
            // Float types round-trip exactly through from_f32.
            prop_assert_eq!(from_f32(&dense, rows, cols, q), buf[off..].to_vec());
        }
    }

    #[test]
    fn quantize_error_bounded(
        rows in 1usize..6,
        ngroups in 1usize..4,
        group in proptest::sample::select(vec![32usize, 64, 128]),
        bits in proptest::sample::select(vec![4u8, 8]),
        bf16 in any::<bool>(),
        mag in proptest::sample::select(vec![1e-3f32, 1.0, 100.0]),
        shift in -1.0f32..1.0,
        seed in any::<u64>(),
    ) {
        let st = if bf16 { ScaleType::Bf16 } else { ScaleType::F16 };
        let cols = group * ngroups;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let vals: Vec<f32> = (0..rows * cols)
            .map(|_| (rng.random_range(-1.0f32..1.0) + shift) * mag)
            .collect();
        let bytes = quantize_affine(&vals, rows, cols, bits, group, st);
        let q = QuantType::Affine { bits, group: group as u32, scale: st };
        let w = TensorView::new(q, rows, cols, &bytes).unwrap();
        let deq = to_f32(&w);
        let (_, s, b) = w.affine_parts();
        // Relative precision of the stored scale/bias type.
        let eps = if bf16 { 1.0 / 256.0 } else { 1.0 / 2048.0 };
        let n_bins = ((1u32 << bits) - 1) as f32;
        for (i, (&v, &d)) in vals.iter().zip(&deq).enumerate() {
            let g = i / group;
            let sv = scale_to_f32(st, [s[2 * g], s[2 * g + 1]]).abs();
            let bv = scale_to_f32(st, [b[2 * g], b[2 * g + 1]]).abs();
            let (s_signed, b_signed) = (
                scale_to_f32(st, [s[2 * g], s[2 * g + 1]]),
                scale_to_f32(st, [b[2 * g], b[2 * g + 1]]),
            );
            // Half a step inside the code range. MLX's zero-exact scale
            // (`edge / q0`) can leave the far end of the group up to one step
            // outside the range, where the code clamps: a full step there.
            // Plus what rounding scale and bias to storage moves, plus f32 slack.
            let t = (v - b_signed) / s_signed;
            let step = if (0.0..=n_bins).contains(&t) { sv / 2.0 } else { sv };
            // f16 scales below 2^-14 are subnormal: absolute quantum 2^-24.
            let tiny = if bf16 { 0.0 } else { (2.0f32).powi(-25) };
            let slack = eps * (bv + n_bins * sv) + n_bins * tiny + 1e-5 * (v.abs() + bv);
            prop_assert!((v - d).abs() <= step + slack,
                "i={} v={} d={} scale={} bias={}", i, v, d, sv, bv);
        }
    }
}

#[test]
fn quantize_known_group() {
    // 0..15 in a group of 32 (twice): scale 1, bias 0 representable exactly.
    let vals: Vec<f32> = (0..32).map(|i| (i % 16) as f32).collect();
    let bytes = quantize_affine(&vals, 1, 32, 4, 32, ScaleType::F16);
    let q4g32 = QuantType::Affine {
        bits: 4,
        group: 32,
        scale: ScaleType::F16,
    };
    let w = TensorView::new(q4g32, 1, 32, &bytes).unwrap();
    assert_eq!(to_f32(&w), vals);
    // w_max dominates: scale -1, bias 15, so q = 15 - v.
    assert_eq!(bytes[0], 0xEF);
    assert_eq!(bytes[7], 0x01);
    // An all-zero group quantizes to zeros.
    let z = quantize_affine(&[0.0; 64], 1, 64, 8, 64, ScaleType::Bf16);
    let w = TensorView::new(
        QuantType::Affine {
            bits: 8,
            group: 64,
            scale: ScaleType::Bf16,
        },
        1,
        64,
        &z,
    )
    .unwrap();
    assert!(to_f32(&w).iter().all(|&v| v == 0.0));
}

#[test]
fn threaded_equals_inline() {
    // Large enough to split across threads; compare with a 1-thread pool.
    let (rows, cols) = (301, 384);
    for q in all_qtypes() {
        let buf = weight_bytes(q, rows, cols, 1, 7);
        let w = TensorView::new(q, rows, cols, &buf[1..]).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for n in [5, 37] {
            let x = rand_vals(&mut rng, n * cols);
            for isa in Isa::available() {
                let mut a = vec![0f32; n * rows];
                let mut b = vec![0f32; n * rows];
                matmul_with(isa, &w, &x, n, &mut a);
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(1)
                    .build()
                    .unwrap();
                pool.install(|| matmul_with(isa, &w, &x, n, &mut b));
                assert_eq!(a, b, "{isa:?} {q:?}");
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(3)
                    .build()
                    .unwrap();
                let mut y = vec![0f32; rows];
                pool.install(|| matvec_with(isa, &w, &x[cols..2 * cols], &mut y));
                assert_eq!(&a[rows..2 * rows], &y[..], "{isa:?} {q:?}");
            }
        }
    }
}

#[test]
fn bytes_per_matvec_is_data_len() {
    let buf = weight_bytes(QuantType::Q4, 3, 64, 0, 1);
    let w = TensorView::new(QuantType::Q4, 3, 64, &buf).unwrap();
    assert_eq!(bytes_per_matvec(&w), buf.len());
}

/// Bandwidth figures; run with
/// `SLIPSTREAM_KERNEL_BENCH=1 cargo test -p slipstream-kernels --release bench -- --nocapture`.
#[test]
fn bench_matvec() {
    let Ok(mode) = std::env::var("SLIPSTREAM_KERNEL_BENCH") else {
        return;
    };
    // `SLIPSTREAM_KERNEL_BENCH=gemm[:ROWS,COLS,TOKENS[,THREADS]]`: one
    // prefill product (default [512x2048] x 256 on one thread), for
    // profiling the GEMM path.
    if let Some(spec) = mode.strip_prefix("gemm") {
        let dims: Vec<usize> = spec
            .trim_start_matches(':')
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| s.parse().expect("gemm:ROWS,COLS,TOKENS[,THREADS]"))
            .collect();
        let (rows, cols, n) = match dims[..] {
            [r, c, n, ..] => (r, c, n),
            _ => (512, 2048, 256),
        };
        let threads = dims.get(3).copied().unwrap_or(1);
        let q = QuantType::Q4;
        let buf = weight_bytes(q, rows, cols, 0, 1);
        let w = TensorView::new(q, rows, cols, &buf).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let x = rand_vals(&mut rng, n * cols);
        let mut y = vec![0f32; n * rows];
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        // Best of 40 (a shared machine's noise only ever slows a run down).
        let mut best = f64::MAX;
        for _ in 0..40 {
            let t0 = std::time::Instant::now();
            pool.install(|| matmul_with(Isa::detect(), &w, &x, n, &mut y));
            best = best.min(t0.elapsed().as_secs_f64());
        }
        let gflops = 2.0 * (rows * cols * n) as f64 / best * 1e-9;
        println!(
            "gemm [{rows}x{cols}] x {n}: best {:.2} ms, {gflops:.1} GFLOP/s ({threads} threads)",
            best * 1e3
        );
        return;
    }
    // `SLIPSTREAM_KERNEL_BENCH=quick`: one small shape (for profiling).
    let shapes: &[(usize, usize)] = if mode == "quick" {
        &[(512, 2048)]
    } else {
        &[(512, 2048), (2048, 512), (248320, 2048)]
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    for &(rows, cols) in shapes {
        let q = QuantType::Q4;
        // Random codes and sane scales/biases (quantizing 500M floats is slow).
        let mut data = vec![0u8; q.nbytes(rows, cols)];
        rng.fill(&mut data[..]);
        let code_bytes = rows * cols / 2;
        for p in data[code_bytes..].chunks_exact_mut(2) {
            let v = half::f16::from_f32(rng.random_range(-0.01f32..0.01));
            p.copy_from_slice(&v.to_le_bytes());
        }
        let w = TensorView::new(q, rows, cols, &data).unwrap();
        let x = rand_vals(&mut rng, cols);
        let mut y = vec![0f32; rows];
        let bytes = bytes_per_matvec(&w) as f64;
        let iters = ((4e9 / bytes) as usize).clamp(3, 20000);
        if mode == "quick" {
            let it = iters * 4;
            let t0 = thread_cpu_ns();
            for _ in 0..it {
                matvec_with(Isa::detect(), &w, &x, &mut y);
            }
            let dt = (thread_cpu_ns() - t0) as f64 * 1e-9 / it as f64;
            println!("quick matvec: {} iters, {:.1} us CPU", it, dt * 1e6);
            let it = iters;
            let xb = rand_vals(&mut rng, 8 * cols);
            let mut yb = vec![0f32; 8 * rows];
            let t0 = thread_cpu_ns();
            for _ in 0..it {
                matmul_with(Isa::detect(), &w, &xb, 8, &mut yb);
            }
            let dt = (thread_cpu_ns() - t0) as f64 * 1e-9 / it as f64;
            println!("quick matmul n=8: {} iters, {:.1} us CPU", it, dt * 1e6);
            return;
        }
        for threads in [1, rayon::current_num_threads()] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for isa in Isa::available() {
                if mode == "quick" && (isa == Isa::Scalar || threads > 1) {
                    continue;
                }
                pool.install(|| {
                    matvec_with(isa, &w, &x, &mut y);
                    let it = if isa == Isa::Scalar {
                        iters.div_ceil(8)
                    } else {
                        iters
                    };
                    let t0 = std::time::Instant::now();
                    for _ in 0..it {
                        matvec_with(isa, &w, &x, &mut y);
                    }
                    let dt = t0.elapsed().as_secs_f64() / it as f64;
                    println!(
                        "q4g64 [{rows}, {cols}] {isa:?} threads={threads}: {:.1} us, {:.2} GB/s",
                        dt * 1e6,
                        bytes / dt / 1e9
                    );
                });
            }
        }
        // Batched: matmul n=8 effective weight bandwidth.
        let n = 8;
        let xb = rand_vals(&mut rng, n * cols);
        let mut yb = vec![0f32; n * rows];
        let it = iters.div_ceil(4);
        let t0 = std::time::Instant::now();
        for _ in 0..it {
            matmul(&w, &xb, n, &mut yb);
        }
        let dt = t0.elapsed().as_secs_f64() / it as f64;
        println!(
            "q4g64 [{rows}, {cols}] matmul n={n} all threads: {:.1} us, {:.2} GB/s of weights, {:.2} us/token",
            dt * 1e6,
            bytes / dt / 1e9,
            dt * 1e6 / n as f64
        );
    }
}

/// CPU time of the calling thread in ns (Linux; 0 elsewhere).
fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

#[test]
fn isa_description_names_the_paths_this_cpu_takes() {
    assert_eq!(Isa::Scalar.describe(), "scalar");
    let avx2 = Isa::Avx2.describe();
    assert!(avx2.starts_with("AVX2+FMA+F16C"));
    // `Isa::Avx2` runs the AVX2 code whatever the CPU; `Isa::Avx512` names
    // its 16-lane paths and the AVX2 code it falls back to.
    assert!(!avx2.contains("AVX-512"));
    let avx512 = Isa::Avx512.describe();
    assert!(avx512.contains("AVX-512") && avx512.contains("AVX2"));
    // Detection picks the widest supported set, and only supported ones.
    let best = Isa::detect();
    assert!(best.is_supported() && Isa::available().contains(&best));
    assert_eq!(best == Isa::Avx512, Isa::Avx512.is_supported());
    if Isa::Avx512.is_supported() {
        assert!(Isa::Avx2.is_supported());
    }
}
