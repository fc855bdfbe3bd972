//! Expert stores: implementations of [`ExpertSource`] over a `.slip` model.
//!
//! Architecture invariant: a store decides only *where* expert bytes come
//! from; the bytes handed to the model are the verified record bytes, so no
//! store can change what the model computes.

pub mod policy;
pub mod trace;

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
}

/// Every expert of every layer held in memory, read and verified once at open.
pub struct ResidentStore {
    model: Arc<SlipModel>,
    /// All records back to back, `record_bytes` apart, layer-major.
    records: Vec<u8>,
    record_bytes: usize,
    num_experts: usize,
    counters: StoreCounters,
}

impl ResidentStore {
    /// Reads the whole expert pool (checksums verified, in parallel).
    pub fn open(model: Arc<SlipModel>) -> Result<Self, BoxError> {
        use rayon::prelude::*;
        let pool = &model.manifest.experts;
        let record_bytes = pool.record_bytes as usize;
        let num_experts = pool.num_experts;
        let mut records = vec![0u8; record_bytes * pool.num_layers * num_experts];
        if record_bytes > 0 {
            records
                .par_chunks_mut(record_bytes)
                .enumerate()
                .try_for_each(|(i, buf)| {
                    model.read_expert(i / num_experts, i % num_experts, buf)
                })?;
        }
        let bytes_read = records.len() as u64;
        Ok(ResidentStore {
            model,
            records,
            record_bytes,
            num_experts,
            counters: StoreCounters {
                bytes_read,
                ..Default::default()
            },
        })
    }

    pub fn counters(&self) -> StoreCounters {
        self.counters
    }
}

impl ExpertSource for ResidentStore {
    fn with_experts(
        &mut self,
        request: &ExpertRequest<'_>,
        compute: &mut dyn FnMut(u32, ExpertWeights<'_>),
    ) -> Result<(), BoxError> {
        let layer = request.layer;
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
            let weights = self.model.expert_views(record)?;
            self.counters.hits += 1;
            compute(e, weights);
        }
        Ok(())
    }
}
