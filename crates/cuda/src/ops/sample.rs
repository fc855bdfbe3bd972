//! Token choice on the device: argmax and the seeded draw.

use slipstream_kernels::sample::{DrawParams, MAX_VOCAB};

use crate::{CudaError, DBuf, DevPtr, Gpu, Result};

/// Blocks of the argmax's first launch (passed to the kernels as `ARGMAX_BLOCKS`).
pub(crate) const ARGMAX_BLOCKS: usize = 256;
/// Blocks of the seeded draw's wide launches; `samp_draw` runs one thread
/// per block (`SampleScratch::parts`).
pub(crate) const SAMPLE_BLOCKS: usize = 256;
/// Bytes of the draw's state (passed to the kernels as `SAMP_STATE_BYTES`).
pub(crate) const SAMPLE_STATE_BYTES: usize = 4096;

/// Device memory of the seeded draw ([`Gpu::sample`]) over up to
/// `capacity` logits.
pub struct SampleScratch {
    /// The draw's state (`SampState` in sample.cu).
    state: DBuf,
    /// `[capacity]` u64 fixed-point weights.
    weights: DBuf,
    /// `[SAMPLE_BLOCKS]` u64 kept mass per block.
    parts: DBuf,
    capacity: usize,
}

impl Gpu {
    /// Index of the largest of `n` values into the i32 at `out` (ties to
    /// the lowest index, NaN never wins, `n - 1` when all are NaN): 256
    /// blocks over contiguous chunks, then one block over their results.
    pub fn argmax(&self, x: DevPtr, n: usize, out: DevPtr) -> Result<()> {
        let n = n as i32;
        let parts = self.argmax_parts.ptr;
        self.go(
            &self.f.argmax_part,
            (ARGMAX_BLOCKS as u32, 1, 1),
            256,
            &mut args!(&x, &n, &parts),
        )?;
        self.go(
            &self.f.argmax_final,
            (1, 1, 1),
            ARGMAX_BLOCKS as u32,
            &mut args!(&parts, &n, &out),
        )
    }

    /// Scratch memory for [`Gpu::sample`] over up to `capacity` logits
    /// (at most `slipstream_kernels::sample::MAX_VOCAB`, the largest
    /// vocabulary the draw's u64 sums hold).
    pub fn sample_scratch(&self, capacity: usize) -> Result<SampleScratch> {
        if capacity > MAX_VOCAB {
            return Err(CudaError::Invalid(format!(
                "a draw over {capacity} logits (the device draw holds up to {MAX_VOCAB})"
            )));
        }
        Ok(SampleScratch {
            state: self.alloc(SAMPLE_STATE_BYTES)?,
            weights: self.alloc(capacity * 8)?,
            parts: self.alloc(SAMPLE_BLOCKS * 8)?,
            capacity,
        })
    }

    /// The seeded draw over `n` logits at `x` into the i32 at `out`, which
    /// must already hold the argmax (kept when no logit is finite): the
    /// token `slipstream_kernels::sample::draw` picks for the same logits,
    /// settings and `u` in `[0, 1)`. No host synchronisation; 6 to 24
    /// launches (each cut four digit passes, only when it is set).
    pub fn sample(
        &self,
        x: DevPtr,
        n: usize,
        p: &DrawParams,
        u: f64,
        scratch: &SampleScratch,
        out: DevPtr,
    ) -> Result<()> {
        let DrawParams {
            temperature,
            top_k,
            top_p,
            min_p,
        } = *p;
        if n > scratch.capacity || n == 0 {
            return Err(CudaError::Invalid(format!(
                "a draw over {n} logits with scratch for {}",
                scratch.capacity
            )));
        }
        let (st, wt, parts) = (scratch.state.ptr, scratch.weights.ptr, scratch.parts.ptr);
        let ni = n as i32;
        let wide = ((SAMPLE_BLOCKS as u32, 1, 1), 256);
        self.go(&self.f.samp_init, (1, 1, 1), 256, &mut args!(&st))?;
        self.go(&self.f.samp_top, wide.0, wide.1, &mut args!(&x, &ni, &st))?;
        let cut = |m: i32| -> Result<()> {
            for d in 0..4i32 {
                self.go(
                    &self.f.samp_hist,
                    wide.0,
                    wide.1,
                    &mut args!(&x, &ni, &wt, &st, &m, &d, &top_k, &top_p),
                )?;
                self.go(
                    &self.f.samp_select,
                    (1, 1, 1),
                    256,
                    &mut args!(&st, &m, &d, &top_k, &top_p),
                )?;
            }
            self.go(
                &self.f.samp_tie,
                (1, 1, 1),
                1024,
                &mut args!(&x, &ni, &wt, &st, &m),
            )
        };
        if top_k > 0 {
            cut(0)?;
        }
        self.go(
            &self.f.samp_weights,
            wide.0,
            wide.1,
            &mut args!(&x, &ni, &wt, &st, &temperature, &min_p),
        )?;
        if top_p < 1.0 {
            cut(1)?;
        }
        self.go(
            &self.f.samp_part,
            wide.0,
            wide.1,
            &mut args!(&x, &ni, &wt, &st, &parts),
        )?;
        self.go(
            &self.f.samp_draw,
            (1, 1, 1),
            SAMPLE_BLOCKS as u32,
            &mut args!(&x, &ni, &wt, &st, &parts, &u, &out),
        )
    }
}
