//! The streaming store: a bounded number of expert slots per layer, filled
//! from the expert pool file by a pool of reader threads.
//!
//! `begin` settles hits and misses with the layer's [`LayerCache`] and starts
//! the reads at once; `with_experts` computes the hits while the reads land
//! and then each miss as it arrives. Misses that cannot take a slot (a batch
//! needing more experts than there are slots, or a policy refusing
//! admission) stream through a few scratch buffers.
//!
//! When a layer's slots can hold every one of its experts nothing is ever
//! evicted, so idle reader threads fill the free slots in the background
//! ([`StreamConfig::background_fill`]): the cache converges to fully
//! resident without a token waiting for those reads. A request for an
//! expert whose fill is in flight waits for that read. Filled records are
//! verified on first use, like every other record before it is computed.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use memmap2::MmapMut;
use rayon::prelude::*;
use slipstream_core::{BoxError, ExpertRequest, ExpertSource, ExpertWeights};
use slipstream_format::SlipModel;

use crate::policy::{LayerCache, Outcome, PolicyKind};
use crate::reader::{open_pool_file, Readahead, ReaderPool, Segment};
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
    /// With at least as many slots as experts, let idle reader threads read
    /// the experts not yet resident into the free slots.
    pub background_fill: bool,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            slots: 64,
            policy: PolicyKind::Aging,
            io_threads: 4,
            direct_io: false,
            readahead: Readahead::Default,
            background_fill: true,
        }
    }
}

/// Scratch buffers for streamed misses (reads in flight at once beyond the slots).
const SCRATCH_BUFFERS: usize = 8;

/// Read ids at and above this are background fills (`FILL_ID + layer *
/// experts + expert`); below it, indices into the pending request.
const FILL_ID: usize = 1 << 40;

/// A background read in flight into a held slot.
#[derive(Debug, Clone, Copy)]
struct Fill {
    layer: usize,
    expert: u32,
    slot: usize,
}

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
    /// Bytes of one slot ([`SlipModel::expert_slot_bytes`]).
    stride: usize,
    pending: Option<Pending>,
    /// Background fills in flight, by read id.
    fills: HashMap<usize, Fill>,
    /// Next (layer * experts + expert) the fill sweep looks at.
    fill_cursor: usize,
    /// Whether the sweep may still find an expert to fill.
    fill_active: bool,
    /// Background fills at once (leaves readers free for demand misses).
    max_fills: usize,
    /// `unverified[layer * slots_per_layer + slot]`: a filled record whose
    /// checksum is checked on its first use.
    unverified: Vec<bool>,
    counters: StoreCounters,
    config: StreamConfig,
}

impl StreamingStore {
    pub fn open(model: Arc<SlipModel>, config: StreamConfig) -> Result<Self, BoxError> {
        let pool_index = &model.manifest.experts;
        let layers = pool_index.num_layers;
        let experts = pool_index.num_experts;
        let slots_per_layer = config.slots.clamp(1, experts.max(1));
        // A `.slip` record's stride, or in place the three parts' aligned
        // regions. Anonymous mappings are page aligned, and the stride and
        // every read's destination in a slot are multiples of 4096, so
        // every read satisfies O_DIRECT's alignment.
        let stride = model.expert_slot_bytes();
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
        let fill_active = config.background_fill && slots_per_layer >= experts && experts > 0;
        Ok(StreamingStore {
            pool,
            model,
            caches,
            slots,
            scratch,
            slots_per_layer,
            stride,
            pending: None,
            fills: HashMap::new(),
            fill_cursor: 0,
            fill_active,
            max_fills: (config.io_threads / 2).max(1),
            unverified: vec![false; layers * slots_per_layer],
            counters: StoreCounters::default(),
            config: StreamConfig {
                slots: slots_per_layer,
                ..config
            },
        })
    }

    /// Runs the background fill to its end: blocks until every expert of
    /// every layer is resident (when [`StreamConfig::background_fill`] is
    /// on and the slots can hold them all). Reads that fail leave their
    /// expert to be read on demand. Returns the experts now resident.
    pub fn finish_background_fill(&mut self) -> Result<usize, BoxError> {
        if self.pending.is_some() {
            return Err("expert store: a request is pending".into());
        }
        loop {
            self.top_up_fills();
            if self.fills.is_empty() {
                break;
            }
            self.wait_for_fill()?;
        }
        Ok(self.caches.iter().map(|c| c.resident().len()).sum())
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
        &mem[off..off + self.stride]
    }

    /// Starts the reads of one expert into `place`: one submission of its
    /// segments (one `.slip` record, or the three parts of an expert read
    /// in place, which reader threads take in parallel), one completion.
    fn submit(&mut self, layer: usize, expert: u32, id: usize, place: Place) {
        let reads = self.model.expert_reads(layer, expert as usize);
        let dest = match place {
            Place::Slot(s) => self.slot_ptr(layer, s),
            Place::Scratch(b) => self.scratch_ptr(b),
        };
        let mut bytes = 0u64;
        let segments: Vec<Segment> = reads
            .iter()
            .filter(|r| r.dest + r.len <= self.stride)
            .map(|r| {
                bytes += r.len as u64;
                // SAFETY: `r.dest + r.len <= stride` (filtered above), inside
                // the stride-sized buffer at `dest`.
                Segment::new(r.offset, r.len, r.need, unsafe { dest.add(r.dest) })
            })
            .collect();
        // SAFETY: each segment lies in a whole stride-sized buffer that
        // nothing reads until this job's completion is received
        // (`with_experts` drains every demand read before returning; a
        // fill's slot is held by `reserve_fill` until its completion is
        // settled).
        unsafe { self.pool.submit_segments(id, segments, id >= FILL_ID) };
        self.counters.bytes_read += bytes;
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

    fn fill_id(&self, layer: usize, expert: u32) -> usize {
        FILL_ID + layer * self.model.manifest.experts.num_experts + expert as usize
    }

    /// Starts background fills up to `max_fills`, sweeping (layer, expert)
    /// pairs in order; stops for good once a whole sweep finds nothing to
    /// read (a fill that fails later leaves its expert to a demand read).
    fn top_up_fills(&mut self) {
        let experts = self.model.manifest.experts.num_experts;
        let total = self.caches.len() * experts;
        let mut looked = 0;
        while self.fill_active && self.fills.len() < self.max_fills {
            if looked == total {
                // Every expert is resident or being filled, and no eviction
                // can undo that: never sweep again.
                self.fill_active = false;
                return;
            }
            let at = self.fill_cursor;
            self.fill_cursor = (at + 1) % total;
            looked += 1;
            let (layer, expert) = (at / experts, (at % experts) as u32);
            let id = self.fill_id(layer, expert);
            if self.fills.contains_key(&id) {
                continue;
            }
            if let Some(slot) = self.caches[layer].reserve_fill(expert) {
                self.fills.insert(
                    id,
                    Fill {
                        layer,
                        expert,
                        slot,
                    },
                );
                self.submit(layer, expert, id, Place::Slot(slot));
                self.counters.fills += 1;
            }
        }
    }

    /// Settles a finished background read: the expert becomes resident
    /// (verified on first use) or, when the read failed, the slot is free
    /// again. Returns false for an id that is no fill.
    fn settle_fill(&mut self, id: usize, result: &std::io::Result<()>) -> bool {
        let Some(f) = self.fills.remove(&id) else {
            return false;
        };
        match result {
            Ok(()) => {
                self.caches[f.layer].commit_fill(f.expert, f.slot);
                self.unverified[f.layer * self.slots_per_layer + f.slot] = true;
            }
            Err(_) => {
                // Not fatal: a request for the expert reads it again and
                // reports the error then.
                self.caches[f.layer].cancel_fill(f.slot);
            }
        }
        true
    }

    /// Blocks for the next completion, which must be a fill (no request
    /// pending), and settles it; the wait counts as read wait.
    fn wait_for_fill(&mut self) -> Result<(), BoxError> {
        let t = Instant::now();
        let d = self.pool.wait();
        self.counters.read_wait_ns += t.elapsed().as_nanos() as u64;
        if self.settle_fill(d.id, &d.result) {
            Ok(())
        } else {
            Err("expert store: unknown read completion".into())
        }
    }

    /// Settles fills that finished without blocking, then blocks until no
    /// fill of `experts` (in `layer`) is in flight. Called with no request
    /// pending, so every completion is a fill.
    fn settle_fills_for(&mut self, layer: usize, experts: &[u32]) -> Result<(), BoxError> {
        while let Some(d) = self.pool.try_wait() {
            if !self.settle_fill(d.id, &d.result) {
                return Err("expert store: unknown read completion".into());
            }
        }
        while experts
            .iter()
            .any(|&e| self.fills.contains_key(&self.fill_id(layer, e)))
        {
            self.wait_for_fill()?;
        }
        Ok(())
    }

    /// Checks the records of hits that a background fill brought in and
    /// nobody has used yet; a bad one is dropped from its slot.
    fn verify_filled_hits(
        &mut self,
        layer: usize,
        experts: &[u32],
        outcomes: &[Outcome],
    ) -> Result<(), BoxError> {
        let base = layer * self.slots_per_layer;
        let to_check: Vec<(u32, usize)> = experts
            .iter()
            .zip(outcomes)
            .filter_map(|(&e, o)| match *o {
                Outcome::Hit { slot } if self.unverified[base + slot] => Some((e, slot)),
                _ => None,
            })
            .collect();
        if to_check.is_empty() {
            return Ok(());
        }
        let model = &*self.model;
        let records: Vec<&[u8]> = to_check
            .iter()
            .map(|&(_, slot)| self.place_bytes(layer, Place::Slot(slot)))
            .collect();
        let checked: Vec<Result<(), BoxError>> = to_check
            .par_iter()
            .zip(&records)
            .map(|(&(e, _), record)| {
                model
                    .verify_expert(layer, e as usize, record)
                    .map_err(BoxError::from)
            })
            .collect();
        drop(records);
        let mut first_err = None;
        for ((e, slot), ok) in to_check.into_iter().zip(checked) {
            match ok {
                Ok(()) => self.unverified[base + slot] = false,
                Err(err) => {
                    self.unverified[base + slot] = false;
                    self.caches[layer].invalidate(e);
                    first_err.get_or_insert(err);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl ExpertSource for StreamingStore {
    fn begin(&mut self, req: &ExpertRequest<'_>) -> Result<(), BoxError> {
        if self.pending.is_some() {
            return Err("expert store: begin called twice without with_experts".into());
        }
        if !self.fills.is_empty() {
            self.settle_fills_for(req.layer, req.experts)?;
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
        // Behind the demand reads in the readers' queue.
        self.top_up_fills();
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
        // Hits first: their bytes are already here and verified (filled
        // records on their first use).
        let mut first_err: Option<BoxError> =
            self.verify_filled_hits(layer, &experts, &outcomes).err();
        if first_err.is_none() {
            let mut hits = Vec::with_capacity(outcomes.len());
            for (i, o) in outcomes.iter().enumerate() {
                if let Outcome::Hit { slot } = *o {
                    let bytes = self.place_bytes(layer, Place::Slot(slot));
                    match self.model.expert_views(layer, experts[i] as usize, bytes) {
                        Ok(w) => hits.push((experts[i], w)),
                        Err(e) => {
                            first_err = Some(e.into());
                            break;
                        }
                    }
                }
            }
            if first_err.is_none() && !hits.is_empty() {
                compute(&hits);
            }
        }
        // Then the misses as they land: every read finished by the time
        // the previous batch is done forms the next batch, so misses that
        // land together run in parallel like the hits.
        while first_err.is_none() && self.pending.as_ref().is_some_and(|p| p.in_flight > 0) {
            let t = Instant::now();
            let mut done = vec![self.pool.wait()];
            self.counters.read_wait_ns += t.elapsed().as_nanos() as u64;
            while let Some(d) = self.pool.try_wait() {
                done.push(d);
            }
            done.retain(|d| !self.settle_fill(d.id, &d.result));
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
                    Ok(()) if first_err.is_none() => {
                        match model.expert_views(layer, expert as usize, record) {
                            Ok(w) => batch.push((expert, w)),
                            Err(e) => first_err = Some(e.into()),
                        }
                    }
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
                self.top_up_fills();
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
        let mut left = p.in_flight;
        while left > 0 {
            let done = self.pool.wait();
            if done.id == usize::MAX {
                return; // the readers are gone: nothing is in flight
            }
            if self.settle_fill(done.id, &done.result) {
                continue;
            }
            left -= 1;
            if let (Some(Some(Place::Slot(_))), Some(&e)) =
                (p.place.get(done.id), experts.get(done.id))
            {
                self.caches[layer].invalidate(e);
            }
        }
    }

    /// Waits for every read in flight, background fills included (after a
    /// protocol error, and before the memory the reads target goes away).
    fn drain(&mut self) {
        let mut left = self.pending.take().map_or(0, |p| p.in_flight);
        while left > 0 || !self.fills.is_empty() {
            let done = self.pool.wait();
            if done.id == usize::MAX {
                return; // the readers are gone: nothing is in flight
            }
            if !self.settle_fill(done.id, &done.result) {
                left = left.saturating_sub(1);
            }
        }
    }
}

impl ExpertStore for StreamingStore {
    fn abandon_pending(&mut self) {
        if let Some(p) = &self.pending {
            let (layer, experts) = (p.layer, p.experts.clone());
            self.drain_forgetting(layer, &experts);
        }
    }

    fn counters(&self) -> StoreCounters {
        self.counters
    }

    fn describe(&self) -> String {
        format!(
            "streaming: {} slots/layer ({:.1} MB), policy {}, {} reader threads{}{}",
            self.config.slots,
            self.slots.len() as f64 / 1e6,
            self.config.policy,
            self.config.io_threads,
            if self.config.direct_io {
                ", direct I/O"
            } else {
                ""
            },
            if self.config.background_fill
                && self.slots_per_layer >= self.model.manifest.experts.num_experts
            {
                ", background fill"
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
