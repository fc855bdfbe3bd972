//! Repacks a checkpoint once per requested quantization and prints the
//! throughput, in the same line `slipstream repack` prints.
//!
//! ```text
//! cargo run --release -p slipstream-repack --example repack_bench -- \
//!     --input CHECKPOINT --output-dir DIR [--quant q4,bf16,f32] [--keep]
//! ```
//!
//! Each run writes `DIR/bench-{quant}.slip`, which is deleted after the run
//! unless `--keep` is given. A checkpoint to try it on comes from the
//! `synth_checkpoint` example.
//!
//! `repack_bench --steps` instead prints the single-thread cost of the
//! conversion steps (bf16 decode, Q4/Q8 quantization, checksum), to see what
//! bounds a repack.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use slipstream_repack::{repack, QuantChoice, RepackOptions};

/// Repacks a checkpoint once per quantization and prints the throughput.
#[derive(clap::Parser)]
struct Args {
    /// The checkpoint to repack (a folder of safetensors, or a GGUF file).
    #[arg(short, long, required_unless_present = "steps")]
    input: Option<PathBuf>,
    /// Where the `bench-{quant}.slip` outputs go.
    #[arg(short, long, required_unless_present = "steps")]
    output_dir: Option<PathBuf>,
    /// The quantizations to time, comma-separated.
    #[arg(short, long, value_delimiter = ',', default_value = "q4,bf16,f32")]
    quant: Vec<QuantChoice>,
    /// Keep the outputs instead of deleting each after its run.
    #[arg(long)]
    keep: bool,
    /// Print the single-thread cost of the conversion steps instead.
    #[arg(long)]
    steps: bool,
}

/// Single-thread cost of the conversion steps on 16M values.
fn steps() {
    let n = 1usize << 24;
    let mut s = 0x9e3779b97f4a7c15u64;
    let bytes: Vec<u8> = (0..n)
        .flat_map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let x = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            half::bf16::from_f32(x).to_bits().to_le_bytes()
        })
        .collect();
    let t = Instant::now();
    let mut back = vec![0f32; n];
    for (o, b) in back.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
    }
    let dt = t.elapsed().as_secs_f64();
    println!("bf16 decode: {:.0} M elem/s", n as f64 / dt / 1e6);
    for bits in [4u8, 8] {
        let t = Instant::now();
        let q = slipstream_kernels::quantize::quantize_affine(
            &back,
            n / 1024,
            1024,
            bits,
            64,
            slipstream_core::ScaleType::F16,
        );
        let dt = t.elapsed().as_secs_f64();
        println!(
            "quantize q{bits}: {:.0} M elem/s ({} bytes)",
            n as f64 / dt / 1e6,
            q.len()
        );
    }
    let t = Instant::now();
    let h = slipstream_format::checksum(&bytes);
    println!(
        "checksum {h:016x}: {:.0} MB/s",
        bytes.len() as f64 / t.elapsed().as_secs_f64() / 1e6
    );
}

fn main() -> ExitCode {
    let args = <Args as clap::Parser>::parse();
    let (Some(input), Some(output_dir)) = (&args.input, &args.output_dir) else {
        steps();
        return ExitCode::SUCCESS;
    };
    if let Err(e) = std::fs::create_dir_all(output_dir) {
        eprintln!("error: {}: {e}", output_dir.display());
        return ExitCode::FAILURE;
    }
    for &quant in &args.quant {
        let output = output_dir.join(format!("bench-{quant}.slip"));
        let report = match repack(
            &RepackOptions {
                input: input.clone(),
                output: output.clone(),
                overwrite: Default::default(),
                quant,
                ggml_to_affine: false,
            },
            &|_| {},
        ) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("error: repacking {} to {quant}: {e}", input.display());
                return ExitCode::FAILURE;
            }
        };
        println!("{}", report.summary(input, &output));
        if !args.keep {
            if let Err(e) = std::fs::remove_dir_all(&output) {
                eprintln!("warning: removing {}: {e}", output.display());
            }
        }
    }
    ExitCode::SUCCESS
}
