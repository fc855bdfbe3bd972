//! CPU compute kernels: matrix-vector and matrix-matrix products over stored
//! weights ([`TensorView`] in any [`QuantType`]), row dequantization and
//! quantization.
//!
//! # Dispatch
//! The public entry points ([`matvec`], [`matmul`]) pick the best instruction
//! set at run time ([`Isa::detect`]): AVX-512 (F + VL) or AVX2+FMA+F16C on
//! x86-64, NEON on aarch64, the portable scalar code everywhere else.
//! [`matvec_with`] / [`matmul_with`] force one (callers choose an [`Isa`]
//! once and pass it down; every kernel dispatches on the one it is given,
//! [`attention`] and [`recurrence`] included). The scalar code ([`scalar`])
//! is also the test oracle.
//!
//! # Determinism
//! For a given [`Isa`], every output element is computed by one fixed
//! instruction sequence per (weight row, token): results are bit-identical
//! whatever the batch size `n` of [`matmul`], however rows are split across
//! threads, and between [`matvec`] and row `t` of [`matmul`]. Different ISAs
//! agree only to rounding.
//!
//! # Affine dot product
//! For affine weights `W[r, j] = s_g * q_j + b_g` the dot product is evaluated
//! as `sum_g (s_g * sum_{j in g} q_j x_j) + sum_g b_g * X_g`, where
//! `X_g = sum_{j in g} x_j` is computed once per input vector.

use rayon::prelude::*;
use slipstream_core::{QuantType, TensorView};

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod ggml;
#[cfg(target_arch = "aarch64")]
mod neon;
mod q4i16;
pub mod quantize;
pub mod recurrence;
pub mod sample;
pub mod scalar;
pub mod softmax;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

/// Instruction set a kernel runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust, no SIMD intrinsics (also the reference implementation).
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512 F + VL on top of [`Isa::Avx2`]: 4-bit affine products
    /// (group a multiple of 16) in 16-lane forms, every other kernel the
    /// AVX2 code (same results as [`Isa::Avx2`] everywhere).
    Avx512,
    /// aarch64 NEON (4-bit affine and f32/bf16 products; other layouts run
    /// the scalar code).
    Neon,
}

impl Isa {
    /// The fastest instruction set supported by this CPU.
    pub fn detect() -> Isa {
        if Isa::Avx512.is_supported() {
            Isa::Avx512
        } else if Isa::Avx2.is_supported() {
            Isa::Avx2
        } else if Isa::Neon.is_supported() {
            Isa::Neon
        } else {
            Isa::Scalar
        }
    }

    /// What the kernels of this instruction set run, for reports.
    pub fn describe(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "AVX2+FMA+F16C",
            Isa::Avx512 => {
                "AVX-512 (F+VL) 4-bit affine products, AVX2+FMA+F16C for the rest \
                 (GGML blocks, 8-bit, float, int16 inputs, attention, recurrence)"
            }
            Isa::Neon => "NEON",
        }
    }

    /// Whether this CPU can run kernels of this instruction set.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => avx2_supported(),
            Isa::Avx512 => avx2_supported() && avx512_supported(),
            Isa::Neon => cfg!(target_arch = "aarch64"),
        }
    }

    /// All instruction sets this CPU supports (scalar first).
    pub fn available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon]
            .into_iter()
            .filter(|i| i.is_supported())
            .collect()
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_supported() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_supported() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn avx512_supported() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_supported() -> bool {
    false
}

/// How the input vector enters products: [`Activations::Int16`] concerns
/// 4-bit affine weights, [`Activations::Int8`] GGML block weights; every
/// other (mode, weight type) pair takes f32 inputs, as
/// [`Activations::Exact`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Activations {
    /// f32 inputs: the product is exact up to f32 rounding. The default:
    /// the 1e-4 parity bound on the MLX 4-bit fixture needs it.
    #[default]
    Exact,
    /// Inputs quantized to int16 with one step per weight group (groups that
    /// are a multiple of 32, up to 4096; others fall back to
    /// [`Activations::Exact`]): integer multiply-adds, no conversions in the
    /// inner loop; 15-45 % faster than [`Activations::Exact`] on the dev box.
    /// Each input moves by at most half a step (`max|x_g| / 65534`), so an
    /// output moves by at most `sum_j |w_j| * step / 2`; on the tiny MLX
    /// parity fixture that compounds to 2e-3 relative logit error, so it is
    /// opt-in.
    Int16,
    /// GGML block weights (`Q4_0`, `Q8_0`, `Q4_K`, `Q5_K`, `Q6_K`) take the
    /// input quantized to 8 bits per block as llama.cpp's CPU backend does
    /// (`q8_0` blocks of 32 for `Q4_0` / `Q8_0`, `q8_K` blocks of 256 for the
    /// K-quants) and integer dot products ([`ggml::q8`]). Each input moves by
    /// at most half a step (`max|x_block| / 254`). Other weight types take
    /// f32 inputs.
    Int8,
}

/// Work (multiply-adds) below which a product runs on the calling thread.
const PAR_MIN_WORK: usize = 1 << 16;

/// Work (multiply-adds) below which a product is split into one chunk per
/// thread (see `run_rows`).
const SMALL_PRODUCT: usize = 1 << 23;

/// `y[r] = sum_c W[r, c] * x[c]`; `x` is `[cols]`, `y` is `[rows]`.
///
/// Uses the best [`Isa`] of this CPU and the rayon global pool for large `W`.
/// Panics if the lengths do not match the shape.
pub fn matvec(w: &TensorView, x: &[f32], y: &mut [f32]) {
    matvec_act(Isa::detect(), Activations::default(), w, x, y)
}

/// [`matvec`] with a given instruction set and exact f32 activations (panics
/// if the CPU lacks it).
pub fn matvec_with(isa: Isa, w: &TensorView, x: &[f32], y: &mut [f32]) {
    matvec_act(isa, Activations::Exact, w, x, y)
}

/// [`matvec`] with a given instruction set and activation mode (panics if the
/// CPU lacks the instruction set).
pub fn matvec_act(isa: Isa, act: Activations, w: &TensorView, x: &[f32], y: &mut [f32]) {
    check_weight(w);
    assert_eq!(x.len(), w.cols, "matvec: x length != cols");
    assert_eq!(y.len(), w.rows, "matvec: y length != rows");
    assert!(isa.is_supported(), "{isa:?} is not supported by this CPU");
    let toks = [Token::new(w, x, act)];
    run_rows(isa, w, &toks, y);
}

/// `y[t, r] = sum_c W[r, c] * x[t, c]` for `n` tokens; `x` is `[n, cols]`,
/// `y` is `[n, rows]`, both row-major.
///
/// Row `t` of `y` is bit-identical to [`matvec`] of row `t` of `x`.
pub fn matmul(w: &TensorView, x: &[f32], n: usize, y: &mut [f32]) {
    matmul_act(Isa::detect(), Activations::default(), w, x, n, y)
}

/// [`matmul`] with a given instruction set and exact f32 activations (panics
/// if the CPU lacks it).
pub fn matmul_with(isa: Isa, w: &TensorView, x: &[f32], n: usize, y: &mut [f32]) {
    matmul_act(isa, Activations::Exact, w, x, n, y)
}

/// [`matmul`] with a given instruction set and activation mode (panics if the
/// CPU lacks the instruction set). Row `t` of `y` is bit-identical to
/// [`matvec_act`] of row `t` of `x` with the same `isa` and `act`.
pub fn matmul_act(isa: Isa, act: Activations, w: &TensorView, x: &[f32], n: usize, y: &mut [f32]) {
    check_weight(w);
    assert_eq!(x.len(), n * w.cols, "matmul: x length != n * cols");
    assert_eq!(y.len(), n * w.rows, "matmul: y length != n * rows");
    assert!(isa.is_supported(), "{isa:?} is not supported by this CPU");
    if n == 0 || w.rows == 0 {
        return;
    }
    let toks: Vec<Token> = (0..n)
        .map(|t| Token::new(w, &x[t * w.cols..(t + 1) * w.cols], act))
        .collect();
    if n == 1 {
        run_rows(isa, w, &toks, y);
    } else {
        run_rows_token_major(isa, w, &toks, y);
    }
}

/// Dequantizes row `row` of `w` into `out` (`[cols]`).
///
/// Affine values are `scale * q + bias` in f32 (a multiply then an add, never
/// fused), so the result is the same on every CPU.
pub fn dequantize_row(w: &TensorView, row: usize, out: &mut [f32]) {
    scalar::dequantize_row(w, row, out)
}

/// Bytes of weight data one matvec reads (for bandwidth figures).
pub fn bytes_per_matvec(w: &TensorView) -> usize {
    w.data.len()
}

/// Panics unless `w` is a layout the kernels handle and its data has the
/// exact length of that layout.
pub(crate) fn check_weight(w: &TensorView) {
    if let QuantType::Affine { bits, group, .. } = w.qtype {
        assert!(bits == 4 || bits == 8, "affine bits must be 4 or 8");
        let group = group as usize;
        assert!(
            group > 0 && group.is_multiple_of(8) && w.cols.is_multiple_of(group),
            "affine group {group} must be a multiple of 8 dividing cols {}",
            w.cols
        );
    }
    assert_eq!(
        w.data.len(),
        w.qtype.nbytes(w.rows, w.cols),
        "tensor data length does not match [{}, {}] {}",
        w.rows,
        w.cols,
        w.qtype.name()
    );
}

/// One input vector plus what the kernels precompute from it.
pub(crate) struct Token<'a> {
    /// `[cols]`.
    pub x: &'a [f32],
    /// Affine only: `gsum[g] = sum of x over group g`, zero-padded to a
    /// multiple of 8 entries. Empty for float weights.
    pub gsum: Vec<f32>,
    /// 4-bit affine with a group that is a multiple of 16 only: each block of
    /// 16 of `x` as its 8 even elements (the low nibbles of 8 code bytes)
    /// then its 8 odd ones divided by 16 (see `avx2::q4_block`). Otherwise
    /// empty.
    pub xp: AlignedF32,
    /// 4-bit affine weights with [`Activations::Int16`]: the quantized input.
    pub(crate) qx: Option<q4i16::QuantizedInput>,
    /// GGML block weights with [`Activations::Int8`]: the quantized input.
    pub(crate) q8: Option<ggml::q8::Q8Row>,
}

impl<'a> Token<'a> {
    pub fn new(w: &TensorView, x: &'a [f32], act: Activations) -> Token<'a> {
        if act == Activations::Int16 && q4i16::supports(w.qtype) {
            let QuantType::Affine { group, .. } = w.qtype else {
                unreachable!()
            };
            let group = group as usize;
            return Token {
                x,
                gsum: Vec::new(),
                xp: AlignedF32::zeroed(0),
                qx: Some(q4i16::quantize_input(x, group)),
                q8: None,
            };
        }
        if act == Activations::Int8 && ggml::q8::supports(w.qtype) {
            return Token {
                x,
                gsum: Vec::new(),
                xp: AlignedF32::zeroed(0),
                qx: None,
                q8: Some(ggml::q8::quantize_input(w.qtype, x)),
            };
        }
        let (gsum, xp) = match w.qtype {
            QuantType::Affine { bits, group, .. } => {
                let group = group as usize;
                let xp = if bits == 4 && group.is_multiple_of(16) {
                    split_pairs(x)
                } else {
                    AlignedF32::zeroed(0)
                };
                (group_sums(x, group), xp)
            }
            _ => (Vec::new(), AlignedF32::zeroed(0)),
        };
        Token {
            x,
            gsum,
            xp,
            qx: None,
            q8: None,
        }
    }
}

/// f32 values in 64-byte aligned storage, so whole 8-lane loads at multiples
/// of 8 and 16-lane loads at multiples of 16 never split a cache line.
pub(crate) struct AlignedF32 {
    buf: Vec<Lanes16>,
    len: usize,
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Lanes16([f32; 16]);

impl AlignedF32 {
    /// `len` zeros.
    pub(crate) fn zeroed(len: usize) -> AlignedF32 {
        AlignedF32 {
            buf: vec![Lanes16([0.0; 16]); len.div_ceil(16)],
            len,
        }
    }
}

impl std::ops::Deref for AlignedF32 {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: `buf` holds len.div_ceil(16) * 16 >= len initialized f32
        // (`Lanes16` is `repr(C)` over `[f32; 16]`), borrowed with `self`.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr().cast::<f32>(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedF32 {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, borrowed mutably with `self`.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_mut_ptr().cast::<f32>(), self.len) }
    }
}

/// Reorders each block of 16 as its even elements then its odd elements
/// (`x.len()` must be a multiple of 16).
fn split_pairs(x: &[f32]) -> AlignedF32 {
    let mut out = AlignedF32::zeroed(x.len());
    for (o, b) in out.chunks_exact_mut(16).zip(x.chunks_exact(16)) {
        for i in 0..8 {
            o[i] = b[2 * i];
            // Exact (a power of two): the kernels multiply it by 16 * the
            // high nibble (see `avx2::q4_block`).
            o[8 + i] = b[2 * i + 1] * (1.0 / 16.0);
        }
    }
    out
}

/// Per-group sums of `x` (sequential order), zero-padded to a multiple of 8.
fn group_sums(x: &[f32], group: usize) -> Vec<f32> {
    let ng = x.len() / group;
    let mut out = vec![0f32; ng.next_multiple_of(8)];
    for (o, g) in out.iter_mut().zip(x.chunks_exact(group)) {
        let mut s = 0f32;
        for &v in g {
            s += v;
        }
        *o = s;
    }
    out
}

/// Computes rows `r0..r1` for all tokens into `out` (`[r1 - r0, toks.len()]`).
fn kernel_rows(isa: Isa, w: &TensorView, r0: usize, r1: usize, toks: &[Token], out: &mut [f32]) {
    if toks.first().is_some_and(|t| t.q8.is_some()) {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => ggml::q8_avx2::rows(w, r0, r1, toks, out),
            // No AVX-512 (VNNI) or NEON form: AVX-512 runs the AVX2 code,
            // the rest the scalar reference.
            _ => ggml::q8::scalar_rows(w, r0, r1, toks, out),
        }
        return;
    }
    if toks.first().is_some_and(|t| t.qx.is_some()) {
        match isa {
            Isa::Scalar => q4i16::scalar_rows(w, r0, r1, toks, out),
            // Int16 inputs have no AVX-512 form: the AVX2 code.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => q4i16::avx2_rows(w, r0, r1, toks, out),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => unreachable!("x86-64 ISA requested on another CPU"),
            // Int16 inputs have no NEON kernel yet: the scalar reference.
            Isa::Neon => q4i16::scalar_rows(w, r0, r1, toks, out),
        }
        return;
    }
    match isa {
        Isa::Scalar => scalar::rows(w, r0, r1, toks, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if avx512::handles(w.qtype) => avx512::rows(w, r0, r1, toks, out),
        // Layouts with no AVX-512 form run the AVX2 code.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2::rows(w, r0, r1, toks, out),
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => unreachable!("x86-64 ISA requested on another CPU"),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::rows(w, r0, r1, toks, out),
        #[cfg(not(target_arch = "aarch64"))]
        Isa::Neon => unreachable!("NEON requested on a non-aarch64 CPU"),
    }
}

/// Rows per thread chunk when a product of `w` with `ntok` tokens is split
/// across the rayon pool, or `None` when it runs on the calling thread.
/// Chunks are a multiple of 4 rows (the kernels' row block).
fn parallel_chunk_rows(w: &TensorView, ntok: usize) -> Option<usize> {
    let work = w.rows * w.cols * ntok;
    let threads = rayon::current_num_threads();
    if work < PAR_MIN_WORK || threads <= 1 || w.rows < 8 {
        return None;
    }
    // Decode-sized products (an expert's matrix: ~1M multiply-adds, tens of
    // microseconds) get one chunk per thread: every extra chunk is another
    // hand-off between threads, which costs more than the imbalance it
    // evens out. Larger ones get a few chunks per thread for balance, each
    // at least ~16K multiply-adds.
    let per_thread = if work < SMALL_PRODUCT { 1 } else { 4 };
    let min_rows = (1usize << 14).div_ceil(w.cols * ntok).max(1);
    Some(
        w.rows
            .div_ceil(threads * per_thread)
            .max(min_rows)
            .next_multiple_of(4),
    )
}

/// Computes all rows into `out` (`[rows, toks.len()]`), splitting rows across
/// the rayon pool when the product is large. Row splits never change the
/// arithmetic of an element.
fn run_rows(isa: Isa, w: &TensorView, toks: &[Token], out: &mut [f32]) {
    let ntok = toks.len();
    let Some(chunk_rows) = parallel_chunk_rows(w, ntok) else {
        kernel_rows(isa, w, 0, w.rows, toks, out);
        return;
    };
    out.par_chunks_mut(chunk_rows * ntok)
        .enumerate()
        .for_each(|(i, o)| {
            let r0 = i * chunk_rows;
            let r1 = r0 + o.len() / ntok;
            kernel_rows(isa, w, r0, r1, toks, o);
        });
}

/// Largest row-major staging block (f32 elements) of
/// [`run_rows_token_major`]: small enough to stay in L2 between the kernel
/// writing it and the scatter reading it back.
const STAGING_ELEMS: usize = 1 << 16;

/// [`run_rows`] into a token-major `y` (`[toks.len(), rows]`): each thread
/// runs its rows a block at a time into a small row-major staging buffer
/// and scatters it into `y` while it is still in cache, so no full-size
/// row-major copy is allocated, zeroed and transposed.
fn run_rows_token_major(isa: Isa, w: &TensorView, toks: &[Token], y: &mut [f32]) {
    let (rows, ntok) = (w.rows, toks.len());
    assert_eq!(y.len(), rows * ntok);
    // Blocks of at least 32 rows (the GEMM path's panel) and a multiple of
    // 4 (the kernels' row block).
    let block_rows = (STAGING_ELEMS / ntok.max(1)).max(32).next_multiple_of(4);
    let out = TokenMajorOut {
        ptr: y.as_mut_ptr(),
        rows,
        ntok,
    };
    let rows_into = |r0: usize, r1: usize| {
        let mut staging = vec![0f32; block_rows.min(r1 - r0) * ntok];
        for b0 in (r0..r1).step_by(block_rows) {
            let b1 = (b0 + block_rows).min(r1);
            let part = &mut staging[..(b1 - b0) * ntok];
            kernel_rows(isa, w, b0, b1, toks, part);
            // SAFETY: b0..b1 lies in 0..rows, and the row ranges handed to
            // `rows_into` are disjoint, so no other thread writes these
            // rows; `y` is borrowed mutably for the whole call.
            unsafe { out.write_rows(b0, b1, part) };
        }
    };
    match parallel_chunk_rows(w, ntok) {
        None => rows_into(0, rows),
        Some(chunk_rows) => (0..rows.div_ceil(chunk_rows))
            .into_par_iter()
            .for_each(|i| rows_into(i * chunk_rows, ((i + 1) * chunk_rows).min(rows))),
    }
}

/// A token-major output `[ntok, rows]` that threads fill by disjoint row
/// ranges (each range is strided across the buffer, so it cannot be split
/// into slices).
struct TokenMajorOut {
    ptr: *mut f32,
    rows: usize,
    ntok: usize,
}

// SAFETY: `write_rows` callers write disjoint rows, so sharing the pointer
// across threads never makes two threads write one element.
unsafe impl Sync for TokenMajorOut {}

impl TokenMajorOut {
    /// Writes rows `r0..r1` of every token from `part` (`[r1 - r0, ntok]`).
    ///
    /// # Safety
    /// `r0 <= r1 <= rows`, the buffer `[ntok, rows]` is still mutably
    /// borrowed by the caller, and no other thread writes rows `r0..r1`
    /// meanwhile.
    unsafe fn write_rows(&self, r0: usize, r1: usize, part: &[f32]) {
        assert!(r0 <= r1 && r1 <= self.rows && part.len() == (r1 - r0) * self.ntok);
        for t in 0..self.ntok {
            // SAFETY: t * rows + r1 <= ntok * rows, inside the buffer (the
            // caller's contract); these elements belong to this caller.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(self.ptr.add(t * self.rows + r0), r1 - r0)
            };
            for (k, d) in dst.iter_mut().enumerate() {
                *d = part[k * self.ntok + t];
            }
        }
    }
}
