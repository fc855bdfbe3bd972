//! `slipstream synth`: writes a synthetic model with random weights in the
//! q4 layout of a real preset, with a calibrated router skew
//! (see `slipstream-synth` and docs/SYNTH.md).

use std::path::PathBuf;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use slipstream_synth::{Preset, Skew, SynthEvent, SynthQuant};

/// Router skew kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SkewKind {
    /// Calibrated popularity + persistence (real-session-like LRU misses).
    Default,
    /// Plain random router: near-uniform routing.
    Uniform,
}

/// Output container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SynthFormat {
    /// A .slip model directory.
    Slip,
    /// A llama.cpp GGUF file (Q4_0, qwen35moe / qwen3next / qwen3moe); implies --quant q4_0.
    Gguf,
}

#[derive(Debug, Clone, clap::Args)]
pub struct SynthArgs {
    /// Shapes to imitate: qwen3.6-35b-a3b, qwen3-30b-a3b, qwen3-next-80b-a3b
    /// or qwen3.5-122b-a10b (docs/SYNTH.md says where each comes from).
    #[arg(long)]
    pub preset: Preset,
    /// Keep only the first N layers (fast experiments).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Multi-token-prediction layers after the main ones, at the real
    /// shapes (Qwen3.6-35B-A3B and Qwen3-Next-80B-A3B ship 1; not for
    /// qwen3-30b-a3b). Default 0.
    #[arg(long, default_value_t = 0)]
    pub mtp_layers: usize,
    /// Seed of every weight; the same seed writes the same bytes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Router skew: default (calibrated) or uniform (none).
    #[arg(long, value_enum, default_value_t = SkewKind::Default)]
    pub skew: SkewKind,
    /// Popularity strength: std of the per-layer router logit bias.
    #[arg(long, default_value_t = slipstream_synth::DEFAULT_POPULARITY)]
    pub skew_strength: f32,
    /// Persistence strength: gain of the slowly varying context heads.
    #[arg(long, default_value_t = slipstream_synth::DEFAULT_PERSISTENCE)]
    pub skew_persistence: f32,
    /// Model directory to write; a file for --format gguf. An existing
    /// model there is replaced atomically; anything else is refused.
    #[arg(long)]
    pub output: PathBuf,
    /// Also replace a damaged model at --output (never a non-model).
    #[arg(long)]
    pub force: bool,
    /// Output container: slip or gguf.
    #[arg(long, value_enum, default_value_t = SynthFormat::Slip)]
    pub format: SynthFormat,
    /// Matrix storage of a .slip: q4 (affine, group 64) or q4_0 (GGML Q4_0,
    /// the same bytes as --format gguf).
    #[arg(long, default_value = "q4")]
    pub quant: SynthQuant,
}

pub fn synth_command(args: SynthArgs) -> anyhow::Result<()> {
    let skew = match args.skew {
        SkewKind::Uniform => Skew::UNIFORM,
        SkewKind::Default => Skew {
            popularity: args.skew_strength,
            persistence: args.skew_persistence,
        },
    };
    let mut opts =
        slipstream_synth::options(args.preset, args.layers, args.seed, skew, &args.output);
    opts.config.mtp_num_layers = args.mtp_layers;
    if args.force {
        opts.overwrite = slipstream_format::Overwrite::Force;
    }
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let on_event = |ev: SynthEvent| match ev {
        SynthEvent::Started { total_bytes } => bar.set_length(total_bytes),
        SynthEvent::Bytes(n) => bar.inc(n),
        SynthEvent::Finishing => bar.set_message("syncing"),
    };
    let report = match args.format {
        SynthFormat::Slip => slipstream_synth::synthesize_q(&opts, args.quant, &on_event),
        SynthFormat::Gguf => slipstream_synth::gguf_export::synthesize_gguf(&opts, &on_event),
    }
    .with_context(|| format!("writing {}", args.output.display()))?;
    bar.finish_and_clear();
    // What the format adds inside the parentheses, and after the figures.
    let (format_note, after) = match args.format {
        SynthFormat::Gguf => (", GGUF Q4_0 with a synthetic tokenizer", String::new()),
        SynthFormat::Slip => (
            "",
            format!(
                "; no tokenizer (use --prompt-tokens), no EOS ids; model hash {}",
                report.model_hash
            ),
        ),
    };
    eprintln!(
        "wrote {} ({} layers, {}{format_note}): {:.2} GB in {:.1} s, {:.0} MB/s{after}",
        args.output.display(),
        opts.config.num_layers(),
        args.preset.name(),
        report.bytes_out as f64 / 1e9,
        report.seconds,
        report.mb_per_s
    );
    Ok(())
}
