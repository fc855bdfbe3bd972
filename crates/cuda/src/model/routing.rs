//! The MoE block on the device: the router, the shared expert and the
//! routed experts, with routing decided on the host (one round trip per
//! layer) or on the device (every expert resident).

use super::*;

impl CudaModel {
    /// The MoE of layer `l` for one token: router on the device, ids to
    /// the host (the round trip), shared expert launched meanwhile, VRAM
    /// cache settled, misses fetched and copied, then all routed experts in
    /// two launches that also add the result into the residual `x`.
    pub(super) fn moe(
        &mut self,
        l: usize,
        x: DAct,
        xn: DAct,
        experts: &mut dyn ExpertSource,
        routes: &mut Vec<Route>,
        times: &mut MoeTimes,
    ) -> Result<std::result::Result<(), slipstream_core::BoxError>> {
        if self.device_routing {
            self.moe_device(l, x, xn, times)?;
            return Ok(Ok(()));
        }
        let t0 = Instant::now();
        let (k, e) = (self.top_k, self.num_experts);
        let xn_p = self.act(xn).ptr;
        let x_p = self.act(x).ptr;
        self.route_seq = self.route_seq.wrapping_add(1).max(1);
        let seq = self.route_seq;
        {
            self.router(l, xn_p, 1)?;
            let g = &self.gpu;
            g.router_topk(
                self.scratch.logits.ptr,
                e,
                k,
                self.renorm,
                self.scratch.route.ptr,
                self.scratch.route.f32_at(k),
                1,
                self.route_pub.as_ref().map(|m| (m, seq)),
                None,
            )?;
            if self.route_pub.is_none() {
                g.ctx.bind_to_thread()?;
                // SAFETY: `route_host` is pinned and holds 2k f32; it is read
                // only after `routed` below has completed.
                unsafe {
                    let dst = std::slice::from_raw_parts_mut(self.route_host.as_mut_ptr()?, 2 * k);
                    result::memcpy_dtoh_async(
                        dst,
                        self.scratch.route.ptr.raw(),
                        g.stream.cu_stream(),
                    )?;
                }
            }
        }
        // Without the mapped buffer: a device-to-host copy and an event.
        let routed = match self.route_pub {
            Some(_) => None,
            None => Some(
                self.gpu
                    .stream
                    .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?,
            ),
        };
        // The shared expert runs on the device while the host settles the cache.
        self.shared_expert(l, xn_p, 1)?;
        let t_wait = Instant::now();
        let (ids, wts): (Vec<u32>, Vec<f32>) = match (&self.route_pub, routed) {
            (Some(m), _) => {
                m.wait_for(2 * k, seq, &self.gpu.stream)?;
                (
                    (0..k).map(|i| m.read(i)).collect(),
                    (0..k).map(|i| f32::from_bits(m.read(k + i))).collect(),
                )
            }
            (None, Some(ev)) => {
                ev.synchronize()?;
                // SAFETY: the event covers the copy into `route_host`.
                let host = unsafe { std::slice::from_raw_parts(self.route_host.as_ptr()?, 2 * k) };
                (
                    host[..k].iter().map(|v| v.to_bits()).collect(),
                    host[k..].to_vec(),
                )
            }
            (None, None) => unreachable!("an event is recorded when there is no mapped buffer"),
        };
        self.stats.route_wait_ns += t_wait.elapsed().as_nanos() as u64;
        if ids.iter().any(|&i| i as usize >= e) {
            return Err(CudaError::Invalid(format!(
                "router returned an expert id outside 0..{e}"
            )));
        }
        routes.push(Route {
            experts: ids.clone(),
            weights: wts,
        });
        let router_ns = t0.elapsed().as_nanos() as u64;

        // Settle hits and misses on the distinct experts in id order.
        let mut distinct = ids.clone();
        distinct.sort_unstable();
        distinct.dedup();
        let counts: Vec<u32> = distinct
            .iter()
            .map(|d| ids.iter().filter(|&&i| i == *d).count() as u32)
            .collect();
        let layer = &mut self.layers[l];
        let outcomes = layer.cache.access(&distinct, &counts, 1);
        let mut addr = vec![DevPtr::NULL; e];
        let mut missing: Vec<(u32, DevPtr)> = Vec::new();
        let mut spill = 0usize;
        for (&d, o) in distinct.iter().zip(&outcomes) {
            let a = match *o {
                Outcome::Hit { slot } => {
                    self.stats.vram_hits += 1;
                    layer.slots.ptr.add_bytes(slot * self.rec_bytes)
                }
                Outcome::Miss { slot, .. } => {
                    self.stats.vram_misses += 1;
                    let a = match slot {
                        Some(s) => layer.slots.ptr.add_bytes(s * self.rec_bytes),
                        None => {
                            spill += 1;
                            self.scratch
                                .spill
                                .ptr
                                .add_bytes((spill - 1) * self.rec_bytes)
                        }
                    };
                    missing.push((d, a));
                    a
                }
            };
            addr[d as usize] = a;
        }
        let mut fetch_ns = 0u64;
        if !missing.is_empty() {
            let ncounts: Vec<u32> = missing
                .iter()
                .map(|m| counts[distinct.iter().position(|x| *x == m.0).unwrap_or(0)])
                .collect();
            match self.fetch(l, &missing, &ncounts, experts)? {
                Ok(ns) => fetch_ns = ns,
                Err(er) => return Ok(Err(er)),
            }
        }
        // Bases in rank order: gate, up, down addresses.
        {
            // SAFETY: `bases_host` is pinned (3k u64); the previous copy out
            // of it completed before `routed` (same stream, earlier).
            let b = unsafe { std::slice::from_raw_parts_mut(self.bases_host.as_mut_ptr()?, 3 * k) };
            for (r, &id) in ids.iter().enumerate() {
                let a = addr[id as usize].raw();
                b[r] = a + self.parts[0].1;
                b[k + r] = a + self.parts[1].1;
                b[2 * k + r] = a + self.parts[2].1;
            }
            let g = &self.gpu;
            g.ctx.bind_to_thread()?;
            // SAFETY: 3k u64 into `scratch.bases` (3k + 3 u64).
            unsafe {
                result::memcpy_htod_async(
                    self.scratch.bases.ptr.raw(),
                    &b[..],
                    g.stream.cu_stream(),
                )?
            };
        }
        let wts = self.scratch.route.f32_at(k);
        self.routed_experts(&self.experts_io(l, xn_p, x_p, wts, 1))?;
        times.router_ns += router_ns;
        times.wait_ns += fetch_ns;
        times.routed_ffn_ns += t0.elapsed().as_nanos() as u64 - router_ns - fetch_ns;
        Ok(Ok(()))
    }

    /// Layer `l`'s router logits into `scratch.logits` and (with a shared
    /// expert) its gate into `scratch.sg`: one launch where both run on the
    /// generic kernel (each the bits of its own launch).
    pub(super) fn router(&self, l: usize, xn_p: DevPtr, n: usize) -> Result<()> {
        let layer = &self.layers[l];
        match &layer.shared {
            Some(sh) => self.gpu.matvec_many(
                &[&layer.router.desc, &sh.sgate.desc],
                xn_p,
                &[self.scratch.logits.ptr, self.scratch.sg.ptr],
                n,
            ),
            None => self
                .gpu
                .matvec(&layer.router.desc, xn_p, self.scratch.logits.ptr, n),
        }
    }

    /// Launches layer `l`'s shared expert (if any) on the `n` rows at
    /// `xn_p` into `scratch.sh_out` (its gate comes with the router).
    pub(super) fn shared_expert(&self, l: usize, xn_p: DevPtr, n: usize) -> Result<()> {
        let Some(sh) = &self.layers[l].shared else {
            return Ok(());
        };
        let g = &self.gpu;
        let sb = sh.bases.ptr;
        g.moe_gate_up(
            [&sh.gate.desc, &sh.up.desc],
            [sb, sb.add_bytes(8 * PASS_TOKENS)],
            self.scratch.xrow_id.ptr,
            xn_p,
            self.scratch.sh_h.ptr,
            n,
        )?;
        g.matvec(
            &sh.down.desc,
            self.scratch.sh_h.ptr,
            self.scratch.sh_out.ptr,
            n,
        )
    }

    /// Layer `l`'s shared expert output and gate (null without one).
    pub(super) fn shared_out(&self, l: usize) -> (DevPtr, DevPtr) {
        if self.layers[l].shared.is_some() {
            (self.scratch.sh_out.ptr, self.scratch.sg.ptr)
        } else {
            (DevPtr::NULL, DevPtr::NULL)
        }
    }

    /// Launches the routed experts of `io` (a layer's, from
    /// [`Self::experts_io`]) over the bases table in `scratch.bases`
    /// (`[gate; n k]`, `[up; n k]`, `[down; n k]` for `io.tokens` n),
    /// adding their (and the shared expert's) output into the residual.
    pub(super) fn routed_experts(&self, io: &ExpertsIo) -> Result<()> {
        let bp = self.scratch.bases.ptr;
        let table = 8 * io.k * io.tokens;
        self.gpu.moe_experts(
            self.part_templates(),
            [bp, bp.add_bytes(table), bp.add_bytes(2 * table)],
            io,
        )
    }

    /// The templates of the routed experts' gate, up and down parts.
    fn part_templates(&self) -> [&WDesc; 3] {
        [&self.parts[0].0, &self.parts[1].0, &self.parts[2].0]
    }

    /// The routed experts' activations of layer `l` over `n` tokens: input
    /// at `xn_p`, weights at `wts`, output added into `x_p`.
    pub(super) fn experts_io(
        &self,
        l: usize,
        xn_p: DevPtr,
        x_p: DevPtr,
        wts: DevPtr,
        n: usize,
    ) -> ExpertsIo {
        ExpertsIo {
            xrow: self.scratch.xrow.ptr,
            xn: xn_p,
            h: self.scratch.h.ptr,
            wts,
            k: self.top_k,
            shared: self.shared_out(l),
            x: x_p,
            tokens: n,
        }
    }

    /// The MoE of layer `l` with device routing: router, bases table,
    /// shared and routed experts queued back to back, no host round trip.
    /// The same kernels on the same addresses as the host-routed path, so
    /// the same bits.
    pub(super) fn moe_device(
        &mut self,
        l: usize,
        x: DAct,
        xn: DAct,
        times: &mut MoeTimes,
    ) -> Result<()> {
        let t0 = Instant::now();
        let (k, e) = (self.top_k, self.num_experts);
        let (xn_p, x_p) = (self.act(xn).ptr, self.act(x).ptr);
        let n = self.pass_n;
        // Layer l's ids `[n, k]` then weights `[n, k]` (layers packed for
        // this pass's n, so the read-back covers only what was written).
        let ids = self.scratch.route_all.f32_at(2 * k * n * l);
        let wts = self.scratch.route_all.f32_at(2 * k * n * l + n * k);
        let layer = &self.layers[l];
        let Some(addr) = &layer.addr_table else {
            return Err(CudaError::Invalid(format!(
                "device routing without layer {l}'s expert table"
            )));
        };
        let bases = RouteBases {
            addr: addr.ptr,
            offsets: [self.parts[0].1, self.parts[1].1, self.parts[2].1],
            out: self.scratch.bases.ptr,
        };
        self.router(l, xn_p, n)?;
        let g = &self.gpu;
        g.router_topk(
            self.scratch.logits.ptr,
            e,
            k,
            self.renorm,
            ids,
            wts,
            n,
            None,
            Some(&bases),
        )?;
        let router_ns = t0.elapsed().as_nanos() as u64;
        self.shared_expert(l, xn_p, n)?;
        // A longer pass loads each routed expert's gate/up once for all
        // its pairs (same bits as the per-pair launch).
        let io = self.experts_io(l, xn_p, x_p, wts, n);
        let grouped = n > 1
            && g.moe_experts_grouped(
                self.part_templates(),
                &bases,
                ids,
                e,
                (&self.scratch.grp_off, &self.scratch.grp_list),
                &io,
            )?;
        if !grouped {
            self.routed_experts(&io)?;
        }
        self.routes_pending = true;
        self.routes_n = n;
        times.router_ns += router_ns;
        times.routed_ffn_ns += t0.elapsed().as_nanos() as u64 - router_ns;
        Ok(())
    }

    /// Counts the last device-routed pass's experts (every one a VRAM hit)
    /// from the ids its router kernels left in `scratch.route_all` (one read,
    /// which waits for the pass).
    pub(super) fn collect_device_routes(&mut self) -> Result<()> {
        if !self.routes_pending {
            return Ok(());
        }
        self.routes_pending = false;
        let (k, e, n) = (self.top_k, self.num_experts, self.routes_n);
        let per_layer = 2 * k * n;
        let words = self
            .gpu
            .read_i32(&self.scratch.route_all, per_layer * self.layers.len())?;
        for (l, layer) in self.layers.iter_mut().enumerate() {
            // The distinct experts of the pass (as a host-routed pass of
            // these tokens would count its cache accesses).
            let mut ids: Vec<i32> = words[per_layer * l..][..n * k].to_vec();
            if ids.iter().any(|&i| i < 0 || i as usize >= e) {
                return Err(CudaError::Invalid(format!(
                    "router returned an expert id outside 0..{e} in layer {l}"
                )));
            }
            ids.sort_unstable();
            ids.dedup();
            self.stats.vram_hits += ids.len() as u64;
            layer.cache.hits += ids.len() as u64;
        }
        Ok(())
    }

    /// Whether the router kernels write the experts' bases table themselves
    /// (see [`CudaModel::preload`]).
    pub fn device_routing(&self) -> bool {
        self.device_routing
    }

    /// Turns device routing on when every layer holds every expert in VRAM
    /// ([`CudaTuning::device_routing`] off keeps the host round trip):
    /// uploads each layer's expert -> record address table. A full cache
    /// never evicts, so the tables stay valid.
    pub(super) fn enable_device_routing(&mut self) -> Result<()> {
        if !self.device_routing_allowed {
            return Ok(());
        }
        let e = self.num_experts;
        let mut tables = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let mut addr = Vec::with_capacity(e * 8);
            for id in 0..e as u32 {
                let Some(slot) = layer.cache.slot_of(id) else {
                    return Ok(());
                };
                let a = layer.slots.ptr.add_bytes(slot * self.rec_bytes);
                addr.extend_from_slice(&a.raw().to_le_bytes());
            }
            tables.push(addr);
        }
        for (layer, addr) in self.layers.iter_mut().zip(tables) {
            layer.addr_table = Some(self.gpu.upload(&addr)?);
        }
        self.device_routing = !self.layers.is_empty();
        Ok(())
    }
}
