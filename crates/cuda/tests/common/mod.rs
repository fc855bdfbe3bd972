//! Test data both CUDA test files build: routed experts packed as the
//! expert pool packs them, with the routing tables the MoE kernels read.

use rand::Rng;
use slipstream_core::QuantType;
use slipstream_cuda::{DBuf, DevPtr, Gpu, WDesc};

pub type Rng64 = rand::rngs::StdRng;

/// `e` experts of (gate `[inter, h]`, up, down `[h, inter]`) in one device
/// buffer of records (parts 256-byte aligned at `offsets`), and `tokens`
/// tokens routed to `k` distinct experts each (pair p = t k + r).
pub struct ExpertRecords {
    /// Keeps the records alive on the device.
    pub _records: DBuf,
    pub offsets: [u64; 3],
    /// Each expert's (gate, up, down) bytes, for the host reference.
    pub views: Vec<(Vec<u8>, Vec<u8>, Vec<u8>)>,
    /// `[tokens * k]` expert ids.
    pub ids: Vec<i32>,
    /// Per pair: gate, up, down bases (three `[pairs]` u64 tables in a row).
    pub table: DBuf,
    /// Each expert's record address (`[e]` u64).
    pub addr: DBuf,
    /// `ids` on the device (i32).
    pub dids: DBuf,
    /// Each pair's token row (i32).
    pub xrow: DBuf,
}

/// Builds [`ExpertRecords`] with weights from `weight(rng, q, rows, cols)`,
/// drawing the weights first, then the routing.
pub fn expert_records(
    g: &Gpu,
    rng: &mut Rng64,
    q: QuantType,
    (h, inter, k, e, tokens): (usize, usize, usize, usize, usize),
    mut weight: impl FnMut(&mut Rng64, QuantType, usize, usize) -> Vec<u8>,
) -> ExpertRecords {
    assert!(
        k <= e,
        "top-{k} of {e} experts: a token routes to k distinct experts"
    );
    let align = |n: usize| n.div_ceil(256) * 256;
    let (gsz, dsz) = (q.nbytes(inter, h), q.nbytes(h, inter));
    let offsets = [0u64, align(gsz) as u64, 2 * align(gsz) as u64];
    let rec = 2 * align(gsz) + align(dsz);
    let mut bytes = vec![0u8; e * rec];
    let mut views = Vec::new();
    for r in 0..e {
        let (gb, ub, db) = (
            weight(rng, q, inter, h),
            weight(rng, q, inter, h),
            weight(rng, q, h, inter),
        );
        let at = r * rec;
        bytes[at..at + gsz].copy_from_slice(&gb);
        bytes[at + offsets[1] as usize..][..gsz].copy_from_slice(&ub);
        bytes[at + offsets[2] as usize..][..dsz].copy_from_slice(&db);
        views.push((gb, ub, db));
    }
    let records = g.upload(&bytes).unwrap();
    let addr: Vec<u64> = (0..e)
        .map(|r| records.ptr.add_bytes(r * rec).raw())
        .collect();
    // Distinct experts per token (as top-k gives), drawn from e.
    let mut ids = Vec::new();
    for _ in 0..tokens {
        let mut pick: Vec<i32> = Vec::new();
        while pick.len() < k {
            let c = rng.random_range(0..e as i32);
            if !pick.contains(&c) {
                pick.push(c);
            }
        }
        ids.extend(pick);
    }
    let mut table: Vec<u64> = Vec::new();
    for off in offsets {
        table.extend(ids.iter().map(|&i| addr[i as usize] + off));
    }
    let le64 = |v: &[u64]| v.iter().flat_map(|a| a.to_le_bytes()).collect::<Vec<u8>>();
    let le32 = |v: &[i32]| v.iter().flat_map(|a| a.to_le_bytes()).collect::<Vec<u8>>();
    let xrow: Vec<i32> = (0..tokens * k).map(|p| (p / k) as i32).collect();
    ExpertRecords {
        table: g.upload(&le64(&table)).unwrap(),
        addr: g.upload(&le64(&addr)).unwrap(),
        dids: g.upload(&le32(&ids)).unwrap(),
        xrow: g.upload(&le32(&xrow)).unwrap(),
        _records: records,
        offsets,
        views,
        ids,
    }
}

/// The shared expert's output and gate for an `ExpertsIo` (`[tokens, h]`
/// and `[tokens]` f32), or none.
pub fn shared_expert_io(shared: bool, out: &DBuf, gate: &DBuf) -> (DevPtr, DevPtr) {
    if shared {
        (out.ptr, gate.ptr)
    } else {
        (DevPtr::NULL, DevPtr::NULL)
    }
}

/// Descriptor templates of an expert's gate/up (`[inter, h]`) and down
/// (`[h, inter]`) parts of type `q`, addresses supplied by the bases table.
pub fn expert_descs(q: QuantType, h: usize, inter: usize) -> (WDesc, WDesc) {
    (
        WDesc::new(q, inter, h, DevPtr::NULL).unwrap(),
        WDesc::new(q, h, inter, DevPtr::NULL).unwrap(),
    )
}
