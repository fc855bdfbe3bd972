//! Dense products: `matvec` and its multi-matrix, wide 4-bit, prefill
//! and tensor-core forms.

use crate::desc::QKind;
use crate::{CudaError, DevPtr, Gpu, Result, WDesc};

/// Tokens one block of the wide 4-bit matvec runs its rows over (the
/// weights are read once per this many tokens of a pass).
pub const A4V_TOKENS_PER_BLOCK: usize = 16;
/// Largest grid y of a launch.
pub(crate) const GRID_Y_MAX: usize = 65535;
/// Tokens the prefill form stages and computes at once
/// (`A4V_TILE_TOKENS` in a4v.cu).
pub(crate) const A4V_TILE_TOKENS: usize = 2;

/// Shared memory the one-token tensor-core kernels may take where the GPU
/// allows more than the default 48 KiB: their staged x for rows of 8192
/// columns (`tc_smem_quarters(8192)`).
pub(crate) const TC_SMEM_OPTIN: usize = 8 * (8192 / 4 / 64) * (48 * 8 + 4) + TC_QUARTER_SUMS;
/// Bytes of `moe_gate_up_tc`'s / `matvec_tc`'s column-quarter sums
/// (`[2 tiles][4 quarters][32 lanes][4]` f32).
pub(crate) const TC_QUARTER_SUMS: usize = 2 * 4 * 32 * 4 * 4;
/// Tokens of a tensor-core prefill block (`TC_TOKENS` in prompt_tc.cu).
pub(crate) const TC_TOKENS: usize = 8;
/// Bytes of `moe_down_tc`'s per-rank row sums (`[8 ranks][16 rows]` f32).
pub(crate) const TC_RANK_SUMS: usize = 8 * 16 * 4;

/// Dynamic shared memory of the prefill kernels over rows of `cols`:
/// two buffers of A4V_TILE_TOKENS staged rows, each `a4v_region` floats
/// (the padded chunks and their sums, rounded to 16 bytes).
pub(crate) fn a4v_tiles_smem(cols: usize) -> usize {
    let region = (37 * (cols / 32) + 3) & !3;
    2 * A4V_TILE_TOKENS * region * 4
}

/// The block ranges of a launch over up to four matrices (`MULTI_ARGS` in
/// a4v.cu): matrix i's blocks of `block_rows` rows start at `bounds[i]`
/// (absent matrices get empty ranges at the end), `total` blocks in all;
/// the matrices and outputs padded to four with the last one.
pub(crate) fn multi_layout<'a>(
    ws: &[&'a WDesc],
    ys: &[DevPtr],
    block_rows: usize,
) -> ([i32; 4], usize, [&'a WDesc; 4], [DevPtr; 4]) {
    let mut bounds = [0i32; 4];
    let mut total = 0usize;
    for (i, w) in ws.iter().enumerate() {
        bounds[i] = total as i32;
        total += w.rows().div_ceil(block_rows);
    }
    for b in bounds.iter_mut().skip(ws.len()) {
        *b = total as i32;
    }
    let wd: [&WDesc; 4] = std::array::from_fn(|i| ws[i.min(ws.len() - 1)]);
    let yd: [DevPtr; 4] = std::array::from_fn(|i| ys[i.min(ys.len() - 1)]);
    (bounds, total, wd, yd)
}

/// Dynamic shared memory of a tensor-core kernel whose 8 warps each stage
/// `cols` values: per group of 64, 48 bf16-pair entries (384 bytes) and
/// the group's sum (4 bytes), then `sums` bytes of partial sums.
pub(crate) fn tc_smem(cols: usize, sums: usize) -> usize {
    8 * (cols / 64) * (48 * 8 + 4) + sums
}

/// Shared memory of `moe_gate_up_tc` / `matvec_tc` over rows of `cols`:
/// each warp stages its quarter of the columns.
pub(crate) fn tc_smem_quarters(cols: usize) -> usize {
    tc_smem(cols / 4, TC_QUARTER_SUMS)
}

impl Gpu {
    /// `y[t, :] = W x[t, :]` for `n` tokens; `x` holds `n * cols` f32 at
    /// address `x`, `y` `n * rows`.
    pub fn matvec(&self, w: &WDesc, x: DevPtr, y: DevPtr, n: usize) -> Result<()> {
        if self.matvec_on_q8(w) {
            let split = self.q8_split(x, w.cols(), n)?;
            return self.matvec_q8_pass(w, split, y, n);
        }
        if self.matvec_on_tensor_cores(w) {
            if n == 1 {
                return self.matvec_tc(&[w], x, &[y]);
            }
            let split = self.tc_split(x, w.cols(), n)?;
            return self.matvec_tc_pass(w, x, split, y, n);
        }
        if let (Some(c), true) = (w.a4v_chunks(), w.codes.is_aligned(16)) {
            // Rows per lane: 8 / c (8 16-byte loads in flight per lane).
            let blocks = w.rows().div_ceil(w.a4v_block_rows(8 / c)) as u32;
            let form = c.trailing_zeros() as usize;
            if n == 1
                || blocks as usize > GRID_Y_MAX
                || a4v_tiles_smem(w.cols()) > self.tiles_smem_max
            {
                // The one-token form, grid y = token (also where the
                // prefill form's grid, row blocks in y, would not fit:
                // same bits).
                let f = &self.f.matvec_a4v[form];
                let grid = (blocks, n as u32, 1);
                return self.go_smem(f, grid, 256, w.a4v_smem(1), &mut args!(w, &x, &y));
            }
            // Each block runs its rows over up to A4V_TOKENS_PER_BLOCK
            // tokens; grid (token blocks, row blocks).
            let tpb = A4V_TOKENS_PER_BLOCK;
            let grid = (n.div_ceil(tpb) as u32, blocks, 1);
            let (n_i, tpb_i) = (n as i32, tpb as i32);
            let f = &self.f.matvec_a4v_t[form];
            return self.go_smem(
                f,
                grid,
                256,
                a4v_tiles_smem(w.cols()) as u32,
                &mut args!(w, &x, &y, &n_i, &tpb_i),
            );
        }
        if let Some(nw) = w.a4_words() {
            let grid = (w.rows().div_ceil(16) as u32, n as u32, 1);
            return self.go(&self.f.matvec_a4, grid, 128, &mut args!(w, &x, &y, &nw));
        }
        let grid = (w.rows().div_ceil(8) as u32, n as u32, 1);
        self.go(&self.f.matvec, grid, 256, &mut args!(w, &x, &y))
    }

    /// Whether [`Gpu::matvec`] runs `w` on the generic `matvec` kernel
    /// (the 8-bit and float kinds; 4-bit rows it cannot take wide).
    fn matvec_generic(&self, w: &WDesc) -> bool {
        let wide = w.a4v_chunks().is_some() && w.codes.is_aligned(16);
        !self.matvec_on_tensor_cores(w) && !wide && w.a4_words().is_none()
    }

    /// Two to four matrices of the generic kernel over the same `n` rows
    /// of x in one `matvec_multi` launch (each block the bits of its own
    /// [`Gpu::matvec`] launch).
    fn matvec_generic_many(&self, ws: &[&WDesc], x: DevPtr, ys: &[DevPtr], n: usize) -> Result<()> {
        let (bounds, total, wd, yd) = multi_layout(ws, ys, 8);
        self.go(
            &self.f.matvec_multi,
            (total as u32, n as u32, 1),
            256,
            &mut args!(
                wd[0], wd[1], wd[2], wd[3], &bounds[1], &bounds[2], &bounds[3], &x, &yd[0], &yd[1],
                &yd[2], &yd[3]
            ),
        )
    }

    /// `ys[i][t] = ws[i] x[t]` for `n` tokens, each output the bits of its
    /// own [`Gpu::matvec`] launch. In one launch: up to four matrices of the
    /// same column count on the generic kernel (8-bit, float), or one
    /// token's on the tensor cores or in the wide 4-bit layout; a longer
    /// pass's tensor-core matrices share one split of x; otherwise one
    /// [`Gpu::matvec`] launch per matrix.
    pub fn matvec_many(&self, ws: &[&WDesc], x: DevPtr, ys: &[DevPtr], n: usize) -> Result<()> {
        if ws.len() != ys.len() {
            return Err(CudaError::Invalid(
                "matvec_many: one output per matrix".into(),
            ));
        }
        let cols = ws.first().map_or(0, |w| w.cols());
        if !ws.is_empty() && ws.iter().all(|w| self.matvec_on_q8(w) && w.cols() == cols) {
            return self.matvec_many_q8(ws, x, ys, n);
        }
        if (2..=4).contains(&ws.len())
            && ws
                .iter()
                .all(|w| self.matvec_generic(w) && w.cols() == cols)
        {
            return self.matvec_generic_many(ws, x, ys, n);
        }
        if n != 1 {
            // Matrices of the same columns on tensor cores share one split
            // of x (the same bits as a split per matrix).
            if ws.len() > 1
                && ws
                    .iter()
                    .all(|w| self.matvec_on_tensor_cores(w) && w.cols() == cols)
            {
                let split = self.tc_split(x, cols, n)?;
                for (w, &y) in ws.iter().zip(ys) {
                    self.matvec_tc_pass(w, x, split, y, n)?;
                }
                return Ok(());
            }
            for (w, &y) in ws.iter().zip(ys) {
                self.matvec(w, x, y, n)?;
            }
            return Ok(());
        }
        if (1..=4).contains(&ws.len())
            && ws
                .iter()
                .all(|w| self.matvec_on_tensor_cores(w) && w.cols() == ws[0].cols())
        {
            return self.matvec_tc(ws, x, ys);
        }
        let chunks = ws.first().and_then(|w| w.a4v_chunks());
        let fused = ws.len() >= 2
            && ws.len() <= 4
            && ws.iter().all(|w| {
                w.a4v_chunks() == chunks && w.codes.is_aligned(16) && w.cols() == ws[0].cols()
            });
        let Some(c) = chunks.filter(|_| fused) else {
            for (w, &y) in ws.iter().zip(ys) {
                self.matvec(w, x, y, 1)?;
            }
            return Ok(());
        };
        let brows = ws[0].a4v_block_rows(8 / c);
        // Block boundaries b1..b3; absent matrices get empty ranges.
        let (bounds, total, wd, yd) = multi_layout(ws, ys, brows);
        let f = &self.f.matvec_a4v_multi[c.trailing_zeros() as usize];
        self.go_smem(
            f,
            (total as u32, 1, 1),
            256,
            ws[0].a4v_smem(1),
            &mut args!(
                wd[0], wd[1], wd[2], wd[3], &bounds[1], &bounds[2], &bounds[3], &x, &yd[0], &yd[1],
                &yd[2], &yd[3]
            ),
        )
    }

    /// `y[t, :] = W x[t, :]` for `n` > 1 tokens on the tensor-core prefill
    /// form, x (at `x`) already split by [`Gpu::tc_split`] into `split`;
    /// each token the bits of its one-token `matvec_tc` launch (which runs
    /// the pass token by token where the grid would not fit).
    fn matvec_tc_pass(
        &self,
        w: &WDesc,
        x: DevPtr,
        split: (DevPtr, DevPtr),
        y: DevPtr,
        n: usize,
    ) -> Result<()> {
        let (xs, gs) = split;
        let grid = (
            n.div_ceil(TC_TOKENS) as u32,
            w.rows().div_ceil(32) as u32,
            1,
        );
        if grid.1 as usize <= GRID_Y_MAX {
            let n_i = n as i32;
            return self.go_smem(
                &self.f.matvec_tc_t,
                grid,
                256,
                self.tc_t_smem() as u32,
                &mut args!(w, &xs, &gs, &y, &n_i),
            );
        }
        for t in 0..n {
            let (xt, yt) = (x.add_f32(t * w.cols()), y.add_f32(t * w.rows()));
            self.matvec_tc(&[w], xt, &[yt])?;
        }
        Ok(())
    }

    /// Whether [`Gpu::matvec`] runs `w` (one token) on the tensor-core
    /// kernel: `tensor_cores` on, affine 4-bit with groups of 64, rows a
    /// multiple of 256 columns, staged x within 48 KiB of shared memory.
    pub fn matvec_on_tensor_cores(&self, w: &WDesc) -> bool {
        self.tensor_cores
            && self.tc_capable
            && w.qt == QKind::Affine4 as i32
            && w.group == 64
            && w.cols().is_multiple_of(256)
            && tc_smem_quarters(w.cols()) <= self.tc_smem_max
            && w.codes.is_aligned(8)
    }

    /// Dynamic shared memory of the tensor-core prefill forms: their
    /// column quarters' sums per mma set (`[TC_TOKENS / tpm][2][4][32][4]`
    /// f32).
    pub(crate) fn tc_t_smem(&self) -> usize {
        TC_TOKENS / self.tc_tpm * TC_QUARTER_SUMS
    }

    /// Splits `n` rows of `cols` f32 at `x` (cols a multiple of 64) into
    /// the tensor-core kernels' staged form in this GPU's scratch: returns
    /// the addresses of the bf16 parts (`[n][cols / 64][48]` u32 pairs) and
    /// of the group sums (`[n][cols / 64]` f32). The scratch stays valid
    /// until the next call on this stream (a larger one first waits for
    /// the stream, then reallocates).
    pub(crate) fn tc_split(&self, x: DevPtr, cols: usize, n: usize) -> Result<(DevPtr, DevPtr)> {
        let ng = cols / 64;
        let (parts, sums) = (n * ng * 48 * 8, n * ng * 4);
        // At least a full pass of the widest rows the kernels take.
        let b = self.scratch(
            &self.tc_split_buf,
            (parts + sums).max(256 * 2048 / 64 * (48 * 8 + 4)),
        )?;
        let (cols_i, grid) = (cols as i32, (ng.div_ceil(8) as u32, n as u32, 1));
        let gs = b.add_bytes(parts);
        self.go(
            &self.f.tc_split,
            grid,
            256,
            &mut args!(&x, &cols_i, &b, &gs),
        )?;
        Ok((b, gs))
    }

    /// One launch of `matvec_tc` over up to 4 matrices of the same columns
    /// (each checked by [`Gpu::matvec_on_tensor_cores`]).
    fn matvec_tc(&self, ws: &[&WDesc], x: DevPtr, ys: &[DevPtr]) -> Result<()> {
        let (bounds, total, wd, yd) = multi_layout(ws, ys, 32);
        let smem = tc_smem_quarters(ws[0].cols()) as u32;
        self.go_smem(
            &self.f.matvec_tc,
            (total as u32, 1, 1),
            256,
            smem,
            &mut args!(
                wd[0], wd[1], wd[2], wd[3], &bounds[1], &bounds[2], &bounds[3], &x, &yd[0], &yd[1],
                &yd[2], &yd[3]
            ),
        )
    }
}
