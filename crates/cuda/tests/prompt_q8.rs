//! The 8-bit prompt forms (kernels/prompt_q8.cu) against their scalar
//! reference (x quantized per group of 64 as `q8_split` does, products in
//! f64), on ragged shapes: each token's bits independent of the pass
//! length and of the tokens beside it, grouped experts the bits of
//! per-pair launches, and the quantization error against the exact f32
//! products within the bound the CLI documents. Each test returns early
//! (prints "skipped") when no CUDA driver, NVRTC or device is present.

use rand::{Rng, SeedableRng};
use slipstream_core::{QuantType, ScaleType, TensorView};
use slipstream_cuda::{CudaTuning, Gpu};
use slipstream_kernels::quantize::from_f32;
use slipstream_kernels::scalar;
use slipstream_models::ops;
use slipstream_testkit::{rel_err, same_bits};

mod common;
use common::Rng64;

/// Relative error of the 8-bit prompt products against the exact ones on
/// these random rows (the int8 rounding of x: about 2^-8 of a group's
/// largest value per element, averaging out over a row).
const Q8_VS_EXACT: f32 = 2e-2;
/// The kernels against their own scalar reference: only the order of f32
/// sums differs.
const Q8_VS_REFERENCE: f32 = 2e-5;

fn gpu() -> Option<Gpu> {
    match slipstream_cuda::probe() {
        Ok(_) => {
            let mut g = Gpu::new(0, &CudaTuning::default())
                .expect("CUDA is present but the device could not be opened");
            if !g.tc_capable {
                eprintln!("skipped: the int8 mma needs sm_80");
                return None;
            }
            g.prompt_int8 = true;
            g.fused = false;
            Some(g)
        }
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

fn q4(scale: ScaleType) -> QuantType {
    QuantType::Affine {
        bits: 4,
        group: 64,
        scale,
    }
}

fn rand_rows(rng: &mut Rng64, n: usize) -> Vec<f32> {
    // Groups of very different magnitudes, and an all-zero group, so the
    // per-group scales matter.
    (0..n)
        .map(|i| {
            let g = i / 64;
            if g % 7 == 3 {
                0.0
            } else {
                rng.random_range(-1.0f32..1.0) * (1 + g % 5 * 3) as f32
            }
        })
        .collect()
}

fn rand_weight(rng: &mut Rng64, q: QuantType, rows: usize, cols: usize) -> Vec<u8> {
    let vals: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    from_f32(&vals, rows, cols, q)
}

/// `q8_split`'s quantization of one row: per group of 64 the codes
/// (round half to even of x * 127 / max|x|, within +-127) times the scale
/// max|x| / 127.
fn q8_row(x: &[f32]) -> Vec<f64> {
    let mut xhat = Vec::with_capacity(x.len());
    for g in x.chunks(64) {
        let m = g.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let inv = if m > 0.0 { 127.0 / m } else { 0.0 };
        let dx = m / 127.0;
        for &v in g {
            let q = (v * inv).round_ties_even().clamp(-127.0, 127.0);
            xhat.push(q as f64 * dx as f64);
        }
    }
    xhat
}

/// Reference of the 8-bit product: the dequantized weights (s code + b)
/// against the quantized x: s dx (codes . xq) + b dx sum(xq) per group.
fn q8_matvec_ref(w: &TensorView, x: &[f32]) -> Vec<f32> {
    let xhat = q8_row(x);
    let mut row = vec![0.0f32; w.cols];
    (0..w.rows)
        .map(|r| {
            scalar::dequantize_row(w, r, &mut row);
            let dot: f64 = (0..w.cols).map(|j| row[j] as f64 * xhat[j]).sum();
            dot as f32
        })
        .collect()
}

fn exact_matvec(w: &TensorView, x: &[f32]) -> Vec<f32> {
    let mut y = vec![0.0; w.rows];
    scalar::matvec(w, x, &mut y);
    y
}

#[test]
fn dense_q8_matches_its_reference_at_every_pass_length() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng64::seed_from_u64(81);
    for (rows, cols, scale) in [
        (200usize, 64usize, ScaleType::F16),
        (1000, 192, ScaleType::Bf16),
        (4096, 2048, ScaleType::Bf16),
        (77, 4096, ScaleType::F16),
        (8, 512, ScaleType::Bf16),
    ] {
        let q = q4(scale);
        let wb = rand_weight(&mut rng, q, rows, cols);
        let wv = TensorView::new(q, rows, cols, &wb).unwrap();
        let dw = g.upload_weight(&wv).unwrap();
        let n_max = 70usize;
        let x = rand_rows(&mut rng, n_max * cols);
        let dx = g.upload_f32(&x).unwrap();
        let dy = g.upload_f32(&vec![f32::NAN; n_max * rows]).unwrap();
        // One token at a time: the per-token bits every pass must give.
        let mut alone = Vec::new();
        for t in 0..n_max {
            g.matvec(&dw.desc, dx.ptr.add_bytes(4 * t * cols), dy.ptr, 1)
                .unwrap();
            alone.push(g.read_f32(&dy, 0, rows).unwrap());
        }
        for (t, got) in alone.iter().enumerate().step_by(9) {
            let xt = &x[t * cols..][..cols];
            let er = rel_err(got, &q8_matvec_ref(&wv, xt));
            assert!(
                er < Q8_VS_REFERENCE,
                "[{rows}, {cols}] token {t}: {er} against the reference"
            );
            let ex = rel_err(got, &exact_matvec(&wv, xt));
            assert!(
                ex < Q8_VS_EXACT,
                "[{rows}, {cols}] token {t}: {ex} against exact"
            );
        }
        for n in [2usize, 7, 64, 65, n_max] {
            g.matvec(&dw.desc, dx.ptr, dy.ptr, n).unwrap();
            let got = g.read_f32(&dy, 0, n * rows).unwrap();
            for t in 0..n {
                assert!(
                    same_bits(&got[t * rows..][..rows], &alone[t]),
                    "[{rows}, {cols}]: token {t} of a {n}-token pass differs from its one-token launch"
                );
            }
        }
        // Several matrices sharing one split of x: each its own launch's bits.
        let dy2 = g.upload_f32(&vec![f32::NAN; n_max * rows]).unwrap();
        g.matvec_many(&[&dw.desc, &dw.desc], dx.ptr, &[dy.ptr, dy2.ptr], 33)
            .unwrap();
        let (a, b) = (
            g.read_f32(&dy, 0, 33 * rows).unwrap(),
            g.read_f32(&dy2, 0, 33 * rows).unwrap(),
        );
        assert!(same_bits(&a, &b) && same_bits(&a[..rows], &alone[0]));
    }
}

#[test]
fn q8_experts_grouped_and_per_pair_agree_with_the_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng64::seed_from_u64(82);
    for (h, inter, k, e, tokens, shared, scale) in [
        (
            192usize,
            64usize,
            4usize,
            16usize,
            5usize,
            true,
            ScaleType::F16,
        ),
        (2048, 512, 8, 20, 9, true, ScaleType::Bf16),
        // The MLX fixture's shape: one group per row, bf16 scales.
        (64, 64, 2, 8, 6, true, ScaleType::Bf16),
        // Many pairs per expert: several 64-pair steps per block (every
        // token routes to both experts: 70 pairs each).
        (512, 256, 2, 2, 70, false, ScaleType::Bf16),
    ] {
        let q = q4(scale);
        let ex = common::expert_records(&g, &mut rng, q, (h, inter, k, e, tokens), rand_weight);
        let x = rand_rows(&mut rng, tokens * h);
        let x0: Vec<f32> = (0..tokens * h)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let wts: Vec<f32> = (0..tokens * k)
            .map(|_| rng.random_range(0.0..1.0))
            .collect();
        let sh_out: Vec<f32> = (0..tokens * h)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let sg: Vec<f32> = (0..tokens).map(|_| rng.random_range(-2.0..2.0)).collect();
        let (gt, dtl) = common::expert_descs(q, h, inter);
        assert!(g.experts_on_q8([&gt, &gt, &dtl], k));
        // Per pair (host routing's bases tables), then grouped by expert
        // (device routing).
        let sh = shared.then_some((&sh_out[..], &sg[..]));
        let (want, got, took) = common::per_pair_and_grouped(&g, &ex, &x, &x0, &wts, sh);
        assert!(
            took,
            "h={h} i={inter}: the grouped q8 path must take the shape"
        );
        assert!(
            same_bits(&got, &want),
            "h={h} i={inter} k={k} tokens={tokens}: grouped q8 experts differ from per-pair launches"
        );
        // The scalar reference of the 8-bit arithmetic, and exact f32.
        let mut reference = x0.clone();
        let mut exact = x0.clone();
        for t in 0..tokens {
            let xt = &x[t * h..][..h];
            for r in 0..k {
                let (gv, uv, dv) = ex.pair_views(t * k + r);
                let (gq, uq) = (q8_matvec_ref(&gv, xt), q8_matvec_ref(&uv, xt));
                let hq: Vec<f32> = gq.iter().zip(&uq).map(|(a, b)| ops::silu(*a) * b).collect();
                let dq = q8_matvec_ref(&dv, &hq);
                let (ge, ue) = (exact_matvec(&gv, xt), exact_matvec(&uv, xt));
                let he: Vec<f32> = ge.iter().zip(&ue).map(|(a, b)| ops::silu(*a) * b).collect();
                let de = exact_matvec(&dv, &he);
                for j in 0..h {
                    reference[t * h + j] += dq[j] * wts[t * k + r];
                    exact[t * h + j] += de[j] * wts[t * k + r];
                }
            }
            if shared {
                for j in 0..h {
                    let s = ops::sigmoid(sg[t]) * sh_out[t * h + j];
                    reference[t * h + j] += s;
                    exact[t * h + j] += s;
                }
            }
        }
        let er = rel_err(&got, &reference);
        assert!(er < 1e-3, "h={h} i={inter}: {er} against the q8 reference");
        let ex = rel_err(&got, &exact);
        assert!(ex < Q8_VS_EXACT, "h={h} i={inter}: {ex} against exact");
        eprintln!("q8 experts h={h} i={inter} k={k} tokens={tokens}: rel err {er:.2e} (reference), {ex:.2e} (exact)");
    }
}
