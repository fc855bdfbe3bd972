//! The CUDA kernels compile with NVRTC (no driver or device needed), and
//! every kernel `Gpu::new` loads is in the result. Skipped when NVRTC is
//! absent, unless `SLIPSTREAM_REQUIRE_NVRTC=1` (scripts/test.sh installs
//! NVIDIA's NVRTC wheel and sets it, so CI checks the kernels compile).

use slipstream_cuda::{compile_kernels, CudaError};

/// Kernel names `Gpu::build` loads: `lf("name")`, and `lf3("base")` for
/// the `_c1`, `_c2`, `_c4` forms.
fn loaded_names() -> Vec<String> {
    let src = include_str!("../src/device.rs");
    let mut names = Vec::new();
    for (pat, forms) in [("lf(\"", &[""][..]), ("lf3(\"", &["_c1", "_c2", "_c4"][..])] {
        for part in src.split(pat).skip(1) {
            let name = &part[..part.find('"').expect("unterminated name")];
            names.extend(forms.iter().map(|f| format!("{name}{f}")));
        }
    }
    names
}

#[test]
fn kernels_compile_with_nvrtc_for_each_target() {
    let required = std::env::var("SLIPSTREAM_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    let names = loaded_names();
    assert!(names.len() > 40, "found only {} kernel names", names.len());
    // The H100/H200 target, and the fallback for unknown devices (no
    // programmatic dependent launch, no tensor-core paths taken).
    for (arch, min_blocks, split, tpm) in [("compute_90", 3, true, 2), ("compute_75", 2, false, 1)]
    {
        let ptx = match compile_kernels(arch, min_blocks, split, tpm) {
            Ok(p) => p.to_src(),
            Err(CudaError::Unavailable(e)) if !required => {
                eprintln!("skipped: {e}");
                return;
            }
            Err(e) => panic!("{arch}: {e}"),
        };
        for n in &names {
            assert!(
                ptx.contains(&format!(".entry {n}(")),
                "{arch}: kernel {n} missing from the PTX"
            );
        }
    }
}

/// Every file of `src/kernels` is part of the NVRTC unit, exactly once
/// (a new file must be added to `KERNELS`).
#[test]
fn every_kernel_file_is_in_the_unit() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/kernels");
    let mut total = 0;
    for entry in std::fs::read_dir(&dir).expect("reading src/kernels") {
        let path = entry.expect("a directory entry").path();
        let text = std::fs::read_to_string(&path).expect("reading a kernel file");
        assert_eq!(
            slipstream_cuda::KERNELS.matches(&text).count(),
            1,
            "{} is not in KERNELS once",
            path.display()
        );
        total += text.len();
    }
    assert_eq!(
        total,
        slipstream_cuda::KERNELS.len(),
        "KERNELS holds more than src/kernels"
    );
}
