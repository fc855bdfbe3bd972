//! Generation: the request, prefill in chunks (guarded, checkpointed,
//! hooked), the decode loop on the host or the device, and the counters
//! and timings that come back with every generation.

use std::sync::Arc;
use std::time::Instant;

use slipstream_kernels::sample::DrawParams;
use slipstream_models::speculative::StateTrail;
use slipstream_models::{Logits, ModelError};
use slipstream_store::{Phase, StoreCounters};

use crate::speculative::{lookup_draft, Governor, MtpDrafter, LOOKUP_MAX_NGRAM};
use crate::{
    heap, Checkpoint, CheckpointCollector, Engine, EngineError, ModelState, PenaltyTracker,
    PhaseTimes, PrefillCheckpoint, Restored, Sampler, SamplingParams, SpeculateMode,
    SpeculationStats, StateCache, StepHook,
};

/// What a verify pass leaves for its rollback.
enum VerifyRecord {
    /// The CPU backend's Gated DeltaNet states after each token.
    Cpu(StateTrail),
    /// The CUDA backend keeps its own (`CudaModel::rollback`).
    Device,
}

/// A verify pass's rows and what its rollback needs.
struct Verified {
    /// `[n, vocab]`: row `i` is the distribution after the pass's first
    /// `i + 1` tokens, the bits of a one-token pass there.
    logits: Vec<f32>,
    /// `[n, hidden]` final-normed rows when asked for (the MTP head's
    /// input), else empty.
    hidden: Vec<f32>,
    record: VerifyRecord,
}

fn cuda_error(e: slipstream_cuda::CudaError) -> ModelError {
    ModelError::State(format!("CUDA: {e}"))
}

/// The pieces a prefill of `len` tokens starting at position `base` runs
/// in: `(start, end, chunk_end)` with offsets into the prefilled tokens.
/// Chunks of `chunk` tokens from the start of the call, each split further
/// where an absolute position is a multiple of `interval` or is `at`;
/// `chunk_end` marks the ends of the chunks themselves.
fn prefill_pieces(
    base: usize,
    len: usize,
    chunk: usize,
    interval: Option<usize>,
    at: Option<usize>,
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
        if let Some(a) = at.filter(|&a| a > base + start) {
            end = end.min(a - base);
        }
        out.push((start, end, end == chunk_end.min(len)));
        start = end;
    }
    out
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
    /// A prompt position where the state cache takes a checkpoint too
    /// ([`Engine::generate_cached`]): the end of the conversation before
    /// the chat template's opening of the reply. The next request's
    /// template may render that opening differently (Qwen3.x drop an
    /// earlier reply's reasoning), so the prompt-end checkpoint lies past
    /// where the next prompt diverges; this one does not.
    pub checkpoint_at: Option<usize>,
}

impl GenerateRequest {
    /// Greedy decoding of at most `max_new_tokens` tokens after `prompt`:
    /// no stop tokens beyond the model's EOS, no logits kept, no cancel flag.
    pub fn new(prompt: Vec<u32>, max_new_tokens: usize) -> Self {
        GenerateRequest {
            prompt,
            max_new_tokens,
            sampling: SamplingParams::default(),
            stop_tokens: Vec::new(),
            keep_logits: false,
            cancel: None,
            checkpoint_at: None,
        }
    }

    /// The same request drawing with `sampling`.
    pub fn with_sampling(mut self, sampling: SamplingParams) -> Self {
        self.sampling = sampling;
        self
    }

    /// The same request keeping the logits of every position
    /// ([`Generation::logits`]).
    pub fn keeping_logits(mut self) -> Self {
        self.keep_logits = true;
        self
    }

    /// The same request stopped when `flag` is set.
    pub fn cancelled_by(mut self, flag: Arc<std::sync::atomic::AtomicBool>) -> Self {
        self.cancel = Some(flag);
        self
    }
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
    /// Speculative decoding counters, when it was on (boxed: the stats
    /// travel in the server's events).
    pub speculation: Option<Box<SpeculationStats>>,
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

impl Engine {
    /// Runs one generated token on the CUDA backend and returns the next
    /// token, chosen on the device: the argmax (`draw: None`) or the seeded
    /// draw (`CudaModel::next_token`).
    fn run_next_on_device(
        &mut self,
        state: &mut ModelState,
        token: u32,
        draw: Option<(DrawParams, f64)>,
    ) -> Result<u32, slipstream_models::ModelError> {
        let no_device = || {
            slipstream_models::ModelError::State(
                "choosing tokens on the device without a CUDA backend".into(),
            )
        };
        if self.cuda.is_none() {
            return Err(no_device());
        }
        // A prompt restored whole runs no prefill: its first generated token
        // is the first pass from the restored state (run_model brings the
        // device to it).
        self.run_model(state, &[token], Logits::None, false)?;
        let c = self.cuda.as_mut().ok_or_else(no_device)?;
        c.next_token(&self.model, draw)
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

    /// The next token from a row of logits: the request's penalties and
    /// the step hook's mask applied to a copy first, then the sampler; the
    /// hook learns the token.
    fn choose_next(
        &mut self,
        sampler: &mut Sampler,
        row: &[f32],
        penalties: Option<&PenaltyTracker>,
        hook: &mut Option<Box<dyn StepHook>>,
        edited: &mut Vec<f32>,
    ) -> Result<u32, EngineError> {
        if penalties.is_none() && hook.is_none() {
            return Ok(self.choose_from_row(sampler, row)?);
        }
        edited.clear();
        edited.extend_from_slice(row);
        if let Some(p) = penalties {
            p.apply(edited);
        }
        if let Some(h) = hook.as_deref_mut() {
            h.mask(edited).map_err(EngineError::Hook)?;
        }
        let t = self.choose_from_row(sampler, edited)?;
        if let Some(h) = hook.as_deref_mut() {
            h.accept(t).map_err(EngineError::Hook)?;
        }
        Ok(t)
    }

    /// Up to `k` draft tokens after `history` (prompt and tokens so far,
    /// the last not yet run) from the drafter of `mode`; ids outside the
    /// vocabulary end the draft.
    fn draft(
        &mut self,
        mode: SpeculateMode,
        history: &[u32],
        k: usize,
    ) -> Result<Vec<u32>, EngineError> {
        let mut drafts = match mode {
            SpeculateMode::Off => Vec::new(),
            SpeculateMode::Lookup => lookup_draft(history, k, 1, LOOKUP_MAX_NGRAM),
            SpeculateMode::Mtp => self.mtp_draft(history, k)?,
            SpeculateMode::Both => {
                let d = lookup_draft(history, k, 2, LOOKUP_MAX_NGRAM);
                if d.is_empty() {
                    self.mtp_draft(history, k)?
                } else {
                    d
                }
            }
            SpeculateMode::Custom => self
                .drafter
                .as_mut()
                .map(|d| d.draft(history, k))
                .unwrap_or_default(),
        };
        drafts.truncate(k);
        let vocab = self.model.config.vocab_size;
        if let Some(bad) = drafts.iter().position(|&t| t as usize >= vocab) {
            drafts.truncate(bad);
        }
        Ok(drafts)
    }

    fn mtp_draft(&mut self, history: &[u32], k: usize) -> Result<Vec<u32>, EngineError> {
        match self.mtp_drafter.as_mut() {
            Some(m) => Ok(m.draft(&self.model, &mut self.store, history, k)?),
            None => Ok(Vec::new()),
        }
    }

    /// Runs `pass` (the last chosen token, then the drafts) as one verify
    /// pass on the backend in use: every row's logits, the final-normed
    /// rows when `want_hidden`, and the record [`Engine::roll_back`]
    /// takes. On error the state must be discarded.
    fn verify_pass(
        &mut self,
        state: &mut ModelState,
        pass: &[u32],
        want_hidden: bool,
    ) -> Result<Verified, ModelError> {
        if self.cuda.is_none() {
            let v = self.model.forward_verify(
                state,
                pass,
                &mut self.store,
                want_hidden,
                self.phases.as_mut(),
            )?;
            return Ok(Verified {
                logits: v.logits,
                hidden: v.hidden,
                record: VerifyRecord::Cpu(v.trail),
            });
        }
        // The device holds `state` before the record starts.
        self.state_to_device(state)?;
        if let Some(c) = self.cuda.as_mut() {
            c.begin_verify(pass.len()).map_err(cuda_error)?;
        }
        let (out, hidden) = self.run_on_device(state, pass, Logits::All, false, want_hidden);
        if let Some(c) = self.cuda.as_mut() {
            c.end_verify();
        }
        Ok(Verified {
            logits: out?,
            hidden,
            record: VerifyRecord::Device,
        })
    }

    /// Rolls `state` (and the device's, on CUDA) back to the first `keep`
    /// tokens of the verify pass that left `record`.
    fn roll_back(
        &mut self,
        state: &mut ModelState,
        record: &VerifyRecord,
        keep: usize,
    ) -> Result<(), ModelError> {
        match record {
            VerifyRecord::Cpu(trail) => state.rollback(trail, keep),
            VerifyRecord::Device => {
                let c = self
                    .cuda
                    .as_mut()
                    .ok_or_else(|| ModelError::State("a device rollback without CUDA".into()))?;
                c.rollback(keep).map_err(cuda_error)?;
                let position = c.position();
                state.tokens.truncate(position);
                if let Some(t) = self.device_tokens.as_mut() {
                    t.truncate(position);
                }
                Ok(())
            }
        }
    }

    /// The cost of verify passes from `state`: for each `n` in
    /// `1..=max_tokens`, the fastest of `repeats` passes of `n` tokens
    /// (`tokens` cycled; seconds). A pass of 1 is a plain decode step (no
    /// record); `n` checks `n - 1` drafts. On the CPU each pass runs from a
    /// copy of `state`; on CUDA from the device's state, rolled back to the
    /// pass's first token after each (so the position moves on by one).
    pub fn measure_verify(
        &mut self,
        state: &ModelState,
        tokens: &[u32],
        max_tokens: usize,
        repeats: usize,
    ) -> Result<Vec<(usize, f64)>, EngineError> {
        if tokens.is_empty() || max_tokens == 0 {
            return Err(EngineError::Request(
                "measuring verify passes needs tokens and a length".into(),
            ));
        }
        // Measured passes feed neither the MTP drafter nor the phase timers.
        let (drafter, phases) = (self.mtp_drafter.take(), self.phases.take());
        let out = self.time_verify_passes(state, tokens, max_tokens, repeats);
        (self.mtp_drafter, self.phases) = (drafter, phases);
        out
    }

    fn time_verify_passes(
        &mut self,
        state: &ModelState,
        tokens: &[u32],
        max_tokens: usize,
        repeats: usize,
    ) -> Result<Vec<(usize, f64)>, EngineError> {
        let mut out = Vec::with_capacity(max_tokens);
        for n in 1..=max_tokens {
            let pass: Vec<u32> = tokens.iter().cycle().take(n).copied().collect();
            let mut best = f64::INFINITY;
            let mut s = state.clone();
            for r in 0..repeats.max(1) {
                if r > 0 && self.cuda.is_none() {
                    s = state.clone();
                }
                let t = Instant::now();
                let record = if n == 1 {
                    self.run_model(&mut s, &pass, Logits::Last, false)?;
                    None
                } else {
                    Some(self.verify_pass(&mut s, &pass, false)?.record)
                };
                best = best.min(t.elapsed().as_secs_f64());
                if let (Some(r), true) = (record, self.cuda.is_some()) {
                    self.roll_back(&mut s, &r, 1)?;
                }
            }
            out.push((n, best));
        }
        Ok(out)
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
        let extra = self.checkpoints.as_ref().and_then(|c| c.at);
        let base = state.tokens.len();
        let pieces = prefill_pieces(base, tokens.len(), chunk, interval, extra);
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
            // A state cache checkpoint: at interval multiples, at the end
            // of the prompt and where the request asks.
            let checkpoint_here = interval.is_some_and(|n| {
                last || (base + end).is_multiple_of(n) || extra == Some(base + end)
            });
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
            at: req.checkpoint_at.filter(|&a| a > 0 && a < req.prompt.len()),
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
        self.mtp_drafter = None;
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
        self.mtp_drafter = None;
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
        // Speculative decoding: drafts verified in one pass, rows chosen
        // from in order exactly as plain decoding would.
        let settings = self.speculation.clone();
        let speculating = settings.mode != SpeculateMode::Off;
        if speculating && settings.mode == SpeculateMode::Custom && self.drafter.is_none() {
            return Err(EngineError::Request(
                "custom speculation without a drafter (Engine::set_drafter)".into(),
            ));
        }
        let mut governor = speculating.then(|| Governor::new(&settings));
        self.mtp_drafter =
            if speculating && matches!(settings.mode, SpeculateMode::Mtp | SpeculateMode::Both) {
                MtpDrafter::new(&self.model)
            } else {
                None
            };
        let mut history: Vec<u32> = if speculating {
            req.prompt.clone()
        } else {
            Vec::new()
        };
        // A token chosen from a verify pass's row, emitted next.
        let mut pending: Option<u32> = None;

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
        // Whether the last step's row is still on the device only (a plain
        // step chosen there, not a verify pass).
        let mut last_on_device = false;
        while tokens.len() < req.max_new_tokens {
            let next = match device_next.take().or(pending.take()) {
                Some(t) => t,
                None => {
                    self.choose_next(&mut sampler, &last, penalties.as_ref(), hook, &mut edited)?
                }
            };
            if let Some(p) = penalties.as_mut() {
                p.record(next);
            }
            tokens.push(next);
            if speculating {
                history.push(next);
            }
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
            // Drafts for a verify step, when the governor lets it run;
            // never past the last token asked for.
            let t_step = Instant::now();
            let remaining = req.max_new_tokens - tokens.len();
            let drafts = match governor.as_ref() {
                Some(g) if g.wants_drafts() && remaining > 1 => self
                    .draft(
                        settings.mode,
                        &history,
                        settings.draft_tokens.min(remaining - 1),
                    )
                    .inspect_err(|_| state.last_logits.clear())?,
                _ => Vec::new(),
            };
            if !drafts.is_empty() {
                let start = state.tokens.len();
                let mut pass = Vec::with_capacity(1 + drafts.len());
                pass.push(next);
                pass.extend_from_slice(&drafts);
                let want_hidden = self.mtp_drafter.is_some();
                let verified = self.verify_pass(state, &pass, want_hidden);
                let verified = verified.inspect_err(|_| state.last_logits.clear())?;
                last_on_device = false;
                // Row i is the distribution after pass[..=i]: drafts are
                // taken while the token chosen from it equals them; the
                // first that differs is the chosen token, emitted next.
                // `keep`: pass tokens the state keeps (every emitted token
                // but the last emitted).
                let mut keep = 1;
                let mut accepted = 0;
                let mut ended = false;
                for (i, &d) in drafts.iter().enumerate() {
                    let row = &verified.logits[i * vocab..][..vocab];
                    let t =
                        self.choose_next(&mut sampler, row, penalties.as_ref(), hook, &mut edited)?;
                    if t != d {
                        pending = Some(t);
                        break;
                    }
                    accepted += 1;
                    if let Some(p) = penalties.as_mut() {
                        p.record(d);
                    }
                    tokens.push(d);
                    history.push(d);
                    if !on_token(d) || cancelled() {
                        finish = FinishReason::Cancelled;
                        ended = true;
                    } else if stops.contains(&d) {
                        finish = FinishReason::Stop;
                        ended = true;
                    } else if tokens.len() == req.max_new_tokens {
                        ended = true;
                    }
                    if ended {
                        break;
                    }
                    keep += 1;
                }
                self.roll_back(state, &verified.record, keep)
                    .inspect_err(|_| state.last_logits.clear())?;
                if let Some(m) = self.mtp_drafter.as_mut() {
                    m.push_hidden(
                        start,
                        &verified.hidden[..keep * self.model.config.hidden_size],
                    );
                }
                last.clear();
                last.extend_from_slice(&verified.logits[(keep - 1) * vocab..][..vocab]);
                if req.keep_logits {
                    all_logits.extend_from_slice(&verified.logits[..keep * vocab]);
                }
                if let Some(g) = governor.as_mut() {
                    let emitted = accepted + usize::from(pending.is_some());
                    g.verify_step(drafts.len(), accepted, emitted, t_step.elapsed());
                }
                if ended {
                    break;
                }
                continue;
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
            last_on_device = on_device;
            match step {
                Ok(t) => device_next = t,
                Err(e) => {
                    state.last_logits.clear();
                    return Err(e.into());
                }
            }
            if let Some(g) = governor.as_mut() {
                g.plain_step(t_step.elapsed());
            }
            if req.keep_logits {
                all_logits.extend_from_slice(&last);
            }
        }
        state.last_logits = match self.cuda.as_mut() {
            // The last step's row is still on the device.
            Some(c) if last_on_device => c.last_logits()?,
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
            speculation: governor.map(|g| Box::new(g.finish())),
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
}
