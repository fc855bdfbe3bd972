//! The streaming store: a bounded number of expert slots per layer, filled
//! from the expert pool file by a pool of reader threads.
//!
//! `begin` settles hits and misses with the layer's [`LayerCache`] and starts
//! the reads at once; `with_experts` computes the hits while the reads land
//! and then each miss as it arrives. Misses that cannot take a slot (a batch
//! needing more experts than there are slots, or a policy refusing
//! admission) stream through a few scratch buffers.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use memmap2::MmapMut;
use rayon::prelude::*;
use slipstream_core::{BoxError, ExpertRequest, ExpertSource, ExpertWeights};
use slipstream_format::SlipModel;

use crate::policy::{LayerCache, Outcome, PolicyKind};
use crate::reader::{open_pool_file, Readahead, ReaderPool};
use crate::{ExpertStore, StoreCounters};

/// Settings of a [`StreamingStore`].
#[derive(Debug, Clone)]
pub struct StreamConfig {
    /// Expert slots per layer.
    pub slots: usize,
    pub policy: PolicyKind,
    /// Reader threads.
    pub io_threads: usize,
    /// Open the pool with O_DIRECT (no second copy in the page cache).
    pub direct_io: bool,
    pub readahead: Readahead,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            slots: 64,
            policy: PolicyKind::Aging,
            io_threads: 4,
            direct_io: false,
            readahead: Readahead::Default,
        }
    }
}

/// Scratch buffers for streamed misses (reads in flight at once beyond the slots).
const SCRATCH_BUFFERS: usize = 8;

/// Where a requested expert's bytes are (or will be).
#[derive(Debug, Clone, Copy)]
enum Place {
    Slot(usize),
    Scratch(usize),
}

struct Pending {
    layer: usize,
    experts: Vec<u32>,
    outcomes: Vec<Outcome>,
    /// Request indices of streamed misses not yet submitted.
    streamed: VecDeque<usize>,
    /// Scratch buffers free for the next streamed miss.
    free_scratch: Vec<usize>,
    /// `place[i]` for submitted misses.
    place: Vec<Option<Place>>,
    in_flight: usize,
}

/// Bounded per-layer expert cache over the `.slip` expert pool.
pub struct StreamingStore {
    // Field order matters: the reader pool is dropped (threads joined) before
    // the memory its reads target.
    pool: ReaderPool,
    model: Arc<SlipModel>,
    caches: Vec<LayerCache>,
    slots: MmapMut,
    scratch: MmapMut,
    slots_per_layer: usize,
    stride: usize,
    record_bytes: usize,
    pending: Option<Pending>,
    counters: StoreCounters,
    config: StreamConfig,
}

impl StreamingStore {
    pub fn open(model: Arc<SlipModel>, config: StreamConfig) -> Result<Self, BoxError> {
        let pool_index = &model.manifest.experts;
        let layers = pool_index.num_layers;
        let experts = pool_index.num_experts;
        let slots_per_layer = config.slots.clamp(1, experts.max(1));
        let stride = pool_index.record_stride as usize;
        let record_bytes = pool_index.record_bytes as usize;
        // Anonymous mappings are page aligned, and the stride is a multiple
        // of 4096, so every slot satisfies O_DIRECT's alignment.
        let slots = MmapMut::map_anon((layers * slots_per_layer * stride).max(1))?;
        // Transparent huge pages where the kernel gives them only on request
        // (`madvise` mode): decode reads experts scattered over gigabytes of
        // slots, and 4 KiB pages would put a page walk behind most of them.
        // Best effort: without THP the slots work the same.
        #[cfg(target_os = "linux")]
        let _ = slots.advise(memmap2::Advice::HugePage);
        let scratch = MmapMut::map_anon((SCRATCH_BUFFERS * stride).max(1))?;
        let file = open_pool_file(model.experts_path(), config.direct_io, config.readahead)?;
        let pool = ReaderPool::new(file, config.io_threads);
        let caches = (0..layers)
            .map(|_| LayerCache::new(config.policy.build(experts), experts, slots_per_layer))
            .collect();
        Ok(StreamingStore {
            pool,
            model,
            caches,
            slots,
            scratch,
            slots_per_layer,
            stride,
            record_bytes,
            pending: None,
            counters: StoreCounters::default(),
            config: StreamConfig {
                slots: slots_per_layer,
                ..config
            },
        })
    }

    /// Bytes of slot memory (all layers).
    pub fn slot_bytes(&self) -> usize {
        self.slots.len()
    }

    fn slot_ptr(&mut self, layer: usize, slot: usize) -> *mut u8 {
        let off = (layer * self.slots_per_layer + slot) * self.stride;
        // SAFETY: `off + stride <= slots.len()` by construction of the mapping.
        unsafe { self.slots.as_mut_ptr().add(off) }
    }

    fn scratch_ptr(&mut self, buf: usize) -> *mut u8 {
        // SAFETY: `buf < SCRATCH_BUFFERS`, inside the scratch mapping.
        unsafe { self.scratch.as_mut_ptr().add(buf * self.stride) }
    }

    fn place_bytes(&self, layer: usize, place: Place) -> &[u8] {
        let (mem, off) = match place {
            Place::Slot(s) => (
                &self.slots,
                (layer * self.slots_per_layer + s) * self.stride,
            ),
            Place::Scratch(b) => (&self.scratch, b * self.stride),
        };
        &mem[off..off + self.record_bytes]
    }

    fn submit(&mut self, layer: usize, expert: u32, id: usize, place: Place) {
        let offset = self
            .model
            .manifest
            .experts
            .record_offset(layer, expert as usize);
        let dest = match place {
            Place::Slot(s) => self.slot_ptr(layer, s),
            Place::Scratch(b) => self.scratch_ptr(b),
        };
        // SAFETY: `dest` is a whole stride-sized buffer that nothing reads
        // until this job's completion is received in `with_experts`, which
        // drains every job before returning.
        unsafe { self.pool.submit(id, offset, self.stride, dest) };
        self.counters.bytes_read += self.stride as u64;
    }

    fn submit_streamed(&mut self) {
        loop {
            let Some(p) = self.pending.as_mut() else {
                return;
            };
            if p.free_scratch.is_empty() || p.streamed.is_empty() {
                return;
            }
            let (Some(buf), Some(i)) = (p.free_scratch.pop(), p.streamed.pop_front()) else {
                return;
            };
            p.place[i] = Some(Place::Scratch(buf));
            p.in_flight += 1;
            let (layer, expert) = (p.layer, p.experts[i]);
            self.submit(layer, expert, i, Place::Scratch(buf));
        }
    }
}

impl ExpertSource for StreamingStore {
    fn begin(&mut self, req: &ExpertRequest<'_>) -> Result<(), BoxError> {
        if self.pending.is_some() {
            return Err("expert store: begin called twice without with_experts".into());
        }
        let outcomes = self.caches[req.layer].access(req.experts, req.counts, req.tokens);
        let mut p = Pending {
            layer: req.layer,
            experts: req.experts.to_vec(),
            outcomes: outcomes.clone(),
            streamed: VecDeque::new(),
            free_scratch: (0..SCRATCH_BUFFERS).rev().collect(),
            place: vec![None; outcomes.len()],
            in_flight: 0,
        };
        let mut to_submit = Vec::new();
        for (i, o) in outcomes.iter().enumerate() {
            match *o {
                Outcome::Hit { .. } => self.counters.hits += 1,
                Outcome::Miss { slot, .. } => {
                    self.counters.misses += 1;
                    match slot {
                        Some(s) => {
                            p.place[i] = Some(Place::Slot(s));
                            p.in_flight += 1;
                            to_submit.push((i, s));
                        }
                        None => p.streamed.push_back(i),
                    }
                }
            }
        }
        let layer = req.layer;
        let experts = p.experts.clone();
        self.pending = Some(p);
        for (i, s) in to_submit {
            self.submit(layer, experts[i], i, Place::Slot(s));
        }
        self.submit_streamed();
        Ok(())
    }

    fn with_experts(
        &mut self,
        req: &ExpertRequest<'_>,
        compute: &mut dyn FnMut(u32, ExpertWeights<'_>),
    ) -> Result<(), BoxError> {
        self.with_expert_batches(req, &mut |batch| {
            for &(e, w) in batch {
                compute(e, w);
            }
        })
    }

    /// All hits as one batch, then each miss as it lands.
    fn with_expert_batches(
        &mut self,
        req: &ExpertRequest<'_>,
        compute: &mut dyn FnMut(&slipstream_core::ExpertBatch<'_>),
    ) -> Result<(), BoxError> {
        if self.pending.is_none() {
            self.begin(req)?;
        }
        let layer = req.layer;
        let (experts, outcomes) = match &self.pending {
            Some(p) if p.layer == layer && p.experts == req.experts => {
                (p.experts.clone(), p.outcomes.clone())
            }
            _ => {
                self.drain();
                return Err("expert store: with_experts does not match begin".into());
            }
        };
        // Hits first: their bytes are already here and verified.
        let mut hits = Vec::with_capacity(outcomes.len());
        for (i, o) in outcomes.iter().enumerate() {
            if let Outcome::Hit { slot } = *o {
                let bytes = self.place_bytes(layer, Place::Slot(slot));
                hits.push((experts[i], self.model.expert_views(bytes)?));
            }
        }
        if !hits.is_empty() {
            compute(&hits);
        }
        drop(hits);
        // Then the misses as they land: every read finished by the time
        // the previous batch is done forms the next batch, so misses that
        // land together run in parallel like the hits.
        let mut first_err: Option<BoxError> = None;
        while first_err.is_none() && self.pending.as_ref().is_some_and(|p| p.in_flight > 0) {
            let t = Instant::now();
            let mut done = vec![self.pool.wait()];
            self.counters.read_wait_ns += t.elapsed().as_nanos() as u64;
            while let Some(d) = self.pool.try_wait() {
                done.push(d);
            }
            let Some(p) = self.pending.as_mut() else {
                break;
            };
            // (request index, place, read result) of each completion.
            let mut landed = Vec::with_capacity(done.len());
            for d in done {
                p.in_flight = p.in_flight.saturating_sub(1);
                match p.place.get(d.id).copied().flatten() {
                    Some(place) => landed.push((d.id, place, d.result)),
                    None => {
                        first_err
                            .get_or_insert_with(|| "expert store: unknown read completion".into());
                    }
                }
            }
            // Checksums in parallel (a record is ~1.8 MB of hashing).
            let model = &*self.model;
            let records: Vec<&[u8]> = landed
                .iter()
                .map(|(_, place, _)| self.place_bytes(layer, *place))
                .collect();
            let checked: Vec<Result<(), BoxError>> = landed
                .par_iter()
                .zip(&records)
                .map(|((i, _, result), record)| {
                    let expert = experts[*i];
                    match result {
                        Err(e) => Err(BoxError::from(format!(
                            "reading expert {expert} of layer {layer}: {e}"
                        ))),
                        Ok(()) => model
                            .verify_expert(layer, expert as usize, record)
                            .map_err(BoxError::from),
                    }
                })
                .collect();
            let mut batch = Vec::with_capacity(landed.len());
            let mut bad = Vec::new();
            for (((i, _, _), ok), record) in landed.iter().zip(checked).zip(&records) {
                let expert = experts[*i];
                match ok {
                    Ok(()) if first_err.is_none() => match model.expert_views(record) {
                        Ok(w) => batch.push((expert, w)),
                        Err(e) => first_err = Some(e.into()),
                    },
                    Ok(()) => {}
                    Err(e) => {
                        bad.push(expert);
                        first_err.get_or_insert(e);
                    }
                }
            }
            if first_err.is_none() && !batch.is_empty() {
                compute(&batch);
            }
            drop(batch);
            drop(records);
            // Never keep bad bytes in a slot.
            for expert in bad {
                self.caches[layer].invalidate(expert);
            }
            if let Some(p) = self.pending.as_mut() {
                for (_, place, _) in &landed {
                    if let Place::Scratch(buf) = *place {
                        p.free_scratch.push(buf);
                    }
                }
            }
            if first_err.is_none() {
                self.submit_streamed();
            } else if let Some(p) = self.pending.as_mut() {
                p.streamed.clear();
            }
        }
        if first_err.is_some() {
            // Reads still in flight target slot and scratch memory: wait for
            // them before anything else may touch it, and forget the experts
            // they were filling (their bytes were never verified).
            self.drain_forgetting(layer, &experts);
        }
        self.pending = None;
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl StreamingStore {
    /// Waits for every read in flight after an error in layer `layer`'s
    /// batch and drops the experts those reads were filling from the
    /// layer's slots, so no unverified record is ever a hit.
    fn drain_forgetting(&mut self, layer: usize, experts: &[u32]) {
        let Some(p) = self.pending.take() else {
            return;
        };
        for _ in 0..p.in_flight {
            let done = self.pool.wait();
            if let (Some(Some(Place::Slot(_))), Some(&e)) =
                (p.place.get(done.id), experts.get(done.id))
            {
                self.caches[layer].invalidate(e);
            }
        }
    }

    /// Waits for every read in flight (after a protocol error).
    fn drain(&mut self) {
        if let Some(p) = self.pending.take() {
            for _ in 0..p.in_flight {
                self.pool.wait();
            }
        }
    }
}

impl ExpertStore for StreamingStore {
    fn counters(&self) -> StoreCounters {
        self.counters
    }

    fn describe(&self) -> String {
        format!(
            "streaming: {} slots/layer ({:.1} MB), policy {}, {} reader threads{}",
            self.config.slots,
            self.slots.len() as f64 / 1e6,
            self.config.policy,
            self.config.io_threads,
            if self.config.direct_io {
                ", direct I/O"
            } else {
                ""
            }
        )
    }

    fn resident_experts(&self) -> Vec<Vec<u32>> {
        self.caches.iter().map(|c| c.resident()).collect()
    }

    fn slot_capacity(&self) -> Option<usize> {
        Some(self.slots_per_layer)
    }

    fn unfilled_slot_bytes(&self) -> u64 {
        let filled: usize = self.caches.iter().map(|c| c.resident().len()).sum();
        let total = self.caches.len() * self.slots_per_layer;
        (total.saturating_sub(filled) * self.stride) as u64
    }
}

impl Drop for StreamingStore {
    fn drop(&mut self) {
        self.drain();
    }
}
