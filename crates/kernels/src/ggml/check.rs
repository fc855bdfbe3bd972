//! Backend-independent checks of weight products, for any kernel under test
//! (the CPU ISAs here; a GPU backend can call the same functions with its own
//! kernel). Written for the GGML block types; float and affine weights work
//! too ([`random_weights`]). Each check returns `Err(description)` on the
//! first mismatch.
//!
//! The oracle is the scalar reference ([`crate::scalar::matmul`], which for
//! GGML types dequantizes exactly as gguf-py does).

use super::{dequantize_block, scale_min_k4};
use slipstream_core::{QuantType, TensorView};

/// A product under test: `(w, x [n, cols], n, y [n, rows])`, as
/// [`crate::matmul`].
pub type MatmulFn<'a> = &'a dyn Fn(&TensorView, &[f32], usize, &mut [f32]);

/// The GGML block types.
pub const GGML_TYPES: [QuantType; 5] = [
    QuantType::Q4_0,
    QuantType::Q8_0,
    QuantType::Q4K,
    QuantType::Q5K,
    QuantType::Q6K,
];

/// Small deterministic generator (splitmix64), so the checks need no
/// dependencies and give the same data everywhere.
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }

    /// Random bytes.
    pub fn fill(&mut self, b: &mut [u8]) {
        for c in b.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

/// A random f16 scale: usually ordinary (`1e-3..1`, either sign), with
/// `extreme` often one of 0, the smallest subnormal, the largest finite
/// value, or a tiny normal. Never infinite or NaN.
fn rand_scale(rng: &mut SplitMix, extreme: bool) -> [u8; 2] {
    let pick = rng.next_u64() % 8;
    let v = if extreme && pick < 4 {
        [0.0f32, 5.96e-8, 65504.0, -65504.0][pick as usize]
    } else if extreme && pick == 4 {
        6.1e-5
    } else {
        let m = rng.uniform(1e-3, 1.0);
        if rng.next_u64() & 1 == 0 {
            m
        } else {
            -m
        }
    };
    half::f16::from_f32(v).to_le_bytes()
}

/// Random `[rows, cols]` bytes of GGML type `qtype`: random codes and
/// sub-block scales, f16 block scales from [`rand_scale`].
/// Panics unless `qtype` is a GGML type and `cols` a multiple of its block.
pub fn random_blocks(
    qtype: QuantType,
    rows: usize,
    cols: usize,
    seed: u64,
    extreme: bool,
) -> Vec<u8> {
    let (be, bb) = qtype.ggml_block().expect("GGML block type");
    assert!(cols.is_multiple_of(be));
    let mut rng = SplitMix(seed);
    let mut out = vec![0u8; qtype.nbytes(rows, cols)];
    rng.fill(&mut out);
    for b in out.chunks_exact_mut(bb) {
        match qtype {
            QuantType::Q4_0 | QuantType::Q8_0 => {
                b[0..2].copy_from_slice(&rand_scale(&mut rng, extreme))
            }
            QuantType::Q4K | QuantType::Q5K => {
                b[0..2].copy_from_slice(&rand_scale(&mut rng, extreme));
                b[2..4].copy_from_slice(&rand_scale(&mut rng, extreme));
            }
            _ => b[208..210].copy_from_slice(&rand_scale(&mut rng, extreme)),
        }
    }
    out
}

/// Random `[rows, cols]` weights of any type: GGML types from
/// [`random_blocks`]; float and affine types by storing random values whose
/// magnitude varies every 32 elements (1x to 13x) with
/// [`crate::quantize::from_f32`] (`extreme` is ignored there). Panics if
/// `cols` is not legal for `qtype`.
pub fn random_weights(
    qtype: QuantType,
    rows: usize,
    cols: usize,
    seed: u64,
    extreme: bool,
) -> Vec<u8> {
    if qtype.is_ggml() {
        return random_blocks(qtype, rows, cols, seed, extreme);
    }
    qtype.check_cols(cols).expect("legal row length");
    let mut rng = SplitMix(seed);
    let vals: Vec<f32> = (0..rows * cols)
        .map(|i| rng.uniform(-1.0, 1.0) * (1.0 + (i / 32 % 5) as f32 * 3.0))
        .collect();
    crate::quantize::from_f32(&vals, rows, cols, qtype)
}

/// Per element of row `r`, the magnitude that rounding in any summation
/// order is relative to: `|w x|`, plus twice the offset terms that kernels
/// may sum separately (`|m x|` for `Q4_K`/`Q5_K`, `|8 d x|` for `Q4_0`,
/// `|32 d sc x|` for `Q6_K`; the raw-code term is at most `|w x|` plus it).
fn magnitude(w: &TensorView, r: usize, x: &[f32]) -> f64 {
    let Some((be, bb)) = w.qtype.ggml_block() else {
        let mut dense = vec![0f32; w.cols];
        crate::scalar::dequantize_row(w, r, &mut dense);
        return dense
            .iter()
            .zip(x)
            .map(|(&a, &b)| (a as f64 * b as f64).abs())
            .sum();
    };
    let rb = w.cols / be * bb;
    let row = &w.data[r * rb..(r + 1) * rb];
    let mut buf = vec![0f32; be];
    let mut mag = 0f64;
    for (i, b) in row.chunks_exact(bb).enumerate() {
        dequantize_block(w.qtype, b, &mut buf);
        let xb = &x[i * be..(i + 1) * be];
        for (&v, &xv) in buf.iter().zip(xb) {
            mag += (v as f64 * xv as f64).abs();
        }
        let abs_sum = |xs: &[f32]| -> f64 { xs.iter().map(|v| v.abs() as f64).sum() };
        match w.qtype {
            QuantType::Q4_0 => mag += 2.0 * 8.0 * (super::f16_at(b, 0) as f64).abs() * abs_sum(xb),
            QuantType::Q6K => {
                let d = super::f16_at(b, 208) as f64;
                for (k, xs) in xb.chunks_exact(16).enumerate() {
                    mag += 2.0 * 32.0 * (d * (b[192 + k] as i8) as f64).abs() * abs_sum(xs);
                }
            }
            _ => {}
        }
        if matches!(w.qtype, QuantType::Q4K | QuantType::Q5K) {
            let dmin = super::f16_at(b, 2) as f64;
            let (_, m) = scale_min_k4(&b[4..16]);
            for (j, xs) in xb.chunks_exact(32).enumerate() {
                let s: f64 = xs.iter().map(|v| v.abs() as f64).sum();
                mag += 2.0 * (dmin * m[j] as f64).abs() * s;
            }
        }
    }
    mag
}

/// A random product to check kernels on: [`random_weights`] of `qtype`
/// `[rows, cols]` and `n` tokens of `x` uniform in [-1, 1) (seeded by
/// `seed ^ x_salt`, so each check draws its own inputs).
pub struct Problem {
    pub qtype: QuantType,
    pub rows: usize,
    pub cols: usize,
    pub n: usize,
    pub weights: Vec<u8>,
    pub x: Vec<f32>,
}

impl Problem {
    pub fn random(
        qtype: QuantType,
        [rows, cols]: [usize; 2],
        n: usize,
        seed: u64,
        extreme: bool,
        x_salt: u64,
    ) -> Problem {
        let weights = random_weights(qtype, rows, cols, seed, extreme);
        let mut rng = SplitMix(seed ^ x_salt);
        let x = (0..n * cols).map(|_| rng.uniform(-1.0, 1.0)).collect();
        Problem {
            qtype,
            rows,
            cols,
            n,
            weights,
            x,
        }
    }

    fn view(&self) -> Result<TensorView<'_>, String> {
        TensorView::new(self.qtype, self.rows, self.cols, &self.weights).map_err(|e| e.to_string())
    }

    /// `kernel`'s `[n, rows]` output.
    fn run(&self, kernel: MatmulFn) -> Result<Vec<f32>, String> {
        let mut y = vec![0f32; self.n * self.rows];
        kernel(&self.view()?, &self.x, self.n, &mut y);
        Ok(y)
    }

    /// "Q4_0 [rows x cols] n=N", for error messages.
    fn name(&self) -> String {
        format!(
            "{} [{}x{}] n={}",
            self.qtype.name(),
            self.rows,
            self.cols,
            self.n
        )
    }
}

/// Checks `kernel` against the scalar reference on `p`. Each output must
/// be within `1e-4 * magnitude + 1e-30` of the reference, and the
/// reference within the same bound of the float64 dot product of the
/// dequantized row.
pub fn check_against_reference(kernel: MatmulFn, p: &Problem) -> Result<(), String> {
    let w = p.view()?;
    let (rows, cols) = (p.rows, p.cols);
    let y = p.run(kernel)?;
    let yr = p.run(&|w, x, n, y| crate::scalar::matmul(w, x, n, y))?;
    let mut dense = vec![0f32; cols];
    for r in 0..rows {
        crate::scalar::dequantize_row(&w, r, &mut dense);
        for t in 0..p.n {
            let xt = &p.x[t * cols..(t + 1) * cols];
            let tol = 1e-4 * magnitude(&w, r, xt) + 1e-30;
            let exact: f64 = dense
                .iter()
                .zip(xt)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum();
            let (got, want) = (y[t * rows + r] as f64, yr[t * rows + r] as f64);
            if (got - want).abs() > tol || got.is_nan() != want.is_nan() {
                return Err(format!(
                    "{} r={r} t={t}: kernel {got} reference {want} tol {tol}",
                    p.name()
                ));
            }
            if (want - exact).abs() > tol {
                return Err(format!(
                    "{} r={r} t={t}: reference {want} exact {exact} tol {tol}",
                    p.name()
                ));
            }
        }
    }
    Ok(())
}

/// Checks that row `t` of `kernel` over `p`'s `n` tokens is bit-identical
/// to `kernel` over token `t` alone (the batching invariant).
pub fn check_batch_is_single(kernel: MatmulFn, p: &Problem) -> Result<(), String> {
    let w = p.view()?;
    let (rows, cols) = (p.rows, p.cols);
    let y = p.run(kernel)?;
    let mut y1 = vec![0f32; rows];
    for t in 0..p.n {
        kernel(&w, &p.x[t * cols..(t + 1) * cols], 1, &mut y1);
        for r in 0..rows {
            if y1[r].to_bits() != y[t * rows + r].to_bits() {
                return Err(format!(
                    "{} t={t} r={r}: batch {} single {}",
                    p.name(),
                    y[t * rows + r],
                    y1[r]
                ));
            }
        }
    }
    Ok(())
}
