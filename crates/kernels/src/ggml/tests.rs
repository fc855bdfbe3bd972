use super::check::{
    check_against_reference, check_batch_is_single, random_blocks, Problem, SplitMix, GGML_TYPES,
};
use super::*;
use crate::{matmul_with, matvec_with, Isa};
use proptest::prelude::*;

/// The dispatch's matmul for one ISA, as a kernel under test.
fn isa_kernel(isa: Isa) -> impl Fn(&TensorView, &[f32], usize, &mut [f32]) {
    move |w, x, n, y| matmul_with(isa, w, x, n, y)
}

/// A random case: type, rows (ragged, 1..70), blocks per row, tokens, seed.
/// [`check_against_reference`] and [`check_batch_is_single`] on every ISA
/// this CPU has, the failing ISA named.
fn check_every_isa(
    q: QuantType,
    rows: usize,
    cols: usize,
    n: usize,
    seed: u64,
    extreme: bool,
) -> Result<(), TestCaseError> {
    let reference_case = Problem::random(q, [rows, cols], n, seed, extreme, 0x5eed);
    let batch_case = Problem::random(q, [rows, cols], n, seed, true, 0xba7c);
    for isa in Isa::available() {
        let k = isa_kernel(isa);
        let r = check_against_reference(&k, &reference_case);
        prop_assert!(r.is_ok(), "{:?} seed {}: {}", isa, seed, r.unwrap_err());
        let r = check_batch_is_single(&k, &batch_case);
        prop_assert!(r.is_ok(), "{:?} seed {}: {}", isa, seed, r.unwrap_err());
    }
    Ok(())
}

fn case() -> impl Strategy<Value = (QuantType, usize, usize, usize, u64, bool)> {
    (
        proptest::sample::select(GGML_TYPES.to_vec()),
        1usize..70,
        1usize..5,
        1usize..10,
        any::<u64>(),
        any::<bool>(),
    )
        .prop_map(|(q, rows, nb, n, seed, extreme)| {
            let (be, _) = q.ggml_block().unwrap();
            (q, rows, nb * be, n, seed, extreme)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// The same generic checks on the float and affine types.
    #[test]
    fn generic_checks_on_other_types(
        q in proptest::sample::select(vec![
            QuantType::F32, QuantType::F16, QuantType::Bf16, QuantType::Q4, QuantType::Q8,
        ]),
        rows in 1usize..40,
        ng in 1usize..4,
        n in 1usize..7,
        seed in any::<u64>(),
    ) {
        let cols = 64 * ng;
        check_every_isa(q, rows, cols, n, seed, false)?;
    }

    #[test]
    fn kernels_match_reference((q, rows, cols, n, seed, extreme) in case()) {
        check_every_isa(q, rows, cols, n, seed, extreme)?;
    }

    #[test]
    fn matvec_is_matmul_row((q, rows, cols, _n, seed, _e) in case()) {
        let data = random_blocks(q, rows, cols, seed, true);
        let w = TensorView::new(q, rows, cols, &data).unwrap();
        let mut rng = SplitMix(seed);
        let x: Vec<f32> = (0..cols).map(|_| rng.uniform(-2.0, 2.0)).collect();
        for isa in Isa::available() {
            let mut a = vec![0f32; rows];
            let mut b = vec![0f32; rows];
            matvec_with(isa, &w, &x, &mut a);
            matmul_with(isa, &w, &x, 1, &mut b);
            prop_assert_eq!(
                a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn k_quantizers_error_bounded(
        q in proptest::sample::select(vec![QuantType::Q4K, QuantType::Q5K, QuantType::Q6K]),
        mag in proptest::sample::select(vec![1e-3f32, 1.0, 300.0]),
        shift in -1.0f32..1.0,
        seed in any::<u64>(),
    ) {
        let mut rng = SplitMix(seed);
        let vals: Vec<f32> = (0..2 * QK_K)
            .map(|i| (rng.uniform(-1.0, 1.0) * (1.0 + (i / 32 % 4) as f32) + shift) * mag)
            .collect();
        let bytes = quantize(&vals, q);
        let w = TensorView::new(q, 1, vals.len(), &bytes).unwrap();
        let mut deq = vec![0f32; vals.len()];
        dequantize_row(&w, 0, &mut deq);
        for (blk, (x, y)) in vals.chunks_exact(QK_K).zip(deq.chunks_exact(QK_K)).enumerate() {
            let b = &bytes[blk * q.ggml_block().unwrap().1..];
            // Bound from the fit: half a code step, plus what rounding the
            // 6/8-bit sub-block scales (at most half a super-scale step per
            // code, `nmax` codes) and the mins moves, plus f16 and f32 slack.
            let (nmax, d, dmin) = match q {
                QuantType::Q4K => (15.0, f16_at(b, 0), f16_at(b, 2)),
                QuantType::Q5K => (31.0, f16_at(b, 0), f16_at(b, 2)),
                _ => (32.0, f16_at(b, 208), 0.0),
            };
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (e, (&v, &r)) in x.iter().zip(y).enumerate() {
                let step = match q {
                    QuantType::Q6K => d * (b[192 + e / 16] as i8) as f32,
                    _ => {
                        let (sc, _) = scale_min_k4(&b[4..16]);
                        d * sc[e / 32] as f32
                    }
                };
                let bound = 0.5 * step + 0.5 * d * nmax + 0.5 * dmin + 2e-3 * amax;
                prop_assert!((v - r).abs() <= bound,
                    "{} e={} v={} deq={} bound={}", q.name(), e, v, r, bound);
            }
        }
    }
}

/// A prompt-sized case: type, rows (ragged across the GEMM path's 32-row
/// panels and 2-row tiles), columns (up to 3 of its 256-column blocks),
/// tokens 1..=17, seed, extreme scales.
fn gemm_case() -> impl Strategy<Value = (QuantType, usize, usize, usize, u64, bool)> {
    (
        proptest::sample::select(GGML_TYPES.to_vec()),
        1usize..75,
        1usize..25,
        1usize..18,
        any::<u64>(),
        any::<bool>(),
    )
        .prop_map(|(q, rows, nb, n, seed, extreme)| {
            let (be, _) = q.ggml_block().unwrap();
            let nb = if be == QK_K { nb % 3 + 1 } else { nb };
            (q, rows, nb * be, n, seed, extreme)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// The GEMM path, for every token count (each tile shape, ragged token
    /// blocks) and a ragged row range, gives each token's matvec bits.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn gemm_is_matvec_per_token((q, rows, cols, n, seed, extreme) in gemm_case()) {
        if !Isa::Avx2.is_supported() {
            return Ok(());
        }
        let data = random_blocks(q, rows, cols, seed, extreme);
        let w = TensorView::new(q, rows, cols, &data).unwrap();
        let mut rng = SplitMix(seed ^ 0x6e33);
        let x: Vec<f32> = (0..n * cols).map(|_| rng.uniform(-2.0, 2.0)).collect();
        let toks: Vec<crate::Token> = (0..n)
            .map(|t| crate::Token::new(&w, &x[t * cols..(t + 1) * cols], crate::Activations::Exact))
            .collect();
        let r0 = rows / 3;
        let mut got = vec![f32::NAN; (rows - r0) * n];
        // SAFETY: the CPU supports AVX2, FMA and F16C (checked above).
        unsafe { super::gemm::rows(&w, r0, rows, &toks, &mut got) };
        let mut y = vec![0f32; rows];
        for t in 0..n {
            matvec_with(Isa::Avx2, &w, &x[t * cols..(t + 1) * cols], &mut y);
            for r in r0..rows {
                prop_assert_eq!(y[r].to_bits(), got[(r - r0) * n + t].to_bits(),
                    "{} [{}x{}] n={} t={} r={}: matvec {} gemm {}",
                    q.name(), rows, cols, n, t, r, y[r], got[(r - r0) * n + t]);
            }
        }
    }

    /// Prompt-sized products through the dispatch (the GEMM path from 8
    /// tokens for Q6_K; the 4-token blocks below 32 for the others): within the reference's tolerance, and each token's bits
    /// those of the token alone, on every ISA.
    #[test]
    fn prompt_products_match_reference((q, rows, cols, n, seed, extreme) in gemm_case()) {
        check_every_isa(q, rows, cols, n, seed, extreme)?;
    }
}

#[test]
fn threaded_equals_inline() {
    let (rows, nb) = (301, 3);
    for q in GGML_TYPES {
        let cols = nb * q.ggml_block().unwrap().0;
        let data = random_blocks(q, rows, cols, 11, false);
        let w = TensorView::new(q, rows, cols, &data).unwrap();
        let mut rng = SplitMix(3);
        // 5: the 4-token blocks; 19: the GEMM path for Q6_K; 33: for all.
        for n in [5, 19, 33] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.uniform(-1.0, 1.0)).collect();
            for isa in Isa::available() {
                let mut a = vec![0f32; n * rows];
                let mut b = vec![0f32; n * rows];
                let one = rayon::ThreadPoolBuilder::new()
                    .num_threads(1)
                    .build()
                    .unwrap();
                one.install(|| matmul_with(isa, &w, &x, n, &mut a));
                let three = rayon::ThreadPoolBuilder::new()
                    .num_threads(3)
                    .build()
                    .unwrap();
                three.install(|| matmul_with(isa, &w, &x, n, &mut b));
                assert_eq!(a, b, "{isa:?} {q:?} n={n}");
            }
        }
    }
}

#[test]
fn scale_min_pack_roundtrip() {
    let mut rng = SplitMix(9);
    for _ in 0..1000 {
        let sc: [u8; 8] = std::array::from_fn(|_| (rng.next_u64() % 64) as u8);
        let m: [u8; 8] = std::array::from_fn(|_| (rng.next_u64() % 64) as u8);
        assert_eq!(scale_min_k4(&pack_scale_min_k4(&sc, &m)), (sc, m));
    }
}

#[test]
fn q4_0_known_block() {
    // Largest magnitude -8 at element 3: d = 1, codes q = x + 8.
    let mut x = [0f32; 32];
    for (i, v) in x.iter_mut().enumerate() {
        *v = (i % 16) as f32 - 8.0;
    }
    x[3] = -8.0;
    let b = quantize_q4_0(&x);
    assert_eq!(b.len(), 18);
    assert_eq!(f16_at(&b, 0), 1.0);
    let w = TensorView::new(QuantType::Q4_0, 1, 32, &b).unwrap();
    let mut out = [0f32; 32];
    dequantize_row(&w, 0, &mut out);
    assert_eq!(out, x);
    // Element 0 (-8) is the low nibble of byte 2, element 16 the high one.
    assert_eq!(b[2], 0x00);
    assert_eq!(b[3], 0x11);
}

/// The committed fixture from gguf-py (tools/reference/ggml_blocks.py).
mod fixture {
    use super::*;
    use std::path::PathBuf;

    fn dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/ggml_blocks")
    }

    fn read(name: &str) -> Vec<u8> {
        let p = dir().join(name);
        std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    fn f32s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    #[test]
    fn dequantize_matches_gguf_py_bit_for_bit() {
        for q in GGML_TYPES {
            let name = q.name();
            let blocks = read(&format!("{name}.blocks.bin"));
            let want = f32s(&read(&format!("{name}.dequant.f32.bin")));
            let (be, bb) = q.ggml_block().unwrap();
            assert_eq!(blocks.len() / bb * be, want.len(), "{name}");
            let w = TensorView::new(q, 1, want.len(), &blocks).unwrap();
            let mut got = vec![0f32; want.len()];
            dequantize_row(&w, 0, &mut got);
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), e.to_bits(), "{name} element {i}: {g} vs {e}");
            }
        }
    }

    #[test]
    fn quantize_matches_gguf_py_bit_for_bit() {
        let vals = f32s(&read("values.f32.bin"));
        assert_eq!(quantize_q4_0(&vals), read("q4_0.quant.bin"));
        assert_eq!(quantize_q8_0(&vals), read("q8_0.quant.bin"));
    }
}

// ---------------------------------------------------------------------------
// 8-bit activations (`Activations::Int8`, `q8`)
// ---------------------------------------------------------------------------

/// A random input for the 8-bit cases: magnitudes varying per 32 elements
/// (1e-3x to 1e3x), with `extreme` some all-zero blocks and single spikes.
fn q8_input(rng: &mut SplitMix, len: usize, extreme: bool) -> Vec<f32> {
    let mut x: Vec<f32> = (0..len).map(|_| rng.uniform(-1.0, 1.0)).collect();
    for b in x.chunks_mut(32) {
        let pick = rng.next_u64() % 8;
        let m = if extreme && pick == 0 {
            0.0
        } else if extreme && pick == 1 {
            1e-30
        } else {
            10f32.powf(rng.uniform(-3.0, 3.0))
        };
        for v in b.iter_mut() {
            *v *= m;
        }
        if extreme && pick == 2 {
            b[(rng.next_u64() % 32) as usize] = 3e4;
        }
    }
    x
}

fn int8_kernel(isa: Isa) -> impl Fn(&TensorView, &[f32], usize, &mut [f32]) {
    move |w, x, n, y| crate::matmul_act(isa, crate::Activations::Int8, w, x, n, y)
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(p, q)| p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Every ISA's 8-bit product is the scalar reference's bits, and `n`
    /// tokens at once are each token's one-token bits (ragged rows across
    /// the 4-token and 32-token blocks, several blocks, extreme scales).
    #[test]
    fn int8_isas_match_reference_and_one_token(
        (q, rows, cols, n, seed, extreme) in gemm_case(),
        n_extra in 0usize..40,
    ) {
        // Up to 56 tokens: past the AVX2 kernel's 32-token block.
        let n = n + if n_extra > 30 { n_extra } else { 0 };
        let data = random_blocks(q, rows, cols, seed, extreme);
        let w = TensorView::new(q, rows, cols, &data).unwrap();
        let mut rng = SplitMix(seed ^ 0x5eed);
        let x = q8_input(&mut rng, n * cols, extreme);
        let mut reference = vec![0f32; n * rows];
        int8_kernel(Isa::Scalar)(&w, &x, n, &mut reference);
        // The reference is `q8::dot` of the quantized input, element by element.
        for t in 0..n {
            let qx = q8::quantize_input(q, &x[t * cols..(t + 1) * cols]);
            for r in 0..rows {
                let v = q8::dot(q, row_bytes(&w, r), &qx);
                prop_assert!(same_bits(&[v], &[reference[t * rows + r]]));
            }
        }
        for isa in Isa::available() {
            let mut y = vec![0f32; n * rows];
            int8_kernel(isa)(&w, &x, n, &mut y);
            prop_assert!(same_bits(&y, &reference), "{:?} != scalar reference", isa);
            for t in 0..n {
                let mut y1 = vec![0f32; rows];
                crate::matvec_act(isa, crate::Activations::Int8, &w, &x[t * cols..(t + 1) * cols], &mut y1);
                prop_assert!(same_bits(&y1, &y[t * rows..(t + 1) * rows]), "{:?} token {}", isa, t);
            }
        }
    }

    /// The 8-bit product is within its rounding bound of the exact one:
    /// each input moves by at most ~0.5 code step (plus the f16 rounding of
    /// the `q8_0` step: 0.6 steps in all), so an output moves by at most
    /// `sum_j |w_j| * 0.6 * amax_block(j) / 127`, plus f32 rounding.
    #[test]
    fn int8_within_bound_of_exact((q, rows, cols, _n, seed, _e) in gemm_case()) {
        let data = random_blocks(q, rows, cols, seed, false);
        let w = TensorView::new(q, rows, cols, &data).unwrap();
        let mut rng = SplitMix(seed ^ 0xb0b);
        let x = q8_input(&mut rng, cols, false);
        let mut y = vec![0f32; rows];
        crate::matvec_act(Isa::detect(), crate::Activations::Int8, &w, &x, &mut y);
        let (be, _) = q.ggml_block().unwrap();
        let amax: Vec<f64> = x
            .chunks_exact(be.min(QK_K))
            .map(|b| b.iter().fold(0f64, |a, &v| a.max(v.abs() as f64)))
            .collect();
        let mut wr = vec![0f32; cols];
        for (r, &yr) in y.iter().enumerate() {
            dequantize_row(&w, r, &mut wr);
            let (mut exact, mut bound, mut mag) = (0f64, 0f64, 0f64);
            for j in 0..cols {
                let (wj, xj) = (wr[j] as f64, x[j] as f64);
                exact += wj * xj;
                mag += (wj * xj).abs();
                bound += wj.abs() * 0.6 * amax[j / be] / 127.0;
            }
            let err = (yr as f64 - exact).abs();
            prop_assert!(
                err <= bound + 1e-5 * (mag + bound) + 1e-30,
                "{} row {}: |{} - {}| = {} > bound {}", q.name(), r, yr, exact, err, bound
            );
        }
    }

    /// The `q8_0` input codes and steps are the `Q8_0` quantizer's (llama.cpp's
    /// `quantize_row_q8_0_ref`, checked against gguf-py above).
    #[test]
    fn q8_0_input_is_quantize_row_q8_0_ref(seed in any::<u64>(), nb in 1usize..6) {
        let mut rng = SplitMix(seed);
        let x = q8_input(&mut rng, nb * QK, true);
        let qx = q8::quantize_q8_0(&x);
        let bytes = quantize_q8_0(&x);
        for (b, blk) in bytes.chunks_exact(34).enumerate() {
            prop_assert_eq!(qx.d[b].to_bits(), f16_at(blk, 0).to_bits());
            for j in 0..QK {
                prop_assert_eq!(qx.qs[b * QK + j], blk[2 + j] as i8);
            }
        }
    }
}

/// `q8_K` rounding: `iscale = -127 / max` (the first element of largest
/// magnitude), codes rounded half to even (`nearest_int`), `d = 1 / iscale`,
/// sums per 16; an all-zero block is all zeros with `d = 0`.
#[test]
fn q8_k_input_known_block() {
    let mut x = vec![0f32; 2 * QK_K];
    // max = -127 (first of the largest magnitude) so iscale = 1.
    x[0] = -127.0;
    x[1] = 127.0;
    x[2] = 2.5;
    x[3] = 3.5;
    x[4] = -0.5;
    x[5] = -1.5;
    x[16] = 100.0;
    let q = q8::quantize_q8_k(&x);
    assert_eq!(q.d, vec![1.0, 0.0]);
    assert_eq!(&q.qs[..6], &[-127, 127, 2, 4, 0, -2]);
    assert_eq!(q.qs[16], 100);
    assert_eq!(q.bsums[0], 4); // -127 + 127 + 2 + 4 + 0 - 2
    assert_eq!(q.bsums[1], 100);
    // A positive max: iscale = -1, d = -1, codes of the opposite sign.
    let mut y = vec![0f32; QK_K];
    y[7] = 127.0;
    y[8] = -2.5;
    let q = q8::quantize_q8_k(&y);
    assert_eq!(q.d, vec![-1.0]);
    assert_eq!((q.qs[7], q.qs[8]), (-127, 2));
    assert!(q.qs[QK_K..].iter().all(|&v| v == 0));
    assert!(q.bsums[16..].iter().all(|&v| v == 0));
}

/// Every GGML type has an 8-bit kernel, and the other types ignore the mode
/// (their f32 products, bit for bit).
#[test]
fn int8_mode_scope() {
    for q in GGML_TYPES {
        assert!(q8::supports(q), "{}", q.name());
    }
    for q in [QuantType::F32, QuantType::Q4] {
        let (rows, cols) = (5, 64);
        let data = super::check::random_weights(q, rows, cols, 3, false);
        let w = TensorView::new(q, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let (mut a, mut b) = (vec![0f32; rows], vec![0f32; rows]);
        crate::matvec_act(Isa::detect(), crate::Activations::Int8, &w, &x, &mut a);
        crate::matvec_act(Isa::detect(), crate::Activations::Exact, &w, &x, &mut b);
        assert!(same_bits(&a, &b));
    }
}
