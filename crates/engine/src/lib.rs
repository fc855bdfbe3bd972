//! The engine: the only crate that wires a `.slip` model, an expert store,
//! the model code and the tokenizer together. This file holds the engine
//! itself (opening, the backend, hooks, snapshots, the expert cache);
//! [`generate`] runs prefill and decode, [`plan`] predicts memory.

pub mod generate;
pub mod guard;
pub mod heap;
pub mod npy;
pub mod plan;
pub mod prompt_cache;
pub mod sampler;
pub mod snapshot;
pub mod speculative;
pub mod state_cache;
pub mod text;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use slipstream_core::ModelConfig;
pub use slipstream_format::SlipModel;
pub use slipstream_models::transformer::PhaseTimes;
pub use slipstream_models::ModelState;
use slipstream_models::{Logits, Transformer};
use slipstream_store::{
    ExpertStore, ResidentStore, StoreCounters, StreamConfig, StreamingStore, TraceHeader,
    TraceWriter, TracedStore,
};

pub use generate::{
    peak_rss_bytes, FinishReason, GenerateRequest, Generation, GenerationPhases, GenerationStats,
};
pub use guard::GrowthPrediction;
pub use plan::{
    parse_size, plan_memory, predict_footprint, resolve_direct_io, slots_for_budget,
    vram_slots_for_budget, DirectIoChoice, FootprintPrediction, MachineMemory, MemoryPlan,
    MemoryRequest, ModelSizes, SlotsRequest,
};
pub use prompt_cache::PromptCache;
pub use sampler::{Penalties, PenaltyTracker, Sampler, SamplingParams};
pub use slipstream_format::GenerationDefaults;
pub use snapshot::{Snapshot, SnapshotError, SnapshotExpect};
pub use speculative::{
    lookup_draft, Drafter, SpeculateMode, Speculation, SpeculationStats, DEFAULT_DRAFT_TOKENS,
};
pub use state_cache::{Checkpoint, Restored, StateCache, StateCacheStats};
pub use text::{text_bytes_bound, Bounded, ChatMessage, ChatTemplate, StreamDecoder, TextCodec};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Format(#[from] slipstream_format::FormatError),
    /// A GGUF file opened in place could not be read as a model.
    #[error(transparent)]
    Gguf(#[from] slipstream_repack::RepackError),
    #[error(transparent)]
    Model(#[from] slipstream_models::ModelError),
    #[error("expert store: {0}")]
    Store(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("{0}")]
    Request(String),
    /// The memory guard refused a prefill chunk (nothing was allocated).
    #[error("{0}")]
    Memory(String),
    /// The [`StepHook`] stopped the generation.
    #[error("{0}")]
    Hook(String),
}

/// Sees every step of a generation on the host: masks the logits a token
/// is chosen from (constrained decoding) and learns the token chosen. With
/// a hook installed ([`Engine::set_step_hook`]) every token is chosen on
/// the host, also on the CUDA backend.
pub trait StepHook: Send {
    /// The logits `[vocab]` of the next token, after the request's
    /// [`Penalties`] and before temperature and truncation; set entries to
    /// `-inf` to forbid tokens. An error ends the generation with it.
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String>;
    /// The token chosen from the masked logits, or written by the caller
    /// (a forced reasoning close).
    fn accept(&mut self, token: u32) -> Result<(), String>;
}

/// A prefill chunk boundary, handed to the [`PrefillHook`].
pub struct PrefillCheckpoint<'a> {
    /// The state after the chunk, with `last_logits` of its last token.
    pub state: &'a ModelState,
    /// Experts the cache holds now, per layer.
    pub resident: &'a [Vec<u32>],
    /// Whether this is the last chunk of the prefill call.
    pub last_chunk: bool,
}

/// Called after every prefill chunk (e.g. to write snapshots for a prompt
/// cache). Failures are the hook's to report; it cannot stop the prefill.
pub type PrefillHook = Box<dyn FnMut(&PrefillCheckpoint<'_>) + Send>;

/// What [`Engine::restore_for_prompt`] did.
#[derive(Debug)]
pub enum RestoreOutcome {
    /// The snapshot's `tokens` prompt tokens were restored.
    Restored {
        tokens: usize,
        warmed: Option<WarmReport>,
    },
    /// No snapshot file.
    Missing,
    /// A valid snapshot of a prompt that is not a prefix of this one.
    DifferentPrompt { tokens: usize },
    /// The snapshot cannot be used (other model or version, corrupt,
    /// truncated, wrong shapes).
    Rejected(SnapshotError),
}

/// What warming the expert cache did.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct WarmReport {
    /// Experts requested (at most the slots of each layer).
    pub experts: usize,
    pub misses: u64,
    pub bytes_read: u64,
    pub seconds: f64,
}

/// Where routed experts live.
#[derive(Debug, Clone)]
pub enum StoreChoice {
    /// Every expert read once at open and kept in memory.
    Resident,
    /// A bounded per-layer cache filled from the SSD.
    Streaming(StreamConfig),
}

/// Settings of an engine, passed explicitly.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Most prompt tokens run through the model at once.
    pub prefill_chunk: usize,
    pub store: StoreChoice,
    /// Record every expert request to this route trace file.
    pub route_trace: Option<std::path::PathBuf>,
    /// Where a GGUF run in place keeps its checksum table when the file's
    /// own directory cannot (docs/GGUF_IN_PLACE.md).
    pub gguf_index_dir: Option<std::path::PathBuf>,
    /// The memory guard's limit in bytes (`None`: no guard); the
    /// `slipstream` command passes [`MachineMemory::guard_limit`].
    pub memory_limit: Option<u64>,
    /// Where the model runs; settled when the engine opens
    /// ([`Engine::backend_note`] says what was chosen).
    pub backend: BackendChoice,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            prefill_chunk: 4096,
            store: StoreChoice::Streaming(StreamConfig::default()),
            route_trace: None,
            gguf_index_dir: None,
            memory_limit: None,
            backend: BackendChoice::Cpu,
        }
    }
}

/// An opened model ready to generate.
pub struct Engine {
    pub file: Arc<SlipModel>,
    pub model: Transformer,
    store: TracedStore,
    pub codec: Option<TextCodec>,
    pub template: Option<ChatTemplate>,
    config: EngineConfig,
    memory_limit: Option<u64>,
    /// Whether a forward pass has touched the mapped dense weights.
    dense_touched: bool,
    prefill_hook: Option<PrefillHook>,
    /// Phase timers, when turned on by [`Engine::set_phases`].
    phases: Option<PhaseTimes>,
    /// The CUDA backend, when the configuration's [`BackendChoice`] chose it.
    cuda: Option<slipstream_cuda::CudaModel>,
    /// The tokens of the sequence whose state the CUDA backend's device
    /// holds (`None`: unknown, after a failed pass). A host state with other
    /// tokens is uploaded before it runs ([`Engine::state_to_device`]).
    device_tokens: Option<Vec<u32>>,
    /// Checkpoints being taken for a [`StateCache`] during
    /// [`Engine::generate_cached`].
    checkpoints: Option<CheckpointCollector>,
    /// Called at every generated step ([`StepHook`]).
    step_hook: Option<Box<dyn StepHook>>,
    /// Speculative decoding settings ([`Engine::set_speculation`]).
    speculation: Speculation,
    /// The drafter of [`SpeculateMode::Custom`].
    drafter: Option<Box<dyn Drafter>>,
    /// The MTP head's drafting state while a generation drafts with it; the
    /// CPU passes hand it their hidden rows.
    mtp_drafter: Option<speculative::MtpDrafter>,
    /// [`Engine::backend_note`].
    backend_note: Option<String>,
}

/// Checkpoints of the conversation being generated.
struct CheckpointCollector {
    /// Take one at every multiple of this position inside a prefill.
    interval: usize,
    /// And one at this position (`GenerateRequest::checkpoint_at`).
    at: Option<usize>,
    taken: Vec<Arc<Checkpoint>>,
}

/// Records a pass of `tokens` on the CUDA device in `device_tokens`, which
/// [`Engine::state_to_device`] left equal to the state's tokens: appended on
/// success, unknown after a failure (a pass may have stopped midway).
fn device_ran(device_tokens: &mut Option<Vec<u32>>, tokens: &[u32], ok: bool) {
    match (ok, device_tokens.as_mut()) {
        (true, Some(t)) => t.extend_from_slice(tokens),
        _ => *device_tokens = None,
    }
}

/// Where the model runs (`slipstream run --backend`).
#[derive(Debug, Clone)]
pub enum BackendChoice {
    Cpu,
    /// The CUDA backend; an error when no GPU is usable.
    Cuda(slipstream_cuda::CudaOptions),
    /// CUDA when a GPU is usable, else the CPU.
    Auto(slipstream_cuda::CudaOptions),
}

/// Opens a model: a `.slip` directory, or a GGUF file read in place (its
/// checksum table beside it or in `gguf_index_dir`, built on first use).
pub fn open_model(path: &Path, gguf_index_dir: Option<&Path>) -> Result<SlipModel, EngineError> {
    if path.is_file() && slipstream_repack::is_gguf_file(path) {
        let opts = slipstream_repack::InPlaceOptions {
            index_dir: gguf_index_dir.map(Path::to_path_buf),
        };
        return Ok(slipstream_repack::open_gguf_in_place(path, &opts)?);
    }
    Ok(SlipModel::open(path)?)
}

impl Engine {
    /// Opens a model ([`open_model`]: a `.slip` directory or a GGUF file
    /// in place) with the store `config` chooses.
    pub fn open(path: &Path, config: EngineConfig) -> Result<Self, EngineError> {
        let file = Arc::new(open_model(path, config.gguf_index_dir.as_deref())?);
        Self::from_model(file, config)
    }

    /// An engine over a model already opened (and so verified): the caller
    /// that planned with its manifest opens and hashes it only once.
    pub fn from_model(file: Arc<SlipModel>, config: EngineConfig) -> Result<Self, EngineError> {
        // Before the model loads: measured faster than from the prefill on.
        heap::keep_freed_memory();
        let model = slipstream_models::load(&file.manifest.config, file.as_ref())?;
        let inner: Box<dyn ExpertStore> = match &config.store {
            StoreChoice::Resident => Box::new(
                ResidentStore::open(file.clone()).map_err(|e| EngineError::Store(e.to_string()))?,
            ),
            StoreChoice::Streaming(sc) => Box::new(
                StreamingStore::open(file.clone(), sc.clone())
                    .map_err(|e| EngineError::Store(e.to_string()))?,
            ),
        };
        let trace = match &config.route_trace {
            Some(path) => {
                let c = &file.manifest.config;
                Some(
                    TraceWriter::create(
                        path,
                        TraceHeader {
                            layers: c.num_layers(),
                            experts: c.num_experts,
                            top_k: c.num_experts_per_tok,
                        },
                    )
                    .map_err(|e| {
                        EngineError::Request(format!("route trace {}: {e}", path.display()))
                    })?,
                )
            }
            None => None,
        };
        let store = TracedStore::new(inner, trace);
        let codec = match &file.manifest.tokenizer {
            Some(name) => Some(TextCodec::from_bytes(&file.read_file(name)?)?),
            None => None,
        };
        let template = match &file.manifest.chat_template {
            Some(src) => Some(ChatTemplate::new(src)?),
            None => None,
        };
        let memory_limit = config.memory_limit;
        let backend = config.backend.clone();
        let mut engine = Engine {
            file,
            model,
            store,
            codec,
            template,
            config,
            memory_limit,
            dense_touched: false,
            prefill_hook: None,
            phases: None,
            cuda: None,
            device_tokens: None,
            checkpoints: None,
            step_hook: None,
            speculation: Speculation::default(),
            drafter: None,
            mtp_drafter: None,
            backend_note: None,
        };
        engine.backend_note = engine.start_backend(&backend)?;
        Ok(engine)
    }

    /// The configuration the engine was opened with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// What the configuration's backend choice settled, as one line (`None`
    /// for the CPU when it was asked for, which needs no set-up).
    pub fn backend_note(&self) -> Option<&str> {
        self.backend_note.as_deref()
    }

    /// Starts the backend `choice` names; returns a line describing the
    /// choice (`None` for a CPU that was asked for). The CUDA backend keeps
    /// its state on the device; the engine copies it to the host where a
    /// snapshot, the prompt cache or the state cache takes it, and back when
    /// a restored state runs.
    fn start_backend(&mut self, choice: &BackendChoice) -> Result<Option<String>, EngineError> {
        let opts = match choice {
            BackendChoice::Cpu => return Ok(None),
            BackendChoice::Auto(o) => match slipstream_cuda::probe() {
                Ok(_) => o,
                Err(e) => return Ok(Some(format!("backend: cpu ({e})"))),
            },
            BackendChoice::Cuda(o) => o,
        };
        let parts = &self.file.manifest.experts.parts;
        if !self.file.manifest.experts.layer_parts.is_empty() {
            let why = "the CUDA backend needs one expert type per part for all layers, and this model's differ between layers (a K-quant mix)";
            if let BackendChoice::Auto(_) = choice {
                return Ok(Some(format!("backend: cpu ({why})")));
            }
            return Err(EngineError::Request(format!(
                "{why}: run it with --backend cpu"
            )));
        }
        if parts.len() != 3 {
            return Err(EngineError::Request(format!(
                "the expert pool has {} parts per record, the CUDA backend needs gate, up, down",
                parts.len()
            )));
        }
        let p = |i: usize| (parts[i].qtype, parts[i].shape);
        let m = slipstream_cuda::CudaModel::new(&self.model, [p(0), p(1), p(2)], opts)
            .map_err(|e| EngineError::Request(format!("CUDA backend: {e}")))?;
        let mut m = m;
        let mut line = format!("backend: {}", m.describe());
        if m.slots() >= self.model.config.num_experts
            || opts
                .ram_slots
                .is_some_and(|r| r >= self.model.config.num_experts)
        {
            // Fully resident: fill VRAM now so decode carries no first-use copies.
            let t = std::time::Instant::now();
            let n = m
                .preload(&mut self.store)
                .map_err(|e| EngineError::Request(format!("CUDA backend: {e}")))?
                .map_err(|e| EngineError::Store(e.to_string()))?;
            line.push_str(&format!(
                "; {n} experts preloaded into VRAM (and a full RAM tier) in {:.1} s",
                t.elapsed().as_secs_f64()
            ));
            if m.device_routing() {
                line.push_str("; routing on the device (no host round trip per layer)");
                if m.pass_graphs() {
                    line.push_str("; each pass's layers replayed as one CUDA graph");
                }
            }
        }
        self.cuda = Some(m);
        self.device_tokens = None;
        Ok(Some(line))
    }

    /// How the prompt's products are computed: `exact` (the CPU backend,
    /// or CUDA on its exact forms) or `int8` (CUDA's 8-bit prompt forms,
    /// [`slipstream_cuda::PromptPrecision`]).
    pub fn prompt_precision(&self) -> &'static str {
        self.cuda
            .as_ref()
            .map_or("exact", |c| c.prompt_precision().name())
    }

    /// Counters of the CUDA backend (`None` on the CPU).
    pub fn cuda_stats(&self) -> Option<slipstream_cuda::CudaStats> {
        self.cuda.as_ref().map(|c| c.stats)
    }

    /// One forward pass on the chosen backend over prompt tokens
    /// (`prompt`) or a generated one (the CUDA backend may run the two on
    /// different kernels).
    fn run_model(
        &mut self,
        state: &mut ModelState,
        tokens: &[u32],
        want: Logits,
        prompt: bool,
    ) -> Result<Vec<f32>, slipstream_models::ModelError> {
        self.state_to_device(state)?;
        match self.cuda.as_mut() {
            Some(_) => {
                // Drafting with the MTP head: it takes every pass's
                // final-normed hidden rows, read back from the device.
                let keep_hidden = self.mtp_drafter.is_some();
                let start = state.tokens.len();
                let (out, hidden) = self.run_on_device(state, tokens, want, prompt, keep_hidden);
                if let (Ok(_), Some(d)) = (&out, self.mtp_drafter.as_mut()) {
                    d.push_hidden(start, &hidden);
                }
                out
            }
            None => match self.mtp_drafter.as_mut() {
                // Drafting with the MTP head: it takes every pass's
                // final-normed hidden rows (the logits are the same bits).
                Some(d) => {
                    let start = state.tokens.len();
                    let mut hidden = Vec::new();
                    let out = self.model.forward_timed_hidden(
                        state,
                        tokens,
                        &mut self.store,
                        want,
                        self.phases.as_mut(),
                        &mut hidden,
                    );
                    if out.is_ok() {
                        d.push_hidden(start, &hidden);
                    }
                    out
                }
                None => self.model.forward_timed(
                    state,
                    tokens,
                    &mut self.store,
                    want,
                    None,
                    self.phases.as_mut(),
                ),
            },
        }
    }

    /// A pass of `tokens` on the CUDA backend (the caller checked there is
    /// one) from `state`, which the caller brought to the device
    /// ([`Engine::state_to_device`]); with `keep_hidden`
    /// also every token's final-normed hidden row (`[tokens, hidden]`,
    /// else empty).
    pub(crate) fn run_on_device(
        &mut self,
        state: &mut ModelState,
        tokens: &[u32],
        want: Logits,
        prompt: bool,
        keep_hidden: bool,
    ) -> (Result<Vec<f32>, slipstream_models::ModelError>, Vec<f32>) {
        let Some(c) = self.cuda.as_mut() else {
            let e = slipstream_models::ModelError::State("no CUDA backend".into());
            return (Err(e), Vec::new());
        };
        c.set_prompt_pass(prompt);
        let phases = self.phases.as_mut();
        let out = if keep_hidden {
            c.collect_hidden();
            self.model
                .run_norming_every_row(c, state, tokens, &mut self.store, want, phases)
        } else {
            self.model
                .run(c, state, tokens, &mut self.store, want, None, phases)
        };
        let hidden = c.take_hidden();
        device_ran(&mut self.device_tokens, tokens, out.is_ok());
        (out, hidden)
    }

    /// Sets speculative decoding for the generations that follow (off by
    /// default), on either backend. The output is the same tokens either way: greedy bit for bit,
    /// sampled draw for draw (see docs/SPECULATIVE.md).
    pub fn set_speculation(&mut self, settings: Speculation) -> Result<(), EngineError> {
        settings
            .check(self.model.mtp_depth())
            .map_err(EngineError::Request)?;
        self.speculation = settings;
        Ok(())
    }

    pub fn speculation(&self) -> &Speculation {
        &self.speculation
    }

    /// What [`Engine::set_speculation`] settled, for a start-up line: `None`
    /// when off; on CUDA, that generation stays plain.
    pub fn speculation_note(&self) -> Option<String> {
        let s = &self.speculation;
        match s.mode {
            SpeculateMode::Off => None,
            mode => Some(format!(
                "speculative decoding: {}, {} drafts per verify pass{}",
                mode.name(),
                s.draft_tokens,
                if s.auto_off { "" } else { ", always on" }
            )),
        }
    }

    /// Installs the drafter [`SpeculateMode::Custom`] drafts with.
    pub fn set_drafter(&mut self, drafter: Option<Box<dyn Drafter>>) -> Option<Box<dyn Drafter>> {
        std::mem::replace(&mut self.drafter, drafter)
    }

    /// Makes the CUDA backend's device hold `state` before a pass runs from
    /// it: a state of another sequence (restored from a snapshot, the
    /// prompt cache or the state cache, or another conversation's) is
    /// uploaded; a fresh one needs nothing (the pass at position 0 clears
    /// the device). A no-op on the CPU.
    fn state_to_device(&mut self, state: &ModelState) -> Result<(), slipstream_models::ModelError> {
        let Some(c) = self.cuda.as_mut() else {
            return Ok(());
        };
        if state.tokens.is_empty() {
            // The pass at position 0 clears the device.
            self.device_tokens = Some(Vec::new());
            return Ok(());
        }
        if self.device_tokens.as_ref() == Some(&state.tokens) {
            return Ok(());
        }
        self.device_tokens = None;
        c.write_state(state)
            .map_err(|e| slipstream_models::ModelError::State(format!("CUDA: {e}")))?;
        self.device_tokens = Some(state.tokens.clone());
        Ok(())
    }

    /// Copies the CUDA backend's device state into `state.layers` when the
    /// device holds `state`'s sequence, so it can be checkpointed, cached or
    /// saved (the KV rows the host already holds stay; the rest come over).
    /// A no-op on the CPU, whose passes write `state` itself.
    fn state_to_host(&mut self, state: &mut ModelState) -> Result<(), EngineError> {
        let Some(c) = self.cuda.as_mut() else {
            return Ok(());
        };
        if self.device_tokens.as_ref() != Some(&state.tokens) {
            return Ok(());
        }
        c.read_state(state).map_err(|e| {
            EngineError::Model(slipstream_models::ModelError::State(format!("CUDA: {e}")))
        })
    }

    /// Turns the per-phase timers on or off (off by default: timing costs a
    /// few clock reads per layer).
    pub fn set_phases(&mut self, on: bool) {
        self.phases = on.then(PhaseTimes::default);
    }

    /// Footprint limit of the memory guard (`None`: off). Defaults to
    /// [`EngineConfig::memory_limit`].
    pub fn set_memory_limit(&mut self, limit: Option<u64>) {
        self.memory_limit = limit;
    }

    pub fn memory_limit(&self) -> Option<u64> {
        self.memory_limit
    }

    /// Installs (or removes) the hook called at every generated step of
    /// the following generations; returns the one it replaces.
    pub fn set_step_hook(&mut self, hook: Option<Box<dyn StepHook>>) -> Option<Box<dyn StepHook>> {
        std::mem::replace(&mut self.step_hook, hook)
    }

    /// Installs (or removes) the hook called after every prefill chunk.
    pub fn set_prefill_hook(&mut self, hook: Option<PrefillHook>) -> Option<PrefillHook> {
        std::mem::replace(&mut self.prefill_hook, hook)
    }

    /// Identifies the weights (`manifest.model_hash`).
    pub fn model_hash(&self) -> &str {
        &self.file.manifest.model_hash
    }

    /// What a snapshot must match to be restored into this model.
    pub fn snapshot_expect(&self) -> SnapshotExpect {
        SnapshotExpect {
            model_hash: self.model_hash().to_string(),
            layers: snapshot::LayerShape::of(&self.new_state()),
            vocab_size: self.model.config.vocab_size,
            num_experts: self.model.config.num_experts,
            expert_layers: self.model.config.total_layers(),
        }
    }

    /// Writes `state` and the experts resident now to `path`, atomically.
    /// Returns the bytes written.
    pub fn save_snapshot(&self, path: &Path, state: &ModelState) -> Result<u64, SnapshotError> {
        if state.tokens.is_empty() || state.last_logits.len() != self.model.config.vocab_size {
            return Err(SnapshotError::Shape(
                "only a state with tokens and their next-token logits can be saved".into(),
            ));
        }
        snapshot::write_snapshot(path, self.model_hash(), state, &self.resident_experts())
    }

    /// Reads a snapshot and checks it against this model.
    pub fn load_snapshot(&self, path: &Path) -> Result<Snapshot, SnapshotError> {
        snapshot::read_snapshot(path, &self.snapshot_expect())
    }

    /// A state for `prompt` from the snapshot at `path`: restored (and the
    /// expert cache warmed with the experts it recorded when `warm`) when the
    /// snapshot's tokens are a prefix of the prompt, fresh otherwise. A
    /// snapshot that cannot be used is logged as a warning and reported in
    /// the outcome; it never fails the call.
    pub fn restore_for_prompt(
        &mut self,
        path: &Path,
        prompt: &[u32],
        warm: bool,
    ) -> (ModelState, RestoreOutcome) {
        if !path.exists() {
            return (self.new_state(), RestoreOutcome::Missing);
        }
        match self.load_snapshot(path) {
            Ok(snap) if prompt.starts_with(&snap.state.tokens) => {
                let warmed = if warm {
                    match self.warm_experts(&snap.resident) {
                        Ok(r) => Some(r),
                        Err(e) => {
                            tracing::warn!("warming the expert cache failed: {e}");
                            None
                        }
                    }
                } else {
                    None
                };
                let tokens = snap.state.tokens.len();
                (snap.state, RestoreOutcome::Restored { tokens, warmed })
            }
            Ok(snap) => (
                self.new_state(),
                RestoreOutcome::DifferentPrompt {
                    tokens: snap.state.tokens.len(),
                },
            ),
            Err(e) => {
                tracing::warn!(
                    "ignoring snapshot {}: {e}; prefilling from scratch",
                    path.display()
                );
                (self.new_state(), RestoreOutcome::Rejected(e))
            }
        }
    }

    /// Opens a prompt cache for this model.
    pub fn open_prompt_cache(&self, dir: &Path, max_bytes: u64) -> std::io::Result<PromptCache> {
        PromptCache::open(dir, max_bytes, self.snapshot_expect())
    }

    /// Reads the listed experts into the cache's slots (see
    /// [`slipstream_store::warm_source`]); a no-op for a resident store.
    pub fn warm_experts(&mut self, resident: &[Vec<u32>]) -> Result<WarmReport, EngineError> {
        let experts = self.model.config.num_experts as u32;
        let layers = self.model.layers.len();
        let list: Vec<Vec<u32>> = resident
            .iter()
            .take(layers)
            .map(|l| l.iter().copied().filter(|&e| e < experts).collect())
            .collect();
        let before = self.store.inner.counters();
        let t = Instant::now();
        let n = self
            .store
            .warm(&list)
            .map_err(|e| EngineError::Store(e.to_string()))?;
        let d = self.store.inner.counters().since(&before);
        Ok(WarmReport {
            experts: n,
            misses: d.misses,
            bytes_read: d.bytes_read,
            seconds: t.elapsed().as_secs_f64(),
        })
    }

    pub fn model_config(&self) -> &ModelConfig {
        &self.model.config
    }

    /// Tokens that end generation by default.
    pub fn eos_tokens(&self) -> &[u32] {
        &self.file.manifest.eos_token_ids
    }

    /// The sampling settings the checkpoint recommends (all absent when
    /// its manifest records none).
    pub fn generation_defaults(&self) -> slipstream_format::GenerationDefaults {
        self.file.manifest.generation.clone().unwrap_or_default()
    }

    pub fn new_state(&self) -> ModelState {
        self.model.new_state()
    }

    /// Makes the engine usable again after a pass panicked (a caller that
    /// catches panics, like the server, calls this): the store forgets the
    /// request left pending and no checkpoints are being collected.
    pub fn recover_after_panic(&mut self) {
        self.store.inner.abandon_pending();
        self.checkpoints = None;
    }

    /// Tokens between [`StateCache`] checkpoints inside a prefill for this
    /// model (see [`state_cache::default_checkpoint_interval`]).
    pub fn default_checkpoint_interval(&self) -> usize {
        let state = self.new_state();
        let kv_per_token: usize = state
            .layers
            .iter()
            .map(|l| match l {
                slipstream_models::state::LayerState::Attn(a) => a.kv_dim * 2 * 4,
                slipstream_models::state::LayerState::Linear(_) => 0,
            })
            .sum();
        state_cache::default_checkpoint_interval(
            state_cache::checkpoint_bytes(&state, self.model.config.vocab_size),
            kv_per_token,
        )
    }

    pub fn store_counters(&self) -> StoreCounters {
        self.store.inner.counters()
    }

    /// One line describing the expert store.
    pub fn store_description(&self) -> String {
        self.store.inner.describe()
    }

    /// Experts held in memory now, per layer.
    pub fn resident_experts(&self) -> Vec<Vec<u32>> {
        self.store.inner.resident_experts()
    }

    /// Completes the route trace file, if one is being recorded.
    pub fn finish_trace(&mut self) -> Result<(), EngineError> {
        self.store
            .finish_trace()
            .map_err(|e| EngineError::Request(format!("route trace: {e}")))
    }
}
