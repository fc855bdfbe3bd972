//! The prompt's 4-bit products in 8-bit integers (kernels/prompt_q8.cu):
//! each pass's input rows quantized once per group of 64 (`q8_split`),
//! then the dense, grouped (device routing) and per-pair (host routing)
//! products on int8 mma. Taken where [`Gpu::prompt_int8`] is set (the
//! prompt's passes at [`crate::PromptPrecision::Int8`]) and the weights
//! are affine 4-bit with groups of 64. A token's bits follow from its own
//! row only, so every pass length, slot count and routing mode gives the
//! same prompt logits.

use crate::desc::QKind;
use crate::ops::matvec::GRID_Y_MAX;
use crate::ops::moe::{same_layout, ExpertsIo};
use crate::{CudaError, DBuf, DevPtr, Gpu, Result, RouteBases, WDesc};

/// Tokens (or pairs) one q8 block computes at once (`Q8_TILES * 8`).
const Q8_BLOCK_TOKENS: usize = 64;
/// Rows of one dense or down q8 block (8 warps of 16).
const Q8_BLOCK_ROWS: usize = 128;
/// Gate/up rows of one q8 block (8 warps of 8 gate + 8 up rows).
const Q8_GATE_UP_ROWS: usize = 64;

/// Bytes of `n` rows of `cols` in the q8 form: the int8 codes, then one
/// (scale, sum) pair of f32 per group of 64.
fn q8_bytes(n: usize, cols: usize) -> (usize, usize) {
    let ng = cols / 64;
    (n * ng * 64, n * ng * 8)
}

impl Gpu {
    /// Whether `w`'s products in this pass take the 8-bit forms:
    /// [`Gpu::prompt_int8`] on a GPU with int8 mma (sm_80+), affine 4-bit
    /// with groups of 64, 8-byte aligned codes.
    pub fn matvec_on_q8(&self, w: &WDesc) -> bool {
        self.prompt_int8
            && self.tc_capable
            && w.qt == QKind::Affine4 as i32
            && w.group == 64
            && w.cols() > 0
            && w.cols().is_multiple_of(64)
            && w.codes.is_aligned(8)
    }

    /// Whether the routed experts with these parts (gate, up, down) take
    /// the 8-bit forms: each part as [`Gpu::matvec_on_q8`], gate and up of
    /// one layout, down's columns gate's rows.
    pub fn experts_on_q8(&self, parts: [&WDesc; 3], k: usize) -> bool {
        let [gt, ut, dt] = parts;
        self.matvec_on_q8(gt)
            && self.matvec_on_q8(dt)
            && same_layout(gt, ut)
            && gt.scale_bf16 == dt.scale_bf16
            && dt.cols() == gt.rows()
            && k >= 1
    }

    /// `n` rows of `cols` f32 at `x` quantized into the q8 scratch:
    /// (codes, scales and sums) addresses. The split stays valid for the
    /// launches queued before the next split.
    pub(crate) fn q8_split(&self, x: DevPtr, cols: usize, n: usize) -> Result<(DevPtr, DevPtr)> {
        let (codes, sums) = q8_bytes(n, cols);
        let (full_codes, full_sums) = q8_bytes(crate::options::PASS_TOKENS * 8, 2048);
        let b = self.scratch(
            &self.q8_split_buf,
            (codes + sums).max(full_codes + full_sums),
        )?;
        let ds = b.add_bytes(codes);
        let cols_i = cols as i32;
        self.go(
            &self.f.q8_split,
            ((cols / 64).div_ceil(8) as u32, n as u32, 1),
            256,
            &mut args!(&x, &cols_i, &b, &ds),
        )?;
        Ok((b, ds))
    }

    /// `y[t, :] = W x[t, :]` for `n` tokens already split by
    /// [`Gpu::q8_split`].
    pub(crate) fn matvec_q8_pass(
        &self,
        w: &WDesc,
        split: (DevPtr, DevPtr),
        y: DevPtr,
        n: usize,
    ) -> Result<()> {
        let (xq, ds) = split;
        let grid = (
            n.div_ceil(Q8_BLOCK_TOKENS) as u32,
            w.rows().div_ceil(Q8_BLOCK_ROWS) as u32,
            1,
        );
        if grid.1 as usize > GRID_Y_MAX {
            return Err(CudaError::Invalid(format!(
                "a matrix of {} rows is past the 8-bit prompt kernel's grid",
                w.rows()
            )));
        }
        let n_i = n as i32;
        self.go(
            &self.f.matvec_q8_t,
            grid,
            256,
            &mut args!(w, &xq, &ds, &y, &n_i),
        )
    }

    /// [`Gpu::matvec_many`] on the 8-bit forms: one split of x for every
    /// matrix (all of `cols` columns).
    pub(crate) fn matvec_many_q8(
        &self,
        ws: &[&WDesc],
        x: DevPtr,
        ys: &[DevPtr],
        n: usize,
    ) -> Result<()> {
        let cols = ws.first().map_or(0, |w| w.cols());
        let split = self.q8_split(x, cols, n)?;
        for (w, &y) in ws.iter().zip(ys) {
            self.matvec_q8_pass(w, split, y, n)?;
        }
        Ok(())
    }

    /// The routed experts of `io.tokens` tokens pair by pair over the
    /// bases tables `bases` (gate, up, down: `[tokens * k]` addresses each,
    /// host routing), then each token's ranks summed into `io.x`.
    pub(crate) fn moe_experts_q8_pairs(
        &self,
        parts: [&WDesc; 3],
        bases: [DevPtr; 3],
        io: &ExpertsIo,
    ) -> Result<()> {
        let [gt, ut, dt] = parts;
        let (xrow, h, pairs) = (io.xrow, io.h, (io.tokens * io.k) as u32);
        self.q8_experts(
            parts,
            io,
            |(xq, ds)| {
                self.go(
                    &self.f.moe_gate_up_q8_pairs,
                    (gt.rows().div_ceil(Q8_GATE_UP_ROWS) as u32, pairs, 1),
                    256,
                    &mut args!(gt, ut, &bases[0], &bases[1], &xrow, &xq, &ds, &h),
                )
            },
            |(hq, hs), v| {
                self.go(
                    &self.f.moe_down_q8_pairs,
                    (dt.rows().div_ceil(Q8_BLOCK_ROWS) as u32, pairs, 1),
                    256,
                    &mut args!(dt, &bases[2], &hq, &hs, &v),
                )
            },
        )
    }

    /// The routed experts of a pass grouped by expert (device routing:
    /// `grp` from `group_pairs`, records at `route.addr`), then each
    /// token's ranks summed into `io.x`.
    pub(crate) fn moe_experts_q8_grouped(
        &self,
        parts: [&WDesc; 3],
        route: &RouteBases,
        e: usize,
        grp: (&DBuf, &DBuf),
        io: &ExpertsIo,
    ) -> Result<()> {
        let [gt, ut, dt] = parts;
        let (xrow, h) = (io.xrow, io.h);
        let (off, list) = grp;
        let o2 = route.offsets[2];
        self.q8_experts(
            parts,
            io,
            |(xq, ds)| {
                self.go(
                    &self.f.moe_gate_up_q8_grouped,
                    (gt.rows().div_ceil(Q8_GATE_UP_ROWS) as u32, e as u32, 1),
                    256,
                    &mut grouped_gate_up_args!(gt, ut, route, grp, &xrow, [&xq, &ds], &h),
                )
            },
            |(hq, hs), v| {
                self.go(
                    &self.f.moe_down_q8_grouped,
                    (dt.rows().div_ceil(Q8_BLOCK_ROWS) as u32, e as u32, 1),
                    256,
                    &mut args!(dt, &route.addr, &o2, &off.ptr, &list.ptr, &hq, &hs, &v),
                )
            },
        )
    }

    /// What both expert forms do around their two launches: x split,
    /// `gate_up` (given the split), h split by pair, `down` (given that
    /// split and the per-pair output rows `v`, `[pairs, H]`), then each
    /// token's ranks summed into `io.x`.
    fn q8_experts(
        &self,
        parts: [&WDesc; 3],
        io: &ExpertsIo,
        gate_up: impl FnOnce((DevPtr, DevPtr)) -> Result<()>,
        down: impl FnOnce((DevPtr, DevPtr), DevPtr) -> Result<()>,
    ) -> Result<()> {
        let [gt, _, dt] = parts;
        let pairs = io.tokens * io.k;
        gate_up(self.q8_split(io.xn, gt.cols(), io.tokens)?)?;
        let h_split = self.q8_split(io.h, dt.cols(), pairs)?;
        let v = self.scratch(&self.tc_down_buf, pairs * dt.rows() * 4)?;
        down(h_split, v)?;
        self.moe_down_sum(v, dt.rows(), io)
    }

    /// `moe_down_combine`: each token's `k` rank outputs (`v`, `[pairs,
    /// rows]`) summed in rank order with their weights, the gated shared
    /// expert added, into the residual.
    pub(crate) fn moe_down_sum(&self, v: DevPtr, rows: usize, io: &ExpertsIo) -> Result<()> {
        let (h_i, k_i) = (rows as i32, io.k as i32);
        let (wts, shared, x) = (io.wts, io.shared, io.x);
        self.go(
            &self.f.moe_down_combine,
            (rows.div_ceil(256) as u32, io.tokens as u32, 1),
            256,
            &mut args!(&v, &h_i, &wts, &k_i, &shared.0, &shared.1, &x),
        )
    }
}
