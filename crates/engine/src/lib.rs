//! The engine: the only crate that wires a `.slip` model, an expert store,
//! the model code and the tokenizer together. Prefill runs in chunks,
//! decode one token at a time; counters and timings come back with every
//! generation.

pub mod npy;
pub mod sampler;
pub mod text;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use slipstream_core::ModelConfig;
use slipstream_format::SlipModel;
use slipstream_models::{Logits, ModelState, Transformer};
use slipstream_store::{ResidentStore, StoreCounters};

pub use sampler::{Sampler, SamplingParams};
pub use text::{ChatMessage, ChatTemplate, StreamDecoder, TextCodec};

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
}

/// Settings of an engine, passed explicitly.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Most prompt tokens run through the model at once.
    pub prefill_chunk: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            prefill_chunk: 4096,
        }
    }
}

/// An opened model ready to generate.
pub struct Engine {
    pub file: Arc<SlipModel>,
    pub model: Transformer,
    store: ResidentStore,
    pub codec: Option<TextCodec>,
    pub template: Option<ChatTemplate>,
    config: EngineConfig,
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
}

/// Timings and counters of one generation.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub time_to_first_token_s: f64,
    pub prefill_tokens_per_s: f64,
    /// Tokens after the first, per second of decode.
    pub decode_tokens_per_s: f64,
    pub peak_rss_bytes: u64,
    pub expert_hits: u64,
    pub expert_misses: u64,
    pub expert_bytes_read: u64,
}

impl Engine {
    /// Opens a `.slip` model directory with all experts resident.
    pub fn open(path: &Path, config: EngineConfig) -> Result<Self, EngineError> {
        let file = Arc::new(SlipModel::open(path)?);
        let model = slipstream_models::load(&file.manifest.config, file.as_ref())?;
        let store =
            ResidentStore::open(file.clone()).map_err(|e| EngineError::Store(e.to_string()))?;
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
        })
    }

    pub fn model_config(&self) -> &ModelConfig {
        &self.model.config
    }

    /// Tokens that end generation by default.
    pub fn eos_tokens(&self) -> &[u32] {
        &self.file.manifest.eos_token_ids
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
        let chunk = self.config.prefill_chunk.max(1);
        let mut out = Vec::new();
        let n_chunks = tokens.len().div_ceil(chunk);
        for (i, piece) in tokens.chunks(chunk).enumerate() {
            let last = i + 1 == n_chunks;
            let w = match want {
                Logits::All => Logits::All,
                Logits::Last if last => Logits::Last,
                _ => Logits::None,
            };
            let logits = self.model.forward(state, piece, &mut self.store, w, None)?;
            out.extend_from_slice(&logits);
        }
        Ok(out)
    }

    /// Generates from a fresh state. `on_token(id)` is called as each token
    /// is produced; returning `false` cancels.
    pub fn generate(
        &mut self,
        req: &GenerateRequest,
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
        let before = self.store.counters();
        let mut state = self.new_state();
        let mut sampler = Sampler::new(req.sampling.clone());
        let mut stops: Vec<u32> = req.stop_tokens.clone();
        stops.extend_from_slice(self.eos_tokens());

        let t0 = Instant::now();
        let want = if req.keep_logits {
            Logits::All
        } else {
            Logits::Last
        };
        let mut all_logits = self.prefill(&mut state, &req.prompt, want)?;
        let mut last: Vec<f32> = all_logits[all_logits.len() - vocab..].to_vec();
        if !req.keep_logits {
            all_logits.clear();
        }
        let prefill_s = t0.elapsed().as_secs_f64();

        let mut tokens = Vec::new();
        let mut finish = FinishReason::Length;
        let mut first_token_s = prefill_s;
        let t_decode = Instant::now();
        let mut decode_start = t_decode;
        while tokens.len() < req.max_new_tokens {
            let next = sampler.sample(&last);
            tokens.push(next);
            if tokens.len() == 1 {
                first_token_s = t0.elapsed().as_secs_f64();
                decode_start = Instant::now();
            }
            if !on_token(next) {
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
            last = self
                .model
                .forward(&mut state, &[next], &mut self.store, Logits::Last, None)?;
            if req.keep_logits {
                all_logits.extend_from_slice(&last);
            }
        }
        let decode_s = decode_start.elapsed().as_secs_f64();
        let after = self.store.counters();
        let decoded = tokens.len().saturating_sub(1);
        let stats = GenerationStats {
            prompt_tokens: req.prompt.len(),
            generated_tokens: tokens.len(),
            time_to_first_token_s: first_token_s,
            prefill_tokens_per_s: rate(req.prompt.len(), prefill_s),
            decode_tokens_per_s: rate(decoded, decode_s),
            peak_rss_bytes: peak_rss_bytes(),
            expert_hits: after.hits - before.hits,
            expert_misses: after.misses - before.misses,
            expert_bytes_read: after.bytes_read - before.bytes_read,
        };
        Ok(Generation {
            tokens,
            finish,
            logits: all_logits,
            stats,
        })
    }

    pub fn store_counters(&self) -> StoreCounters {
        self.store.counters()
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
