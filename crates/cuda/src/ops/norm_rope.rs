//! Norms, RoPE, the attention's q/k preparation, embedding rows and
//! residual adds.

use crate::{CudaError, DevPtr, Gpu, Position, Result, WDesc};

/// An attention layer's q/k preparation over a pass of `n` tokens of `nh`
/// query and `nkv` KV heads of `hd` (`dims`): q/k norm, RoPE, the output
/// gate split off the q projection, and k/v appended to the caches.
#[derive(Debug, Clone, Copy)]
pub struct QkPrep {
    /// `[n, nh * hd]` (`[n, nh * 2 hd]` gated), `[n, nkv * hd]`,
    /// `[n, nkv * hd]` f32: the projections.
    pub q_all: DevPtr,
    pub k_all: DevPtr,
    pub v_all: DevPtr,
    /// `[hd]` f32 each: the q and k norms' weights.
    pub qn: DevPtr,
    pub kn: DevPtr,
    /// `[half]` f32: RoPE's inverse frequencies.
    pub inv_freq: DevPtr,
    pub half: usize,
    pub dims: (usize, usize, usize),
    /// The q projection holds an output gate per head.
    pub gated: bool,
    pub eps: f32,
    /// `[n, nh, hd]` f32: the prepared queries and (gated) their gates.
    pub q_out: DevPtr,
    pub gate_out: DevPtr,
    /// `[rows, nkv * hd]` f32: the KV caches the pass's rows are written to.
    pub kcache: DevPtr,
    pub vcache: DevPtr,
}

impl Gpu {
    /// RMS norm of `rows` rows of `dim` values.
    pub fn rms_norm(
        &self,
        x: DevPtr,
        w: DevPtr,
        out: DevPtr,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        self.add_rms_norm(x, DevPtr::NULL, w, out, rows, dim, eps)
    }

    /// [`Gpu::add`] of `add` (`[rows, dim]`; 0 for none) into `x`, then
    /// [`Gpu::rms_norm`] of the sum, in one launch with the same bits.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm(
        &self,
        x: DevPtr,
        add: DevPtr,
        w: DevPtr,
        out: DevPtr,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        let dim = dim as i32;
        self.go(
            &self.f.rms_norm,
            (rows as u32, 1, 1),
            256,
            &mut args!(&x, &w, &out, &dim, &eps, &add),
        )
    }

    /// RoPE in place on `heads` rows of `hd` values at `pos`.
    pub fn rope(
        &self,
        v: DevPtr,
        inv_freq: DevPtr,
        half: usize,
        hd: usize,
        heads: usize,
        pos: usize,
    ) -> Result<()> {
        let (half, hd, pos) = (half as i32, hd as i32, pos as i32);
        self.go(
            &self.f.rope,
            (heads as u32, 1, 1),
            128,
            &mut args!(&v, &inv_freq, &half, &hd, &pos),
        )
    }

    /// q/k norm + RoPE + gate split + KV append for `n` tokens at `pos0`.
    pub fn qk_prep(&self, p: &QkPrep, pos0: Position, n: usize) -> Result<()> {
        let QkPrep {
            q_all,
            k_all,
            v_all,
            qn,
            kn,
            inv_freq,
            half,
            dims,
            gated,
            eps,
            q_out,
            gate_out,
            kcache,
            vcache,
        } = *p;
        let (nh, nkv, hd) = dims;
        let q_stride = if gated { 2 * hd } else { hd } as i32;
        let (pos0, dpos) = match pos0 {
            Position::Host(p) => (p as i32, DevPtr::NULL),
            Position::Device { ptr, .. } if n == 1 => (0, ptr),
            Position::Device { .. } => {
                return Err(CudaError::Invalid(
                    "qk_prep reads a device position for one token only".into(),
                ))
            }
        };
        let (half, nh_i, nkv_i, hd_i) = (half as i32, nh as i32, nkv as i32, hd as i32);
        let gate_out = if gated { gate_out } else { DevPtr::NULL };
        self.go(
            &self.f.qk_prep,
            ((nh + nkv) as u32, n as u32, 1),
            256,
            &mut args!(
                &q_all, &k_all, &v_all, &qn, &kn, &inv_freq, &half, &nh_i, &nkv_i, &hd_i,
                &q_stride, &eps, &pos0, &q_out, &gate_out, &kcache, &vcache, &dpos
            ),
        )
    }

    /// Rows `ids[t]` (i32 at `ids`) of `w` into `out[t]`, `tokens` rows.
    pub fn embed_rows(&self, w: &WDesc, ids: DevPtr, out: DevPtr, tokens: usize) -> Result<()> {
        self.go(
            &self.f.embed_rows,
            (w.cols().div_ceil(256) as u32, tokens as u32, 1),
            256,
            &mut args!(w, &ids, &out),
        )
    }

    /// `x += y` over `n` f32.
    pub fn add(&self, x: DevPtr, y: DevPtr, n: usize) -> Result<()> {
        let ni = n as i32;
        self.go(
            &self.f.add_inplace,
            (n.div_ceil(256) as u32, 1, 1),
            256,
            &mut args!(&x, &y, &ni),
        )
    }
}
