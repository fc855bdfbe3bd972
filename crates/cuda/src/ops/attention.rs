//! Attention over the KV cache: the split decode form (one query, or a
//! pass's queries causally) and the prompt's tensor-core form.

use crate::{CudaError, DBuf, DevPtr, Gpu, Position, Result};

/// Keys per attention split (`ATT_CHUNK` in attention.cu).
pub const ATT_CHUNK: usize = 128;
/// Keys per split of the prompt attention (`PA_SPLIT` in attention.cu).
pub const PA_SPLIT: usize = 1024;
/// Rows (query, head) per block of the prompt attention (`PA_ROWS`).
pub(crate) const PA_ROWS: usize = 16;
/// Keys per step of the prompt attention (`PA_KEYS`).
pub(crate) const PA_KEYS: usize = 32;

/// The buffers of an attention launch over `n` queries of `nh` heads of
/// `hd` over `nkv` KV heads (`n` is the launch's argument).
#[derive(Debug, Clone, Copy)]
pub struct AttnIo {
    /// `[n, nh, hd]` f32: the queries (normed, rotated).
    pub q: DevPtr,
    /// `[keys, nkv * hd]` f32: the key and value caches.
    pub kc: DevPtr,
    pub vc: DevPtr,
    /// (nh, nkv, hd).
    pub dims: (usize, usize, usize),
    /// `[n, nh, hd]` f32: the output gate (0: none).
    pub gate: DevPtr,
    /// `[n, nh, hd]` f32: the output.
    pub out: DevPtr,
}

/// Most query heads per KV head (`ATT_MAXG`).
pub const ATT_MAXG: usize = 16;

/// The split attention's partials in `scratch` (query z's at z times its
/// stride): the splits' maxima `[nh, nsplit]`, sums `[nh, nsplit]`, then
/// unnormalised outputs `[nh, nsplit, hd]`, as addresses.
pub(crate) fn attn_partials(scratch: &DBuf, nh: usize, nsplit: usize) -> (DevPtr, DevPtr, DevPtr) {
    (
        scratch.ptr,
        scratch.f32_at(nh * nsplit),
        scratch.f32_at(2 * nh * nsplit),
    )
}

/// Dynamic shared memory of `attn_prompt_tc` for heads of `hd`: the
/// tile's queries, a block of keys and of values (padded rows), the
/// block's probabilities and the rows' rescale factors.
pub(crate) fn prompt_attn_smem(hd: usize) -> usize {
    4 * (PA_ROWS * (hd + 4)
        + PA_KEYS * (hd + 4)
        + PA_KEYS * (hd + 8)
        + PA_ROWS * (PA_KEYS + 4)
        + PA_ROWS)
}

impl Gpu {
    /// Decode attention of the token at position `at` over the `at + 1`
    /// cached positions: `q` `[nh, hd]`, caches `[keys, nkv*hd]`, `out`
    /// `[nh, hd]`; `scratch` holds at least [`Gpu::attn_scratch_f32`]
    /// floats for `at + 1` keys (for the capacity with
    /// [`Position::Device`]); `gate` 0 for none. Both forms of `at` give
    /// the same bits.
    pub fn attention(&self, io: &AttnIo, at: Position, scratch: &DBuf) -> Result<()> {
        self.attention_causal(io, at, 1, scratch)
    }

    /// [`Gpu::attention`] of `n` queries in one launch pair: query t (`q`,
    /// `gate`, `out` `[n, nh, hd]`) sits at position `at + t` and sees the
    /// keys up to its own position (the pass's keys are in the caches
    /// already). `scratch` holds `n` times [`Gpu::attn_scratch_f32`] for
    /// the last query's keys. Each query gets the bits of its own
    /// one-query launch. [`Position::Device`] takes one query only.
    pub fn attention_causal(
        &self,
        io: &AttnIo,
        at: Position,
        n: usize,
        scratch: &DBuf,
    ) -> Result<()> {
        let (nh, nkv, hd) = io.dims;
        if nh / nkv > ATT_MAXG || hd > 256 || !nh.is_multiple_of(nkv) || n == 0 {
            return Err(CudaError::Invalid(format!(
                "attention of {n} queries with {nh} heads over {nkv} KV heads of {hd} is outside the kernel's limits"
            )));
        }
        // `keys` (the first query's) and `last` (the last query's) size the
        // grid and scratch: the real counts, or the capacity when the
        // kernels read the count from device memory.
        let (keys, dpos) = match at {
            Position::Host(p) => (p + 1, DevPtr::NULL),
            Position::Device { ptr, cap } if n == 1 => (cap.max(1), ptr),
            Position::Device { .. } => {
                return Err(CudaError::Invalid(
                    "attention reads a device position for one query only".into(),
                ))
            }
        };
        let last = keys + n - 1;
        let nsplit = last.div_ceil(ATT_CHUNK);
        let per_query = Self::attn_scratch_f32(nh, hd, last);
        if scratch.len_f32() < n * per_query {
            return Err(CudaError::Invalid("attention scratch too small".into()));
        }
        let (pm, pl, pacc) = attn_partials(scratch, nh, nsplit);
        let scale = 1.0f32 / (hd as f32).sqrt();
        let (keys_i, nh_i, nkv_i, hd_i, ns_i, zs) = (
            keys as i32,
            nh as i32,
            nkv as i32,
            hd as i32,
            keys.div_ceil(ATT_CHUNK) as i32,
            per_query as i32,
        );
        self.go(
            &self.f.attn_partial,
            (nkv as u32, nsplit as u32, n as u32),
            256,
            &mut args!(
                &io.q, &io.kc, &io.vc, &keys_i, &nh_i, &nkv_i, &hd_i, &scale, &ns_i, &pm, &pl,
                &pacc, &dpos, &zs
            ),
        )?;
        let chunk = ATT_CHUNK as i32;
        self.attn_combine(io, (pm, pl, pacc), n, [ns_i, keys_i, zs, chunk], dpos)
    }

    /// The second launch of both attention forms: each of the `n` queries'
    /// split partials ([`attn_partials`]) combined in order, times the
    /// gate, into `io.out`. The kernel's integers: the split count, the
    /// first query's keys, the scratch floats per query and the keys per
    /// split; `dpos` the device position (0: none).
    fn attn_combine(
        &self,
        io: &AttnIo,
        (pm, pl, pacc): (DevPtr, DevPtr, DevPtr),
        n: usize,
        [ns_i, keys_i, zs, chunk]: [i32; 4],
        dpos: DevPtr,
    ) -> Result<()> {
        let (nh, _, hd) = io.dims;
        let (hd_i, gate, out) = (hd as i32, io.gate, io.out);
        self.go(
            &self.f.attn_combine,
            (nh as u32, 1, n as u32),
            256,
            &mut args!(&pm, &pl, &pacc, &ns_i, &hd_i, &gate, &out, &dpos, &keys_i, &zs, &chunk),
        )
    }

    /// Whether [`Gpu::attention_prompt`] runs heads of `hd` dimensions
    /// here: tensor cores (sm_80+), `hd` a multiple of 32 up to 256, and the
    /// shared memory for it.
    pub fn prompt_attention_on_tensor_cores(&self, hd: usize) -> bool {
        self.prompt_attn_tc
            && self.tc_capable
            && hd.is_multiple_of(32)
            && (32..=256).contains(&hd)
            && prompt_attn_smem(hd) <= self.attn_smem_max
    }

    /// Attention of a prompt pass's `n` queries on tensor cores: query t
    /// (`q`, `gate`, `out` `[n, nh, hd]`) sits at position `pos0 + t` and
    /// sees the keys up to its own (the pass's keys are in the caches
    /// `[keys, nkv*hd]` already). Both products in 3xTF32 (about f32),
    /// keys in splits of [`PA_SPLIT`] combined in order. Each query's bits
    /// depend only on its own query, keys and values: a pass of any length
    /// gives the same as one query per launch. `scratch` holds `n` times
    /// [`Gpu::prompt_attn_scratch_f32`] for the last query's keys.
    pub fn attention_prompt(
        &self,
        io: &AttnIo,
        pos0: usize,
        n: usize,
        scratch: &DBuf,
    ) -> Result<()> {
        let (nh, nkv, hd) = io.dims;
        if n == 0
            || nkv == 0
            || !nh.is_multiple_of(nkv)
            || !self.prompt_attention_on_tensor_cores(hd)
        {
            return Err(CudaError::Invalid(format!(
                "prompt attention of {n} queries with {nh} heads over {nkv} KV heads of {hd} \
                 does not run on tensor cores here"
            )));
        }
        let last = pos0 + n;
        let nsplit = last.div_ceil(PA_SPLIT);
        let per_query = Self::prompt_attn_scratch_f32(nh, hd, last);
        let (rows, grid_y) = (n * (nh / nkv), u32::try_from(nsplit));
        let (Ok(grid_y), Ok(zs)) = (grid_y, i32::try_from(per_query)) else {
            return Err(CudaError::Invalid(format!(
                "prompt attention over {last} keys is too long"
            )));
        };
        if scratch.len_f32() < n * per_query {
            return Err(CudaError::Invalid(
                "prompt attention scratch too small".into(),
            ));
        }
        let (pm, pl, pacc) = attn_partials(scratch, nh, nsplit);
        let scale = 1.0f32 / (hd as f32).sqrt();
        let (pos0_i, n_i, nh_i, nkv_i, hd_i, keys_i) = (
            pos0 as i32,
            n as i32,
            nh as i32,
            nkv as i32,
            hd as i32,
            (pos0 + 1) as i32,
        );
        self.go_smem(
            &self.f.attn_prompt_tc,
            (rows.div_ceil(PA_ROWS) as u32, grid_y, nkv as u32),
            128,
            prompt_attn_smem(hd) as u32,
            &mut args!(
                &io.q, &io.kc, &io.vc, &pos0_i, &n_i, &nh_i, &nkv_i, &hd_i, &scale, &pm, &pl,
                &pacc, &zs
            ),
        )?;
        let (ns_i, chunk) = (nsplit as i32, PA_SPLIT as i32);
        self.attn_combine(
            io,
            (pm, pl, pacc),
            n,
            [ns_i, keys_i, zs, chunk],
            DevPtr::NULL,
        )
    }

    /// Scratch floats [`Gpu::attention_prompt`] needs per query of `keys`
    /// keys.
    pub fn prompt_attn_scratch_f32(nh: usize, hd: usize, keys: usize) -> usize {
        nh * keys.div_ceil(PA_SPLIT).max(1) * (2 + hd)
    }

    /// Scratch floats [`Gpu::attention`] needs for `keys` keys.
    pub fn attn_scratch_f32(nh: usize, hd: usize, keys: usize) -> usize {
        let ns = keys.div_ceil(ATT_CHUNK).max(1);
        nh * ns * (2 + hd)
    }
}
