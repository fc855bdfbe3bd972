//! The engine: the only crate that wires a `.slip` model, an expert store,
//! the model code and the tokenizer together. Prefill runs in chunks,
//! decode one token at a time; counters and timings come back with every
//! generation.

pub mod guard;
pub mod heap;
pub mod npy;
pub mod prompt_cache;
pub mod sampler;
pub mod snapshot;
pub mod state_cache;
pub mod text;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use slipstream_core::ModelConfig;
use slipstream_format::SlipModel;
use slipstream_kernels::sample::DrawParams;
pub use slipstream_models::transformer::PhaseTimes;
pub use slipstream_models::ModelState;
use slipstream_models::{Logits, Transformer};
use slipstream_store::{
    ExpertStore, Phase, ResidentStore, StoreCounters, StreamConfig, StreamingStore, TraceHeader,
    TraceWriter, TracedStore,
};

pub use guard::{default_memory_limit, GrowthPrediction};
pub use prompt_cache::PromptCache;
pub use sampler::{Penalties, PenaltyTracker, Sampler, SamplingParams};
pub use slipstream_format::GenerationDefaults;
pub use snapshot::{Snapshot, SnapshotError, SnapshotExpect};
pub use state_cache::{Checkpoint, Restored, StateCache, StateCacheStats};
pub use text::{text_bytes_bound, Bounded, ChatMessage, ChatTemplate, StreamDecoder, TextCodec};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Format(#[from] slipstream_format::FormatError),
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
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            prefill_chunk: 4096,
            store: StoreChoice::Streaming(StreamConfig::default()),
            route_trace: None,
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
    /// The CUDA backend, when [`Engine::set_backend`] chose it.
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
}

/// Checkpoints of the conversation being generated.
struct CheckpointCollector {
    /// Take one at every multiple of this position inside a prefill.
    interval: usize,
    taken: Vec<Arc<Checkpoint>>,
}

/// The pieces a prefill of `len` tokens starting at position `base` runs
/// in: `(start, end, chunk_end)` with offsets into the prefilled tokens.
/// Chunks of `chunk` tokens from the start of the call, each split further
/// where an absolute position is a multiple of `interval`; `chunk_end`
/// marks the ends of the chunks themselves.
fn prefill_pieces(
    base: usize,
    len: usize,
    chunk: usize,
    interval: Option<usize>,
) -> Vec<(usize, usize, bool)> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < len {
        let chunk_end = (start / chunk + 1) * chunk;
        let mut end = chunk_end.min(len);
        if let Some(n) = interval.filter(|&n| n > 0) {
            let next = ((base + start) / n + 1) * n - base;
            end = end.min(next);
        }
        out.push((start, end, end == chunk_end.min(len)));
        start = end;
    }
    out
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

/// One generation request.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Stop when one of these is produced (the model's EOS ids are added).
    pub stop_tokens: Vec<u32>,
    /// Keep the logits of every prompt position and every generated step.
    pub keep_logits: bool,
    /// Set from another thread to stop between prefill chunks or tokens.
    pub cancel: Option<Arc<std::sync::atomic::AtomicBool>>,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Length,
    Stop,
    Cancelled,
}

/// Result of one generation.
#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    /// `[prompt + generated - 1, vocab]` when `keep_logits`, else empty.
    pub logits: Vec<f32>,
    pub stats: GenerationStats,
    /// Per-phase time of the prefill and of the decode steps after the
    /// first token, when phase timers are on.
    pub phases: Option<GenerationPhases>,
}

/// Phase split of one generation.
#[derive(Debug, Clone, Copy)]
pub struct GenerationPhases {
    pub prefill: PhaseTimes,
    pub decode: PhaseTimes,
}

/// Timings and counters of one generation.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    /// Prompt tokens taken from the kept state instead of prefilled.
    pub reused_prompt_tokens: usize,
    pub generated_tokens: usize,
    pub time_to_first_token_s: f64,
    pub prefill_tokens_per_s: f64,
    /// Tokens after the first, per second of decode.
    pub decode_tokens_per_s: f64,
    pub peak_rss_bytes: u64,
    pub prefill_expert_misses: u64,
    pub prefill_expert_bytes_read: u64,
    /// Decode counters cover the steps after the first token (the first
    /// token's logits come from prefill).
    pub decode_expert_hits: u64,
    pub decode_expert_misses: u64,
    pub decode_misses_per_token: f64,
    pub decode_bytes_read_per_token: f64,
    pub decode_read_wait_ms_per_token: f64,
    pub expert_hits: u64,
    pub expert_misses: u64,
    pub expert_bytes_read: u64,
    /// Background reads into free slots started during the call (their
    /// bytes are in the `bytes_read` figures).
    pub expert_fills: u64,
}

impl Engine {
    /// Opens a `.slip` model directory with all experts resident.
    pub fn open(path: &Path, config: EngineConfig) -> Result<Self, EngineError> {
        // Before the model loads: measured faster than from the prefill on.
        heap::keep_freed_memory();
        let file = Arc::new(SlipModel::open(path)?);
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
        Ok(Engine {
            file,
            model,
            store,
            codec,
            template,
            config,
            memory_limit: guard::default_memory_limit(),
            dense_touched: false,
            prefill_hook: None,
            phases: None,
            cuda: None,
            device_tokens: None,
            checkpoints: None,
            step_hook: None,
        })
    }

    /// Chooses where the model runs; returns a line describing the choice.
    /// The CUDA backend keeps its state on the device; the engine copies
    /// it to the host where a snapshot, the prompt cache or the state cache
    /// takes it, and back when a restored state runs.
    pub fn set_backend(&mut self, choice: &BackendChoice) -> Result<String, EngineError> {
        let opts = match choice {
            BackendChoice::Cpu => {
                self.cuda = None;
                return Ok("backend: cpu".into());
            }
            BackendChoice::Auto(o) => match slipstream_cuda::probe() {
                Ok(_) => o,
                Err(e) => {
                    self.cuda = None;
                    return Ok(format!("backend: cpu ({e})"));
                }
            },
            BackendChoice::Cuda(o) => o,
        };
        let parts = &self.file.manifest.experts.parts;
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
        Ok(line)
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
            Some(c) => {
                c.set_prompt_pass(prompt);
                let out = self.model.run(
                    c,
                    state,
                    tokens,
                    &mut self.store,
                    want,
                    None,
                    self.phases.as_mut(),
                );
                self.device_tokens = out.is_ok().then(|| state.tokens.clone());
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
        }
    }

    /// Runs one generated token on the CUDA backend and returns the next
    /// token, chosen on the device: the argmax (`draw: None`) or the seeded
    /// draw (`CudaModel::next_token`).
    fn run_next_on_device(
        &mut self,
        state: &mut ModelState,
        token: u32,
        draw: Option<(DrawParams, f64)>,
    ) -> Result<u32, slipstream_models::ModelError> {
        let Some(c) = self.cuda.as_mut() else {
            return Err(slipstream_models::ModelError::State(
                "choosing tokens on the device without a CUDA backend".into(),
            ));
        };
        c.set_prompt_pass(false);
        let out = self.model.run(
            c,
            state,
            &[token],
            &mut self.store,
            Logits::None,
            None,
            self.phases.as_mut(),
        );
        match (&out, self.device_tokens.as_mut()) {
            (Ok(_), Some(t)) => t.push(token),
            _ => self.device_tokens = None,
        }
        out?;
        c.next_token(&self.model, draw)
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
        if state.tokens.is_empty() || self.device_tokens.as_ref() == Some(&state.tokens) {
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

    /// The next token from a row of logits on the host. On the CUDA
    /// backend a seeded draw runs on the device (`CudaModel::draw_row`:
    /// the token the host reference gives, in far less time); otherwise the
    /// sampler draws here.
    fn choose_from_row(
        &mut self,
        sampler: &mut Sampler,
        row: &[f32],
    ) -> Result<u32, slipstream_models::ModelError> {
        if let Some(c) = self.cuda.as_mut().filter(|_| sampler.is_fixed_point()) {
            if let Some((p, u)) = sampler.next_device_draw() {
                return c.draw_row(row, p, u);
            }
        }
        Ok(sampler.sample(row))
    }

    /// Turns the per-phase timers on or off (off by default: timing costs a
    /// few clock reads per layer).
    pub fn set_phases(&mut self, on: bool) {
        self.phases = on.then(PhaseTimes::default);
    }

    /// Footprint limit of the memory guard (`None`: off). Defaults to
    /// [`default_memory_limit`].
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

    /// Predicted footprint growth of prefilling `tokens` more tokens into
    /// `state` (see [`guard`] for what is counted).
    pub fn predict_prefill_growth(
        &self,
        state: &ModelState,
        tokens: usize,
        keep_all_logits: bool,
    ) -> GrowthPrediction {
        use slipstream_models::state::LayerState;
        let c = &self.model.config;
        let mut st = 0u64;
        for l in &state.layers {
            match l {
                LayerState::Attn(a) => {
                    let need = (a.len() + tokens) * a.kv_dim;
                    let cap = a.k.capacity();
                    if need > cap {
                        // Vec growth: a new buffer of max(2*cap, need) while
                        // the old one is still held, for K and for V.
                        st += 2 * 4 * need.max(2 * cap) as u64;
                    }
                }
                LayerState::Linear(s) if state.tokens.is_empty() => {
                    st += 4 * (s.conv.len() + s.recurrent.len()) as u64;
                }
                LayerState::Linear(_) => {}
            }
        }
        let chunk = self.config.prefill_chunk.max(1).min(tokens) as u64;
        let width = (c.hidden_size * (c.num_experts_per_tok + 8))
            .max(c.linear_conv_dim() * 2)
            .max(c.num_attention_heads * c.head_dim * 3)
            + c.moe_intermediate_size
                .max(c.shared_expert_intermediate_size)
                * 2;
        let mut act = chunk * width as u64 * 4 + c.vocab_size as u64 * 4 * 2;
        if keep_all_logits {
            act += tokens as u64 * c.vocab_size as u64 * 4 * 2;
        }
        GrowthPrediction {
            state: st,
            activations: act,
            unfilled_slots: self.store.inner.unfilled_slot_bytes(),
            dense_untouched: self.dense_untouched_bytes(),
        }
    }

    /// Dense weight bytes not yet in this process's resident set: the
    /// mapping's `Rss` where `/proc/self/smaps` tells, else all of them until
    /// a forward pass has run.
    fn dense_untouched_bytes(&self) -> u64 {
        let (addr, len) = self.file.dense_mapping();
        match guard::mapping_rss_bytes(addr) {
            Some(rss) if len > 0 => (len as u64).saturating_sub(rss),
            _ if self.dense_touched => 0,
            _ => self.file.manifest.dense_file_bytes,
        }
    }

    /// The memory guard: refuses to prefill `remaining` tokens (the next
    /// chunk being `chunk_tokens` of them) when footprint + predicted growth
    /// exceeds the limit.
    fn guard_chunk(
        &self,
        state: &ModelState,
        remaining: usize,
        chunk_tokens: usize,
        total: usize,
        keep_all: bool,
    ) -> Result<(), EngineError> {
        let Some(limit) = self.memory_limit else {
            return Ok(());
        };
        let Some(footprint) = guard::current_rss_bytes() else {
            return Ok(());
        };
        let growth = self.predict_prefill_growth(state, remaining, keep_all);
        if footprint.saturating_add(growth.total()) > limit {
            let msg = guard::refusal(
                chunk_tokens,
                total - remaining,
                total,
                footprint,
                &growth,
                limit,
            );
            tracing::debug!("{msg}");
            return Err(EngineError::Memory(msg));
        }
        Ok(())
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

    /// Runs `tokens` in chunks; returns the logits asked for (`All` rows
    /// concatenated across chunks, or the last row).
    pub fn prefill(
        &mut self,
        state: &mut ModelState,
        tokens: &[u32],
        want: Logits,
    ) -> Result<Vec<f32>, EngineError> {
        Ok(self
            .prefill_cancellable(state, tokens, want, &|| false)?
            .unwrap_or_default())
    }

    /// [`Engine::prefill`] that checks `cancelled` before each chunk and
    /// returns `None` when it fires (the state then holds the chunks done).
    pub fn prefill_cancellable(
        &mut self,
        state: &mut ModelState,
        tokens: &[u32],
        want: Logits,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Option<Vec<f32>>, EngineError> {
        let chunk = self.config.prefill_chunk.max(1);
        let vocab = self.model.config.vocab_size;
        let mut out = Vec::new();
        let interval = self.checkpoints.as_ref().map(|c| c.interval);
        let base = state.tokens.len();
        let pieces = prefill_pieces(base, tokens.len(), chunk, interval);
        let hooked = self.prefill_hook.is_some();
        let _release = heap::ReleaseOnDrop;
        for (i, &(start, end, chunk_end)) in pieces.iter().enumerate() {
            let piece = &tokens[start..end];
            let last = end == tokens.len();
            if cancelled() {
                // The state is valid for the chunks done, but its logits
                // are not those of its last token any more.
                state.last_logits.clear();
                return Ok(None);
            }
            let remaining = tokens.len() - start;
            if i > 0 {
                heap::release_freed();
            }
            self.guard_chunk(
                state,
                remaining,
                piece.len(),
                tokens.len(),
                want == Logits::All,
            )?;
            // A state cache checkpoint: at interval multiples and at the
            // end of the prompt.
            let checkpoint_here = interval.is_some_and(|n| last || (base + end).is_multiple_of(n));
            // The last row is always computed on the last chunk (the state's
            // next-token distribution, kept for reuse and snapshots), on
            // every chunk when a hook may snapshot the boundary, and where a
            // checkpoint is taken.
            let w = match want {
                Logits::All => Logits::All,
                _ if last || (hooked && chunk_end) || checkpoint_here => Logits::Last,
                _ => Logits::None,
            };
            let logits = self.run_model(state, piece, w, true)?;
            self.dense_touched = true;
            if w == Logits::None {
                state.last_logits.clear();
            } else {
                state.last_logits = logits[logits.len() - vocab..].to_vec();
            }
            if checkpoint_here || (chunk_end && hooked) {
                self.state_to_host(state)?;
            }
            if checkpoint_here {
                if let (Some(c), Some(cp)) = (self.checkpoints.as_mut(), Checkpoint::of(state)) {
                    c.taken.push(Arc::new(cp));
                }
            }
            if let (true, Some(mut hook)) = (chunk_end, self.prefill_hook.take()) {
                let resident = self.store.inner.resident_experts();
                hook(&PrefillCheckpoint {
                    state,
                    resident: &resident,
                    last_chunk: last,
                });
                self.prefill_hook = Some(hook);
            }
            if want == Logits::All || (last && want == Logits::Last) {
                out.extend_from_slice(&logits);
            }
        }
        Ok(Some(out))
    }

    fn cancelled(&self, req: &GenerateRequest, reused: usize, before: StoreCounters) -> Generation {
        let after = self.store.inner.counters().since(&before);
        Generation {
            phases: None,
            tokens: Vec::new(),
            finish: FinishReason::Cancelled,
            logits: Vec::new(),
            stats: GenerationStats {
                prompt_tokens: req.prompt.len(),
                reused_prompt_tokens: reused,
                peak_rss_bytes: peak_rss_bytes(),
                prefill_expert_misses: after.misses,
                prefill_expert_bytes_read: after.bytes_read,
                expert_hits: after.hits,
                expert_misses: after.misses,
                expert_bytes_read: after.bytes_read,
                ..Default::default()
            },
        }
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

    /// Generates from a state `cache` restored for this prompt (see
    /// [`StateCache::restore`]), taking checkpoints at the cache's interval
    /// inside the prefill and at the end of the prompt, and keeps the
    /// conversation (prompt and reply) in `cache` afterwards. The output is
    /// the same as from a fresh state: every restore point is a state an
    /// uninterrupted prefill passes through.
    pub fn generate_cached(
        &mut self,
        cache: &mut StateCache,
        restored: Restored,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Generation, EngineError> {
        let Restored {
            mut state,
            checkpoints,
            resident,
        } = restored;
        if let Some(resident) = resident.filter(|_| !state.tokens.is_empty()) {
            if let Err(e) = self.warm_experts(&resident) {
                tracing::warn!("warming the expert cache failed: {e}");
            }
        }
        let mut checkpoints = checkpoints;
        // A prompt restored whole runs no prefill, so its end is kept here.
        let at_prompt_end = state.tokens.len() == req.prompt.len();
        if at_prompt_end && checkpoints.last().map(|c| c.position) != Some(req.prompt.len()) {
            checkpoints.extend(Checkpoint::of(&state).map(Arc::new));
        }
        self.checkpoints = Some(CheckpointCollector {
            interval: cache.interval(),
            taken: checkpoints,
        });
        let result = self.generate_with_state(&mut state, req, on_token);
        let taken = self.checkpoints.take().map(|c| c.taken).unwrap_or_default();
        if result.is_ok() {
            let prompt_end = req.prompt.len().min(state.tokens.len());
            cache.insert(state, taken, prompt_end, self.resident_experts());
        }
        result
    }

    /// Generates from a fresh state. `on_token(id)` is called as each token
    /// is produced; returning `false` cancels.
    pub fn generate(
        &mut self,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Generation, EngineError> {
        // The state is dropped after: no copy of it back from a device.
        let mut state = self.new_state();
        let mut hook = self.step_hook.take();
        let result = self.generate_inner(&mut state, req, &mut hook, on_token);
        self.step_hook = hook;
        result
    }

    /// Generates continuing from `state` when its tokens are a prefix of
    /// the prompt (only the rest is prefilled), from a fresh state otherwise.
    /// On return `state` holds every token fed to the model (the prompt and
    /// all generated tokens but the last). With `keep_logits`, logits rows
    /// start at the first prefilled token. On error `state` is reset.
    pub fn generate_with_state(
        &mut self,
        state: &mut ModelState,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Generation, EngineError> {
        let mut hook = self.step_hook.take();
        let result = self.generate_inner(state, req, &mut hook, on_token);
        self.step_hook = hook;
        let result = result.and_then(|g| self.state_to_host(state).map(|()| g));
        if result.is_err() {
            *state = self.new_state();
        }
        result
    }

    fn generate_inner(
        &mut self,
        state: &mut ModelState,
        req: &GenerateRequest,
        hook: &mut Option<Box<dyn StepHook>>,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Generation, EngineError> {
        if req.prompt.is_empty() {
            return Err(EngineError::Request("the prompt is empty".into()));
        }
        let vocab = self.model.config.vocab_size;
        if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::Request(format!(
                "prompt token {bad} is outside the vocabulary (size {vocab})"
            )));
        }
        let phases_start = self.phases;
        let before = self.store.inner.counters();
        let reusable = state.tokens.len() <= req.prompt.len()
            && req.prompt.starts_with(&state.tokens)
            && (state.tokens.len() < req.prompt.len() || !state.last_logits.is_empty())
            && state.layers.len() == self.model.layers.len();
        if !reusable {
            *state = self.new_state();
        }
        let reused = state.tokens.len();
        let cancelled = || {
            req.cancel
                .as_ref()
                .is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed))
        };
        let mut sampler = Sampler::new(req.sampling.clone());
        // On the CUDA backend every draw is the device's integer draw,
        // also when a row is drawn from here.
        sampler.set_fixed_point(self.cuda.as_ref().is_some_and(|c| c.draws_on_device()));
        let mut stops: Vec<u32> = req.stop_tokens.clone();
        stops.extend_from_slice(self.eos_tokens());
        let mut penalties = req
            .sampling
            .penalties
            .is_active()
            .then(|| PenaltyTracker::new(req.sampling.penalties, &req.prompt));
        // Logits edited for a draw (penalties, the hook's mask): `last`
        // stays the model's, kept in the state for a later restore.
        let edits_logits = penalties.is_some() || hook.is_some();
        let mut edited: Vec<f32> = Vec::new();

        let t0 = Instant::now();
        let want = if req.keep_logits {
            Logits::All
        } else {
            Logits::Last
        };
        self.store.set_phase(Phase::Prefill);
        let suffix = &req.prompt[reused..];
        let mut all_logits = if suffix.is_empty() {
            Vec::new()
        } else {
            match self.prefill_cancellable(state, suffix, want, &cancelled)? {
                Some(l) => l,
                None => return Ok(self.cancelled(req, reused, before)),
            }
        };
        let phases_prefill = self.phases;
        let after_prefill = self.store.inner.counters();
        self.store.set_phase(Phase::Decode);
        let mut last: Vec<f32> = if all_logits.is_empty() {
            state.last_logits.clone()
        } else {
            all_logits[all_logits.len() - vocab..].to_vec()
        };
        if !req.keep_logits {
            all_logits.clear();
        }
        let prefill_s = t0.elapsed().as_secs_f64();

        let mut tokens = Vec::new();
        let mut finish = FinishReason::Length;
        let mut first_token_s = prefill_s;
        let t_decode = Instant::now();
        let mut decode_start = t_decode;
        // On the GPU each next token is chosen there (the argmax, or the
        // seeded draw): 4 bytes come back per token instead of a row of
        // logits (same tokens: the device follows `sampler::argmax`'s rule
        // and computes `sample::draw` bit for bit).
        let on_device = self.cuda.is_some()
            && !req.keep_logits
            && !edits_logits
            && (sampler.is_greedy() || sampler.is_fixed_point());
        let mut device_next: Option<u32> = None;
        while tokens.len() < req.max_new_tokens {
            let next = match device_next.take() {
                Some(t) => t,
                None if edits_logits => {
                    edited.clear();
                    edited.extend_from_slice(&last);
                    if let Some(p) = &penalties {
                        p.apply(&mut edited);
                    }
                    if let Some(h) = hook.as_deref_mut() {
                        h.mask(&mut edited).map_err(EngineError::Hook)?;
                    }
                    let t = self.choose_from_row(&mut sampler, &edited)?;
                    if let Some(h) = hook.as_deref_mut() {
                        h.accept(t).map_err(EngineError::Hook)?;
                    }
                    t
                }
                None => self.choose_from_row(&mut sampler, &last)?,
            };
            if let Some(p) = penalties.as_mut() {
                p.record(next);
            }
            tokens.push(next);
            if tokens.len() == 1 {
                first_token_s = t0.elapsed().as_secs_f64();
                decode_start = Instant::now();
            }
            if !on_token(next) || cancelled() {
                finish = FinishReason::Cancelled;
                break;
            }
            if stops.contains(&next) {
                finish = FinishReason::Stop;
                break;
            }
            if tokens.len() == req.max_new_tokens {
                break;
            }
            // The state's logits are set once, after the loop (a 1 MB copy
            // per token otherwise); a failed step leaves none.
            let step = if on_device {
                let draw = sampler.next_device_draw();
                self.run_next_on_device(state, next, draw).map(Some)
            } else {
                self.run_model(state, &[next], Logits::Last, false)
                    .map(|l| {
                        last = l;
                        None
                    })
            };
            match step {
                Ok(t) => device_next = t,
                Err(e) => {
                    state.last_logits.clear();
                    return Err(e.into());
                }
            }
            if req.keep_logits {
                all_logits.extend_from_slice(&last);
            }
        }
        state.last_logits = match self.cuda.as_mut() {
            // The last step's row is still on the device.
            Some(c) if on_device && tokens.len() > 1 => c.last_logits()?,
            _ => last,
        };
        let decode_s = decode_start.elapsed().as_secs_f64();
        let phases_end = self.phases;
        let after = self.store.inner.counters();
        let decoded = tokens.len().saturating_sub(1);
        let prefill_c = after_prefill.since(&before);
        let decode_c = after.since(&after_prefill);
        let per_decoded = |v: u64| {
            if decoded > 0 {
                v as f64 / decoded as f64
            } else {
                0.0
            }
        };
        let stats = GenerationStats {
            prompt_tokens: req.prompt.len(),
            reused_prompt_tokens: reused,
            generated_tokens: tokens.len(),
            time_to_first_token_s: first_token_s,
            prefill_tokens_per_s: rate(req.prompt.len() - reused, prefill_s),
            decode_tokens_per_s: rate(decoded, decode_s),
            peak_rss_bytes: peak_rss_bytes(),
            prefill_expert_misses: prefill_c.misses,
            prefill_expert_bytes_read: prefill_c.bytes_read,
            decode_expert_hits: decode_c.hits,
            decode_expert_misses: decode_c.misses,
            decode_misses_per_token: per_decoded(decode_c.misses),
            decode_bytes_read_per_token: per_decoded(decode_c.bytes_read),
            decode_read_wait_ms_per_token: per_decoded(decode_c.read_wait_ns) / 1e6,
            expert_hits: after.hits - before.hits,
            expert_misses: after.misses - before.misses,
            expert_bytes_read: after.bytes_read - before.bytes_read,
            expert_fills: after.fills - before.fills,
        };
        let phases = match (phases_start, phases_prefill, phases_end) {
            (Some(a), Some(b), Some(c)) => {
                let mut prefill = b.since(&a);
                prefill.store_read_wait_ns = Some(prefill_c.read_wait_ns);
                let mut decode = c.since(&b);
                decode.store_read_wait_ns = Some(decode_c.read_wait_ns);
                Some(GenerationPhases { prefill, decode })
            }
            _ => None,
        };
        Ok(Generation {
            phases,
            tokens,
            finish,
            logits: all_logits,
            stats,
        })
    }

    pub fn store_counters(&self) -> StoreCounters {
        self.store.inner.counters()
    }

    /// Predicted peak footprint of this engine at `context` tokens.
    pub fn predicted_footprint(&self, context: usize) -> FootprintPrediction {
        let slots = match &self.config.store {
            StoreChoice::Resident => self.model.config.num_experts,
            StoreChoice::Streaming(sc) => sc.slots,
        };
        predict_footprint(&self.file, slots, context, self.config.prefill_chunk)
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

fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// Peak resident set size of this process (VmHWM), 0 when unknown.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// Parses sizes like `8G`, `512M`, `1.5GiB`, `4096` (bytes).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("bad size {s:?}: expected e.g. 8G or 512M"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => 1024.0 * 1024.0,
        "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tb" | "tib" => 1024.0_f64.powi(4),
        _ => return Err(format!("bad size unit in {s:?}: use K, M, G or T")),
    };
    Ok((value * mult) as u64)
}

/// Predicted peak footprint of a streaming run, in bytes, by part.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FootprintPrediction {
    /// Dense weights (mapped, all pages touched).
    pub dense: u64,
    /// Expert slots, all layers.
    pub slots: u64,
    /// Scratch buffers for streamed misses.
    pub scratch: u64,
    /// KV cache and linear-attention state at `context` tokens.
    pub state: u64,
    /// Activations of one prefill chunk (rough upper bound).
    pub activations: u64,
    /// Process baseline: code, allocator, tokenizer, thread stacks.
    pub baseline: u64,
}

impl FootprintPrediction {
    pub fn total(&self) -> u64 {
        self.dense + self.slots + self.scratch + self.state + self.activations + self.baseline
    }
}

/// Predicts the footprint of a run with `slots` expert slots per layer, a
/// context of `context` tokens and prefill chunks of `chunk` tokens.
pub fn predict_footprint(
    file: &SlipModel,
    slots: usize,
    context: usize,
    chunk: usize,
) -> FootprintPrediction {
    let m = &file.manifest;
    let c = &m.config;
    let stride = m.experts.record_stride;
    // Slots are kept for every layer of the pool, MTP layers included.
    let layers = m.experts.num_layers as u64;
    let mut state = 0u64;
    for kind in &c.layer_types {
        state += match kind {
            slipstream_core::config::LayerKind::FullAttention => {
                // f32 K and V per token.
                (2 * c.num_key_value_heads * c.head_dim * 4 * context) as u64
            }
            slipstream_core::config::LayerKind::LinearAttention => {
                ((c.linear_conv_kernel - 1) * c.linear_conv_dim() * 4
                    + c.linear_num_value_heads
                        * c.linear_key_head_dim
                        * c.linear_value_head_dim
                        * 4) as u64
            }
        };
    }
    let tokens = chunk.min(context.max(1)) as u64;
    // Widest per-token activations: qkv/z projections, router logits, logits.
    let width = (c.hidden_size * 8)
        .max(c.linear_conv_dim() * 2)
        .max(c.num_attention_heads * c.head_dim * 3) as u64;
    let activations = tokens * width * 4 + c.vocab_size as u64 * 4 * 2;
    FootprintPrediction {
        dense: m.dense_file_bytes,
        slots: layers * slots.min(c.num_experts) as u64 * stride,
        scratch: 8 * stride,
        state,
        activations,
        baseline: 24 << 20,
    }
}

/// The outcome of `--direct-io auto` (or an explicit choice), with the
/// reason in words for the run's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirectIoChoice {
    pub direct: bool,
    pub reason: String,
}

/// Decides whether expert reads use O_DIRECT.
///
/// Buffered reads leave each read expert in the page cache, a free second
/// cache level below the slots, but only while memory has room for it: when
/// every expert has a slot the copy is pure duplication, and when the
/// memory left beside the predicted footprint (dense weights, slots, state
/// at `context` tokens, buffers) cannot hold half of the expert file, the
/// cache turns over without hits and squeezes the mapped dense weights out
/// (measured on the 35B model: 256 slots buffered prefilled 25-40 % slower
/// than 64 slots; at an 8 GB cap direct I/O decoded 3.26 tok/s against
/// buffered 2.42). `memory` is the smaller of physical memory and the cgroup
/// limit (`None`: unknown, keep buffered).
pub fn resolve_direct_io(
    mode: slipstream_store::DirectIo,
    file: &SlipModel,
    slots: usize,
    context: usize,
    chunk: usize,
    memory: Option<u64>,
) -> DirectIoChoice {
    use slipstream_store::DirectIo;
    let choice = |direct: bool, reason: String| DirectIoChoice { direct, reason };
    match mode {
        DirectIo::On => return choice(true, "--direct-io on".into()),
        DirectIo::Off => return choice(false, "--direct-io off".into()),
        DirectIo::Auto => {}
    }
    let m = &file.manifest;
    let experts = m.config.num_experts;
    if slots >= experts {
        return choice(
            true,
            format!("auto: all {experts} experts of a layer have slots, a page-cache copy would only duplicate them"),
        );
    }
    let Some(memory) = memory else {
        return choice(false, "auto: memory size unknown, buffered".into());
    };
    let pool = m.experts.record_stride * (m.experts.num_layers * experts) as u64;
    let footprint = predict_footprint(file, slots, context, chunk).total();
    let room = memory.saturating_sub(footprint);
    let gb = |b: u64| b as f64 / 1e9;
    if room < pool / 2 {
        choice(
            true,
            format!(
                "auto: {:.2} GB of memory beside the predicted {:.2} GB footprint cannot cache half of the {:.2} GB expert file",
                gb(room),
                gb(footprint),
                gb(pool)
            ),
        )
    } else {
        choice(
            false,
            format!(
                "auto: the page cache ({:.2} GB beside the predicted {:.2} GB footprint) caches experts below the slots",
                gb(room),
                gb(footprint)
            ),
        )
    }
}

/// The memory a run may use: the smaller of physical memory and the cgroup
/// limit, `None` when neither is known.
pub fn available_memory() -> Option<u64> {
    match (guard::physical_memory_bytes(), guard::cgroup_limit_bytes()) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The most slots per layer whose predicted footprint fits `budget`.
pub fn slots_for_budget(
    file: &SlipModel,
    budget: u64,
    context: usize,
    chunk: usize,
) -> Result<usize, String> {
    let fixed = predict_footprint(file, 0, context, chunk);
    let per_slot = file.manifest.experts.record_stride * file.manifest.experts.num_layers as u64;
    let room = budget.saturating_sub(fixed.total());
    let slots = (room / per_slot.max(1)) as usize;
    if slots == 0 {
        return Err(format!(
            "a memory budget of {:.2} GB leaves no room for expert slots: dense weights, state and buffers need {:.2} GB and one slot per layer {:.2} GB",
            budget as f64 / 1e9,
            fixed.total() as f64 / 1e9,
            per_slot as f64 / 1e9
        ));
    }
    Ok(slots.min(file.manifest.config.num_experts))
}
