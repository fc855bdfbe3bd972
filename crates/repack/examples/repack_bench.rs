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

const USAGE: &str =
    "usage: repack_bench --input CHECKPOINT --output-dir DIR [--quant q4,bf16,f32] [--keep]
       repack_bench --steps";

struct Args {
    input: PathBuf,
    output_dir: PathBuf,
    quants: Vec<QuantChoice>,
    keep: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut input = None;
    let mut output_dir = None;
    let mut quants = vec![QuantChoice::Q4, QuantChoice::Bf16, QuantChoice::F32];
    let mut keep = false;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let (key, inline) = match a.split_once('=') {
            Some((k, v)) if k.starts_with("--") => (k.to_string(), Some(v.to_string())),
            _ => (a.clone(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| it.next())
                .ok_or_else(|| format!("{key} needs a value"))
        };
        match key.as_str() {
            "--input" | "-i" => input = Some(PathBuf::from(value()?)),
            "--output-dir" | "-o" => output_dir = Some(PathBuf::from(value()?)),
            "--quant" | "-q" => {
                quants = value()?
                    .split(',')
                    .map(|q| q.trim().parse::<QuantChoice>())
                    .collect::<Result<_, _>>()?
            }
            "--keep" => keep = true,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unexpected argument {other:?}")),
        }
    }
    Ok(Args {
        input: input.ok_or("--input CHECKPOINT is required")?,
        output_dir: output_dir.ok_or("--output-dir DIR is required")?,
        quants,
        keep,
    })
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
    if std::env::args().skip(1).any(|a| a == "--steps") {
        steps();
        return ExitCode::SUCCESS;
    }
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("error: {e}");
            }
            eprintln!("{USAGE}");
            return if e.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(2)
            };
        }
    };
    if let Err(e) = std::fs::create_dir_all(&args.output_dir) {
        eprintln!("error: {}: {e}", args.output_dir.display());
        return ExitCode::FAILURE;
    }
    for &quant in &args.quants {
        let output = args.output_dir.join(format!("bench-{quant}.slip"));
        let report = match repack(
            &RepackOptions {
                input: args.input.clone(),
                output: output.clone(),
                overwrite: Default::default(),
                quant,
                ggml_to_affine: false,
            },
            &|_| {},
        ) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("error: repacking {} to {quant}: {e}", args.input.display());
                return ExitCode::FAILURE;
            }
        };
        println!(
            "repacked {} ({}, {}) -> {}: {} tensors, {} experts, {:.1} MB in, {:.1} MB out, {:.2} s, {:.0} MB/s",
            args.input.display(),
            report.kind.name(),
            report.config.architecture.name(),
            output.display(),
            report.tensors_written,
            report.experts_written,
            report.bytes_in as f64 / 1e6,
            report.bytes_out as f64 / 1e6,
            report.seconds,
            report.mb_per_s
        );
        if !args.keep {
            if let Err(e) = std::fs::remove_dir_all(&output) {
                eprintln!("warning: removing {}: {e}", output.display());
            }
        }
    }
    ExitCode::SUCCESS
}
