//! Measurement kernels: bandwidth probes, launch-cost probes and the
//! experts kernels' register report (for `examples/cuda_bench.rs`).

use cudarc::driver::CudaStream;

use crate::{DevPtr, Gpu, Result};

impl Gpu {
    /// Copies `bytes` (a multiple of 16) from `src` to `dst` with a kernel.
    pub fn bw_copy(&self, src: DevPtr, dst: DevPtr, bytes: usize) -> Result<()> {
        let n = (bytes / 16) as u64;
        self.go(
            &self.f.bw_copy,
            (self.sms as u32 * 8, 1, 1),
            512,
            &mut args!(&src, &dst, &n),
        )
    }

    /// Reads `bytes` (a multiple of 16) at `src` with a kernel.
    pub fn bw_read(&self, src: DevPtr, bytes: usize, sink: DevPtr) -> Result<()> {
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
