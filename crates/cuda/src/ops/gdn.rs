//! Gated DeltaNet: the causal convolution and the recurrence.

use crate::{CudaError, Gpu, Result};

impl Gpu {
    /// Causal conv + SiLU over `n` tokens of `c` channels (kernel `k` <= 8).
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_conv(
        &self,
        x: u64,
        n: usize,
        cw: u64,
        c: usize,
        k: usize,
        state: u64,
        out: u64,
    ) -> Result<()> {
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
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_step(
        &self,
        conv_out: u64,
        z: u64,
        b: u64,
        a: u64,
        a_log: u64,
        dt_bias: u64,
        norm: u64,
        state: u64,
        n: usize,
        dims: (usize, usize, usize, usize),
        eps: f32,
        core: u64,
    ) -> Result<()> {
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
