//! Random tensors written straight into their stored byte layout: affine
//! 4/8-bit codes with f16 scales and biases, no float intermediate.

use rayon::prelude::*;

/// xoshiro256++ seeded through SplitMix64: fast, reproducible forever.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

/// One SplitMix64 step (also used to derive seeds).
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A seed for one named stream: the same (seed, name, a, b) always gives
/// the same stream, independent of thread count or generation order.
pub fn derive_seed(seed: u64, name: &str, a: u64, b: u64) -> u64 {
    let mut s = xxhash_rust::xxh3::xxh3_64_with_seed(name.as_bytes(), seed);
    s ^= splitmix64(&mut a.wrapping_mul(0x1000_0000_01b3).wrapping_add(b));
    splitmix64(&mut s)
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        Rng {
            s: [
                splitmix64(&mut sm),
                splitmix64(&mut sm),
                splitmix64(&mut sm),
                splitmix64(&mut sm),
            ],
        }
    }

    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    #[inline]
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let u2 = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }

    pub fn fill_bytes(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let v = self.next_u64().to_le_bytes();
            let n = rest.len();
            rest.copy_from_slice(&v[..n]);
        }
    }
}

/// Content of one quantization group (64 consecutive elements of a row).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Group {
    /// Uniform random codes, dequantized mean ~0 and this standard deviation.
    Rand(f32),
    /// All zeros (scale 0, bias 0).
    Zero,
    /// The first element of the group is this value, the others 0.
    First(f32),
}

pub const GROUP: usize = 64;

fn f16_bits(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_le_bytes()
}

/// Fills one row of an affine tensor: `codes` (cols * bits / 8 bytes),
/// `scales` and `biases` (2 bytes per group each).
fn fill_row(
    bits: u8,
    rng: &mut Rng,
    codes: &mut [u8],
    scales: &mut [u8],
    biases: &mut [u8],
    group_of: &dyn Fn(usize) -> Group,
) {
    let gbytes = GROUP * bits as usize / 8;
    let levels = ((1u32 << bits) - 1) as f32;
    // Uniform codes 0..=levels: std of the code is sqrt(((levels+1)^2-1)/12).
    let code_std = (((levels + 1.0) * (levels + 1.0) - 1.0) / 12.0).sqrt();
    let mid = levels / 2.0;
    let ngroups = scales.len() / 2;
    for g in 0..ngroups {
        let c = &mut codes[g * gbytes..(g + 1) * gbytes];
        let (s, b) = match group_of(g) {
            Group::Rand(std) => {
                rng.fill_bytes(c);
                let r = rng.next_u64();
                // +-25% jitter of the group scale, random sign (as in MLX files).
                let jitter = 0.75 + 0.5 * ((r >> 11) as f32 / (1u64 << 53) as f32);
                let sign = if r & 1 == 0 { 1.0 } else { -1.0 };
                let s = half::f16::from_f32(sign * jitter * std / code_std).to_f32();
                (s, -mid * s)
            }
            Group::Zero => {
                c.fill(0);
                (0.0, 0.0)
            }
            Group::First(v) => {
                c.fill(0);
                c[0] = if bits == 4 { 0x0f } else { 0xff };
                (v / levels, 0.0)
            }
        };
        scales[2 * g..2 * g + 2].copy_from_slice(&f16_bits(s));
        biases[2 * g..2 * g + 2].copy_from_slice(&f16_bits(b));
    }
}

/// Row `r`'s own random stream for a tensor seeded `seed`.
pub(crate) fn row_rng(seed: u64, r: usize) -> Rng {
    Rng::new(seed ^ (r as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// A `[rows, cols]` affine tensor (group 64, f16 scales) whose group `g` of
/// row `r` is `spec(r, g)`. Rows are generated in parallel when `parallel`;
/// each row has its own stream, so the bytes never depend on threading.
pub fn affine(
    rows: usize,
    cols: usize,
    bits: u8,
    seed: u64,
    parallel: bool,
    spec: &(dyn Fn(usize, usize) -> Group + Sync),
) -> Vec<u8> {
    assert!(
        cols.is_multiple_of(GROUP),
        "cols {cols} not a multiple of 64"
    );
    let gpr = cols / GROUP;
    let code_row = cols * bits as usize / 8;
    let codes_len = rows * code_row;
    let mut out = vec![0u8; codes_len + 4 * rows * gpr];
    let (codes, params) = out.split_at_mut(codes_len);
    let (scales, biases) = params.split_at_mut(2 * rows * gpr);
    type RowParts<'a> = (usize, ((&'a mut [u8], &'a mut [u8]), &'a mut [u8]));
    let work = |(r, ((c, s), b)): RowParts<'_>| {
        let mut rng = row_rng(seed, r);
        fill_row(bits, &mut rng, c, s, b, &|g| spec(r, g));
    };
    if parallel {
        codes
            .par_chunks_mut(code_row)
            .zip(scales.par_chunks_mut(2 * gpr))
            .zip(biases.par_chunks_mut(2 * gpr))
            .enumerate()
            .for_each(work);
    } else {
        codes
            .chunks_mut(code_row)
            .zip(scales.chunks_mut(2 * gpr))
            .zip(biases.chunks_mut(2 * gpr))
            .enumerate()
            .for_each(work);
    }
    out
}

/// Little-endian f32 bytes.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
