//! Gated DeltaNet: the causal convolution and the recurrence.

use crate::{CudaError, DevPtr, Gpu, Result};

/// A Gated DeltaNet layer's causal convolution over `C` channels.
#[derive(Debug, Clone, Copy)]
pub struct GdnConv {
    /// `[C, kernel]` f32: the depthwise weights.
    pub weights: DevPtr,
    /// Channels `C`.
    pub channels: usize,
    /// Taps (1..=8).
    pub kernel: usize,
    /// `[kernel - 1, C]` f32: the last inputs, updated in place.
    pub state: DevPtr,
}

/// A Gated DeltaNet layer's recurrence over a pass: its parameters and
/// state, the pass's inputs and output. `dims` = (nk, dk, nv, dv).
#[derive(Debug, Clone, Copy)]
pub struct GdnStep {
    /// `[n, conv channels]` f32: the convolution's output (q, k, v).
    pub conv_out: DevPtr,
    /// `[n, nv * dv]`, `[n, nv]`, `[n, nv]` f32: the z, b and a projections.
    pub z: DevPtr,
    pub b: DevPtr,
    pub a: DevPtr,
    /// `[nv]` f32 each: the decay's log and the step's bias.
    pub a_log: DevPtr,
    pub dt_bias: DevPtr,
    /// `[dv]` f32: the output norm's weights.
    pub norm: DevPtr,
    /// `[nv, dk, dv]` f32: the recurrent state, updated in place.
    pub state: DevPtr,
    pub dims: (usize, usize, usize, usize),
    pub eps: f32,
    /// `[n, nv * dv]` f32: the output.
    pub core: DevPtr,
}

impl Gpu {
    /// Causal conv + SiLU over `n` tokens of `c` channels (kernel `k` <= 8).
    pub fn gdn_conv(&self, x: DevPtr, n: usize, conv: &GdnConv, out: DevPtr) -> Result<()> {
        let GdnConv {
            weights: cw,
            channels: c,
            kernel: k,
            state,
        } = *conv;
        if !(1..=8).contains(&k) {
            return Err(CudaError::Invalid(format!(
                "conv kernel {k} is outside 1..=8"
            )));
        }
        let (n, ci, ki) = (n as i32, c as i32, k as i32);
        self.go(
            &self.f.gdn_conv,
            (c.div_ceil(256) as u32, 1, 1),
            256,
            &mut args!(&x, &n, &cw, &ci, &ki, &state, &out),
        )
    }

    /// The Gated DeltaNet recurrence over `n` tokens, all value heads.
    /// `dims` = (nk, dk, nv, dv); dk, dv <= 256.
    pub fn gdn_step(&self, step: &GdnStep, n: usize) -> Result<()> {
        let GdnStep {
            conv_out,
            z,
            b,
            a,
            a_log,
            dt_bias,
            norm,
            state,
            dims,
            eps,
            core,
        } = *step;
        let (nk, dk, nv, dv) = dims;
        if dk > 256 || dv > 256 || nk == 0 || !nv.is_multiple_of(nk) {
            return Err(CudaError::Invalid(format!(
                "gated delta rule with heads {nk}x{dk} / {nv}x{dv} is outside the kernel's limits"
            )));
        }
        // Heads up to 128 x 128: a register-resident form (512 threads).
        let (f, threads) = if dk <= 128 && dv <= 128 {
            if self.gdn_rows {
                (&self.f.gdn_step_r, 512)
            } else {
                (&self.f.gdn_step_w, 512)
            }
        } else {
            (&self.f.gdn_step, 128)
        };
        let (n, nk, dk, nv, dv) = (n as i32, nk as i32, dk as i32, nv as i32, dv as i32);
        self.go(
            f,
            (nv as u32, 1, 1),
            threads,
            &mut args!(
                &conv_out, &z, &b, &a, &a_log, &dt_bias, &norm, &state, &n, &nk, &dk, &nv, &dv,
                &eps, &core
            ),
        )
    }
}
