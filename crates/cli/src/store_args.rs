//! The expert store and backend flags `run` and `serve` share, and the one
//! place they become the engine's configuration.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use slipstream_engine::{parse_size, BackendChoice, EngineConfig, StoreChoice};
use slipstream_format::SlipModel;
use slipstream_store::{PolicyKind, Readahead, StreamConfig};

/// Where routed experts live, how they are read, and where the model runs.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct StoreArgs {
    /// Expert slots per layer (the cache size).
    #[arg(long, conflicts_with_all = ["memory_budget", "resident"])]
    pub expert_cache_slots: Option<usize>,
    /// Derive the slots from a memory budget, e.g. 8G (the choice is printed).
    #[arg(long, value_parser = parse_size, conflicts_with = "resident")]
    pub memory_budget: Option<u64>,
    /// Replacement policy: aging (LFU halved every 32 tokens), lfu, lru.
    #[arg(long, default_value = "aging")]
    pub expert_cache_policy: PolicyKind,
    /// Reader threads for expert reads (default: what `slipstream hwbench`
    /// found best on this machine, else 4).
    #[arg(long)]
    pub io_threads: Option<usize>,
    /// Read experts with O_DIRECT so the page cache holds no second copy:
    /// auto (default: on when every expert has a slot or the memory beside
    /// the slots cannot cache half the expert file), on (also plain
    /// `--direct-io`), off.
    #[arg(long, default_value = "auto", num_args = 0..=1, default_missing_value = "on")]
    pub direct_io: slipstream_store::DirectIo,
    /// Read-ahead advice on the expert file: default, off, random.
    #[arg(long, default_value = "default")]
    pub readahead: Readahead,
    /// With at least as many slots as experts, do not read the experts
    /// nobody asked for yet into the free slots in the background.
    #[arg(long)]
    pub no_background_fill: bool,
    /// Read every expert into memory at start (no streaming).
    #[arg(long)]
    pub resident: bool,
    /// Record every layer's expert requests to this file (for `slipstream replay`).
    #[arg(long)]
    pub route_trace: Option<PathBuf>,
    /// Where the model runs: cpu, cuda, or auto (cuda when a GPU is usable).
    /// With cuda the expert store flags set the host tier (RAM or SSD) and
    /// --vram-slots / --vram-budget the VRAM expert cache above it.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda", "auto"])]
    pub backend: String,
    /// VRAM expert slots per layer (cuda; default: every expert).
    #[arg(long, conflicts_with = "vram_budget")]
    pub vram_slots: Option<usize>,
    /// VRAM for the expert cache, e.g. 4G, split evenly over the layers (cuda).
    #[arg(long, value_parser = parse_size)]
    pub vram_budget: Option<u64>,
    /// Pinned host-RAM expert slots per layer between VRAM and the expert
    /// store (cuda; e.g. 256 keeps every expert of a 256-expert model pinned).
    #[arg(long)]
    pub ram_cache_slots: Option<usize>,
    /// The prompt's 4-bit products on tensor cores (cuda): exact (f32 to
    /// its last bit, the default) or int8 (x quantized per group of 64, as
    /// llama.cpp's MMQ; not yet run on a GPU). Generated tokens are always
    /// exact.
    #[arg(long, default_value = "exact", value_parser = ["exact", "int8"])]
    pub prompt_precision: String,
}

/// What [`StoreArgs::plan`] settles: the engine to open and the backend to
/// put it on once open.
#[derive(Debug, Clone)]
pub struct StorePlan {
    pub engine: EngineConfig,
    pub backend: BackendChoice,
}

/// The model's manifest, opened on first need and then kept: planning
/// reads it for several decisions.
fn opened<'a>(slot: &'a mut Option<SlipModel>, model: &Path) -> Result<&'a SlipModel> {
    if let Some(file) = slot.take() {
        return Ok(slot.insert(file));
    }
    let file = if model.is_file() && slipstream_repack::is_gguf_file(model) {
        open_gguf(model)?
    } else {
        SlipModel::open(model).with_context(|| format!("opening model {}", model.display()))?
    };
    Ok(slot.insert(file))
}

/// Opens a GGUF in place, saying when its checksum table is built (the
/// first open reads the whole file once).
fn open_gguf(model: &Path) -> Result<SlipModel> {
    use slipstream_repack::{InPlaceOptions, IndexUse};
    let opts = InPlaceOptions {
        index_dir: crate::gguf_index_dir(),
    };
    let known = slipstream_repack::index_locations(model, &opts)
        .iter()
        .any(|p| p.is_file());
    if !known {
        eprintln!(
            "[gguf] {} runs in place; this first open reads the whole file once for its checksum table",
            model.display()
        );
    }
    let (file, used) = slipstream_repack::open_gguf_in_place_with(model, &opts)
        .with_context(|| format!("opening model {}", model.display()))?;
    match used {
        IndexUse::Reused(_) => {}
        IndexUse::Built(p) => eprintln!("[gguf] checksum table written to {}", p.display()),
        IndexUse::BuiltUnsaved => eprintln!(
            "[gguf] the checksum table could not be saved (beside the file or in {}): it is rebuilt at every open",
            opts.index_dir.map(|d| d.display().to_string()).unwrap_or_default()
        ),
    }
    Ok(file)
}

impl StoreArgs {
    /// The engine configuration and backend for the model at `model`, with
    /// sequences of at most `context` tokens (positions) prefilled
    /// `prefill_chunk` tokens at a time. A `--memory-budget` is turned into
    /// slots here (the choice printed to stderr); `--direct-io auto` is
    /// settled against this machine's memory.
    pub fn plan(&self, model: &Path, context: usize, prefill_chunk: usize) -> Result<StorePlan> {
        self.plan_opened(model, context, prefill_chunk).map(|p| p.0)
    }

    /// [`StoreArgs::plan`], also handing over the model when planning
    /// opened it (so the engine need not open and verify it again).
    pub fn plan_opened(
        &self,
        model: &Path,
        context: usize,
        prefill_chunk: usize,
    ) -> Result<(StorePlan, Option<SlipModel>)> {
        let prefill_chunk = prefill_chunk.max(1);
        let mut file = None;
        let store = if self.resident {
            StoreChoice::Resident
        } else {
            let slots = match (self.expert_cache_slots, self.memory_budget) {
                (Some(n), _) => n,
                (None, Some(budget)) => {
                    let file = opened(&mut file, model)?;
                    let n =
                        slipstream_engine::slots_for_budget(file, budget, context, prefill_chunk)
                            .map_err(anyhow::Error::msg)?;
                    let p = slipstream_engine::predict_footprint(file, n, context, prefill_chunk);
                    eprintln!(
                        "[memory] budget {:.2} GB -> {n} expert slots per layer (predicted footprint {:.2} GB: dense {:.2}, slots {:.2}, state {:.2}, buffers {:.2})",
                        budget as f64 / 1e9,
                        p.total() as f64 / 1e9,
                        p.dense as f64 / 1e9,
                        p.slots as f64 / 1e9,
                        p.state as f64 / 1e9,
                        (p.scratch + p.activations + p.baseline) as f64 / 1e9
                    );
                    n
                }
                (None, None) => 64,
            };
            if slots == 0 {
                bail!("--expert-cache-slots must be at least 1");
            }
            StoreChoice::Streaming(StreamConfig {
                slots,
                policy: self.expert_cache_policy,
                io_threads: self
                    .io_threads
                    .unwrap_or_else(crate::default_io_threads)
                    .max(1),
                direct_io: crate::settle_direct_io(
                    self.direct_io,
                    opened(&mut file, model)?,
                    slots,
                    context,
                    prefill_chunk,
                    self.memory_budget,
                ),
                readahead: self.readahead,
                background_fill: !self.no_background_fill,
            })
        };
        let backend = self.backend_choice(model, &mut file)?;
        let plan = StorePlan {
            engine: EngineConfig {
                prefill_chunk,
                store,
                route_trace: self.route_trace.clone(),
                gguf_index_dir: crate::gguf_index_dir(),
            },
            backend,
        };
        Ok((plan, file))
    }

    /// `--backend` with the CUDA options (`--vram-slots`, `--vram-budget`,
    /// `--ram-cache-slots`, the expert cache policy).
    fn backend_choice(&self, model: &Path, file: &mut Option<SlipModel>) -> Result<BackendChoice> {
        if self.backend == "cpu" {
            return Ok(BackendChoice::Cpu);
        }
        let vram_slots = match (self.vram_slots, self.vram_budget) {
            (Some(n), _) => Some(n.max(1)),
            (None, Some(b)) => Some(slipstream_engine::vram_slots_for_budget(
                opened(file, model)?,
                b,
            )),
            (None, None) => None,
        };
        let opts = slipstream_cuda::CudaOptions {
            device: 0,
            vram_slots,
            ram_slots: self.ram_cache_slots,
            policy: self.expert_cache_policy,
            // The CUDA backend's tuning switches, for measuring (the
            // library reads no environment).
            tuning: slipstream_cuda::CudaTuning {
                prompt_precision: if self.prompt_precision == "int8" {
                    slipstream_cuda::PromptPrecision::Int8
                } else {
                    slipstream_cuda::PromptPrecision::Exact
                },
                ..slipstream_cuda::CudaTuning::from_vars(|name| std::env::var(name).ok())
            },
        };
        // clap admits only cpu, cuda and auto; the bare `slipstream` demo
        // run builds its arguments by `Default`, whose empty name has always
        // meant auto.
        Ok(match self.backend.as_str() {
            "cuda" => BackendChoice::Cuda(opts),
            _ => BackendChoice::Auto(opts),
        })
    }
}
