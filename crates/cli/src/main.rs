//! `slipstream`: run and convert mixture-of-experts models.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use slipstream_cli::demo;
use slipstream_cli::speculate_args::SpeculateArgs;
use slipstream_cli::store_args::StoreArgs;
use slipstream_engine::npy;
use slipstream_engine::parse_size;
use slipstream_engine::{Engine, GenerateRequest, RestoreOutcome, StreamDecoder, WarmReport};
use slipstream_repack::{repack, ProgressEvent, QuantChoice, RepackOptions};

#[derive(Parser)]
#[command(
    name = "slipstream",
    version,
    about = "Run mixture-of-experts models larger than memory"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text (with no --model: the embedded demo model).
    Run(Box<RunArgs>),
    /// Convert a Hugging Face or MLX checkpoint directory into a .slip model.
    Repack(RepackArgs),
    /// Replay a route trace through cache policies at several slot counts.
    Replay(ReplayArgs),
    /// Write a model with random weights at a real model's shapes.
    Synth(slipstream_cli::synth_cmd::SynthArgs),
    /// Serve OpenAI and Anthropic APIs and a chat page (no --model: the demo model).
    Serve(Box<slipstream_cli::serve_cmd::ServeArgs>),
    /// Measure this machine's ceilings: SSD, memory bandwidth, kernels.
    Hwbench(slipstream_cli::hwbench_cmd::HwbenchArgs),
    /// Benchmark matrix: each run a fresh process meeting a stated file
    /// cache, optional memory cap and llama.cpp peer; CSV, JSON, charts.
    /// `bench agent`: a recorded agent session replayed against servers.
    Bench(Box<slipstream_bench::cli::BenchCommand>),
}

#[derive(Args)]
struct ReplayArgs {
    /// Trace written by `slipstream run --route-trace`.
    #[arg(long)]
    trace: PathBuf,
    /// Slot counts per layer, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "16,32,64,128")]
    slots: Vec<usize>,
    /// Policies, comma separated, or `all`: aging, lfu, lru, arc, lrfu,
    /// s3-fifo, sieve, w-tinylfu, belady.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    policies: Vec<String>,
}

#[derive(Args, Default)]
struct RunArgs {
    /// A .slip model directory, or a GGUF file run in place (no repack; a
    /// checksum table is built on first use); the embedded demo model when
    /// omitted.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt text.
    #[arg(long, conflicts_with_all = ["prompt_file", "prompt_tokens"])]
    prompt: Option<String>,
    /// Read the prompt text from a file.
    #[arg(long, conflicts_with = "prompt_tokens")]
    prompt_file: Option<PathBuf>,
    /// Prompt as token ids, comma separated (no tokenizer involved).
    #[arg(long, value_delimiter = ',')]
    prompt_tokens: Option<Vec<u32>>,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Let the chat template open a thinking block (templates that support it).
    #[arg(long, requires = "chat")]
    think: bool,
    /// A chat template (Jinja, or a tokenizer_config.json holding one) to
    /// use instead of the model's own.
    #[arg(long, value_name = "FILE", requires = "chat")]
    chat_template: Option<PathBuf>,
    /// Template variables as a JSON object, e.g. '{"enable_thinking": true}'
    /// (`--think` is `enable_thinking: true`).
    #[arg(long, value_name = "JSON", requires = "chat")]
    chat_template_kwargs: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_new: usize,
    #[command(flatten)]
    sampling: slipstream_cli::sampling_args::SamplingArgs,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Token ids that also end generation, comma separated.
    #[arg(long, value_delimiter = ',')]
    stop_token: Vec<u32>,
    /// Write float32 logits [positions, vocab] of every prompt position and
    /// every generated step to this .npy file.
    #[arg(long)]
    dump_logits: Option<PathBuf>,
    /// Write the run's statistics as JSON to this file.
    #[arg(long)]
    stats_json: Option<PathBuf>,
    /// Compute threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// How inputs enter quantized products on the CPU: f32 (exact, the
    /// default), int16 (4-bit affine weights: quantized per weight group)
    /// or int8 (GGML block weights from a GGUF: quantized per block as
    /// llama.cpp does, integer dot products). The integer modes are faster
    /// and off by a small rounding error; see docs/KERNELS.md.
    #[arg(long, default_value = "f32", value_parser = ["f32", "int16", "int8"])]
    activations: String,
    /// Print generated token ids instead of text.
    #[arg(long)]
    print_ids: bool,
    /// Time each phase (expert FFN, linear/full attention, head, norms and
    /// router, expert-read wait, other) and print the per-token split.
    #[arg(long)]
    phases: bool,
    /// Restore the prompt's state from this snapshot when it holds the
    /// prompt or a prefix of it (only the rest is prefilled); after a
    /// prefill, write the state to it (atomically).
    #[arg(long)]
    kv_snapshot: Option<PathBuf>,
    /// Directory of a prompt cache: snapshots at prefill chunk boundaries,
    /// so a prompt sharing a prefix with an earlier one prefills only the rest.
    #[arg(long)]
    prompt_cache: Option<PathBuf>,
    /// Most bytes the prompt cache holds (least recently used evicted).
    #[arg(long, value_parser = parse_size, default_value = "8G")]
    prompt_cache_size: u64,
    /// Do not warm the expert cache with the experts a snapshot recorded.
    #[arg(long)]
    no_warm_experts: bool,
    /// Write per-token decode latency as CSV (token, seconds since the first
    /// token, latency ms, tokens/s) to this file.
    #[arg(long)]
    decode_curve: Option<PathBuf>,
    #[command(flatten)]
    speculation: SpeculateArgs,
    /// After the run, time verify passes of 1 to N tokens from the final
    /// state (the cost of checking N-1 drafts against a plain step).
    #[arg(long, value_name = "N")]
    measure_verify: Option<usize>,
    #[command(flatten)]
    store: StoreArgs,
}

fn warm_note(w: &Option<WarmReport>) -> String {
    match w {
        Some(w) => format!(
            ", expert cache warmed with {} experts ({:.1} MB read, {:.3} s)",
            w.experts,
            w.bytes_read as f64 / 1e6,
            w.seconds
        ),
        None => ", expert cache cold".into(),
    }
}

#[derive(Args)]
struct RepackArgs {
    /// Checkpoint directory (config.json + safetensors, HF or MLX), or a
    /// GGUF file (qwen35moe / qwen3moe; its tensor types are kept, --quant
    /// does not apply).
    #[arg(long)]
    input: PathBuf,
    /// Output .slip directory. An existing slipstream model there is
    /// replaced atomically; anything else is refused, as is an output
    /// inside the input.
    #[arg(long)]
    output: PathBuf,
    /// Also replace a damaged model at --output (never a non-model).
    #[arg(long)]
    force: bool,
    /// Storage of float tensors: q4 (MLX-style 4-bit, group 64), q8, bf16, f32.
    #[arg(long, default_value = "q4")]
    quant: QuantChoice,
    /// GGUF input: convert Q4_0 / Q8_0 tensors exactly (same values) to
    /// affine 4-bit / 8-bit group 32. Off by default: on AVX2 the GGML
    /// kernels run these faster (docs/BENCHMARKS.md).
    #[arg(long)]
    ggml_to_affine: bool,
}

fn main() {
    // Warnings, and the server's access log and `--log-prompts` lines.
    const DEFAULT_LOG: &str = "warn,slipstream::access=info,slipstream::prompt=info";
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SLIPSTREAM_LOG")
                .unwrap_or_else(|_| DEFAULT_LOG.into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Run(args)) => run(*args),
        Some(Command::Repack(args)) => repack_cmd(args),
        Some(Command::Synth(args)) => slipstream_cli::synth_cmd::synth_command(args),
        Some(Command::Serve(args)) => slipstream_cli::serve_cmd::serve_command(*args),
        Some(Command::Hwbench(args)) => slipstream_cli::hwbench_cmd::hwbench_command(args),
        Some(Command::Bench(args)) => std::env::current_exe()
            .context("locating the slipstream binary")
            .and_then(|exe| {
                slipstream_bench::cli::bench_command(*args, exe, slipstream_cli::gguf_index_dir())
            }),
        Some(Command::Replay(args)) => {
            slipstream_cli::replay_cmd::replay_command(&args.trace, &args.slots, &args.policies)
        }
        None => run(RunArgs {
            max_new: 128,
            ..Default::default()
        }),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// A progress bar fed by repack events.
fn repack_progress(bar: &ProgressBar) -> impl Fn(ProgressEvent) + '_ {
    move |ev| match ev {
        ProgressEvent::Started {
            total_bytes,
            tensors,
            experts,
            kind,
            architecture,
        } => {
            bar.set_length(total_bytes);
            bar.set_message(format!(
                "{} {} ({tensors} tensors, {experts} experts)",
                kind.name(),
                architecture.name()
            ));
        }
        ProgressEvent::Tensor { bytes_in, .. } | ProgressEvent::Expert { bytes_in, .. } => {
            bar.inc(bytes_in)
        }
        ProgressEvent::Finishing => bar.set_message("syncing"),
    }
}

fn new_bar() -> ProgressBar {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {bytes}/{total_bytes} {bytes_per_sec} {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

fn repack_cmd(args: RepackArgs) -> Result<()> {
    let bar = new_bar();
    let report = repack(
        &RepackOptions {
            input: args.input.clone(),
            output: args.output.clone(),
            overwrite: if args.force {
                slipstream_format::Overwrite::Force
            } else {
                slipstream_format::Overwrite::VerifiedOnly
            },
            quant: args.quant,
            ggml_to_affine: args.ggml_to_affine,
        },
        &repack_progress(&bar),
    );
    bar.finish_and_clear();
    let report = report.with_context(|| format!("repacking {}", args.input.display()))?;
    eprintln!("{}", report.summary(&args.input, &args.output));
    Ok(())
}

/// The error for a prompt of `tokens` (a number, or "more than N") tokens
/// on a model of `positions` positions.
fn too_long(tokens: &str, positions: usize) -> String {
    format!(
        "the prompt is {tokens} tokens; this model has {positions} positions (max_position_embeddings), so a prompt must be at most {} tokens to leave room for a reply",
        positions.saturating_sub(1)
    )
}

/// Reads a prompt file of at most `max_bytes` bytes (the most text a
/// prompt that fits `positions` may take), without reading more of a larger
/// one or of an endless one (a device, a FIFO).
fn read_prompt_file(path: &Path, max_bytes: usize, positions: usize) -> Result<String> {
    use std::io::Read;
    let context = || format!("reading prompt file {}", path.display());
    let file = std::fs::File::open(path).with_context(context)?;
    let too_big = || {
        anyhow::anyhow!(
            "prompt file {} is larger than {} MiB, more text than a prompt for this model's {positions} positions can hold",
            path.display(),
            max_bytes >> 20
        )
    };
    if file.metadata().with_context(context)?.len() > max_bytes as u64 {
        return Err(too_big());
    }
    let mut bytes = Vec::new();
    file.take(max_bytes as u64 + 1)
        .read_to_end(&mut bytes)
        .with_context(context)?;
    if bytes.len() > max_bytes {
        return Err(too_big());
    }
    String::from_utf8(bytes).with_context(|| format!("prompt file {} is not UTF-8", path.display()))
}

fn run(args: RunArgs) -> Result<()> {
    // The flags are checked before the model opens; the checkpoint's
    // defaults join them once it has.
    args.sampling
        .resolve_for_run(&Default::default(), args.seed)
        .map_err(|e| anyhow::anyhow!(e))?;
    // Template settings are checked before the model opens.
    let template_override = match &args.chat_template {
        Some(p) => Some(slipstream_engine::ChatTemplate::new(
            &slipstream_cli::read_chat_template(p)?,
        )?),
        None => None,
    };
    let mut template_kwargs = match &args.chat_template_kwargs {
        Some(s) => slipstream_cli::parse_template_kwargs(s)?,
        None => Default::default(),
    };
    let think = match template_kwargs.remove("enable_thinking") {
        Some(serde_json::Value::Bool(false)) if args.think => {
            bail!("--think contradicts --chat-template-kwargs' \"enable_thinking\": false")
        }
        Some(serde_json::Value::Bool(on)) => on || args.think,
        _ => args.think,
    };
    if let Some(n) = args.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build_global()
            .context("setting up compute threads")?;
    }
    // Opened (and its dense weights hashed) once: planning reads its
    // manifest, the engine takes it over.
    let file = match &args.model {
        Some(p) => slipstream_cli::store_args::open_model(p)?,
        None => {
            let bar = new_bar();
            let model = demo::open_demo_model(&repack_progress(&bar));
            bar.finish_and_clear();
            model.context("preparing the embedded demo model")?
        }
    };
    // The path as given: a GGUF run in place has no model directory.
    let model_path = args.model.clone().unwrap_or_else(|| file.dir.clone());
    let plan = args.store.plan(&file, args.max_new + 4096)?;
    let mut engine = Engine::from_model(std::sync::Arc::new(file), plan.engine)
        .with_context(|| format!("opening model {}", model_path.display()))?;
    tracing::info!("{}", engine.store_description());
    engine.set_phases(args.phases);
    match args.activations.as_str() {
        "int16" => engine
            .model
            .set_activations(slipstream_kernels::Activations::Int16),
        "int8" => engine
            .model
            .set_activations(slipstream_kernels::Activations::Int8),
        _ => {}
    }
    if let Some(note) = engine.backend_note() {
        eprintln!("[backend] {note}");
    }
    engine.set_speculation(args.speculation.settings())?;
    if let Some(note) = engine.speculation_note() {
        eprintln!("[speculate] {note}");
    }

    // A prompt leaves room for at least one generated token.
    let positions = engine.model_config().max_position_embeddings;
    let most_prompt = positions.saturating_sub(1);
    let prompt_text = match (&args.prompt, &args.prompt_file, &args.prompt_tokens) {
        (Some(p), _, _) => Some(p.clone()),
        (None, Some(f), _) => Some(read_prompt_file(
            f,
            slipstream_engine::text_bytes_bound(most_prompt),
            positions,
        )?),
        (None, None, Some(_)) => None,
        (None, None, None) => Some(demo::DEFAULT_PROMPT.to_string()),
    };
    let prompt: Vec<u32> = match (prompt_text, &args.prompt_tokens) {
        (None, Some(ids)) => ids.clone(),
        (Some(text), _) => {
            let codec = engine
                .codec
                .as_ref()
                .context("this model has no tokenizer; pass --prompt-tokens")?;
            let text = if args.chat {
                let template = template_override
                    .as_ref()
                    .or(engine.template.as_ref())
                    .context(
                        "this model has no chat template; pass --chat-template or drop --chat",
                    )?;
                let mut messages = Vec::new();
                if let Some(s) = &args.system {
                    messages.push(serde_json::json!({"role": "system", "content": s}));
                }
                messages.push(serde_json::json!({"role": "user", "content": text}));
                let mut context = template_kwargs.clone();
                context.insert("messages".into(), messages.into());
                context.insert("add_generation_prompt".into(), true.into());
                context.insert("enable_thinking".into(), think.into());
                template.render_json(&serde_json::Value::Object(context))?
            } else {
                text
            };
            match codec.encode_within(&text, most_prompt)? {
                slipstream_engine::Bounded::Fits(ids) => ids,
                slipstream_engine::Bounded::TooLong { .. } => {
                    bail!(too_long(&format!("more than {most_prompt}"), positions))
                }
            }
        }
        (None, None) => bail!("no prompt"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    if prompt.len() > most_prompt {
        bail!(too_long(&prompt.len().to_string(), positions));
    }
    let room = positions - prompt.len();
    let max_new = if args.max_new > room {
        eprintln!(
            "note: --max-new {} cut to {room}: the model has {positions} positions and the prompt takes {}",
            args.max_new,
            prompt.len()
        );
        room
    } else {
        args.max_new
    };

    let sampling = args
        .sampling
        .resolve_for_run(&engine.generation_defaults(), args.seed)
        .map_err(|e| {
            anyhow::anyhow!("sampling settings (flags over the model's generation_config): {e}")
        })?;
    let req = GenerateRequest {
        prompt: prompt.clone(),
        max_new_tokens: max_new,
        sampling,
        stop_tokens: args.stop_token.clone(),
        keep_logits: args.dump_logits.is_some(),
        cancel: None,
        checkpoint_at: None,
    };

    let t_restore = std::time::Instant::now();
    let warm = !args.no_warm_experts;
    let mut state = engine.new_state();
    let mut restore_json = serde_json::Value::Null;
    if let Some(path) = &args.kv_snapshot {
        let (st, outcome) = engine.restore_for_prompt(path, &prompt, warm);
        state = st;
        match outcome {
            RestoreOutcome::Restored { tokens, warmed } => {
                eprintln!(
                    "[snapshot] restored {tokens} of {} prompt tokens from {} in {:.3} s{}",
                    prompt.len(),
                    path.display(),
                    t_restore.elapsed().as_secs_f64(),
                    warm_note(&warmed)
                );
                restore_json =
                    serde_json::json!({"source": "kv-snapshot", "tokens": tokens, "warm": warmed});
            }
            RestoreOutcome::Missing => {
                eprintln!(
                    "[snapshot] {} does not exist yet: prefilling",
                    path.display()
                )
            }
            RestoreOutcome::DifferentPrompt { tokens } => eprintln!(
                "[snapshot] {} holds another prompt ({tokens} tokens): prefilling",
                path.display()
            ),
            RestoreOutcome::Rejected(e) => eprintln!(
                "warning: ignoring snapshot {}: {e}; prefilling from scratch",
                path.display()
            ),
        }
    }
    let cache = match &args.prompt_cache {
        Some(dir) => Some(
            engine
                .open_prompt_cache(dir, args.prompt_cache_size)
                .with_context(|| format!("opening prompt cache {}", dir.display()))?,
        ),
        None => None,
    };
    if let Some(cache) = &cache {
        if state.tokens.len() < prompt.len() {
            if let Some(snap) = cache.lookup(&prompt) {
                if snap.state.tokens.len() > state.tokens.len() {
                    let warmed = if warm {
                        Some(engine.warm_experts(&snap.resident)?)
                    } else {
                        None
                    };
                    eprintln!(
                        "[prompt-cache] restored {} of {} prompt tokens from {} in {:.3} s{}",
                        snap.state.tokens.len(),
                        prompt.len(),
                        cache.dir().display(),
                        t_restore.elapsed().as_secs_f64(),
                        warm_note(&warmed)
                    );
                    restore_json = serde_json::json!({"source": "prompt-cache", "tokens": snap.state.tokens.len(), "warm": warmed});
                    state = snap.state;
                }
            }
        }
    }
    let restore_s = t_restore.elapsed().as_secs_f64();
    if args.kv_snapshot.is_some() || cache.is_some() {
        let snapshot_path = args.kv_snapshot.clone();
        let model_hash = engine.model_hash().to_string();
        let prompt_len = prompt.len();
        let mut cache = cache;
        engine.set_prefill_hook(Some(Box::new(move |cp| {
            if let Some(c) = cache.as_mut() {
                if let Err(e) = c.insert(cp.state, cp.resident) {
                    eprintln!("warning: prompt cache insert failed: {e}");
                }
            }
            if let (Some(path), true) = (&snapshot_path, cp.last_chunk) {
                if cp.state.tokens.len() == prompt_len {
                    let t = std::time::Instant::now();
                    match slipstream_engine::snapshot::write_snapshot(
                        path,
                        &model_hash,
                        cp.state,
                        cp.resident,
                    ) {
                        Ok(n) => eprintln!(
                            "[snapshot] wrote {} tokens to {} ({:.1} MB, {:.3} s)",
                            cp.state.tokens.len(),
                            path.display(),
                            n as f64 / 1e6,
                            t.elapsed().as_secs_f64()
                        ),
                        Err(e) => {
                            eprintln!("warning: writing snapshot {} failed: {e}", path.display())
                        }
                    }
                }
            }
        })));
    }

    let mut token_times: Vec<std::time::Instant> = Vec::new();
    let t_generate = std::time::Instant::now();
    let mut stdout = std::io::stdout().lock();
    let print_text = !args.print_ids && engine.codec.is_some();
    if print_text && args.prompt_tokens.is_none() && !args.chat {
        if let Some(codec) = &engine.codec {
            let _ = write!(stdout, "{}", codec.decode(&prompt)?);
            let _ = stdout.flush();
        }
    }
    let mut decoder = StreamDecoder::default();
    let mut sink_err = None;
    let codec = engine.codec.take();
    let gen = engine.generate_with_state(&mut state, &req, &mut |id| {
        token_times.push(std::time::Instant::now());
        let piece = if print_text {
            match codec.as_ref().map(|c| decoder.push(c, id)) {
                Some(Ok(s)) => s,
                Some(Err(e)) => {
                    sink_err = Some(e);
                    return false;
                }
                None => String::new(),
            }
        } else {
            format!("{id} ")
        };
        // A closed stdout (e.g. piped into `head`) ends generation quietly.
        write!(stdout, "{piece}")
            .and_then(|_| stdout.flush())
            .is_ok()
    });
    engine.codec = codec;
    let gen = gen?;
    if let Some(e) = sink_err {
        return Err(e.into());
    }
    let _ = writeln!(stdout);

    engine.finish_trace()?;
    let s = &gen.stats;
    eprintln!(
        "[stats] prompt {} tokens | time to first token {:.3} s | prefill {:.1} tok/s | decode {:.2} tok/s ({} tokens) | peak RSS {:.1} MB",
        s.prompt_tokens,
        s.time_to_first_token_s,
        s.prefill_tokens_per_s,
        s.decode_tokens_per_s,
        s.generated_tokens,
        s.peak_rss_bytes as f64 / 1e6,
    );
    eprintln!(
        "[experts] {} | hits {} misses {} background fills {} | decode: {:.1} misses/token, {:.2} MB read/token, {:.2} ms read wait/token | prefill: {} misses, {:.1} MB read",
        engine.store_description(),
        s.expert_hits,
        s.expert_misses,
        s.expert_fills,
        s.decode_misses_per_token,
        s.decode_bytes_read_per_token / 1e6,
        s.decode_read_wait_ms_per_token,
        s.prefill_expert_misses,
        s.prefill_expert_bytes_read as f64 / 1e6,
    );
    if let Some(cs) = engine.cuda_stats() {
        let t = cs.tokens.max(1) as f64;
        eprintln!(
            "[cuda] VRAM hits {} misses {} (RAM tier hits {}, store reads {}) ({:.2} misses/token over {} tokens, {:.2} MB host->device/token) | routing round trip {:.3} ms/token | host fetch {:.3} ms/token | CUDA graphs: {} captured, {} passes replayed",
            cs.vram_hits,
            cs.vram_misses,
            cs.ram_hits,
            cs.store_reads,
            cs.vram_misses as f64 / t,
            cs.tokens,
            cs.h2d_bytes as f64 / 1e6 / t,
            cs.route_wait_ns as f64 / 1e6 / t,
            cs.fetch_ns as f64 / 1e6 / t,
            cs.graph_captures,
            cs.graph_replays,
        );
    }
    if let Some(p) = &gen.phases {
        eprintln!("[phases] prefill: {}", p.prefill.report(0));
        eprintln!(
            "[phases] decode: {}",
            p.decode.report(s.generated_tokens.saturating_sub(1) as u64)
        );
    }
    if let Some(sp) = &s.speculation {
        eprintln!("{}", sp.line());
    }
    if let Some(n) = args.measure_verify {
        let mut ids = prompt.clone();
        ids.extend_from_slice(&gen.tokens);
        let tail = &ids[ids.len().saturating_sub(n.max(1))..];
        let costs = engine.measure_verify(&state, tail, n, 3)?;
        let one = costs.first().map_or(0.0, |c| c.1);
        for (k, secs) in costs {
            eprintln!(
                "[verify] {k} tokens: {:.2} ms per pass ({:.2}x a one-token pass, {:.2} ms per token)",
                secs * 1e3,
                if one > 0.0 { secs / one } else { 0.0 },
                secs * 1e3 / k as f64,
            );
        }
    }
    if let Some(path) = &args.stats_json {
        // The CUDA kernels' switches, when the run used the GPU.
        let cuda_tuning = match &engine.config().backend {
            slipstream_engine::BackendChoice::Cuda(o)
            | slipstream_engine::BackendChoice::Auto(o)
                if engine.cuda_stats().is_some() =>
            {
                Some(&o.tuning)
            }
            _ => None,
        };
        let json = serde_json::json!({
            "model": model_path.display().to_string(),
            "prompt_tokens": prompt,
            "generated_tokens": gen.tokens,
            "finish": format!("{:?}", gen.finish).to_lowercase(),
            "stats": s,
            "store": engine.store_description(),
            "prompt_precision": engine.prompt_precision(),
            "cuda_tuning": cuda_tuning,
            "restore": restore_json,
            "restore_s": restore_s,
            "time_to_first_token_with_restore_s": restore_s + s.time_to_first_token_s,
            "token_times_s": token_times.iter().map(|t| t.duration_since(t_generate).as_secs_f64()).collect::<Vec<_>>(),
            "predicted_footprint": engine.predicted_footprint(prompt.len() + gen.tokens.len()),
        });
        std::fs::write(path, serde_json::to_vec_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.decode_curve {
        let mut csv = String::from("token,seconds_since_first,latency_ms,tokens_per_s\n");
        let mut prev = t_generate;
        for (i, t) in token_times.iter().enumerate() {
            let lat = t.duration_since(prev).as_secs_f64();
            let since = token_times
                .first()
                .map_or(0.0, |f| t.duration_since(*f).as_secs_f64());
            csv.push_str(&format!(
                "{i},{since:.6},{:.3},{:.3}\n",
                lat * 1e3,
                if lat > 0.0 { 1.0 / lat } else { 0.0 }
            ));
            prev = *t;
        }
        std::fs::write(path, csv).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.dump_logits {
        let vocab = engine.model_config().vocab_size;
        let rows = gen.logits.len() / vocab;
        npy::write_f32(path, &[rows, vocab], &gen.logits)?;
    }
    Ok(())
}
