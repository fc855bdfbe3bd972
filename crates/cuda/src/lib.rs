//! CUDA backend: decode kernels compiled at run time by NVRTC
//! (`kernels/decode.cu`), device buffers, and [`CudaModel`], the CUDA
//! implementation of the model's [`slipstream_models::Backend`] with dense
//! weights resident in VRAM and a per-layer VRAM expert cache.
//!
//! Nothing here links against CUDA: the driver and NVRTC are loaded
//! dynamically (cudarc `dynamic-loading`), so the crate builds and its tests
//! skip cleanly on machines without a GPU. Call [`available`] before
//! [`Gpu::new`].
//!
//! Device addresses are passed to kernels as `u64`; every buffer is a
//! [`DBuf`] whose size the wrappers check before a launch.

mod model;

pub use model::{CudaModel, CudaOptions, CudaStats, GdnForm, TensorCoreUse};

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUevent_flags, CUfunction};
use cudarc::driver::{
    result, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, PinnedHostSlice,
};
use slipstream_core::{QuantType, ScaleType, TensorView};
use slipstream_kernels::sample::{DrawParams, MAX_VOCAB};

/// The kernel source, compiled by NVRTC when a [`Gpu`] is created.
pub const KERNELS: &str = include_str!("kernels/decode.cu");

/// Errors of the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("NVRTC could not compile the kernels: {0}")]
    Compile(String),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, CudaError>;

/// Whether a CUDA driver, NVRTC and at least one device are present.
/// Never panics (the libraries are probed before any call into them).
pub fn available() -> bool {
    probe().is_ok()
}

/// Why CUDA is not usable here, or `Ok(device count)`.
pub fn probe() -> Result<usize> {
    // SAFETY: only tries to dlopen the libraries; no symbol is called.
    let (drv, rtc) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
        )
    };
    if !drv {
        return Err(CudaError::Unavailable(
            "no CUDA driver library (libcuda.so)".into(),
        ));
    }
    if !rtc {
        return Err(CudaError::Unavailable(
            "no NVRTC library (libnvrtc.so; add the CUDA toolkit's lib64 to LD_LIBRARY_PATH)"
                .into(),
        ));
    }
    let n = CudaContext::device_count()
        .map_err(|e| CudaError::Unavailable(format!("cuInit failed: {e}")))?;
    if n < 1 {
        return Err(CudaError::Unavailable("no CUDA device".into()));
    }
    Ok(n as usize)
}

/// Weight kinds the kernels know (`QT_*` in decode.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum QKind {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
    Affine4 = 3,
    Affine8 = 4,
    Q4_0 = 5,
    Q8_0 = 6,
    Q4K = 7,
    Q5K = 8,
    Q6K = 9,
}

/// A weight matrix as the kernels see it (`struct W` in decode.cu).
#[derive(Debug, Clone, Copy, Default)]
#[repr(C)]
pub struct WDesc {
    pub codes: u64,
    pub scales: u64,
    pub biases: u64,
    pub rows: i32,
    pub cols: i32,
    pub qt: i32,
    pub group: i32,
    pub scale_bf16: i32,
    pub pad: i32,
}

// SAFETY: plain repr(C) data matching `struct W` in decode.cu.
unsafe impl cudarc::driver::DeviceRepr for WDesc {}

impl WDesc {
    /// The descriptor of a `[rows, cols]` tensor of `qtype` stored at device
    /// address `base` (affine: codes, scales, biases back to back).
    pub fn new(qtype: QuantType, rows: usize, cols: usize, base: u64) -> Result<WDesc> {
        // GGML blocks (GGUF import): whole blocks per row, on the generic
        // kernels; `group` carries the block's elements.
        let ggml = |k: QKind| {
            let be = qtype.ggml_block().map_or(1, |(be, _)| be);
            if !cols.is_multiple_of(be) {
                return Err(CudaError::Invalid(format!(
                    "{} rows of {cols} values are not whole blocks of {be}",
                    qtype.name()
                )));
            }
            Ok((k, be, false, qtype.nbytes(rows, cols), 0))
        };
        let (qt, group, sbf, cb, sb) = match qtype {
            QuantType::F32 => (QKind::F32, 0, false, 0, 0),
            QuantType::F16 => (QKind::F16, 0, false, 0, 0),
            QuantType::Bf16 => (QKind::Bf16, 0, false, 0, 0),
            QuantType::Affine { bits, group, scale } => {
                let g = group as usize;
                if !cols.is_multiple_of(g) || !g.is_multiple_of(8) {
                    return Err(CudaError::Invalid(format!(
                        "affine group {g} does not divide row length {cols}"
                    )));
                }
                let k = match bits {
                    4 => QKind::Affine4,
                    8 => QKind::Affine8,
                    b => {
                        return Err(CudaError::Invalid(format!(
                            "{b}-bit weights are not supported"
                        )))
                    }
                };
                let cb = rows * cols * bits as usize / 8;
                let sb = rows * (cols / g) * 2;
                (k, g, scale == ScaleType::Bf16, cb, sb)
            }
            QuantType::Q4_0 => ggml(QKind::Q4_0)?,
            QuantType::Q8_0 => ggml(QKind::Q8_0)?,
            QuantType::Q4K => ggml(QKind::Q4K)?,
            QuantType::Q5K => ggml(QKind::Q5K)?,
            QuantType::Q6K => ggml(QKind::Q6K)?,
        };
        Ok(WDesc {
            codes: base,
            scales: base + cb as u64,
            biases: base + (cb + sb) as u64,
            rows: rows as i32,
            cols: cols as i32,
            qt: qt as i32,
            group: group as i32,
            scale_bf16: sbf as i32,
            pad: 0,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows as usize
    }

    /// For affine 4-bit weights: the words each lane loads per step in the
    /// multi-row kernels (4, 2 or 1: 16-byte loads where the group and the
    /// row length allow). `None` for other kinds.
    pub fn a4_words(&self) -> Option<i32> {
        if self.qt != QKind::Affine4 as i32 {
            return None;
        }
        let (g, c) = (self.group, self.cols);
        Some(if g % 32 == 0 && c / 32 >= 32 {
            4
        } else if g % 16 == 0 && c / 16 >= 32 {
            2
        } else {
            1
        })
    }
    pub fn cols(&self) -> usize {
        self.cols as usize
    }

    /// For affine 4-bit weights that the wide ("a4v") kernels take: the
    /// 16-byte chunks (32 codes, one scale) each lane owns per row, 1, 2 or
    /// 4. They need `group` a power of two >= 32 and `cols = 32 * S` with S a power of
    /// two up to 32 (one chunk per lane, 32 / S rows per warp step) or
    /// `S = 32 * C`; codes 16-byte aligned (checked for dense weights;
    /// expert parts sit at 256-byte offsets). `None`: the older kernels.
    pub fn a4v_chunks(&self) -> Option<usize> {
        if self.qt != QKind::Affine4 as i32
            || self.group % 32 != 0
            || !(self.group as u32).is_power_of_two()
            || self.cols % 32 != 0
        {
            return None;
        }
        let s = (self.cols / 32) as usize;
        match s {
            1..=31 if 32usize.is_multiple_of(s) => Some(1),
            32 | 64 | 128 => Some(s / 32),
            _ => None,
        }
    }

    /// Rows a 256-thread block of the wide kernels covers: 8 warps x
    /// (32 / lanes per row) x rows per lane (`r_lane`).
    fn a4v_block_rows(&self, r_lane: usize) -> usize {
        let s = self.cols() / 32;
        8 * (32 / s.min(32)) * r_lane
    }

    /// Dynamic shared memory of the wide kernels for `rows_x` x rows of
    /// `cols` floats, padded 4 floats per 32, then one sum per 32.
    fn a4v_smem(&self, rows_x: usize) -> u32 {
        (rows_x * self.cols() / 32 * 37 * 4) as u32
    }
}

/// A device allocation of `bytes` bytes at address `ptr`.
pub struct DBuf {
    _mem: CudaSlice<u8>,
    pub ptr: u64,
    pub bytes: usize,
}

impl DBuf {
    /// Address of f32 element `i`.
    pub fn f32_at(&self, i: usize) -> u64 {
        self.ptr + 4 * i as u64
    }
    /// Number of f32 values it holds.
    pub fn len_f32(&self) -> usize {
        self.bytes / 4
    }
}

/// Page-locked host memory (u32 words) that kernels write directly (mapped
/// into the device's address space): the routing decision's way back.
pub struct Mapped {
    _mem: PinnedHostSlice<u32>,
    /// Host address of word 0 (kept as an integer so the owner stays `Send`).
    host: usize,
    /// Device address of word 0.
    pub dev: u64,
    pub len: usize,
}

impl Mapped {
    /// Word `i`, read as the device may have written it (volatile).
    pub fn read(&self, i: usize) -> u32 {
        assert!(i < self.len);
        // SAFETY: `host` is the start of a live allocation of `len` u32
        // (owned by `_mem`); i < len. Volatile: the device writes it.
        unsafe { std::ptr::read_volatile((self.host as *const u32).add(i)) }
    }

    /// Polls word `i` until it holds `seq`. Every 1024 polls the stream is
    /// queried: an error on it is returned, and so is a stream that went
    /// idle without the word arriving (no kernel is left to write it).
    pub fn wait_for(&self, i: usize, seq: u32, stream: &CudaStream) -> Result<()> {
        let mut n = 0u64;
        loop {
            if self.read(i) == seq {
                std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
                return Ok(());
            }
            n += 1;
            if n.is_multiple_of(1024) {
                // SAFETY: a live stream of this context.
                let r = unsafe { cudarc::driver::sys::cuStreamQuery(stream.cu_stream()) };
                match r {
                    cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => {}
                    cudarc::driver::sys::CUresult::CUDA_SUCCESS => {
                        if self.read(i) == seq {
                            std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
                            return Ok(());
                        }
                        return Err(CudaError::Invalid(
                            "the routing decision never arrived from the device".into(),
                        ));
                    }
                    e => return Err(CudaError::Driver(cudarc::driver::DriverError(e))),
                }
            }
            std::hint::spin_loop();
        }
    }
}

/// Device routing for [`Gpu::router_topk`]: `addr` holds one u64 device
/// address per expert (its VRAM record); for token t's routed experts in
/// rank order r the kernel writes, with `p = t k + r` over `T` tokens,
/// `out[p] = addr[id] + offsets[0]`, `out[T k + p] = addr[id] + offsets[1]`,
/// `out[2 T k + p] = addr[id] + offsets[2]` (gate, up, down: the table
/// [`Gpu::moe_experts`] reads).
#[derive(Debug, Clone, Copy)]
pub struct RouteBases {
    pub addr: u64,
    pub offsets: [u64; 3],
    pub out: u64,
}

/// A weight uploaded to the device.
pub struct DWeight {
    pub buf: DBuf,
    pub desc: WDesc,
}

/// The compiled kernels.
struct Funcs {
    matvec: CudaFunction,
    matvec_a4: CudaFunction,
    /// Wide 4-bit kernels for 1, 2 and 4 chunks per lane.
    matvec_a4v: [CudaFunction; 3],
    /// The prefill form: each block over up to A4V_TOKENS_PER_BLOCK tokens.
    matvec_a4v_t: [CudaFunction; 3],
    matvec_a4v_multi: [CudaFunction; 3],
    moe_gate_up_a4v: [CudaFunction; 3],
    moe_gate_up_tc: CudaFunction,
    matvec_tc: CudaFunction,
    moe_down_tc: CudaFunction,
    /// Prefill on tensor cores: rows split into the staged form once per
    /// pass, then the dense and grouped gate/up products over many tokens.
    tc_split: CudaFunction,
    matvec_tc_t: CudaFunction,
    moe_gate_up_tc_grouped: CudaFunction,
    moe_down_tc_grouped: CudaFunction,
    moe_down_combine: CudaFunction,
    /// Prefill: pairs grouped by expert, gate/up over each group.
    group_pairs: CudaFunction,
    moe_gate_up_grouped: [CudaFunction; 3],
    moe_down_a4v: CudaFunction,
    /// Prefill: each block runs `DOWN_GROUPS` row blocks over its token.
    moe_down_a4v_t: CudaFunction,
    /// Gate/up and down of every routed expert in one launch.
    moe_fused_a4v: [CudaFunction; 3],
    moe_gate_up_a4: CudaFunction,
    moe_down_a4: CudaFunction,
    moe_gate_up: CudaFunction,
    moe_down: CudaFunction,
    rms_norm: CudaFunction,
    rope: CudaFunction,
    qk_prep: CudaFunction,
    attn_partial: CudaFunction,
    attn_combine: CudaFunction,
    attn_prompt_tc: CudaFunction,
    matvec_multi: CudaFunction,
    gdn_conv: CudaFunction,
    gdn_step: CudaFunction,
    gdn_step_r: CudaFunction,
    gdn_step_w: CudaFunction,
    router_topk: CudaFunction,
    argmax_part: CudaFunction,
    argmax_final: CudaFunction,
    samp_init: CudaFunction,
    samp_top: CudaFunction,
    samp_hist: CudaFunction,
    samp_select: CudaFunction,
    samp_tie: CudaFunction,
    samp_weights: CudaFunction,
    samp_part: CudaFunction,
    samp_draw: CudaFunction,
    embed_rows: CudaFunction,
    add_inplace: CudaFunction,
    bw_copy: CudaFunction,
    bw_read: CudaFunction,
    spin: CudaFunction,
    nop: CudaFunction,
}

/// Default register cap of the routed experts' wide kernels: blocks of 256
/// threads per SM (`MOE_MINB` in decode.cu; the standalone gate/up kernels
/// get one more with the split layout). With 3, 396 blocks of a launch are
/// resident at once on the H200's 132 SMs.
pub const MOE_MIN_BLOCKS: u32 = 3;

/// Tokens one block of the wide 4-bit matvec runs its rows over (the
/// weights are read once per this many tokens of a pass).
pub const A4V_TOKENS_PER_BLOCK: usize = 16;
/// Largest grid y of a launch.
const GRID_Y_MAX: usize = 65535;
/// Experts the down kernels stage at once (`DOWN_KB` in decode.cu).
const DOWN_KB: usize = 8;
/// Blocks of the argmax's first launch (passed to decode.cu as `ARGMAX_BLOCKS`).
const ARGMAX_BLOCKS: usize = 256;
/// Blocks of the seeded draw's wide launches; `samp_draw` runs one thread
/// per block (`SampleScratch::parts`).
const SAMPLE_BLOCKS: usize = 256;
/// Bytes of the draw's state (passed to decode.cu as `SAMP_STATE_BYTES`).
const SAMPLE_STATE_BYTES: usize = 4096;
/// Row blocks one prefill down block runs (`DOWN_GROUPS`).
const DOWN_GROUPS: usize = 8;
/// Tokens the prefill form stages and computes at once
/// (`A4V_TILE_TOKENS` in decode.cu).
const A4V_TILE_TOKENS: usize = 2;

/// Dynamic shared memory of the prefill kernels over rows of `cols`:
/// two buffers of A4V_TILE_TOKENS staged rows, each `a4v_region` floats
/// (the padded chunks and their sums, rounded to 16 bytes).
fn a4v_tiles_smem(cols: usize) -> usize {
    let region = (37 * (cols / 32) + 3) & !3;
    2 * A4V_TILE_TOKENS * region * 4
}

/// Keys per attention split (`ATT_CHUNK` in decode.cu).
pub const ATT_CHUNK: usize = 128;
/// Keys per split of the prompt attention (`PA_SPLIT` in decode.cu).
pub const PA_SPLIT: usize = 1024;
/// Rows (query, head) per block of the prompt attention (`PA_ROWS`).
const PA_ROWS: usize = 16;
/// Keys per step of the prompt attention (`PA_KEYS`).
const PA_KEYS: usize = 32;

/// The split attention's partials in `scratch` (query z's at z times its
/// stride): the splits' maxima `[nh, nsplit]`, sums `[nh, nsplit]`, then
/// unnormalised outputs `[nh, nsplit, hd]`, as addresses.
fn attn_partials(scratch: &DBuf, nh: usize, nsplit: usize) -> (u64, u64, u64) {
    (
        scratch.ptr,
        scratch.f32_at(nh * nsplit),
        scratch.f32_at(2 * nh * nsplit),
    )
}

/// The block ranges of a launch over up to four matrices (`MULTI_ARGS` in
/// decode.cu): matrix i's blocks of `block_rows` rows start at `bounds[i]`
/// (absent matrices get empty ranges at the end), `total` blocks in all;
/// the matrices and outputs padded to four with the last one.
fn multi_layout<'a>(
    ws: &[&'a WDesc],
    ys: &[u64],
    block_rows: usize,
) -> ([i32; 4], usize, [&'a WDesc; 4], [u64; 4]) {
    let mut bounds = [0i32; 4];
    let mut total = 0usize;
    for (i, w) in ws.iter().enumerate() {
        bounds[i] = total as i32;
        total += w.rows().div_ceil(block_rows);
    }
    for b in bounds.iter_mut().skip(ws.len()) {
        *b = total as i32;
    }
    let wd: [&WDesc; 4] = std::array::from_fn(|i| ws[i.min(ws.len() - 1)]);
    let yd: [u64; 4] = std::array::from_fn(|i| ys[i.min(ys.len() - 1)]);
    (bounds, total, wd, yd)
}

/// Dynamic shared memory of `attn_prompt_tc` for heads of `hd`: the
/// tile's queries, a block of keys and of values (padded rows), the
/// block's probabilities and the rows' rescale factors.
fn prompt_attn_smem(hd: usize) -> usize {
    4 * (PA_ROWS * (hd + 4)
        + PA_KEYS * (hd + 4)
        + PA_KEYS * (hd + 8)
        + PA_ROWS * (PA_KEYS + 4)
        + PA_ROWS)
}

/// Most query heads per KV head (`ATT_MAXG`).
pub const ATT_MAXG: usize = 16;

/// Where a decode kernel takes the token's position from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Position {
    /// An argument of the launch (the launch is for this position only).
    Host(usize),
    /// The i32 at device address `ptr`, read when the kernel runs, so a
    /// launch captured in a CUDA graph replays at every position below
    /// `cap` (the KV cache's rows; attention grids are sized for it).
    Device { ptr: u64, cap: usize },
}

/// One CUDA device with its compute stream, a copy stream and the kernels.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// Host-to-device expert copies run here, overlapped with compute.
    pub copy_stream: Arc<CudaStream>,
    f: Funcs,
    /// Device name and compute capability, for logs.
    pub name: String,
    pub sms: usize,
    /// Block tickets and counters of the fused experts kernel (3 u32, zero
    /// between launches; only launches on `stream` use them).
    fused_sync: DBuf,
    /// The argmax's per-block partials (`[2, ARGMAX_BLOCKS]` words).
    argmax_parts: DBuf,
    /// Whether [`Gpu::moe_experts`] may use the fused kernel.
    pub fused: bool,
    /// Whether the tensor-core kernels run where they apply (affine 4-bit,
    /// group 64). `CudaModel` sets it per pass (`TensorCoreUse`: the
    /// prompt's passes by default); [`Gpu::new`] leaves it off unless
    /// `SLIPSTREAM_CUDA_TC=1`.
    pub tensor_cores: bool,
    /// The GPU has the bf16 mma the tensor-core kernels use (sm_80+);
    /// without it they never run, whatever `tensor_cores` says.
    pub tc_capable: bool,
    /// The kernels were built with `A4V_SPLIT=1` (grid shapes follow it).
    split: bool,
    /// Kernels on `stream` launch with programmatic stream serialization
    /// (sm_90+): each may start while the previous one finishes, issuing
    /// its weight loads before it waits (`PDL_WAIT` in decode.cu). On by
    /// default where supported; `SLIPSTREAM_CUDA_PDL=0` turns it off. The
    /// results are the same bits either way.
    pub pdl: bool,
    /// Dynamic shared memory the one-token tensor-core kernels may take
    /// (48 KiB, or up to [`TC_SMEM_OPTIN`] where the GPU allows it); rows
    /// whose staged x needs more run the a4v kernels, at every pass length.
    tc_smem_max: usize,
    /// Dynamic shared memory the prefill kernels (`matvec_a4v_t_*`,
    /// `moe_gate_up_grouped_*`) may take; larger rows run the per-token
    /// kernels (same bits).
    tiles_smem_max: usize,
    /// Scratch of the tensor-core prefill forms: a pass's input rows in
    /// the staged form (`tc_split`), grown on demand.
    tc_split_buf: Mutex<Option<DBuf>>,
    /// Scratch of the grouped tensor-core down: each pair's outputs.
    tc_down_buf: Mutex<Option<DBuf>>,
    /// Tokens per mma of the tensor-core prefill forms (`TC_TPM`): 2 (the
    /// default) or 1 (`SLIPSTREAM_CUDA_TC_TPM=1`, the one-token kernels'
    /// B layout; the same bits where the mma's columns are independent).
    tc_tpm: usize,
    /// Whether [`Gpu::attention_prompt`] may run (`SLIPSTREAM_CUDA_TC_ATTN=0`
    /// turns it off, for measuring; the model then runs the prompt's
    /// attention on the decode kernels).
    pub prompt_attn_tc: bool,
    /// Dynamic shared memory `attn_prompt_tc` may take.
    attn_smem_max: usize,
    /// Heads up to 128 x 128 run `gdn_step_r` (state rows over 4 thread
    /// groups, block barriers in every dot product) instead of
    /// `gdn_step_w` (columns per warp, one barrier per token). Off at
    /// [`Gpu::new`]; `CudaModel::new` sets it from `SLIPSTREAM_CUDA_GDN`
    /// (`GdnForm`).
    pub gdn_rows: bool,
}

/// Packs kernel arguments (each a `&T: DeviceRepr` local) into the
/// pointer array `cuLaunchKernel` takes.
macro_rules! args {
    ($($a:expr),* $(,)?) => {
        [$(($a) as *const _ as *mut c_void),*]
    };
}

/// Compiles decode.cu with NVRTC for virtual architecture `arch` (e.g.
/// "compute_90") with the build-time constants [`Gpu::new`] passes: the
/// experts kernels' register cap (`min_blocks` blocks per SM), the split
/// layout, the tensor-core tokens per m-tile (1 or 2). Needs only NVRTC,
/// no driver or device (the CPU-only tests compile the kernels this way).
pub fn compile_kernels(
    arch: &'static str,
    min_blocks: u32,
    split: bool,
    tc_tpm: usize,
) -> Result<cudarc::nvrtc::Ptx> {
    // SAFETY: only probes whether the library can be loaded (cudarc
    // panics on a missing library otherwise).
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::Unavailable("NVRTC (libnvrtc) not found".into()));
    }
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        options: vec![
            "--std=c++17".into(),
            format!("-DMOE_MINB={}", min_blocks.clamp(1, 8)),
            format!("-DMOE_GU_MINB={}", (min_blocks + split as u32).clamp(1, 8)),
            format!("-DA4V_SPLIT={}", split as i32),
            format!("-DTC_TPM={tc_tpm}"),
            format!("-DARGMAX_BLOCKS={ARGMAX_BLOCKS}"),
            format!("-DSAMP_STATE_BYTES={SAMPLE_STATE_BYTES}"),
        ],
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(KERNELS, opts)
        .map_err(|e| CudaError::Compile(format!("{e:?}")))
}

/// Device memory of the seeded draw ([`Gpu::sample`]) over up to
/// `capacity` logits.
pub struct SampleScratch {
    /// The draw's state (`SampState` in decode.cu).
    state: DBuf,
    /// `[capacity]` u64 fixed-point weights.
    weights: DBuf,
    /// `[SAMPLE_BLOCKS]` u64 kept mass per block.
    parts: DBuf,
    capacity: usize,
}

impl Gpu {
    /// Opens device `ordinal` and compiles the kernels for it. The routed
    /// experts' wide kernels are capped to fit [`MOE_MIN_BLOCKS`] blocks per
    /// SM (`SLIPSTREAM_CUDA_MOE_MINB` overrides it); the fused experts
    /// kernel is off unless `SLIPSTREAM_CUDA_FUSED=1` (it measured slower
    /// than the two launches on the H200: see docs/BENCHMARKS.md).
    pub fn new(ordinal: usize) -> Result<Gpu> {
        let minb = std::env::var("SLIPSTREAM_CUDA_MOE_MINB")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(MOE_MIN_BLOCKS);
        let split = std::env::var("SLIPSTREAM_CUDA_A4V_SPLIT").map_or(true, |v| v != "0");
        let mut g = Gpu::build(ordinal, minb, split)?;
        g.fused = std::env::var("SLIPSTREAM_CUDA_FUSED").is_ok_and(|v| v == "1");
        g.tensor_cores = std::env::var("SLIPSTREAM_CUDA_TC").is_ok_and(|v| v == "1");
        g.pdl &= std::env::var("SLIPSTREAM_CUDA_PDL").map_or(true, |v| v != "0");
        Ok(g)
    }

    /// [`Gpu::new`] with the routed experts' kernels capped to fit
    /// `min_blocks` (1..=8) blocks of 256 threads per SM; fused kernel on.
    pub fn with_moe_min_blocks(ordinal: usize, min_blocks: u32) -> Result<Gpu> {
        Gpu::build(ordinal, min_blocks, true)
    }

    /// `split`: the warp-pair down kernel and half-height gate/up blocks
    /// (`A4V_SPLIT` in decode.cu; `SLIPSTREAM_CUDA_A4V_SPLIT=0` turns it
    /// off in [`Gpu::new`]).
    fn build(ordinal: usize, min_blocks: u32, split: bool) -> Result<Gpu> {
        probe()?;
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: we never rely on cudarc's per-slice event tracking: every
        // buffer is used on `stream` (or on `copy_stream` ordered by events
        // recorded explicitly), and buffers outlive the streams' work
        // because `Gpu::drop` order and explicit syncs guarantee it.
        unsafe { ctx.disable_event_tracking() };
        let (maj, min) = ctx.compute_capability()?;
        let arch: &'static str = match (maj, min) {
            (9, 0) => "compute_90",
            (8, 9) => "compute_89",
            (8, 6) => "compute_86",
            (8, 0) => "compute_80",
            (7, 5) => "compute_75",
            (10, 0) => "compute_100",
            (12, 0) => "compute_120",
            _ => "compute_75",
        };
        let tc_tpm = if std::env::var("SLIPSTREAM_CUDA_TC_TPM").is_ok_and(|v| v == "1") {
            1
        } else {
            2
        };
        let ptx = compile_kernels(arch, min_blocks, split, tc_tpm)?;
        let module = ctx.load_module(ptx)?;
        let lf = |n: &str| module.load_function(n);
        // The three chunk-per-lane forms `{base}_c1`, `_c2`, `_c4`.
        let lf3 = |base: &str| -> Result<[CudaFunction; 3]> {
            Ok([
                lf(&format!("{base}_c1"))?,
                lf(&format!("{base}_c2"))?,
                lf(&format!("{base}_c4"))?,
            ])
        };
        let f = Funcs {
            matvec: lf("matvec")?,
            matvec_a4: lf("matvec_a4")?,
            matvec_a4v: lf3("matvec_a4v")?,
            matvec_a4v_t: lf3("matvec_a4v_t")?,
            matvec_a4v_multi: lf3("matvec_a4v_multi")?,
            moe_gate_up_tc: lf("moe_gate_up_tc")?,
            matvec_tc: lf("matvec_tc")?,
            moe_down_tc: lf("moe_down_tc")?,
            tc_split: lf("tc_split")?,
            matvec_tc_t: lf("matvec_tc_t")?,
            moe_gate_up_tc_grouped: lf("moe_gate_up_tc_grouped")?,
            moe_down_tc_grouped: lf("moe_down_tc_grouped")?,
            moe_down_combine: lf("moe_down_combine")?,
            moe_gate_up_a4v: lf3("moe_gate_up_a4v")?,
            moe_down_a4v: lf("moe_down_a4v")?,
            moe_down_a4v_t: lf("moe_down_a4v_t")?,
            group_pairs: lf("group_pairs")?,
            moe_gate_up_grouped: lf3("moe_gate_up_grouped")?,
            moe_fused_a4v: lf3("moe_fused_a4v")?,
            moe_gate_up_a4: lf("moe_gate_up_a4")?,
            moe_down_a4: lf("moe_down_a4")?,
            moe_gate_up: lf("moe_gate_up")?,
            moe_down: lf("moe_down")?,
            rms_norm: lf("rms_norm")?,
            rope: lf("rope")?,
            qk_prep: lf("qk_prep")?,
            attn_partial: lf("attn_partial")?,
            attn_combine: lf("attn_combine")?,
            attn_prompt_tc: lf("attn_prompt_tc")?,
            matvec_multi: lf("matvec_multi")?,
            gdn_conv: lf("gdn_conv")?,
            gdn_step: lf("gdn_step")?,
            gdn_step_r: lf("gdn_step_r")?,
            gdn_step_w: lf("gdn_step_w")?,
            router_topk: lf("router_topk")?,
            argmax_part: lf("argmax_part")?,
            argmax_final: lf("argmax_final")?,
            samp_init: lf("samp_init")?,
            samp_top: lf("samp_top")?,
            samp_hist: lf("samp_hist")?,
            samp_select: lf("samp_select")?,
            samp_tie: lf("samp_tie")?,
            samp_weights: lf("samp_weights")?,
            samp_part: lf("samp_part")?,
            samp_draw: lf("samp_draw")?,
            embed_rows: lf("embed_rows")?,
            add_inplace: lf("add_inplace")?,
            bw_copy: lf("bw_copy")?,
            bw_read: lf("bw_read")?,
            spin: lf("spin")?,
            nop: lf("nop")?,
        };
        let stream = ctx.new_stream()?;
        let copy_stream = ctx.new_stream()?;
        let name = format!("{} (sm_{maj}{min})", ctx.name()?);
        let sms = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as usize;
        let fused_sync = alloc_on(&stream, 16)?;
        let argmax_parts = alloc_on(&stream, 2 * ARGMAX_BLOCKS * 4)?;
        // The prefill kernels double-buffer their staged x (up to 74 KiB
        // for 4096 columns): allow them past the default 48 KiB where the
        // GPU can.
        let optin = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )
        .map_or(48 * 1024, |v| v.max(0) as usize);
        let tiles_smem_max = optin.min(a4v_tiles_smem(4096));
        for func in f.matvec_a4v_t.iter().chain(&f.moe_gate_up_grouped) {
            func.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                tiles_smem_max as i32,
            )?;
        }
        // The one-token tensor-core kernels stage x for 4096-column rows
        // (the 35B model's output projections) in 53 KiB.
        let tc_smem_max = optin.clamp(48 * 1024, TC_SMEM_OPTIN);
        for func in [&f.matvec_tc, &f.moe_gate_up_tc, &f.moe_down_tc] {
            func.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                tc_smem_max as i32,
            )?;
        }
        // The prompt attention holds a tile's queries and a block of keys
        // and values: 84 KiB for 256-dimension heads.
        let attn_smem_max = optin.clamp(48 * 1024, prompt_attn_smem(256));
        f.attn_prompt_tc.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            attn_smem_max as i32,
        )?;
        let prompt_attn_tc = std::env::var("SLIPSTREAM_CUDA_TC_ATTN").map_or(true, |v| v != "0");
        Ok(Gpu {
            ctx,
            stream,
            copy_stream,
            f,
            name,
            sms,
            fused_sync,
            argmax_parts,
            fused: true,
            tensor_cores: false,
            tc_capable: maj >= 8,
            split,
            pdl: maj >= 9,
            tiles_smem_max,
            tc_smem_max,
            tc_split_buf: Mutex::new(None),
            tc_down_buf: Mutex::new(None),
            tc_tpm,
            prompt_attn_tc,
            attn_smem_max,
            gdn_rows: false,
        })
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        Ok(self.ctx.mem_get_info()?)
    }

    /// A zeroed device buffer of `bytes` bytes (at least 16).
    pub fn alloc(&self, bytes: usize) -> Result<DBuf> {
        alloc_on(&self.stream, bytes)
    }

    /// `len` zeroed words of page-locked host memory that kernels can write
    /// ([`Mapped`]).
    pub fn alloc_mapped(&self, len: usize) -> Result<Mapped> {
        use cudarc::driver::sys;
        // SAFETY: a fresh page-locked allocation, mapped for the device
        // (DEVICEMAP) and cached on the host (not write-combined: the host
        // reads it); only touched through `Mapped`.
        let mut mem = unsafe {
            self.ctx.alloc_pinned_with_flags::<u32>(
                len.max(1),
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )?
        };
        let host = mem.as_mut_ptr()?;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `host` is the start of the allocation above; `dev` is a
        // valid out pointer.
        unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut dev, host as *mut c_void, 0).result()?;
            for i in 0..len.max(1) {
                std::ptr::write_volatile(host.add(i), 0);
            }
        }
        Ok(Mapped {
            _mem: mem,
            host: host as usize,
            dev,
            len: len.max(1),
        })
    }

    /// A device buffer holding `data`.
    pub fn upload(&self, data: &[u8]) -> Result<DBuf> {
        let b = self.alloc(data.len())?;
        self.write(&b, 0, data)?;
        Ok(b)
    }

    /// A device buffer holding `data` (f32).
    pub fn upload_f32(&self, data: &[f32]) -> Result<DBuf> {
        self.upload(bytemuck_f32(data))
    }

    /// Copies `data` to `b` at byte `offset` (ordered on the compute stream;
    /// returns when the copy is done, since `data` is pageable).
    pub fn write(&self, b: &DBuf, offset: usize, data: &[u8]) -> Result<()> {
        if offset + data.len() > b.bytes {
            return Err(CudaError::Invalid(
                "write past the end of a device buffer".into(),
            ));
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: the destination range lies inside `b` (checked above);
        // the stream is synchronised before `data` can go away.
        unsafe {
            result::memcpy_htod_async(b.ptr + offset as u64, data, self.stream.cu_stream())?;
        }
        self.stream.synchronize()?;
        Ok(())
    }

    /// Copies `src` (f32) into `b` from element 0.
    pub fn write_f32(&self, b: &DBuf, src: &[f32]) -> Result<()> {
        self.write(b, 0, bytemuck_f32(src))
    }

    /// Reads `n` f32 values of `b` from element `at` (synchronises).
    pub fn read_f32(&self, b: &DBuf, at: usize, n: usize) -> Result<Vec<f32>> {
        if (at + n) * 4 > b.bytes {
            return Err(CudaError::Invalid(
                "read past the end of a device buffer".into(),
            ));
        }
        let mut out = vec![0.0f32; n];
        self.ctx.bind_to_thread()?;
        // SAFETY: the source range lies inside `b`; `out` lives until the
        // stream is synchronised below.
        unsafe {
            result::memcpy_dtoh_async(&mut out[..], b.f32_at(at), self.stream.cu_stream())?;
        }
        self.stream.synchronize()?;
        Ok(out)
    }

    /// Reads `n` i32 values of `b` (synchronises).
    pub fn read_i32(&self, b: &DBuf, n: usize) -> Result<Vec<i32>> {
        Ok(self
            .read_f32(b, 0, n)?
            .into_iter()
            .map(|v| v.to_bits() as i32)
            .collect())
    }

    /// Uploads a weight tensor in its stored layout.
    pub fn upload_weight(&self, w: &TensorView) -> Result<DWeight> {
        let buf = self.upload(w.data)?;
        let desc = WDesc::new(w.qtype, w.rows, w.cols, buf.ptr)?;
        Ok(DWeight { buf, desc })
    }

    pub fn sync(&self) -> Result<()> {
        self.stream.synchronize()?;
        Ok(())
    }

    /// An event recorded on the compute stream now (timing enabled).
    pub fn mark(&self) -> Result<CudaEvent> {
        Ok(self
            .stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
    }

    fn go(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        self.go_on(&self.stream, f, grid, block, args)
    }

    /// [`Gpu::go`] with `smem` bytes of dynamic shared memory (within 48
    /// KiB, or the limit set on `f` at [`Gpu::new`]).
    fn go_smem(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        self.launch(&self.stream, f, grid, block, smem, args)
    }

    fn go_on(
        &self,
        s: &CudaStream,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        self.launch(s, f, grid, block, 0, args)
    }

    /// Launches `f` on `s`; on the compute stream with [`Gpu::pdl`] set, as
    /// a programmatic dependent launch.
    fn launch(
        &self,
        s: &CudaStream,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        use cudarc::driver::sys;
        let cf: CUfunction = f.cu_function();
        if !(self.pdl && std::ptr::eq(s, &*self.stream)) {
            // SAFETY: `cf` is a function of the module we loaded; the
            // callers checked every buffer size the kernel reads or writes
            // and size `smem` within the default 48 KiB or the limit set on
            // `f`.
            unsafe {
                result::launch_kernel(cf, grid, (block, 1, 1), smem, s.cu_stream(), args)?;
            }
            return Ok(());
        }
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: s.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: as above; `cfg` and `attr` outlive the call, and every
        // kernel waits (`PDL_WAIT`) before it touches memory another kernel
        // writes, which is what the attribute requires.
        unsafe {
            sys::cuLaunchKernelEx(&cfg, cf, args.as_mut_ptr(), std::ptr::null_mut()).result()?;
        }
        Ok(())
    }

    /// `y[t, :] = W x[t, :]` for `n` tokens; `x` holds `n * cols` f32 at
    /// address `x`, `y` `n * rows`.
    pub fn matvec(&self, w: &WDesc, x: u64, y: u64, n: usize) -> Result<()> {
        if self.matvec_on_tensor_cores(w) {
            if n == 1 {
                return self.matvec_tc(&[w], x, &[y]);
            }
            let split = self.tc_split(x, w.cols(), n)?;
            return self.matvec_tc_pass(w, x, split, y, n);
        }
        if let (Some(c), true) = (w.a4v_chunks(), w.codes.is_multiple_of(16)) {
            // Rows per lane: 8 / c (8 16-byte loads in flight per lane).
            let blocks = w.rows().div_ceil(w.a4v_block_rows(8 / c)) as u32;
            let form = c.trailing_zeros() as usize;
            if n == 1
                || blocks as usize > GRID_Y_MAX
                || a4v_tiles_smem(w.cols()) > self.tiles_smem_max
            {
                // The one-token form, grid y = token (also where the
                // prefill form's grid, row blocks in y, would not fit:
                // same bits).
                let f = &self.f.matvec_a4v[form];
                let grid = (blocks, n as u32, 1);
                return self.go_smem(f, grid, 256, w.a4v_smem(1), &mut args!(w, &x, &y));
            }
            // Each block runs its rows over up to A4V_TOKENS_PER_BLOCK
            // tokens; grid (token blocks, row blocks).
            let tpb = A4V_TOKENS_PER_BLOCK;
            let grid = (n.div_ceil(tpb) as u32, blocks, 1);
            let (n_i, tpb_i) = (n as i32, tpb as i32);
            let f = &self.f.matvec_a4v_t[form];
            return self.go_smem(
                f,
                grid,
                256,
                a4v_tiles_smem(w.cols()) as u32,
                &mut args!(w, &x, &y, &n_i, &tpb_i),
            );
        }
        if let Some(nw) = w.a4_words() {
            let grid = (w.rows().div_ceil(16) as u32, n as u32, 1);
            return self.go(&self.f.matvec_a4, grid, 128, &mut args!(w, &x, &y, &nw));
        }
        let grid = (w.rows().div_ceil(8) as u32, n as u32, 1);
        self.go(&self.f.matvec, grid, 256, &mut args!(w, &x, &y))
    }

    /// Whether [`Gpu::matvec`] runs `w` on the generic `matvec` kernel
    /// (the 8-bit and float kinds; 4-bit rows it cannot take wide).
    fn matvec_generic(&self, w: &WDesc) -> bool {
        let wide = w.a4v_chunks().is_some() && w.codes.is_multiple_of(16);
        !self.matvec_on_tensor_cores(w) && !wide && w.a4_words().is_none()
    }

    /// Two to four matrices of the generic kernel over the same `n` rows
    /// of x in one `matvec_multi` launch (each block the bits of its own
    /// [`Gpu::matvec`] launch).
    fn matvec_generic_many(&self, ws: &[&WDesc], x: u64, ys: &[u64], n: usize) -> Result<()> {
        let (bounds, total, wd, yd) = multi_layout(ws, ys, 8);
        self.go(
            &self.f.matvec_multi,
            (total as u32, n as u32, 1),
            256,
            &mut args!(
                wd[0], wd[1], wd[2], wd[3], &bounds[1], &bounds[2], &bounds[3], &x, &yd[0], &yd[1],
                &yd[2], &yd[3]
            ),
        )
    }

    /// `ys[i][t] = ws[i] x[t]` for `n` tokens, each output the bits of its
    /// own [`Gpu::matvec`] launch. In one launch: up to four matrices of the
    /// same column count on the generic kernel (8-bit, float), or one
    /// token's on the tensor cores or in the wide 4-bit layout; a longer
    /// pass's tensor-core matrices share one split of x; otherwise one
    /// [`Gpu::matvec`] launch per matrix.
    pub fn matvec_many(&self, ws: &[&WDesc], x: u64, ys: &[u64], n: usize) -> Result<()> {
        if ws.len() != ys.len() {
            return Err(CudaError::Invalid(
                "matvec_many: one output per matrix".into(),
            ));
        }
        let cols = ws.first().map_or(0, |w| w.cols());
        if (2..=4).contains(&ws.len())
            && ws
                .iter()
                .all(|w| self.matvec_generic(w) && w.cols() == cols)
        {
            return self.matvec_generic_many(ws, x, ys, n);
        }
        if n != 1 {
            // Matrices of the same columns on tensor cores share one split
            // of x (the same bits as a split per matrix).
            if ws.len() > 1
                && ws
                    .iter()
                    .all(|w| self.matvec_on_tensor_cores(w) && w.cols() == cols)
            {
                let split = self.tc_split(x, cols, n)?;
                for (w, &y) in ws.iter().zip(ys) {
                    self.matvec_tc_pass(w, x, split, y, n)?;
                }
                return Ok(());
            }
            for (w, &y) in ws.iter().zip(ys) {
                self.matvec(w, x, y, n)?;
            }
            return Ok(());
        }
        if (1..=4).contains(&ws.len())
            && ws
                .iter()
                .all(|w| self.matvec_on_tensor_cores(w) && w.cols() == ws[0].cols())
        {
            return self.matvec_tc(ws, x, ys);
        }
        let chunks = ws.first().and_then(|w| w.a4v_chunks());
        let fused = ws.len() >= 2
            && ws.len() <= 4
            && ws.iter().all(|w| {
                w.a4v_chunks() == chunks && w.codes.is_multiple_of(16) && w.cols() == ws[0].cols()
            });
        let Some(c) = chunks.filter(|_| fused) else {
            for (w, &y) in ws.iter().zip(ys) {
                self.matvec(w, x, y, 1)?;
            }
            return Ok(());
        };
        let brows = ws[0].a4v_block_rows(8 / c);
        // Block boundaries b1..b3; absent matrices get empty ranges.
        let (bounds, total, wd, yd) = multi_layout(ws, ys, brows);
        let f = &self.f.matvec_a4v_multi[c.trailing_zeros() as usize];
        self.go_smem(
            f,
            (total as u32, 1, 1),
            256,
            ws[0].a4v_smem(1),
            &mut args!(
                wd[0], wd[1], wd[2], wd[3], &bounds[1], &bounds[2], &bounds[3], &x, &yd[0], &yd[1],
                &yd[2], &yd[3]
            ),
        )
    }

    /// `y[t, :] = W x[t, :]` for `n` > 1 tokens on the tensor-core prefill
    /// form, x (at `x`) already split by [`Gpu::tc_split`] into `split`;
    /// each token the bits of its one-token `matvec_tc` launch (which runs
    /// the pass token by token where the grid would not fit).
    fn matvec_tc_pass(&self, w: &WDesc, x: u64, split: (u64, u64), y: u64, n: usize) -> Result<()> {
        let (xs, gs) = split;
        let grid = (
            n.div_ceil(TC_TOKENS) as u32,
            w.rows().div_ceil(32) as u32,
            1,
        );
        if grid.1 as usize <= GRID_Y_MAX {
            let n_i = n as i32;
            return self.go_smem(
                &self.f.matvec_tc_t,
                grid,
                256,
                self.tc_t_smem() as u32,
                &mut args!(w, &xs, &gs, &y, &n_i),
            );
        }
        for t in 0..n {
            let (xt, yt) = (x + (4 * t * w.cols()) as u64, y + (4 * t * w.rows()) as u64);
            self.matvec_tc(&[w], xt, &[yt])?;
        }
        Ok(())
    }

    /// Whether [`Gpu::matvec`] runs `w` (one token) on the tensor-core
    /// kernel: `tensor_cores` on, affine 4-bit with groups of 64, rows a
    /// multiple of 256 columns, staged x within 48 KiB of shared memory.
    pub fn matvec_on_tensor_cores(&self, w: &WDesc) -> bool {
        self.tensor_cores
            && self.tc_capable
            && w.qt == QKind::Affine4 as i32
            && w.group == 64
            && w.cols().is_multiple_of(256)
            && tc_smem_quarters(w.cols()) <= self.tc_smem_max
            && w.codes.is_multiple_of(8)
    }

    /// Dynamic shared memory of the tensor-core prefill forms: their
    /// column quarters' sums per mma set (`[TC_TOKENS / tpm][2][4][32][4]`
    /// f32).
    fn tc_t_smem(&self) -> usize {
        TC_TOKENS / self.tc_tpm * TC_QUARTER_SUMS
    }

    /// The address of `slot`'s scratch buffer, grown to at least `bytes`
    /// (a larger one first waits for the stream, so no queued kernel still
    /// uses the old one). Valid until the next call on this slot.
    fn scratch(&self, slot: &Mutex<Option<DBuf>>, bytes: usize) -> Result<u64> {
        let mut buf = slot
            .lock()
            .map_err(|_| CudaError::Invalid("scratch buffer lock poisoned".into()))?;
        if buf.as_ref().is_none_or(|b| b.bytes < bytes) {
            self.stream.synchronize()?;
            *buf = None;
            *buf = Some(self.alloc(bytes)?);
        }
        Ok(buf.as_ref().map_or(0, |b| b.ptr))
    }

    /// Splits `n` rows of `cols` f32 at `x` (cols a multiple of 64) into
    /// the tensor-core kernels' staged form in this GPU's scratch: returns
    /// the addresses of the bf16 parts (`[n][cols / 64][48]` u32 pairs) and
    /// of the group sums (`[n][cols / 64]` f32). The scratch stays valid
    /// until the next call on this stream (a larger one first waits for
    /// the stream, then reallocates).
    fn tc_split(&self, x: u64, cols: usize, n: usize) -> Result<(u64, u64)> {
        let ng = cols / 64;
        let (parts, sums) = (n * ng * 48 * 8, n * ng * 4);
        // At least a full pass of the widest rows the kernels take.
        let b = self.scratch(
            &self.tc_split_buf,
            (parts + sums).max(256 * 2048 / 64 * (48 * 8 + 4)),
        )?;
        let (cols_i, grid) = (cols as i32, (ng.div_ceil(8) as u32, n as u32, 1));
        let gs = b + parts as u64;
        self.go(
            &self.f.tc_split,
            grid,
            256,
            &mut args!(&x, &cols_i, &b, &gs),
        )?;
        Ok((b, gs))
    }

    /// One launch of `matvec_tc` over up to 4 matrices of the same columns
    /// (each checked by [`Gpu::matvec_on_tensor_cores`]).
    fn matvec_tc(&self, ws: &[&WDesc], x: u64, ys: &[u64]) -> Result<()> {
        let (bounds, total, wd, yd) = multi_layout(ws, ys, 32);
        let smem = tc_smem_quarters(ws[0].cols()) as u32;
        self.go_smem(
            &self.f.matvec_tc,
            (total as u32, 1, 1),
            256,
            smem,
            &mut args!(
                wd[0], wd[1], wd[2], wd[3], &bounds[1], &bounds[2], &bounds[3], &x, &yd[0], &yd[1],
                &yd[2], &yd[3]
            ),
        )
    }

    /// Routed experts' gate/up for `pairs` pairs; `gbase`/`ubase` hold
    /// `pairs` u64 part addresses, `xrow` `pairs` i32 token rows of `x`;
    /// `h` receives `[pairs, I]`.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up(
        &self,
        gt: &WDesc,
        ut: &WDesc,
        gbase: u64,
        ubase: u64,
        xrow: u64,
        x: u64,
        h: u64,
        pairs: usize,
    ) -> Result<()> {
        if let Some(c) = gt.a4v_chunks().filter(|_| same_layout(gt, ut)) {
            // Rows per lane: 2 / c, at least 1 (gate and up: 4 loads in
            // flight per lane; 8 for c = 4); 4 / c without the split.
            let r_lane = if self.split { (2 / c).max(1) } else { 4 / c };
            let grid = (
                gt.rows().div_ceil(gt.a4v_block_rows(r_lane)) as u32,
                pairs as u32,
                1,
            );
            let f = &self.f.moe_gate_up_a4v[c.trailing_zeros() as usize];
            return self.go_smem(
                f,
                grid,
                256,
                gt.a4v_smem(1),
                &mut args!(gt, ut, &gbase, &ubase, &xrow, &x, &h),
            );
        }
        if let (Some(nw), Some(_)) = (gt.a4_words(), ut.a4_words()) {
            let grid = (gt.rows().div_ceil(16) as u32, pairs as u32, 1);
            return self.go(
                &self.f.moe_gate_up_a4,
                grid,
                128,
                &mut args!(gt, ut, &gbase, &ubase, &xrow, &x, &h, &nw),
            );
        }
        let grid = (gt.rows().div_ceil(8) as u32, pairs as u32, 1);
        self.go(
            &self.f.moe_gate_up,
            grid,
            256,
            &mut args!(gt, ut, &gbase, &ubase, &xrow, &x, &h),
        )
    }

    /// `x[t] += sum_k wts[t,k] down_{t,k} h[t*K+k] + sigmoid(sg[t]) shared[t]`
    /// for `tokens` tokens (`shared == 0`: no shared expert).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_down(
        &self,
        dt: &WDesc,
        dbase: u64,
        h: u64,
        wts: u64,
        k: usize,
        shared: u64,
        sg: u64,
        x: u64,
        tokens: usize,
    ) -> Result<()> {
        let k = k as i32;
        if dt.a4v_chunks() == Some(1) {
            // One chunk per lane, experts staged 8 at a time (`DOWN_KB`),
            // each warp pair splitting them 4 + 4: half the rows per block.
            // Grid (tokens, row blocks).
            let blocks = dt
                .rows()
                .div_ceil(dt.a4v_block_rows(1) / (1 + self.split as usize));
            if blocks > GRID_Y_MAX {
                return Err(CudaError::Invalid(format!(
                    "down projection of {} rows is beyond one launch",
                    dt.rows()
                )));
            }
            if tokens > 1 && k as usize <= DOWN_KB {
                // A pass of several tokens: each block stages its token's h
                // once for DOWN_GROUPS row blocks (same bits).
                let nb = blocks as i32;
                let grid = (tokens as u32, blocks.div_ceil(DOWN_GROUPS) as u32, 1);
                return self.go_smem(
                    &self.f.moe_down_a4v_t,
                    grid,
                    256,
                    dt.a4v_smem(8),
                    &mut args!(dt, &dbase, &h, &wts, &k, &shared, &sg, &x, &nb),
                );
            }
            let grid = (tokens as u32, blocks as u32, 1);
            return self.go_smem(
                &self.f.moe_down_a4v,
                grid,
                256,
                dt.a4v_smem(8),
                &mut args!(dt, &dbase, &h, &wts, &k, &shared, &sg, &x),
            );
        }
        if let Some(nw) = dt.a4_words() {
            let grid = (dt.rows().div_ceil(16) as u32, tokens as u32, 1);
            return self.go(
                &self.f.moe_down_a4,
                grid,
                128,
                &mut args!(dt, &dbase, &h, &wts, &k, &shared, &sg, &x, &nw),
            );
        }
        let grid = (dt.rows().div_ceil(8) as u32, tokens as u32, 1);
        self.go(
            &self.f.moe_down,
            grid,
            256,
            &mut args!(dt, &dbase, &h, &wts, &k, &shared, &sg, &x),
        )
    }

    /// All routed experts of `tokens` tokens with `k` experts each:
    /// [`Gpu::moe_gate_up`] for the `tokens * k` pairs, then
    /// [`Gpu::moe_down`] into `x`. Where the wide 4-bit kernels take both
    /// shapes (and [`Gpu::fused`] is set) this is one launch of the fused
    /// kernel, whose numbers are bit-identical to the two launches; `h`
    /// holds `[tokens * k, I]` either way.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_experts(
        &self,
        parts: [&WDesc; 3],
        bases: [u64; 3],
        xrow: u64,
        xn: u64,
        h: u64,
        wts: u64,
        k: usize,
        shared: (u64, u64),
        x: u64,
        tokens: usize,
    ) -> Result<()> {
        let [gt, ut, dt] = parts;
        let pairs = tokens * k;
        if let (true, Some(c), Some(1)) = (
            self.fused && same_layout(gt, ut),
            gt.a4v_chunks(),
            dt.a4v_chunks(),
        ) {
            let ga = gt.rows().div_ceil(gt.a4v_block_rows(4 / c)) as i32;
            let gb = dt
                .rows()
                .div_ceil(dt.a4v_block_rows(1) / (1 + self.split as usize))
                as i32;
            let smem = gt.a4v_smem(1).max(dt.a4v_smem(8));
            let grid = (ga as u32 * pairs as u32 + gb as u32 * tokens as u32, 1, 1);
            let (ki, pi, ti) = (k as i32, pairs as i32, tokens as i32);
            let f = &self.f.moe_fused_a4v[c.trailing_zeros() as usize];
            let sync = self.fused_sync.ptr;
            return self.go_smem(
                f,
                grid,
                256,
                smem,
                &mut args!(
                    gt, ut, dt, &bases[0], &bases[1], &bases[2], &xrow, &xn, &h, &wts, &ki,
                    &shared.0, &shared.1, &x, &ga, &pi, &gb, &ti, &sync
                ),
            );
        }
        if self.tensor_cores && self.experts_on_tensor_cores(parts, k) {
            let smem_gu = tc_smem_quarters(gt.cols()) as u32;
            let grid = (gt.rows().div_ceil(16) as u32, pairs as u32, 1);
            self.go_smem(
                &self.f.moe_gate_up_tc,
                grid,
                256,
                smem_gu,
                &mut args!(gt, ut, &bases[0], &bases[1], &xrow, &xn, &h),
            )?;
            return self.moe_down_tc(dt, bases[2], h, wts, k, shared, x, tokens);
        }
        self.moe_gate_up(gt, ut, bases[0], bases[1], xrow, xn, h, pairs)?;
        self.moe_down(dt, bases[2], h, wts, k, shared.0, shared.1, x, tokens)
    }

    /// [`Gpu::moe_experts`] for a pass of `tokens` tokens whose routing is
    /// on the device (prefill), with each expert's gate/up rows loaded once
    /// per pass: the pairs are grouped by expert (`ids` `[tokens, k]`
    /// expert ids into `grp_off` `[e + 1]` and `grp_list` `[tokens k]` i32)
    /// and each group runs its expert (record at `addr[id]`, parts at
    /// `offsets`) over its pairs; the down projections as in
    /// [`Gpu::moe_experts`], over the bases table at `dbase`. Every pair
    /// and token gets the operations of [`Gpu::moe_experts`] (same bits).
    /// Returns false (nothing launched) where the shapes or settings call
    /// for another kernel: then [`Gpu::moe_experts`] runs the pass.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_experts_grouped(
        &self,
        parts: [&WDesc; 3],
        route: &RouteBases,
        ids: u64,
        e: usize,
        grp: (&DBuf, &DBuf),
        xrow: u64,
        xn: u64,
        h: u64,
        wts: u64,
        k: usize,
        shared: (u64, u64),
        x: u64,
        tokens: usize,
    ) -> Result<bool> {
        let [gt, ut, dt] = parts;
        let pairs = tokens * k;
        let fused = self.fused && same_layout(gt, ut) && dt.a4v_chunks() == Some(1);
        let tc = self.tensor_cores && self.experts_on_tensor_cores(parts, k);
        let Some(c) = gt.a4v_chunks().filter(|_| same_layout(gt, ut)) else {
            return Ok(false);
        };
        let tiles_fit = a4v_tiles_smem(gt.cols()) <= self.tiles_smem_max;
        if fused || e > 1024 || !(tc || tiles_fit) {
            return Ok(false);
        }
        let (off, list) = grp;
        if off.len_f32() < e + 1 || list.len_f32() < pairs {
            return Err(CudaError::Invalid("expert group buffers too small".into()));
        }
        let (p_i, e_i) = (pairs as i32, e as i32);
        self.go(
            &self.f.group_pairs,
            (1, 1, 1),
            1024,
            &mut args!(&ids, &p_i, &e_i, &off.ptr, &list.ptr),
        )?;
        let (o0, o1) = (route.offsets[0], route.offsets[1]);
        let dbase = route.out + 16 * pairs as u64;
        if tc {
            // Each pair's h the bits of its moe_gate_up_tc block, each
            // token's down sum the bits of its moe_down_tc block.
            let (xs, gs) = self.tc_split(xn, gt.cols(), tokens)?;
            let grid = (gt.rows().div_ceil(16) as u32, e as u32, 1);
            self.go_smem(
                &self.f.moe_gate_up_tc_grouped,
                grid,
                256,
                self.tc_t_smem() as u32,
                &mut args!(
                    gt,
                    ut,
                    &route.addr,
                    &o0,
                    &o1,
                    &off.ptr,
                    &list.ptr,
                    &xrow,
                    &xs,
                    &gs,
                    &h
                ),
            )?;
            let (hs, hg) = self.tc_split(h, dt.cols(), pairs)?;
            let hd = dt.rows();
            let v = self.scratch(&self.tc_down_buf, pairs * hd * 4)?;
            let o2 = route.offsets[2];
            self.go(
                &self.f.moe_down_tc_grouped,
                (hd.div_ceil(128) as u32, e as u32, 1),
                256,
                &mut args!(dt, &route.addr, &o2, &off.ptr, &list.ptr, &hs, &hg, &v),
            )?;
            let (h_i, k_i) = (hd as i32, k as i32);
            return self
                .go(
                    &self.f.moe_down_combine,
                    (hd.div_ceil(256) as u32, tokens as u32, 1),
                    256,
                    &mut args!(&v, &h_i, &wts, &k_i, &shared.0, &shared.1, &x),
                )
                .map(|()| true);
        }
        let r_lane = if self.split { (2 / c).max(1) } else { 4 / c };
        let grid = (
            gt.rows().div_ceil(gt.a4v_block_rows(r_lane)) as u32,
            e as u32,
            1,
        );
        self.go_smem(
            &self.f.moe_gate_up_grouped[c.trailing_zeros() as usize],
            grid,
            256,
            a4v_tiles_smem(gt.cols()) as u32,
            &mut args!(
                gt,
                ut,
                &route.addr,
                &o0,
                &o1,
                &off.ptr,
                &list.ptr,
                &xrow,
                &xn,
                &h
            ),
        )?;
        self.moe_down(dt, dbase, h, wts, k, shared.0, shared.1, x, tokens)?;
        Ok(true)
    }

    /// `moe_down_tc` over `tokens` tokens (bases at `dbase`, `[tokens, k]`).
    #[allow(clippy::too_many_arguments)]
    fn moe_down_tc(
        &self,
        dt: &WDesc,
        dbase: u64,
        h: u64,
        wts: u64,
        k: usize,
        shared: (u64, u64),
        x: u64,
        tokens: usize,
    ) -> Result<()> {
        let smem_d = tc_smem_ranks(dt.cols()) as u32;
        let grid = (dt.rows().div_ceil(16) as u32, tokens as u32, 1);
        let ki = k as i32;
        self.go_smem(
            &self.f.moe_down_tc,
            grid,
            256,
            smem_d,
            &mut args!(dt, &dbase, &h, &wts, &ki, &shared.0, &shared.1, &x),
        )
    }

    /// Whether [`Gpu::moe_experts`] runs these parts (gate, up, down) with
    /// `k` ranks on the tensor-core kernels (when `tensor_cores` is on and
    /// the fused kernel is off): affine 4-bit with groups of 64, gate/up
    /// rows a multiple of 256 columns, at most 8 ranks, and the staged
    /// inputs within 48 KiB of shared memory.
    pub fn experts_on_tensor_cores(&self, parts: [&WDesc; 3], k: usize) -> bool {
        let [gt, ut, dt] = parts;
        let a4g64 = |w: &WDesc| w.qt == QKind::Affine4 as i32 && w.group == 64;
        self.tc_capable
            && same_layout(gt, ut)
            && a4g64(gt)
            && a4g64(dt)
            && gt.scale_bf16 == dt.scale_bf16
            && gt.cols().is_multiple_of(256)
            && tc_smem_quarters(gt.cols()) <= self.tc_smem_max
            && dt.cols().is_multiple_of(64)
            && (1..=8).contains(&k)
            && tc_smem_ranks(dt.cols()) <= self.tc_smem_max
            && dt.cols() == gt.rows()
    }

    /// RMS norm of `rows` rows of `dim` values.
    pub fn rms_norm(
        &self,
        x: u64,
        w: u64,
        out: u64,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        self.add_rms_norm(x, 0, w, out, rows, dim, eps)
    }

    /// [`Gpu::add`] of `add` (`[rows, dim]`; 0 for none) into `x`, then
    /// [`Gpu::rms_norm`] of the sum, in one launch with the same bits.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm(
        &self,
        x: u64,
        add: u64,
        w: u64,
        out: u64,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        let dim = dim as i32;
        self.go(
            &self.f.rms_norm,
            (rows as u32, 1, 1),
            256,
            &mut args!(&x, &w, &out, &dim, &eps, &add),
        )
    }

    /// RoPE in place on `heads` rows of `hd` values at `pos`.
    pub fn rope(
        &self,
        v: u64,
        inv_freq: u64,
        half: usize,
        hd: usize,
        heads: usize,
        pos: usize,
    ) -> Result<()> {
        let (half, hd, pos) = (half as i32, hd as i32, pos as i32);
        self.go(
            &self.f.rope,
            (heads as u32, 1, 1),
            128,
            &mut args!(&v, &inv_freq, &half, &hd, &pos),
        )
    }

    /// q/k norm + RoPE + gate split + KV append for `n` tokens at `pos0`.
    #[allow(clippy::too_many_arguments)]
    pub fn qk_prep(
        &self,
        q_all: u64,
        k_all: u64,
        v_all: u64,
        qn: u64,
        kn: u64,
        inv_freq: u64,
        half: usize,
        dims: (usize, usize, usize),
        gated: bool,
        eps: f32,
        pos0: Position,
        n: usize,
        q_out: u64,
        gate_out: u64,
        kcache: u64,
        vcache: u64,
    ) -> Result<()> {
        let (nh, nkv, hd) = dims;
        let q_stride = if gated { 2 * hd } else { hd } as i32;
        let (pos0, dpos) = match pos0 {
            Position::Host(p) => (p as i32, 0u64),
            Position::Device { ptr, .. } if n == 1 => (0, ptr),
            Position::Device { .. } => {
                return Err(CudaError::Invalid(
                    "qk_prep reads a device position for one token only".into(),
                ))
            }
        };
        let (half, nh_i, nkv_i, hd_i) = (half as i32, nh as i32, nkv as i32, hd as i32);
        let gate_out = if gated { gate_out } else { 0 };
        self.go(
            &self.f.qk_prep,
            ((nh + nkv) as u32, n as u32, 1),
            256,
            &mut args!(
                &q_all, &k_all, &v_all, &qn, &kn, &inv_freq, &half, &nh_i, &nkv_i, &hd_i,
                &q_stride, &eps, &pos0, &q_out, &gate_out, &kcache, &vcache, &dpos
            ),
        )
    }

    /// Decode attention of the token at position `at` over the `at + 1`
    /// cached positions: `q` `[nh, hd]`, caches `[keys, nkv*hd]`, `out`
    /// `[nh, hd]`; `scratch` holds at least [`Gpu::attn_scratch_f32`]
    /// floats for `at + 1` keys (for the capacity with
    /// [`Position::Device`]); `gate` 0 for none. Both forms of `at` give
    /// the same bits.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        q: u64,
        kc: u64,
        vc: u64,
        at: Position,
        dims: (usize, usize, usize),
        gate: u64,
        scratch: &DBuf,
        out: u64,
    ) -> Result<()> {
        self.attention_causal(q, kc, vc, at, 1, dims, gate, scratch, out)
    }

    /// [`Gpu::attention`] of `n` queries in one launch pair: query t (`q`,
    /// `gate`, `out` `[n, nh, hd]`) sits at position `at + t` and sees the
    /// keys up to its own position (the pass's keys are in the caches
    /// already). `scratch` holds `n` times [`Gpu::attn_scratch_f32`] for
    /// the last query's keys. Each query gets the bits of its own
    /// one-query launch. [`Position::Device`] takes one query only.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_causal(
        &self,
        q: u64,
        kc: u64,
        vc: u64,
        at: Position,
        n: usize,
        dims: (usize, usize, usize),
        gate: u64,
        scratch: &DBuf,
        out: u64,
    ) -> Result<()> {
        let (nh, nkv, hd) = dims;
        if nh / nkv > ATT_MAXG || hd > 256 || !nh.is_multiple_of(nkv) || n == 0 {
            return Err(CudaError::Invalid(format!(
                "attention of {n} queries with {nh} heads over {nkv} KV heads of {hd} is outside the kernel's limits"
            )));
        }
        // `keys` (the first query's) and `last` (the last query's) size the
        // grid and scratch: the real counts, or the capacity when the
        // kernels read the count from device memory.
        let (keys, dpos) = match at {
            Position::Host(p) => (p + 1, 0u64),
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
        let chunk = ATT_CHUNK as i32;
        self.go(
            &self.f.attn_partial,
            (nkv as u32, nsplit as u32, n as u32),
            256,
            &mut args!(
                &q, &kc, &vc, &keys_i, &nh_i, &nkv_i, &hd_i, &scale, &ns_i, &pm, &pl, &pacc, &dpos,
                &zs
            ),
        )?;
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
    #[allow(clippy::too_many_arguments)]
    pub fn attention_prompt(
        &self,
        q: u64,
        kc: u64,
        vc: u64,
        pos0: usize,
        n: usize,
        dims: (usize, usize, usize),
        gate: u64,
        scratch: &DBuf,
        out: u64,
    ) -> Result<()> {
        let (nh, nkv, hd) = dims;
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
                &q, &kc, &vc, &pos0_i, &n_i, &nh_i, &nkv_i, &hd_i, &scale, &pm, &pl, &pacc, &zs
            ),
        )?;
        let (dpos, chunk, ns_i) = (0u64, PA_SPLIT as i32, nsplit as i32);
        self.go(
            &self.f.attn_combine,
            (nh as u32, 1, n as u32),
            256,
            &mut args!(&pm, &pl, &pacc, &ns_i, &hd_i, &gate, &out, &dpos, &keys_i, &zs, &chunk),
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

    /// Causal conv + SiLU over `n` tokens of `c` channels (kernel `k` <= 8).
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_conv(
        &self,
        x: u64,
        n: usize,
        cw: u64,
        c: usize,
        k: usize,
        state: u64,
        out: u64,
    ) -> Result<()> {
        if !(1..=8).contains(&k) {
            return Err(CudaError::Invalid(format!(
                "conv kernel {k} is outside 1..=8"
            )));
        }
        let (n, ci, ki) = (n as i32, c as i32, k as i32);
        self.go(
            &self.f.gdn_conv,
            (c.div_ceil(256) as u32, 1, 1),
            256,
            &mut args!(&x, &n, &cw, &ci, &ki, &state, &out),
        )
    }

    /// The Gated DeltaNet recurrence over `n` tokens, all value heads.
    /// `dims` = (nk, dk, nv, dv); dk, dv <= 256.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_step(
        &self,
        conv_out: u64,
        z: u64,
        b: u64,
        a: u64,
        a_log: u64,
        dt_bias: u64,
        norm: u64,
        state: u64,
        n: usize,
        dims: (usize, usize, usize, usize),
        eps: f32,
        core: u64,
    ) -> Result<()> {
        let (nk, dk, nv, dv) = dims;
        if dk > 256 || dv > 256 || nk == 0 || !nv.is_multiple_of(nk) {
            return Err(CudaError::Invalid(format!(
                "gated delta rule with heads {nk}x{dk} / {nv}x{dv} is outside the kernel's limits"
            )));
        }
        // Heads up to 128 x 128: a register-resident form (512 threads).
        let (f, threads) = if dk <= 128 && dv <= 128 {
            if self.gdn_rows {
                (&self.f.gdn_step_r, 512)
            } else {
                (&self.f.gdn_step_w, 512)
            }
        } else {
            (&self.f.gdn_step, 128)
        };
        let (n, nk, dk, nv, dv) = (n as i32, nk as i32, dk as i32, nv as i32, dv as i32);
        self.go(
            f,
            (nv as u32, 1, 1),
            threads,
            &mut args!(
                &conv_out, &z, &b, &a, &a_log, &dt_bias, &norm, &state, &n, &nk, &dk, &nv, &dv,
                &eps, &core
            ),
        )
    }

    /// Router softmax + top-k for `tokens` rows of `e` logits (e <= 1024,
    /// k <= 64): `ids`/`wts` receive `[tokens, k]`. With `publish` =
    /// (a [`Mapped`] buffer of at least 2k + 1 words, seq), token 0's ids and
    /// weights are also written there, then `seq` in word 2k
    /// ([`Mapped::wait_for`]). With `bases`, every token's experts' bases
    /// table is written on the device too ([`RouteBases`]), so the routed
    /// experts can run without the host.
    #[allow(clippy::too_many_arguments)]
    pub fn router_topk(
        &self,
        logits: u64,
        e: usize,
        k: usize,
        renorm: bool,
        ids: u64,
        wts: u64,
        tokens: usize,
        publish: Option<(&Mapped, u32)>,
        bases: Option<&RouteBases>,
    ) -> Result<()> {
        if e > 1024 || k > 64 || k > e {
            return Err(CudaError::Invalid(format!(
                "router with {e} experts, top {k} is outside the kernel's limits"
            )));
        }
        let (pubp, seq) = match publish {
            Some((m, seq)) if m.len > 2 * k => (m.dev, seq),
            Some(_) => return Err(CudaError::Invalid("publish buffer too small".into())),
            None => (0u64, 0u32),
        };
        let none = RouteBases {
            addr: 0,
            offsets: [0; 3],
            out: 0,
        };
        let b = bases.unwrap_or(&none);
        let (e, k, r) = (e as i32, k as i32, renorm as i32);
        let (o0, o1, o2) = (b.offsets[0], b.offsets[1], b.offsets[2]);
        self.go(
            &self.f.router_topk,
            (tokens as u32, 1, 1),
            32,
            &mut args!(
                &logits, &e, &k, &r, &ids, &wts, &pubp, &seq, &b.addr, &o0, &o1, &o2, &b.out
            ),
        )
    }

    /// Index of the largest of `n` values into the i32 at `out` (ties to
    /// the lowest index, NaN never wins, `n - 1` when all are NaN): 256
    /// blocks over contiguous chunks, then one block over their results.
    pub fn argmax(&self, x: u64, n: usize, out: u64) -> Result<()> {
        let n = n as i32;
        let parts = self.argmax_parts.ptr;
        self.go(
            &self.f.argmax_part,
            (ARGMAX_BLOCKS as u32, 1, 1),
            256,
            &mut args!(&x, &n, &parts),
        )?;
        self.go(
            &self.f.argmax_final,
            (1, 1, 1),
            ARGMAX_BLOCKS as u32,
            &mut args!(&parts, &n, &out),
        )
    }

    /// Scratch memory for [`Gpu::sample`] over up to `capacity` logits
    /// (at most `slipstream_kernels::sample::MAX_VOCAB`, the largest
    /// vocabulary the draw's u64 sums hold).
    pub fn sample_scratch(&self, capacity: usize) -> Result<SampleScratch> {
        if capacity > MAX_VOCAB {
            return Err(CudaError::Invalid(format!(
                "a draw over {capacity} logits (the device draw holds up to {MAX_VOCAB})"
            )));
        }
        Ok(SampleScratch {
            state: self.alloc(SAMPLE_STATE_BYTES)?,
            weights: self.alloc(capacity * 8)?,
            parts: self.alloc(SAMPLE_BLOCKS * 8)?,
            capacity,
        })
    }

    /// The seeded draw over `n` logits at `x` into the i32 at `out`, which
    /// must already hold the argmax (kept when no logit is finite): the
    /// token `slipstream_kernels::sample::draw` picks for the same logits,
    /// settings and `u` in `[0, 1)`. No host synchronisation; 6 to 24
    /// launches (each cut four digit passes, only when it is set).
    pub fn sample(
        &self,
        x: u64,
        n: usize,
        p: &DrawParams,
        u: f64,
        scratch: &SampleScratch,
        out: u64,
    ) -> Result<()> {
        let DrawParams {
            temperature,
            top_k,
            top_p,
            min_p,
        } = *p;
        if n > scratch.capacity || n == 0 {
            return Err(CudaError::Invalid(format!(
                "a draw over {n} logits with scratch for {}",
                scratch.capacity
            )));
        }
        let (st, wt, parts) = (scratch.state.ptr, scratch.weights.ptr, scratch.parts.ptr);
        let ni = n as i32;
        let wide = ((SAMPLE_BLOCKS as u32, 1, 1), 256);
        self.go(&self.f.samp_init, (1, 1, 1), 256, &mut args!(&st))?;
        self.go(&self.f.samp_top, wide.0, wide.1, &mut args!(&x, &ni, &st))?;
        let cut = |m: i32| -> Result<()> {
            for d in 0..4i32 {
                self.go(
                    &self.f.samp_hist,
                    wide.0,
                    wide.1,
                    &mut args!(&x, &ni, &wt, &st, &m, &d, &top_k, &top_p),
                )?;
                self.go(
                    &self.f.samp_select,
                    (1, 1, 1),
                    256,
                    &mut args!(&st, &m, &d, &top_k, &top_p),
                )?;
            }
            self.go(
                &self.f.samp_tie,
                (1, 1, 1),
                1024,
                &mut args!(&x, &ni, &wt, &st, &m),
            )
        };
        if top_k > 0 {
            cut(0)?;
        }
        self.go(
            &self.f.samp_weights,
            wide.0,
            wide.1,
            &mut args!(&x, &ni, &wt, &st, &temperature, &min_p),
        )?;
        if top_p < 1.0 {
            cut(1)?;
        }
        self.go(
            &self.f.samp_part,
            wide.0,
            wide.1,
            &mut args!(&x, &ni, &wt, &st, &parts),
        )?;
        self.go(
            &self.f.samp_draw,
            (1, 1, 1),
            SAMPLE_BLOCKS as u32,
            &mut args!(&x, &ni, &wt, &st, &parts, &u, &out),
        )
    }

    /// Rows `ids[t]` (i32 at `ids`) of `w` into `out[t]`, `tokens` rows.
    pub fn embed_rows(&self, w: &WDesc, ids: u64, out: u64, tokens: usize) -> Result<()> {
        self.go(
            &self.f.embed_rows,
            (w.cols().div_ceil(256) as u32, tokens as u32, 1),
            256,
            &mut args!(w, &ids, &out),
        )
    }

    /// `x += y` over `n` f32.
    pub fn add(&self, x: u64, y: u64, n: usize) -> Result<()> {
        let ni = n as i32;
        self.go(
            &self.f.add_inplace,
            (n.div_ceil(256) as u32, 1, 1),
            256,
            &mut args!(&x, &y, &ni),
        )
    }

    /// Copies `bytes` (a multiple of 16) from `src` to `dst` with a kernel.
    pub fn bw_copy(&self, src: u64, dst: u64, bytes: usize) -> Result<()> {
        let n = (bytes / 16) as u64;
        self.go(
            &self.f.bw_copy,
            (self.sms as u32 * 8, 1, 1),
            512,
            &mut args!(&src, &dst, &n),
        )
    }

    /// Reads `bytes` (a multiple of 16) at `src` with a kernel.
    pub fn bw_read(&self, src: u64, bytes: usize, sink: u64) -> Result<()> {
        let n = (bytes / 16) as u64;
        self.go(
            &self.f.bw_read,
            (self.sms as u32 * 8, 1, 1),
            512,
            &mut args!(&src, &n, &sink),
        )
    }

    /// An empty one-thread kernel (launch-cost probe).
    pub fn nop(&self) -> Result<()> {
        self.go(&self.f.nop, (1, 1, 1), 32, &mut [])
    }

    /// (registers per thread, blocks of 256 threads per SM) of the routed
    /// experts' wide kernels, for the bench's report.
    pub fn kernel_report(&self) -> Vec<(&'static str, i32, u32)> {
        use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS;
        let mut v = Vec::new();
        for (n, f, smem) in [
            ("moe_gate_up_a4v_c2", &self.f.moe_gate_up_a4v[1], 9472),
            ("moe_down_a4v", &self.f.moe_down_a4v, 18944),
            ("moe_fused_a4v_c2", &self.f.moe_fused_a4v[1], 18944),
            ("matvec_a4v_c2", &self.f.matvec_a4v[1], 9472),
        ] {
            let regs = f.get_attribute(CU_FUNC_ATTRIBUTE_NUM_REGS).unwrap_or(-1);
            let occ = f
                .occupancy_max_active_blocks_per_multiprocessor(256, smem, None)
                .unwrap_or(0);
            v.push((n, regs, occ));
        }
        v
    }

    /// A one-thread kernel spinning `cycles` clocks on `s`.
    pub fn spin_on(&self, s: &CudaStream, cycles: i64) -> Result<()> {
        self.go_on(s, &self.f.spin, (1, 1, 1), 32, &mut args!(&cycles))
    }
}

/// A zeroed device buffer of `bytes` bytes (at least 16) allocated on `stream`.
fn alloc_on(stream: &Arc<CudaStream>, bytes: usize) -> Result<DBuf> {
    let n = bytes.max(16).div_ceil(256) * 256;
    let mem = stream.alloc_zeros::<u8>(n)?;
    let ptr = {
        let (p, _guard) = cudarc::driver::DevicePtr::device_ptr(&mem, stream);
        p
    };
    Ok(DBuf {
        _mem: mem,
        ptr,
        bytes,
    })
}

/// Shared memory the one-token tensor-core kernels may take where the GPU
/// allows more than the default 48 KiB: their staged x for rows of 8192
/// columns (`tc_smem_quarters(8192)`).
const TC_SMEM_OPTIN: usize = 8 * (8192 / 4 / 64) * (48 * 8 + 4) + TC_QUARTER_SUMS;
/// Bytes of `moe_gate_up_tc`'s / `matvec_tc`'s column-quarter sums
/// (`[2 tiles][4 quarters][32 lanes][4]` f32).
const TC_QUARTER_SUMS: usize = 2 * 4 * 32 * 4 * 4;
/// Tokens of a tensor-core prefill block (`TC_TOKENS` in decode.cu).
const TC_TOKENS: usize = 8;
/// Bytes of `moe_down_tc`'s per-rank row sums (`[8 ranks][16 rows]` f32).
const TC_RANK_SUMS: usize = 8 * 16 * 4;

/// Dynamic shared memory of a tensor-core kernel whose 8 warps each stage
/// `cols` values: per group of 64, 48 bf16-pair entries (384 bytes) and
/// the group's sum (4 bytes), then `sums` bytes of partial sums.
fn tc_smem(cols: usize, sums: usize) -> usize {
    8 * (cols / 64) * (48 * 8 + 4) + sums
}

/// Shared memory of `moe_gate_up_tc` / `matvec_tc` over rows of `cols`:
/// each warp stages its quarter of the columns.
fn tc_smem_quarters(cols: usize) -> usize {
    tc_smem(cols / 4, TC_QUARTER_SUMS)
}

/// Shared memory of `moe_down_tc` over rows of `cols`: each warp stages
/// its rank's whole input row.
fn tc_smem_ranks(cols: usize) -> usize {
    tc_smem(cols, TC_RANK_SUMS)
}

/// Whether two weight templates have the same shape and quantisation (the
/// wide gate/up kernel reads both with one layout).
fn same_layout(a: &WDesc, b: &WDesc) -> bool {
    (a.rows, a.cols, a.qt, a.group, a.scale_bf16) == (b.rows, b.cols, b.qt, b.group, b.scale_bf16)
}

/// The bytes of an f32 slice (little-endian host).
pub fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding or invalid bit patterns; u8 alignment is 1.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

#[cfg(test)]
mod tests {
    use super::{QKind, WDesc};
    use slipstream_core::QuantType;

    #[test]
    fn ggml_descriptors_take_whole_blocks_only() {
        let w = WDesc::new(QuantType::Q4K, 3, 512, 1000).unwrap();
        assert_eq!(
            (w.qt, w.group, w.rows(), w.cols()),
            (QKind::Q4K as i32, 256, 3, 512)
        );
        assert_eq!(w.codes, 1000);
        let q = WDesc::new(QuantType::Q4_0, 2, 64, 0).unwrap();
        assert_eq!((q.qt, q.group), (QKind::Q4_0 as i32, 32));
        for (t, cols) in [
            (QuantType::Q4K, 100usize),
            (QuantType::Q6K, 128),
            (QuantType::Q8_0, 48),
        ] {
            assert!(
                WDesc::new(t, 1, cols, 0).is_err(),
                "{} of {cols} columns",
                t.name()
            );
        }
    }
}
