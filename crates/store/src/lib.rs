//! Expert stores: implementations of [`ExpertSource`] over a `.slip` model.
//!
//! Architecture invariant: a store decides only *where* expert bytes come
//! from; the bytes handed to the model are the verified record bytes, so no
//! store can change what the model computes.

pub mod policies;
pub mod policy;
pub mod reader;
pub mod replay;
pub mod streaming;
pub mod trace;

pub use policy::PolicyKind;
pub use reader::{supports_direct_io, DirectIo, Readahead};
pub use streaming::{StreamConfig, StreamingStore};
pub use trace::{Phase, TraceHeader, TraceWriter};

use std::sync::Arc;

use slipstream_core::{BoxError, ExpertRequest, ExpertSource, ExpertWeights};
use slipstream_format::SlipModel;

/// Counters every store keeps, per run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreCounters {
    /// Expert requests served from memory.
    pub hits: u64,
    /// Expert requests that needed a read.
    pub misses: u64,
    /// Bytes read from the expert pool file.
    pub bytes_read: u64,
    /// Time the compute thread spent blocked on expert reads.
    pub read_wait_ns: u64,
    /// Background reads started into free slots (their bytes are in
    /// `bytes_read`; a request they serve counts as a hit).
    pub fills: u64,
}

impl StoreCounters {
    /// Counters accumulated since `earlier`.
    pub fn since(&self, earlier: &StoreCounters) -> StoreCounters {
        StoreCounters {
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            bytes_read: self.bytes_read - earlier.bytes_read,
            read_wait_ns: self.read_wait_ns - earlier.read_wait_ns,
            fills: self.fills - earlier.fills,
        }
    }
}

/// An [`ExpertSource`] the engine can also ask for counters and state.
pub trait ExpertStore: ExpertSource {
    fn counters(&self) -> StoreCounters;
    /// One line for logs: kind, slots, memory.
    fn describe(&self) -> String;
    /// Experts held in memory, per layer.
    fn resident_experts(&self) -> Vec<Vec<u32>>;

    /// Forgets a request a pass left pending when it failed or panicked
    /// mid-layer (the server catches panics and goes on), waiting for its
    /// reads, so the next request runs. Stores without requests in flight
    /// have nothing to forget.
    fn abandon_pending(&mut self) {}

    /// Slots per layer of a bounded cache; `None` when every expert is
    /// always resident (nothing to warm, nothing left to fill).
    fn slot_capacity(&self) -> Option<usize> {
        None
    }

    /// Bytes of slot memory not yet holding an expert: what the cache can
    /// still add to the process footprint as it fills (counted once by the
    /// memory guard, not per prefill chunk).
    fn unfilled_slot_bytes(&self) -> u64 {
        0
    }

    /// Reads `resident[layer]` into that layer's slots before any token runs
    /// (e.g. the experts a snapshot recorded), through the ordinary request
    /// path, so counters and policy bookkeeping see them like any other
    /// request. See [`warm_source`] for how this meets the policies. Returns
    /// the number of experts requested. A store with no bounded cache does
    /// nothing.
    fn warm(&mut self, resident: &[Vec<u32>]) -> Result<usize, BoxError> {
        match self.slot_capacity() {
            Some(cap) => warm_source(self, resident, cap),
            None => Ok(0),
        }
    }
}

/// Warms a cache of `capacity` slots per layer through `source`: for each
/// layer one request with `tokens = 0` naming at most `capacity` of the
/// listed experts (the first ones listed, deduplicated, then ascending as
/// requests require), each with a count of 1, whose weights are fetched,
/// verified and dropped.
///
/// How this meets the policies: it is an ordinary [`LayerCache::access`]
/// batch, so a warmed expert is a miss (counted, bytes read) that takes a
/// free slot, or evicts the policy's victim when the cache is already full
/// (never another expert of the same warm batch). LFU and aging start every
/// warmed expert at a count of 1 (counts from before the snapshot are not
/// restored) and the aging clock does not advance (`tokens = 0`); LRU sees
/// the batch as used at one instant. Policies with an admission filter may
/// refuse a warmed expert, which is then read and dropped like any bypassed
/// miss. Because it is a normal request, a route trace recorded through
/// [`TracedStore::warm`] holds it and a replay reproduces the counters.
///
/// [`LayerCache::access`]: policy::LayerCache::access
pub fn warm_source<S: ExpertSource + ?Sized>(
    source: &mut S,
    resident: &[Vec<u32>],
    capacity: usize,
) -> Result<usize, BoxError> {
    let mut requested = 0;
    for (layer, experts) in resident.iter().enumerate() {
        let mut ids: Vec<u32> = Vec::with_capacity(capacity.min(experts.len()));
        for &e in experts {
            if ids.len() == capacity {
                break;
            }
            if !ids.contains(&e) {
                ids.push(e);
            }
        }
        if ids.is_empty() {
            continue;
        }
        ids.sort_unstable();
        let counts = vec![1u32; ids.len()];
        let req = ExpertRequest {
            layer,
            experts: &ids,
            counts: &counts,
            tokens: 0,
        };
        source.begin(&req)?;
        source.with_experts(&req, &mut |_, _| {})?;
        requested += ids.len();
    }
    Ok(requested)
}

/// Wraps a store and records every request into a route trace.
pub struct TracedStore {
    pub inner: Box<dyn ExpertStore>,
    trace: Option<TraceWriter>,
    phase: Phase,
    trace_error: Option<std::io::Error>,
}

impl TracedStore {
    pub fn new(inner: Box<dyn ExpertStore>, trace: Option<TraceWriter>) -> Self {
        TracedStore {
            inner,
            trace,
            phase: Phase::Prefill,
            trace_error: None,
        }
    }

    /// Marks the following requests as prefill or decode in the trace.
    pub fn set_phase(&mut self, phase: Phase) {
        self.phase = phase;
    }

    /// [`ExpertStore::warm`] on the inner store, with the warm requests
    /// recorded in the route trace (as prefill-phase batches of 0 tokens)
    /// so that a replay reproduces the store's counters.
    pub fn warm(&mut self, resident: &[Vec<u32>]) -> Result<usize, BoxError> {
        match self.inner.slot_capacity() {
            Some(cap) => {
                let phase = self.phase;
                self.phase = Phase::Prefill;
                let r = warm_source(self, resident, cap);
                self.phase = phase;
                r
            }
            None => Ok(0),
        }
    }

    /// Completes the trace file (if any).
    pub fn finish_trace(&mut self) -> std::io::Result<()> {
        if let Some(e) = self.trace_error.take() {
            return Err(e);
        }
        match self.trace.take() {
            Some(t) => t.finish(),
            None => Ok(()),
        }
    }
}

impl ExpertSource for TracedStore {
    fn begin(&mut self, request: &ExpertRequest<'_>) -> Result<(), BoxError> {
        if let Some(t) = self.trace.as_mut() {
            if let Err(e) = t.record(
                self.phase,
                request.layer,
                request.tokens,
                request.experts,
                request.counts,
            ) {
                self.trace_error.get_or_insert(e);
                self.trace = None;
            }
        }
        self.inner.begin(request)
    }

    fn with_experts(
        &mut self,
        request: &ExpertRequest<'_>,
        compute: &mut dyn FnMut(u32, ExpertWeights<'_>),
    ) -> Result<(), BoxError> {
        self.inner.with_experts(request, compute)
    }

    fn with_expert_batches(
        &mut self,
        request: &ExpertRequest<'_>,
        compute: &mut dyn FnMut(&slipstream_core::ExpertBatch<'_>),
    ) -> Result<(), BoxError> {
        self.inner.with_expert_batches(request, compute)
    }
}

/// Every expert of every layer held in memory, read and verified once at open.
pub struct ResidentStore {
    model: Arc<SlipModel>,
    /// All experts back to back, `record_bytes` apart, layer-major (an
    /// anonymous mapping with transparent huge pages requested); each as
    /// [`SlipModel::read_expert`] lays it out.
    records: memmap2::MmapMut,
    /// Bytes of the pool (the mapping is at least one byte long).
    pool_bytes: usize,
    record_bytes: usize,
    num_experts: usize,
    counters: StoreCounters,
}

impl ResidentStore {
    /// Reads the whole expert pool (checksums verified, in parallel).
    pub fn open(model: Arc<SlipModel>) -> Result<Self, BoxError> {
        use rayon::prelude::*;
        let pool = &model.manifest.experts;
        let record_bytes = model.expert_buf_bytes();
        let num_experts = pool.num_experts;
        let pool_bytes = record_bytes * pool.num_layers * num_experts;
        let mut records = memmap2::MmapMut::map_anon(pool_bytes.max(1))?;
        // Huge pages where the kernel gives them only on request (see the
        // streaming store's slots); best effort.
        #[cfg(target_os = "linux")]
        let _ = records.advise(memmap2::Advice::HugePage);
        if record_bytes > 0 {
            records[..pool_bytes]
                .par_chunks_mut(record_bytes)
                .enumerate()
                .try_for_each(|(i, buf)| {
                    model.read_expert(i / num_experts, i % num_experts, buf)
                })?;
        }
        Ok(ResidentStore {
            model,
            records,
            pool_bytes,
            record_bytes,
            num_experts,
            counters: StoreCounters {
                bytes_read: pool_bytes as u64,
                ..Default::default()
            },
        })
    }
}

impl ExpertStore for ResidentStore {
    fn counters(&self) -> StoreCounters {
        self.counters
    }

    fn describe(&self) -> String {
        format!(
            "resident: all experts in memory ({:.1} MB)",
            self.pool_bytes as f64 / 1e6
        )
    }

    fn resident_experts(&self) -> Vec<Vec<u32>> {
        let layers = self.model.manifest.experts.num_layers;
        vec![(0..self.num_experts as u32).collect(); layers]
    }
}

impl ExpertSource for ResidentStore {
    fn with_experts(
        &mut self,
        request: &ExpertRequest<'_>,
        compute: &mut dyn FnMut(u32, ExpertWeights<'_>),
    ) -> Result<(), BoxError> {
        self.with_expert_batches(request, &mut |batch| {
            for &(e, w) in batch {
                compute(e, w);
            }
        })
    }

    /// Every expert is in memory: one batch per request.
    fn with_expert_batches(
        &mut self,
        request: &ExpertRequest<'_>,
        compute: &mut dyn FnMut(&slipstream_core::ExpertBatch<'_>),
    ) -> Result<(), BoxError> {
        let layer = request.layer;
        let mut batch = Vec::with_capacity(request.experts.len());
        for &e in request.experts {
            let e_idx = e as usize;
            if e_idx >= self.num_experts {
                return Err(format!("expert {e} requested, layer has {}", self.num_experts).into());
            }
            let start = (layer * self.num_experts + e_idx) * self.record_bytes;
            let record = self
                .records
                .get(start..start + self.record_bytes)
                .ok_or_else(|| format!("layer {layer} is outside the expert pool"))?;
            batch.push((e, self.model.expert_views(layer, e_idx, record)?));
        }
        self.counters.hits += batch.len() as u64;
        compute(&batch);
        Ok(())
    }
}
