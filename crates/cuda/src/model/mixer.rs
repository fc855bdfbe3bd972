//! The token mixers on the device: attention (with KV cache growth) and
//! the Gated DeltaNet, and the residual add they defer into the next norm.

use super::*;

impl CudaModel {
    /// Grows the KV caches of layer `l` to hold `need` rows (copying).
    pub(super) fn ensure_kv(&mut self, l: usize, need: usize) -> Result<()> {
        let gpu = &self.gpu;
        if let DMixer::Attn(a) = &mut self.layers[l].mixer {
            if need > a.cap {
                let cap = need.next_power_of_two().max(2 * a.cap);
                let row = a.dims.1 * a.dims.2 * 4;
                let kc = gpu.alloc(cap * row)?;
                let vc = gpu.alloc(cap * row)?;
                gpu.copy_f32(&kc, 0, &a.kc, 0, a.cap * row / 4)?;
                gpu.copy_f32(&vc, 0, &a.vc, 0, a.cap * row / 4)?;
                gpu.sync()?;
                a.kc = kc;
                a.vc = vc;
                a.cap = cap;
                // A captured graph holds the old buffers' addresses.
                self.graph = None;
                let need_s = Gpu::attn_scratch_f32(a.dims.0, a.dims.2, cap);
                if self.scratch.att_scratch.len_f32() < need_s {
                    self.scratch.att_scratch = gpu.alloc(need_s * 4)?;
                }
            }
        }
        Ok(())
    }

    /// Grows the attention scratch so a pass's `n` queries of layer `l`
    /// run in one launch pair, up to [`QUERY_SCRATCH_MAX`] bytes (longer
    /// contexts run the queries in batches). One-token passes never grow
    /// it, so a captured graph's scratch address stays valid; growing
    /// drops the graph all the same.
    pub(super) fn ensure_query_scratch(&mut self, l: usize, n: usize) -> Result<()> {
        let DMixer::Attn(a) = &self.layers[l].mixer else {
            return Ok(());
        };
        let per_query = Gpu::attn_scratch_f32(a.dims.0, a.dims.2, self.pos + n);
        let want = (n * per_query).min((QUERY_SCRATCH_MAX / 4).max(per_query));
        if self.scratch.att_scratch.len_f32() < want {
            self.scratch.att_scratch = self.gpu.alloc(want * 4)?;
            self.graph = None;
        }
        Ok(())
    }

    pub(super) fn attention(&mut self, l: usize, x: DAct, xn: DAct) -> Result<()> {
        let n = self.pass_n;
        self.ensure_kv(l, self.pos + n)?;
        if n > 1 {
            self.ensure_query_scratch(l, n)?;
        }
        let g = &self.gpu;
        let DMixer::Attn(a) = &self.layers[l].mixer else {
            unreachable!()
        };
        let xn = self.act(xn).ptr;
        let (q_all, k_all, v_all) = (
            self.scratch.q_all.ptr,
            self.scratch.k_all.ptr,
            self.scratch.v_all.ptr,
        );
        // One token: the position comes from device memory (so the
        // launches replay in a graph) and the attention grid covers the
        // cache's capacity. A longer pass: the host's positions.
        let at = if n == 1 {
            self.device_pos(a.cap)
        } else {
            Position::Host(self.pos)
        };
        g.matvec_many(
            &[&a.q.desc, &a.k.desc, &a.v.desc],
            xn,
            &[q_all, k_all, v_all],
            n,
        )?;
        let prep = QkPrep {
            q_all,
            k_all,
            v_all,
            qn: a.q_norm.ptr,
            kn: a.k_norm.ptr,
            inv_freq: a.inv_freq.ptr,
            half: a.half,
            dims: a.dims,
            gated: a.gated,
            eps: a.eps,
            q_out: self.scratch.q.ptr,
            gate_out: self.scratch.gate.ptr,
            kcache: a.kc.ptr,
            vcache: a.vc.ptr,
        };
        g.qk_prep(&prep, at, n)?;
        // Each query over the keys up to its own position (causal): the
        // pass's keys are all in the cache already. As many queries per
        // launch pair as the scratch holds. The prompt's tokens run on the
        // tensor-core kernels at every pass length (one token per pass
        // included, so their bits never depend on the pass length); the
        // generated tokens on the decode kernels.
        let on_tc =
            self.prompt_pass && g.tensor_cores && g.prompt_attention_on_tensor_cores(a.dims.2);
        let row = a.dims.0 * a.dims.2 * 4;
        let per_query = if on_tc {
            Gpu::prompt_attn_scratch_f32(a.dims.0, a.dims.2, self.pos + n)
        } else {
            Gpu::attn_scratch_f32(a.dims.0, a.dims.2, self.pos + n)
        };
        let batch = (self.scratch.att_scratch.len_f32() / per_query).clamp(1, n);
        for t0 in (0..n).step_by(batch) {
            let m = batch.min(n - t0);
            let off = t0 * row;
            let gate = if a.gated {
                self.scratch.gate.ptr.add_bytes(off)
            } else {
                DevPtr::NULL
            };
            let io = AttnIo {
                q: self.scratch.q.ptr.add_bytes(off),
                kc: a.kc.ptr,
                vc: a.vc.ptr,
                dims: a.dims,
                gate,
                out: self.scratch.attn.ptr.add_bytes(off),
            };
            if on_tc {
                g.attention_prompt(&io, self.pos + t0, m, &self.scratch.att_scratch)?;
                continue;
            }
            let at_t = match at {
                Position::Host(p) => Position::Host(p + t0),
                device => device,
            };
            g.attention_causal(&io, at_t, m, &self.scratch.att_scratch)?;
        }
        g.matvec(&a.o.desc, self.scratch.attn.ptr, self.scratch.mixed.ptr, n)?;
        self.defer_residual(x);
        Ok(())
    }

    pub(super) fn gdn(&mut self, l: usize, x: DAct, xn: DAct) -> Result<()> {
        let n = self.pass_n;
        let g = &self.gpu;
        let DMixer::Gdn(d) = &self.layers[l].mixer else {
            unreachable!()
        };
        let xn = self.act(xn).ptr;
        g.matvec_many(
            &[&d.qkv.desc, &d.z.desc, &d.b.desc, &d.a.desc],
            xn,
            &[
                self.scratch.qkv.ptr,
                self.scratch.z.ptr,
                self.scratch.b.ptr,
                self.scratch.a.ptr,
            ],
            n,
        )?;
        let conv = GdnConv {
            weights: d.conv.ptr,
            channels: d.c,
            kernel: d.kernel,
            state: d.conv_state.ptr,
        };
        // A verify pass keeps what a rollback needs (before the conv
        // updates its state, and the recurrence's inputs).
        self.record_gdn(l, true)?;
        g.gdn_conv(self.scratch.qkv.ptr, n, &conv, self.scratch.conv.ptr)?;
        self.record_gdn(l, false)?;
        let s = &self.scratch;
        let step = d.step([s.conv.ptr, s.z.ptr, s.b.ptr, s.a.ptr], s.core.ptr);
        g.gdn_step(&step, n)?;
        g.matvec(
            &d.out.desc,
            self.scratch.core.ptr,
            self.scratch.mixed.ptr,
            n,
        )?;
        self.defer_residual(x);
        Ok(())
    }

    /// The mixer's output in `scratch.mixed` is added into the residual `x` by
    /// the norm that follows (one launch for add + norm, same bits);
    /// [`CudaModel::flush_residual`] adds it on its own when anything else
    /// comes first.
    pub(super) fn defer_residual(&mut self, x: DAct) {
        self.pending_residual = Some(x);
    }

    /// Adds a deferred mixer output into its residual now.
    pub(super) fn flush_residual(&mut self) -> Result<()> {
        match self.pending_residual.take() {
            Some(x) => self.gpu.add(
                self.act(x).ptr,
                self.scratch.mixed.ptr,
                self.hidden * self.pass_n,
            ),
            None => Ok(()),
        }
    }
}
