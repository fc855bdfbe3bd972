//! Test data both CUDA test files build: routed experts packed as the
//! expert pool packs them, with the routing tables the MoE kernels read,
//! and a pass over them run per pair and grouped by expert.

use rand::Rng;
use slipstream_core::{QuantType, TensorView};
use slipstream_cuda::{DBuf, DevPtr, ExpertsIo, Gpu, RouteBases, WDesc};

pub type Rng64 = rand::rngs::StdRng;

/// `e` experts of (gate `[inter, h]`, up, down `[h, inter]`) in one device
/// buffer of records (parts 256-byte aligned at `offsets`), and `tokens`
/// tokens routed to `k` distinct experts each (pair p = t k + r).
pub struct ExpertRecords {
    /// Keeps the records alive on the device.
    pub _records: DBuf,
    /// The experts' type and (h, inter, k, e, tokens), as built.
    pub q: QuantType,
    pub shape: (usize, usize, usize, usize, usize),
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
    shape: (usize, usize, usize, usize, usize),
    mut weight: impl FnMut(&mut Rng64, QuantType, usize, usize) -> Vec<u8>,
) -> ExpertRecords {
    let (h, inter, k, e, tokens) = shape;
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
        q,
        shape,
        offsets,
        views,
        ids,
    }
}

impl ExpertRecords {
    /// Pair `p`'s expert's gate, up and down, for the host reference.
    pub fn pair_views(&self, p: usize) -> (TensorView<'_>, TensorView<'_>, TensorView<'_>) {
        let (h, inter, ..) = self.shape;
        let (gb, ub, db) = &self.views[self.ids[p] as usize];
        (
            TensorView::new(self.q, inter, h, gb).unwrap(),
            TensorView::new(self.q, inter, h, ub).unwrap(),
            TensorView::new(self.q, h, inter, db).unwrap(),
        )
    }
}

/// The shared expert's output and gate for an `ExpertsIo` (`[tokens, h]`
/// and `[tokens]` f32), or none.
pub fn shared_expert_io(shared: Option<(&DBuf, &DBuf)>) -> (DevPtr, DevPtr) {
    shared.map_or((DevPtr::NULL, DevPtr::NULL), |(out, gate)| {
        (out.ptr, gate.ptr)
    })
}

/// Descriptor templates of an expert's gate/up (`[inter, h]`) and down
/// (`[h, inter]`) parts of type `q`, addresses supplied by the bases table.
pub fn expert_descs(q: QuantType, h: usize, inter: usize) -> (WDesc, WDesc) {
    (
        WDesc::new(q, inter, h, DevPtr::NULL).unwrap(),
        WDesc::new(q, h, inter, DevPtr::NULL).unwrap(),
    )
}

/// The routed experts of a pass over `ex` both ways, each into a fresh
/// copy of the residual `x0` (`[tokens, h]`): per pair (`moe_experts`
/// over the bases tables, as host routing runs them) and grouped by
/// expert (`moe_experts_grouped`, as device routing does). The pass: input
/// rows `x` (`[tokens, h]`), routing weights `wts` (`[tokens, k]`) and the
/// shared expert's output and gate logits (`[tokens, h]`, `[tokens]`), if
/// any. Returns the residuals (per pair, grouped) and whether the grouped
/// form took the shape.
pub fn per_pair_and_grouped(
    g: &Gpu,
    ex: &ExpertRecords,
    x: &[f32],
    x0: &[f32],
    wts: &[f32],
    shared: Option<(&[f32], &[f32])>,
) -> (Vec<f32>, Vec<f32>, bool) {
    let (h, inter, k, e, tokens) = ex.shape;
    let pairs = tokens * k;
    let up = |v: &[f32]| g.upload_f32(v).unwrap();
    let (dx, dw) = (up(x), up(wts));
    let sh_bufs = shared.map(|(out, gate)| (up(out), up(gate)));
    let sh = shared_expert_io(sh_bufs.as_ref().map(|(out, gate)| (out, gate)));
    let (gt, dtl) = expert_descs(ex.q, h, inter);
    let io = |h_buf: DevPtr, x_buf: DevPtr| ExpertsIo {
        xrow: ex.xrow.ptr,
        xn: dx.ptr,
        h: h_buf,
        wts: dw.ptr,
        k,
        shared: sh,
        x: x_buf,
        tokens,
    };
    // Per pair.
    let (tp, t8) = (ex.table.ptr, 8 * pairs);
    let dres = up(x0);
    let dh = up(&vec![f32::NAN; pairs * inter]);
    g.moe_experts(
        [&gt, &gt, &dtl],
        [tp, tp.add_bytes(t8), tp.add_bytes(2 * t8)],
        &io(dh.ptr, dres.ptr),
    )
    .unwrap();
    let per_pair = g.read_f32(&dres, 0, tokens * h).unwrap();
    // Grouped by expert.
    let dres2 = up(x0);
    let dh2 = up(&vec![f32::NAN; pairs * inter]);
    let (goff, glist) = (g.alloc(4 * (e + 1)).unwrap(), g.alloc(4 * pairs).unwrap());
    let route = RouteBases {
        addr: ex.addr.ptr,
        offsets: ex.offsets,
        out: tp,
    };
    let took = g
        .moe_experts_grouped(
            [&gt, &gt, &dtl],
            &route,
            ex.dids.ptr,
            e,
            (&goff, &glist),
            &io(dh2.ptr, dres2.ptr),
        )
        .unwrap();
    let grouped = g.read_f32(&dres2, 0, tokens * h).unwrap();
    (per_pair, grouped, took)
}
