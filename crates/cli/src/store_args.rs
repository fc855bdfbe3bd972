//! The expert store, memory and backend flags `run` and `serve` share, and
//! the one place they become the engine's configuration.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use slipstream_engine::{
    parse_size, plan_memory, BackendChoice, EngineConfig, MachineMemory, MemoryRequest, ModelSizes,
    SlotsRequest, StoreChoice,
};
use slipstream_format::SlipModel;
use slipstream_store::{DirectIo, PolicyKind, Readahead, StreamConfig};

/// Where routed experts live, how they are read, and where the model runs.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct StoreArgs {
    /// Expert slots per layer (the cache size; default: what fits this
    /// machine's memory, printed at start).
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
    /// Most prompt tokens per prefill chunk (default 4096, less where memory
    /// is short). A disconnected client's prefill (`serve`) stops at the
    /// next chunk boundary: smaller chunks cancel sooner but read experts
    /// more often.
    #[arg(long)]
    pub prefill_chunk: Option<usize>,
    /// Refuse a prefill chunk when the footprint plus its predicted growth
    /// would exceed this, e.g. 20G (default: 90% of the smaller of physical
    /// memory and the cgroup limit).
    #[arg(long, value_parser = parse_size)]
    pub memory_limit: Option<u64>,
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
    /// FOR TESTING: size the store (slots, direct I/O, prompt chunk) as if
    /// this machine had this much memory, e.g. 2G, instead of what
    /// /proc/meminfo and the cgroup limit say. The memory guard keeps the
    /// detected limit.
    #[arg(long, value_parser = parse_size, hide = true)]
    pub assume_memory: Option<u64>,
}

/// What [`StoreArgs::plan`] settles: the engine to open, its backend
/// included.
#[derive(Debug, Clone)]
pub struct StorePlan {
    pub engine: EngineConfig,
    /// This machine's memory as detected (also under `--assume-memory`,
    /// which only sizes the store).
    pub machine: MachineMemory,
    /// The `[memory]` line: what was detected, what was chosen and why.
    pub summary: String,
}

/// Opens the model at `model`: a `.slip` directory, or a GGUF file in place
/// (docs/GGUF_IN_PLACE.md). Opened once: planning reads its manifest, the
/// engine takes it over.
pub fn open_model(model: &Path) -> Result<SlipModel> {
    if model.is_file() && slipstream_repack::is_gguf_file(model) {
        open_gguf(model)
    } else {
        SlipModel::open(model).with_context(|| format!("opening model {}", model.display()))
    }
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
    /// The engine configuration (its backend included) for the opened model `file`,
    /// with sequences of at most `context` tokens (positions). Flags win;
    /// what they leave open (slots, direct I/O, the prefill chunk) follows
    /// this machine's memory (`slipstream_engine::plan_memory`). The plan's
    /// `[memory]` line is printed to stderr. The memory guard's limit is
    /// `--memory-limit`, else 90 % of the detected memory.
    pub fn plan(&self, file: &SlipModel, context: usize) -> Result<StorePlan> {
        let machine = crate::machine_memory::detect();
        let planned_on = self.assume_memory.map_or(machine, MachineMemory::assume);
        let slots = match (self.resident, self.expert_cache_slots, self.memory_budget) {
            (true, _, _) => SlotsRequest::Resident,
            (false, Some(n), _) => SlotsRequest::Slots(n),
            (false, None, Some(b)) => SlotsRequest::Budget(b),
            (false, None, None) => SlotsRequest::Auto,
        };
        let request = MemoryRequest {
            slots,
            direct_io: self.direct_io,
            prefill_chunk: self.prefill_chunk,
            context,
            o_direct_supported: self.direct_io != DirectIo::Auto
                || slipstream_store::supports_direct_io(file.experts_path()),
        };
        let memory = plan_memory(&ModelSizes::of(file), &planned_on, &request)
            .map_err(anyhow::Error::msg)?;
        eprintln!("{}", memory.summary);
        let store = if memory.resident {
            StoreChoice::Resident
        } else {
            StoreChoice::Streaming(StreamConfig {
                slots: memory.slots,
                policy: self.expert_cache_policy,
                io_threads: self
                    .io_threads
                    .unwrap_or_else(crate::default_io_threads)
                    .max(1),
                direct_io: memory.direct_io.direct,
                readahead: self.readahead,
                background_fill: !self.no_background_fill,
            })
        };
        Ok(StorePlan {
            engine: EngineConfig {
                prefill_chunk: memory.prefill_chunk,
                store,
                route_trace: self.route_trace.clone(),
                gguf_index_dir: crate::gguf_index_dir(),
                memory_limit: self.memory_limit.or(machine.guard_limit()),
                backend: self.backend_choice(file)?,
            },
            machine,
            summary: memory.summary,
        })
    }

    /// `--backend` with the CUDA options (`--vram-slots`, `--vram-budget`,
    /// `--ram-cache-slots`, the expert cache policy).
    fn backend_choice(&self, file: &SlipModel) -> Result<BackendChoice> {
        if self.backend == "cpu" {
            return Ok(BackendChoice::Cpu);
        }
        let vram_slots = match (self.vram_slots, self.vram_budget) {
            (Some(n), _) => Some(n.max(1)),
            (None, Some(b)) => Some(slipstream_engine::vram_slots_for_budget(file, b)),
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
