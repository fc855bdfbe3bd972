//! The VRAM expert cache and the pinned RAM tier: fetching misses from the
//! host store on the copy stream, and preloading a full cache.

use super::*;

impl CudaModel {
    /// Brings `missing` experts of layer `l` (id, VRAM destination; 0 =
    /// none, RAM tier only) to the device: RAM-tier hits are copied straight
    /// from pinned memory; the rest are read through the host store into
    /// their RAM-tier slot (or the staging buffer) and copied from there.
    /// Copies run on the copy stream; the compute stream waits for them. At
    /// most `top_k + 1` experts per call. Returns the host time spent.
    pub(super) fn fetch(
        &mut self,
        l: usize,
        missing: &[(u32, DevPtr)],
        counts: &[u32],
        experts: &mut dyn ExpertSource,
    ) -> Result<std::result::Result<u64, slipstream_core::BoxError>> {
        if missing.len() > self.top_k + 1 {
            return Err(CudaError::Invalid(
                "too many experts for the staging buffer".into(),
            ));
        }
        let t_f = Instant::now();
        if let Some(ev) = self.copy_done.take() {
            ev.synchronize()?; // staging and RAM slots free to write again
        }
        let rec = self.rec_bytes;
        let cs = self.gpu.copy_stream.cu_stream();
        let stage_ptr = self.staging.as_mut_ptr()?;
        self.gpu.ctx.bind_to_thread()?;
        let mut bytes = 0u64;
        // (id, VRAM destination, host bytes to fill) for the host store.
        let mut from_store: Vec<(u32, DevPtr, *mut u8)> = Vec::new();
        let mut store_counts = Vec::new();
        match self.layers[l].ram.as_mut() {
            Some((cache, mem)) => {
                let ids: Vec<u32> = missing.iter().map(|m| m.0).collect();
                let base = mem.as_mut_ptr()?;
                for (i, o) in cache.access(&ids, counts, 1).into_iter().enumerate() {
                    let (id, dst) = missing[i];
                    match o {
                        Outcome::Hit { slot } => {
                            self.stats.ram_hits += 1;
                            if !dst.is_null() {
                                // SAFETY: slot < capacity: `rec` bytes inside
                                // the pinned tier; the device range is a
                                // whole expert slot.
                                unsafe {
                                    let src = std::slice::from_raw_parts(base.add(slot * rec), rec);
                                    result::memcpy_htod_async(dst.raw(), src, cs)?;
                                }
                                bytes += rec as u64;
                            }
                        }
                        Outcome::Miss { slot, .. } => {
                            // SAFETY: inside the tier (slot < capacity) or
                            // the staging buffer (i < k + 1 records).
                            let host = unsafe {
                                match slot {
                                    Some(sl) => base.add(sl * rec),
                                    None => stage_ptr.add(i * rec),
                                }
                            };
                            from_store.push((id, dst, host));
                            store_counts.push(counts[i]);
                        }
                    }
                }
            }
            None => {
                for (i, &(id, dst)) in missing.iter().enumerate() {
                    // SAFETY: i < k + 1 records of staging.
                    from_store.push((id, dst, unsafe { stage_ptr.add(i * rec) }));
                    store_counts.push(counts[i]);
                }
            }
        }
        if !from_store.is_empty() {
            self.stats.store_reads += from_store.len() as u64;
            let need: Vec<u32> = from_store.iter().map(|m| m.0).collect();
            let req = ExpertRequest {
                layer: l,
                experts: &need,
                counts: &store_counts,
                tokens: 1,
            };
            if let Err(er) = experts.begin(&req) {
                return Ok(Err(er));
            }
            let parts = self.parts;
            let mut copy_err: Option<CudaError> = None;
            let res = experts.with_experts(&req, &mut |id, w| {
                let Some(&(_, dst, host)) = from_store.iter().find(|m| m.0 == id) else {
                    return;
                };
                for (pi, view) in [w.gate, w.up, w.down].iter().enumerate() {
                    let (_, off, nb) = parts[pi];
                    if view.data.len() != nb {
                        copy_err = Some(CudaError::Invalid(format!(
                            "expert {id} of layer {l}: part {pi} has {} bytes, expected {nb}",
                            view.data.len()
                        )));
                        return;
                    }
                    // SAFETY: `host` is a whole record (`rec` bytes) of
                    // pinned memory, not read by any copy in flight (event
                    // above); part `pi` lies at `off..off + nb` inside it.
                    unsafe {
                        let s = std::slice::from_raw_parts_mut(host.add(off as usize), nb);
                        s.copy_from_slice(view.data);
                        if !dst.is_null() {
                            if let Err(e2) = result::memcpy_htod_async(dst.raw() + off, &s[..], cs)
                            {
                                copy_err = Some(e2.into());
                            }
                            bytes += nb as u64;
                        }
                    }
                }
            });
            if let Err(er) = res {
                return Ok(Err(er));
            }
            if let Some(ce) = copy_err {
                return Err(ce);
            }
        }
        self.stats.h2d_bytes += bytes;
        let ev = self
            .gpu
            .copy_stream
            .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        self.gpu.stream.wait(&ev)?;
        self.copy_done = Some(ev);
        let ns = t_f.elapsed().as_nanos() as u64;
        self.stats.fetch_ns += ns;
        Ok(Ok(ns))
    }

    /// Fills a full RAM tier, and every VRAM slot when VRAM holds every
    /// expert, in id order through the ordinary miss path, so decode figures
    /// carry no first-use copies. Returns the experts loaded into VRAM; the
    /// counters are reset afterwards.
    pub fn preload(
        &mut self,
        experts: &mut dyn ExpertSource,
    ) -> Result<std::result::Result<usize, slipstream_core::BoxError>> {
        let mut n = 0;
        let k = self.top_k;
        for l in 0..self.layers.len() {
            // A full RAM tier is filled first (from the host store).
            let ram_cap = self.layers[l].ram.as_ref().map_or(0, |r| r.0.capacity());
            if ram_cap >= self.num_experts && self.layers[l].cache.capacity() < self.num_experts {
                let ids: Vec<u32> = (0..self.num_experts as u32).collect();
                for chunk in ids.chunks(k) {
                    let miss: Vec<(u32, DevPtr)> =
                        chunk.iter().map(|&e| (e, DevPtr::NULL)).collect();
                    let ones = vec![1u32; chunk.len()];
                    if let Err(e) = self.fetch(l, &miss, &ones, experts)? {
                        return Ok(Err(e));
                    }
                }
            }
            let cap = self.layers[l].cache.capacity().min(self.num_experts);
            if cap < self.num_experts {
                continue;
            }
            let ids: Vec<u32> = (0..cap as u32).collect();
            for chunk in ids.chunks(k) {
                let ones = vec![1u32; chunk.len()];
                let layer = &mut self.layers[l];
                let outcomes = layer.cache.access(chunk, &ones, 1);
                let mut missing = Vec::new();
                for (&e, o) in chunk.iter().zip(&outcomes) {
                    if let Outcome::Miss { slot: Some(s), .. } = *o {
                        missing.push((e, layer.slots.ptr.add_bytes(s * self.rec_bytes)));
                    }
                }
                if missing.is_empty() {
                    continue;
                }
                n += missing.len();
                let counts = vec![1u32; missing.len()];
                if let Err(e) = self.fetch(l, &missing, &counts, experts)? {
                    return Ok(Err(e));
                }
            }
        }
        self.gpu.copy_stream.synchronize()?;
        self.stats = CudaStats::default();
        self.enable_device_routing()?;
        Ok(Ok(n))
    }
}
