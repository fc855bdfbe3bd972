//! The device: context, compute and copy streams, the compiled kernels
//! ([`Funcs`]), allocation, host <-> device copies and kernel launches.
//! The op families' launch wrappers are in `ops/`.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUevent_flags, CUfunction};
use cudarc::driver::{
    result, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, PinnedHostSlice,
};
use slipstream_core::TensorView;

use crate::ops::attention::prompt_attn_smem;
use crate::ops::matvec::{a4v_tiles_smem, TC_SMEM_OPTIN};
use crate::ops::sample::{ARGMAX_BLOCKS, SAMPLE_STATE_BYTES};
use crate::{CudaError, CudaTuning, DevPtr, Result, WDesc, KERNELS};

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

/// A device allocation of `bytes` bytes at address `ptr`.
pub struct DBuf {
    _mem: CudaSlice<u8>,
    pub ptr: DevPtr,
    pub bytes: usize,
}

impl DBuf {
    /// Address of f32 element `i`.
    pub fn f32_at(&self, i: usize) -> DevPtr {
        self.ptr.add_f32(i)
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
    pub dev: DevPtr,
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

/// A weight uploaded to the device.
pub struct DWeight {
    pub buf: DBuf,
    pub desc: WDesc,
}

/// The compiled kernels.
pub(crate) struct Funcs {
    pub(crate) matvec: CudaFunction,
    pub(crate) matvec_a4: CudaFunction,
    /// Wide 4-bit kernels for 1, 2 and 4 chunks per lane.
    pub(crate) matvec_a4v: [CudaFunction; 3],
    /// The prefill form: each block over up to A4V_TOKENS_PER_BLOCK tokens.
    pub(crate) matvec_a4v_t: [CudaFunction; 3],
    pub(crate) matvec_a4v_multi: [CudaFunction; 3],
    pub(crate) moe_gate_up_a4v: [CudaFunction; 3],
    pub(crate) moe_gate_up_tc: CudaFunction,
    pub(crate) matvec_tc: CudaFunction,
    pub(crate) moe_down_tc: CudaFunction,
    /// Prefill on tensor cores: rows split into the staged form once per
    /// pass, then the dense and grouped gate/up products over many tokens.
    pub(crate) tc_split: CudaFunction,
    pub(crate) matvec_tc_t: CudaFunction,
    pub(crate) moe_gate_up_tc_grouped: CudaFunction,
    pub(crate) moe_down_tc_grouped: CudaFunction,
    pub(crate) moe_down_combine: CudaFunction,
    /// The prompt in 8-bit integers (prompt_q8.cu): rows quantized per
    /// group, then the dense, grouped and per-pair products on int8 mma.
    pub(crate) q8_split: CudaFunction,
    pub(crate) matvec_q8_t: CudaFunction,
    pub(crate) moe_gate_up_q8_grouped: CudaFunction,
    pub(crate) moe_gate_up_q8_pairs: CudaFunction,
    pub(crate) moe_down_q8_grouped: CudaFunction,
    pub(crate) moe_down_q8_pairs: CudaFunction,
    /// Prefill: pairs grouped by expert, gate/up over each group.
    pub(crate) group_pairs: CudaFunction,
    pub(crate) moe_gate_up_grouped: [CudaFunction; 3],
    pub(crate) moe_down_a4v: CudaFunction,
    /// Prefill: each block runs `DOWN_GROUPS` row blocks over its token.
    pub(crate) moe_down_a4v_t: CudaFunction,
    /// Gate/up and down of every routed expert in one launch.
    pub(crate) moe_fused_a4v: [CudaFunction; 3],
    pub(crate) moe_gate_up_a4: CudaFunction,
    pub(crate) moe_down_a4: CudaFunction,
    pub(crate) moe_gate_up: CudaFunction,
    pub(crate) moe_down: CudaFunction,
    pub(crate) rms_norm: CudaFunction,
    pub(crate) rope: CudaFunction,
    pub(crate) qk_prep: CudaFunction,
    pub(crate) attn_partial: CudaFunction,
    pub(crate) attn_combine: CudaFunction,
    pub(crate) attn_prompt_tc: CudaFunction,
    pub(crate) matvec_multi: CudaFunction,
    pub(crate) gdn_conv: CudaFunction,
    pub(crate) gdn_step: CudaFunction,
    pub(crate) gdn_step_r: CudaFunction,
    pub(crate) gdn_step_w: CudaFunction,
    pub(crate) router_topk: CudaFunction,
    pub(crate) argmax_part: CudaFunction,
    pub(crate) argmax_final: CudaFunction,
    pub(crate) samp_init: CudaFunction,
    pub(crate) samp_top: CudaFunction,
    pub(crate) samp_hist: CudaFunction,
    pub(crate) samp_select: CudaFunction,
    pub(crate) samp_tie: CudaFunction,
    pub(crate) samp_weights: CudaFunction,
    pub(crate) samp_part: CudaFunction,
    pub(crate) samp_draw: CudaFunction,
    pub(crate) embed_rows: CudaFunction,
    pub(crate) add_inplace: CudaFunction,
    pub(crate) bw_copy: CudaFunction,
    pub(crate) bw_read: CudaFunction,
    pub(crate) spin: CudaFunction,
    pub(crate) nop: CudaFunction,
}

/// Default register cap of the routed experts' wide kernels: blocks of 256
/// threads per SM (`MOE_MINB` in moe_a4v.cu; the standalone gate/up kernels
/// get one more with the split layout). With 3, 396 blocks of a launch are
/// resident at once on the H200's 132 SMs.
pub const MOE_MIN_BLOCKS: u32 = 3;

/// One CUDA device with its compute stream, a copy stream and the kernels.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// Host-to-device expert copies run here, overlapped with compute.
    pub copy_stream: Arc<CudaStream>,
    pub(crate) f: Funcs,
    /// Device name and compute capability, for logs.
    pub name: String,
    pub sms: usize,
    /// Block tickets and counters of the fused experts kernel (3 u32, zero
    /// between launches; only launches on `stream` use them).
    pub(crate) fused_sync: DBuf,
    /// The argmax's per-block partials (`[2, ARGMAX_BLOCKS]` words).
    pub(crate) argmax_parts: DBuf,
    /// Whether [`Gpu::moe_experts`] may use the fused kernel.
    pub fused: bool,
    /// Whether the tensor-core kernels run where they apply (affine 4-bit,
    /// group 64). `CudaModel` sets it per pass (`TensorCoreUse`: the
    /// prompt's passes by default); [`Gpu::new`] sets it from
    /// [`CudaTuning::gpu_tensor_cores`] (off by default).
    pub tensor_cores: bool,
    /// Whether the 4-bit products this pass runs on tensor cores take the
    /// 8-bit integer forms ([`crate::PromptPrecision::Int8`]; `CudaModel` sets it
    /// for the prompt's passes): x quantized per group of 64, the weights
    /// as stored. Needs `tc_capable`.
    pub prompt_int8: bool,
    /// The GPU has the bf16 mma the tensor-core kernels use (sm_80+);
    /// without it they never run, whatever `tensor_cores` says.
    pub tc_capable: bool,
    /// The kernels were built with `A4V_SPLIT=1` (grid shapes follow it).
    pub(crate) split: bool,
    /// Kernels on `stream` launch with programmatic stream serialization
    /// (sm_90+): each may start while the previous one finishes, issuing
    /// its weight loads before it waits (`PDL_WAIT` in common.cuh). On by
    /// default where supported; [`CudaTuning::pdl`] off turns it off. The
    /// results are the same bits either way.
    pub pdl: bool,
    /// Dynamic shared memory the one-token tensor-core kernels may take
    /// (48 KiB, or up to [`TC_SMEM_OPTIN`] where the GPU allows it); rows
    /// whose staged x needs more run the a4v kernels, at every pass length.
    pub(crate) tc_smem_max: usize,
    /// Dynamic shared memory the prefill kernels (`matvec_a4v_t_*`,
    /// `moe_gate_up_grouped_*`) may take; larger rows run the per-token
    /// kernels (same bits).
    pub(crate) tiles_smem_max: usize,
    /// Scratch of the tensor-core prefill forms: a pass's input rows in
    /// the staged form (`tc_split`), grown on demand.
    pub(crate) tc_split_buf: Mutex<Option<DBuf>>,
    /// Scratch of the grouped tensor-core down: each pair's outputs.
    pub(crate) tc_down_buf: Mutex<Option<DBuf>>,
    /// Scratch of the 8-bit prompt forms: a pass's rows quantized
    /// (`q8_split`), grown on demand; each split is read only by the
    /// launches queued after it and before the next.
    pub(crate) q8_split_buf: Mutex<Option<DBuf>>,
    /// Tokens per mma of the tensor-core prefill forms (`TC_TPM`): 2 (the
    /// default) or 1 ([`CudaTuning::tc_tokens_per_mma`], the one-token
    /// kernels' B layout; the same bits where the mma's columns are
    /// independent).
    pub(crate) tc_tpm: usize,
    /// Whether [`Gpu::attention_prompt`] may run
    /// ([`CudaTuning::prompt_attn_tc`]; off for measuring: the model then
    /// runs the prompt's attention on the decode kernels).
    pub prompt_attn_tc: bool,
    /// Dynamic shared memory `attn_prompt_tc` may take.
    pub(crate) attn_smem_max: usize,
    /// Heads up to 128 x 128 run `gdn_step_r` (state rows over 4 thread
    /// groups, block barriers in every dot product) instead of
    /// `gdn_step_w` (columns per warp, one barrier per token). Off at
    /// [`Gpu::new`]; `CudaModel::new` sets it from
    /// [`CudaTuning::gdn_form`].
    pub gdn_rows: bool,
}

/// Compiles [`KERNELS`] with NVRTC for virtual architecture `arch` (e.g.
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

impl Gpu {
    /// Opens device `ordinal` and compiles the kernels for it with
    /// `tuning`'s register cap ([`CudaTuning::moe_min_blocks`]), split
    /// layout and tensor-core tokens per mma; the fused experts kernel,
    /// the tensor cores and programmatic dependent launch as `tuning` says.
    pub fn new(ordinal: usize, tuning: &CudaTuning) -> Result<Gpu> {
        let mut g = Gpu::build(ordinal, tuning)?;
        g.fused = tuning.fused_experts;
        g.tensor_cores = tuning.gpu_tensor_cores;
        g.pdl &= tuning.pdl;
        Ok(g)
    }

    /// [`Gpu::new`] with the routed experts' kernels capped to fit
    /// `min_blocks` (1..=8) blocks of 256 threads per SM and the split
    /// layout; fused kernel on, tensor cores off, `tuning`'s tensor-core
    /// tokens per mma and prompt attention.
    pub fn with_moe_min_blocks(
        ordinal: usize,
        min_blocks: u32,
        tuning: &CudaTuning,
    ) -> Result<Gpu> {
        let tuning = CudaTuning {
            moe_min_blocks: min_blocks,
            a4v_split: true,
            ..tuning.clone()
        };
        Gpu::build(ordinal, &tuning)
    }

    /// Opens the device and compiles the kernels with `tuning`'s
    /// build-time constants; the launch switches at their defaults (fused
    /// kernel on, tensor cores off, programmatic launch where supported).
    fn build(ordinal: usize, tuning: &CudaTuning) -> Result<Gpu> {
        let (min_blocks, split) = (tuning.moe_min_blocks, tuning.a4v_split);
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
        let tc_tpm = if tuning.tc_tokens_per_mma == 1 { 1 } else { 2 };
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
            q8_split: lf("q8_split")?,
            matvec_q8_t: lf("matvec_q8_t")?,
            moe_gate_up_q8_grouped: lf("moe_gate_up_q8_grouped")?,
            moe_gate_up_q8_pairs: lf("moe_gate_up_q8_pairs")?,
            moe_down_q8_grouped: lf("moe_down_q8_grouped")?,
            moe_down_q8_pairs: lf("moe_down_q8_pairs")?,
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
            prompt_int8: false,
            tc_capable: maj >= 8,
            split,
            pdl: maj >= 9,
            tiles_smem_max,
            tc_smem_max,
            tc_split_buf: Mutex::new(None),
            tc_down_buf: Mutex::new(None),
            q8_split_buf: Mutex::new(None),
            tc_tpm,
            prompt_attn_tc: tuning.prompt_attn_tc,
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
            dev: DevPtr::from_raw(dev),
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
            result::memcpy_htod_async(
                b.ptr.add_bytes(offset).raw(),
                data,
                self.stream.cu_stream(),
            )?;
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
            result::memcpy_dtoh_async(&mut out[..], b.f32_at(at).raw(), self.stream.cu_stream())?;
        }
        self.stream.synchronize()?;
        Ok(out)
    }

    /// Copies `n` f32 values of `src` from element `src_at` into `dst` from
    /// element `dst_at`, queued on the compute stream (no synchronisation).
    pub fn copy_f32(
        &self,
        dst: &DBuf,
        dst_at: usize,
        src: &DBuf,
        src_at: usize,
        n: usize,
    ) -> Result<()> {
        if (dst_at + n) * 4 > dst.bytes || (src_at + n) * 4 > src.bytes {
            return Err(CudaError::Invalid(
                "copy past the end of a device buffer".into(),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: both ranges lie inside their buffers (checked above),
        // which the caller keeps alive while the stream runs the copy.
        unsafe {
            result::memcpy_dtod_async(
                dst.f32_at(dst_at).raw(),
                src.f32_at(src_at).raw(),
                n * 4,
                self.stream.cu_stream(),
            )?;
        }
        Ok(())
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

    pub(crate) fn go(
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
    pub(crate) fn go_smem(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        self.launch(&self.stream, f, grid, block, smem, args)
    }

    pub(crate) fn go_on(
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

    /// The address of `slot`'s scratch buffer, grown to at least `bytes`
    /// (a larger one first waits for the stream, so no queued kernel still
    /// uses the old one). Valid until the next call on this slot.
    pub(crate) fn scratch(&self, slot: &Mutex<Option<DBuf>>, bytes: usize) -> Result<DevPtr> {
        let mut buf = slot
            .lock()
            .map_err(|_| CudaError::Invalid("scratch buffer lock poisoned".into()))?;
        if buf.as_ref().is_none_or(|b| b.bytes < bytes) {
            self.stream.synchronize()?;
            *buf = None;
            *buf = Some(self.alloc(bytes)?);
        }
        Ok(buf.as_ref().map_or(DevPtr::NULL, |b| b.ptr))
    }
}

/// A zeroed device buffer of `bytes` bytes (at least 16) allocated on `stream`.
pub(crate) fn alloc_on(stream: &Arc<CudaStream>, bytes: usize) -> Result<DBuf> {
    let n = bytes.max(16).div_ceil(256) * 256;
    let mem = stream.alloc_zeros::<u8>(n)?;
    let ptr = {
        let (p, _guard) = cudarc::driver::DevicePtr::device_ptr(&mem, stream);
        p
    };
    Ok(DBuf {
        _mem: mem,
        ptr: DevPtr::from_raw(ptr),
        bytes,
    })
}

/// The bytes of an f32 slice (little-endian host).
pub fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding or invalid bit patterns; u8 alignment is 1.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}
