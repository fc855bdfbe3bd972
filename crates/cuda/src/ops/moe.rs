//! Routed and shared experts: the router's top-k, gate/up and down over
//! bases tables, the fused, grouped (prefill) and tensor-core forms.

use crate::desc::QKind;
use crate::ops::matvec::{a4v_tiles_smem, tc_smem, tc_smem_quarters, GRID_Y_MAX, TC_RANK_SUMS};
use crate::{CudaError, DBuf, DevPtr, Gpu, Mapped, Result, RouteBases, WDesc};

/// The activations of a routed-experts launch over `tokens` tokens with
/// `k` experts each (pair p = t k + r is token t's rank-r expert).
#[derive(Debug, Clone, Copy)]
pub struct ExpertsIo {
    /// `[tokens * k]` i32: each pair's token row of `xn`.
    pub xrow: DevPtr,
    /// `[tokens, H]` f32: the experts' (normed) input.
    pub xn: DevPtr,
    /// `[tokens * k, I]` f32: the pairs' gate/up outputs.
    pub h: DevPtr,
    /// `[tokens, k]` f32: the routing weights.
    pub wts: DevPtr,
    /// Experts per token.
    pub k: usize,
    /// The shared expert's output `[tokens, H]` and gate logit `[tokens]`
    /// (`(0, 0)`: no shared expert).
    pub shared: (DevPtr, DevPtr),
    /// `[tokens, H]` f32: the residual the experts' weighted sum (and the
    /// gated shared expert) is added into.
    pub x: DevPtr,
    pub tokens: usize,
}

/// Experts the down kernels stage at once (`DOWN_KB` in moe_a4v.cu).
pub(crate) const DOWN_KB: usize = 8;
/// Row blocks one prefill down block runs (`DOWN_GROUPS`).
pub(crate) const DOWN_GROUPS: usize = 8;

/// Shared memory of `moe_down_tc` over rows of `cols`: each warp stages
/// its rank's whole input row.
pub(crate) fn tc_smem_ranks(cols: usize) -> usize {
    tc_smem(cols, TC_RANK_SUMS)
}

/// Whether two weight templates have the same shape and quantisation (the
/// wide gate/up kernel reads both with one layout).
pub(crate) fn same_layout(a: &WDesc, b: &WDesc) -> bool {
    (a.rows, a.cols, a.qt, a.group, a.scale_bf16) == (b.rows, b.cols, b.qt, b.group, b.scale_bf16)
}

impl Gpu {
    /// Routed experts' gate/up for `pairs` pairs; `gbase`/`ubase` hold
    /// `pairs` u64 part addresses, `xrow` `pairs` i32 token rows of `x`;
    /// `h` receives `[pairs, I]`.
    pub fn moe_gate_up(
        &self,
        [gt, ut]: [&WDesc; 2],
        [gbase, ubase]: [DevPtr; 2],
        xrow: DevPtr,
        x: DevPtr,
        h: DevPtr,
        pairs: usize,
    ) -> Result<()> {
        if let Some(c) = gt.a4v_chunks().filter(|_| same_layout(gt, ut)) {
            // Rows per lane: 2 / c, at least 1 (gate and up: 4 loads in
            // flight per lane; 8 for c = 4); 4 / c without the split.
            let r_lane = if self.split { (2 / c).max(1) } else { 4 / c };
            let grid = (
                gt.rows().div_ceil(gt.a4v_block_rows(r_lane)) as u32,
                pairs as u32,
                1,
            );
            let f = &self.f.moe_gate_up_a4v[c.trailing_zeros() as usize];
            return self.go_smem(
                f,
                grid,
                256,
                gt.a4v_smem(1),
                &mut args!(gt, ut, &gbase, &ubase, &xrow, &x, &h),
            );
        }
        if let (Some(nw), Some(_)) = (gt.a4_words(), ut.a4_words()) {
            let grid = (gt.rows().div_ceil(16) as u32, pairs as u32, 1);
            return self.go(
                &self.f.moe_gate_up_a4,
                grid,
                128,
                &mut args!(gt, ut, &gbase, &ubase, &xrow, &x, &h, &nw),
            );
        }
        let grid = (gt.rows().div_ceil(8) as u32, pairs as u32, 1);
        self.go(
            &self.f.moe_gate_up,
            grid,
            256,
            &mut args!(gt, ut, &gbase, &ubase, &xrow, &x, &h),
        )
    }

    /// `x[t] += sum_k wts[t,k] down_{t,k} h[t*K+k] + sigmoid(sg[t]) shared[t]`
    /// for `tokens` tokens (`shared == 0`: no shared expert).
    pub fn moe_down(&self, dt: &WDesc, dbase: DevPtr, io: &ExpertsIo) -> Result<()> {
        let ExpertsIo {
            h,
            wts,
            k,
            shared: (shared, sg),
            x,
            tokens,
            ..
        } = *io;
        let k = k as i32;
        if dt.a4v_chunks() == Some(1) {
            // One chunk per lane, experts staged 8 at a time (`DOWN_KB`),
            // each warp pair splitting them 4 + 4: half the rows per block.
            // Grid (tokens, row blocks).
            let blocks = dt
                .rows()
                .div_ceil(dt.a4v_block_rows(1) / (1 + self.split as usize));
            if blocks > GRID_Y_MAX {
                return Err(CudaError::Invalid(format!(
                    "down projection of {} rows is beyond one launch",
                    dt.rows()
                )));
            }
            if tokens > 1 && k as usize <= DOWN_KB {
                // A pass of several tokens: each block stages its token's h
                // once for DOWN_GROUPS row blocks (same bits).
                let nb = blocks as i32;
                let grid = (tokens as u32, blocks.div_ceil(DOWN_GROUPS) as u32, 1);
                return self.go_smem(
                    &self.f.moe_down_a4v_t,
                    grid,
                    256,
                    dt.a4v_smem(8),
                    &mut args!(dt, &dbase, &h, &wts, &k, &shared, &sg, &x, &nb),
                );
            }
            let grid = (tokens as u32, blocks as u32, 1);
            return self.go_smem(
                &self.f.moe_down_a4v,
                grid,
                256,
                dt.a4v_smem(8),
                &mut args!(dt, &dbase, &h, &wts, &k, &shared, &sg, &x),
            );
        }
        if let Some(nw) = dt.a4_words() {
            let grid = (dt.rows().div_ceil(16) as u32, tokens as u32, 1);
            return self.go(
                &self.f.moe_down_a4,
                grid,
                128,
                &mut args!(dt, &dbase, &h, &wts, &k, &shared, &sg, &x, &nw),
            );
        }
        let grid = (dt.rows().div_ceil(8) as u32, tokens as u32, 1);
        self.go(
            &self.f.moe_down,
            grid,
            256,
            &mut args!(dt, &dbase, &h, &wts, &k, &shared, &sg, &x),
        )
    }

    /// All routed experts of `tokens` tokens with `k` experts each:
    /// [`Gpu::moe_gate_up`] for the `tokens * k` pairs, then
    /// [`Gpu::moe_down`] into `x`. Where the wide 4-bit kernels take both
    /// shapes (and [`Gpu::fused`] is set) this is one launch of the fused
    /// kernel, whose numbers are bit-identical to the two launches; `h`
    /// holds `[tokens * k, I]` either way.
    pub fn moe_experts(
        &self,
        parts: [&WDesc; 3],
        bases: [DevPtr; 3],
        io: &ExpertsIo,
    ) -> Result<()> {
        let ExpertsIo {
            xrow,
            xn,
            h,
            wts,
            k,
            shared,
            x,
            tokens,
        } = *io;
        let [gt, ut, dt] = parts;
        let pairs = tokens * k;
        // The prompt's int8 forms first: the bits of the grouped ones.
        if self.experts_on_q8(parts, k) {
            return self.moe_experts_q8_pairs(parts, bases, io);
        }
        if let (true, Some(c), Some(1)) = (
            self.fused && same_layout(gt, ut),
            gt.a4v_chunks(),
            dt.a4v_chunks(),
        ) {
            let ga = gt.rows().div_ceil(gt.a4v_block_rows(4 / c)) as i32;
            let gb = dt
                .rows()
                .div_ceil(dt.a4v_block_rows(1) / (1 + self.split as usize))
                as i32;
            let smem = gt.a4v_smem(1).max(dt.a4v_smem(8));
            let grid = (ga as u32 * pairs as u32 + gb as u32 * tokens as u32, 1, 1);
            let (ki, pi, ti) = (k as i32, pairs as i32, tokens as i32);
            let f = &self.f.moe_fused_a4v[c.trailing_zeros() as usize];
            let sync = self.fused_sync.ptr;
            return self.go_smem(
                f,
                grid,
                256,
                smem,
                &mut args!(
                    gt, ut, dt, &bases[0], &bases[1], &bases[2], &xrow, &xn, &h, &wts, &ki,
                    &shared.0, &shared.1, &x, &ga, &pi, &gb, &ti, &sync
                ),
            );
        }
        if self.tensor_cores && self.experts_on_tensor_cores(parts, k) {
            let smem_gu = tc_smem_quarters(gt.cols()) as u32;
            let grid = (gt.rows().div_ceil(16) as u32, pairs as u32, 1);
            self.go_smem(
                &self.f.moe_gate_up_tc,
                grid,
                256,
                smem_gu,
                &mut args!(gt, ut, &bases[0], &bases[1], &xrow, &xn, &h),
            )?;
            return self.moe_down_tc(dt, bases[2], io);
        }
        self.moe_gate_up([gt, ut], [bases[0], bases[1]], xrow, xn, h, pairs)?;
        self.moe_down(dt, bases[2], io)
    }

    /// [`Gpu::moe_experts`] for a pass of `tokens` tokens whose routing is
    /// on the device (prefill), with each expert's gate/up rows loaded once
    /// per pass: the pairs are grouped by expert (`ids` `[tokens, k]`
    /// expert ids into `grp_off` `[e + 1]` and `grp_list` `[tokens k]` i32)
    /// and each group runs its expert (record at `addr[id]`, parts at
    /// `offsets`) over its pairs; the down projections as in
    /// [`Gpu::moe_experts`], over the bases table at `dbase`. Every pair
    /// and token gets the operations of [`Gpu::moe_experts`] (same bits).
    /// Returns false (nothing launched) where the shapes or settings call
    /// for another kernel: then [`Gpu::moe_experts`] runs the pass.
    pub fn moe_experts_grouped(
        &self,
        parts: [&WDesc; 3],
        route: &RouteBases,
        ids: DevPtr,
        e: usize,
        grp: (&DBuf, &DBuf),
        io: &ExpertsIo,
    ) -> Result<bool> {
        let ExpertsIo {
            xrow,
            xn,
            h,
            k,
            tokens,
            ..
        } = *io;
        let [gt, ut, dt] = parts;
        let pairs = tokens * k;
        let q8 = self.experts_on_q8(parts, k);
        let fused = !q8 && self.fused && same_layout(gt, ut) && dt.a4v_chunks() == Some(1);
        let tc = self.tensor_cores && self.experts_on_tensor_cores(parts, k);
        let chunks = gt.a4v_chunks().filter(|_| same_layout(gt, ut));
        let tiles_fit = a4v_tiles_smem(gt.cols()) <= self.tiles_smem_max;
        if fused || e > 1024 || !(q8 || (chunks.is_some() && (tc || tiles_fit))) {
            return Ok(false);
        }
        let (off, list) = grp;
        if off.len_f32() < e + 1 || list.len_f32() < pairs {
            return Err(CudaError::Invalid("expert group buffers too small".into()));
        }
        let (p_i, e_i) = (pairs as i32, e as i32);
        self.go(
            &self.f.group_pairs,
            (1, 1, 1),
            1024,
            &mut args!(&ids, &p_i, &e_i, &off.ptr, &list.ptr),
        )?;
        let dbase = route.out.add_bytes(16 * pairs);
        if q8 {
            return self
                .moe_experts_q8_grouped(parts, route, e, grp, io)
                .map(|()| true);
        }
        let Some(c) = chunks else {
            return Ok(false);
        };
        if tc {
            // Each pair's h the bits of its moe_gate_up_tc block, each
            // token's down sum the bits of its moe_down_tc block.
            let (xs, gs) = self.tc_split(xn, gt.cols(), tokens)?;
            let grid = (gt.rows().div_ceil(16) as u32, e as u32, 1);
            self.go_smem(
                &self.f.moe_gate_up_tc_grouped,
                grid,
                256,
                self.tc_t_smem() as u32,
                &mut grouped_gate_up_args!(gt, ut, route, grp, &xrow, [&xs, &gs], &h),
            )?;
            let (hs, hg) = self.tc_split(h, dt.cols(), pairs)?;
            let hd = dt.rows();
            let v = self.scratch(&self.tc_down_buf, pairs * hd * 4)?;
            let o2 = route.offsets[2];
            self.go(
                &self.f.moe_down_tc_grouped,
                (hd.div_ceil(128) as u32, e as u32, 1),
                256,
                &mut args!(dt, &route.addr, &o2, &off.ptr, &list.ptr, &hs, &hg, &v),
            )?;
            return self.moe_down_sum(v, hd, io).map(|()| true);
        }
        let r_lane = if self.split { (2 / c).max(1) } else { 4 / c };
        let grid = (
            gt.rows().div_ceil(gt.a4v_block_rows(r_lane)) as u32,
            e as u32,
            1,
        );
        self.go_smem(
            &self.f.moe_gate_up_grouped[c.trailing_zeros() as usize],
            grid,
            256,
            a4v_tiles_smem(gt.cols()) as u32,
            &mut grouped_gate_up_args!(gt, ut, route, grp, &xrow, [&xn], &h),
        )?;
        self.moe_down(dt, dbase, io)?;
        Ok(true)
    }

    /// `moe_down_tc` over `tokens` tokens (bases at `dbase`, `[tokens, k]`).
    fn moe_down_tc(&self, dt: &WDesc, dbase: DevPtr, io: &ExpertsIo) -> Result<()> {
        let ExpertsIo {
            h,
            wts,
            k,
            shared,
            x,
            tokens,
            ..
        } = *io;
        let smem_d = tc_smem_ranks(dt.cols()) as u32;
        let grid = (dt.rows().div_ceil(16) as u32, tokens as u32, 1);
        let ki = k as i32;
        self.go_smem(
            &self.f.moe_down_tc,
            grid,
            256,
            smem_d,
            &mut args!(dt, &dbase, &h, &wts, &ki, &shared.0, &shared.1, &x),
        )
    }

    /// Whether [`Gpu::moe_experts`] runs these parts (gate, up, down) with
    /// `k` ranks on the tensor-core kernels (when `tensor_cores` is on and
    /// the fused kernel is off): affine 4-bit with groups of 64, gate/up
    /// rows a multiple of 256 columns, at most 8 ranks, and the staged
    /// inputs within 48 KiB of shared memory.
    pub fn experts_on_tensor_cores(&self, parts: [&WDesc; 3], k: usize) -> bool {
        let [gt, ut, dt] = parts;
        let a4g64 = |w: &WDesc| w.qt == QKind::Affine4 as i32 && w.group == 64;
        self.tc_capable
            && same_layout(gt, ut)
            && a4g64(gt)
            && a4g64(dt)
            && gt.scale_bf16 == dt.scale_bf16
            && gt.cols().is_multiple_of(256)
            && tc_smem_quarters(gt.cols()) <= self.tc_smem_max
            && dt.cols().is_multiple_of(64)
            && (1..=8).contains(&k)
            && tc_smem_ranks(dt.cols()) <= self.tc_smem_max
            && dt.cols() == gt.rows()
    }

    /// Router softmax + top-k for `tokens` rows of `e` logits (e <= 1024,
    /// k <= 64): `ids`/`wts` receive `[tokens, k]`. With `publish` =
    /// (a [`Mapped`] buffer of at least 2k + 1 words, seq), token 0's ids and
    /// weights are also written there, then `seq` in word 2k
    /// ([`Mapped::wait_for`]). With `bases`, every token's experts' bases
    /// table is written on the device too ([`RouteBases`]), so the routed
    /// experts can run without the host.
    #[allow(clippy::too_many_arguments)]
    pub fn router_topk(
        &self,
        logits: DevPtr,
        e: usize,
        k: usize,
        renorm: bool,
        ids: DevPtr,
        wts: DevPtr,
        tokens: usize,
        publish: Option<(&Mapped, u32)>,
        bases: Option<&RouteBases>,
    ) -> Result<()> {
        if e > 1024 || k > 64 || k > e {
            return Err(CudaError::Invalid(format!(
                "router with {e} experts, top {k} is outside the kernel's limits"
            )));
        }
        let (pubp, seq) = match publish {
            Some((m, seq)) if m.len > 2 * k => (m.dev, seq),
            Some(_) => return Err(CudaError::Invalid("publish buffer too small".into())),
            None => (DevPtr::NULL, 0u32),
        };
        let none = RouteBases {
            addr: DevPtr::NULL,
            offsets: [0; 3],
            out: DevPtr::NULL,
        };
        let b = bases.unwrap_or(&none);
        let (e, k, r) = (e as i32, k as i32, renorm as i32);
        let (o0, o1, o2) = (b.offsets[0], b.offsets[1], b.offsets[2]);
        self.go(
            &self.f.router_topk,
            (tokens as u32, 1, 1),
            32,
            &mut args!(
                &logits, &e, &k, &r, &ids, &wts, &pubp, &seq, &b.addr, &o0, &o1, &o2, &b.out
            ),
        )
    }
}
