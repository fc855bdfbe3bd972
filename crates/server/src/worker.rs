//! The engine thread: one model, one sequence at a time, jobs taken in FIFO
//! order from a bounded queue. The engine is synchronous and not `Sync`, so
//! it lives on this thread alone; requests talk to it through channels.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use slipstream_engine::{
    Engine, FinishReason, GenerateRequest, GenerationDefaults, GenerationStats, PromptCache,
    Restored, SamplingParams, StateCache, StepHook, TextCodec,
};
use tokio::sync::mpsc::UnboundedSender;

use crate::script::Script;

/// What a request asks the engine for.
pub struct Job {
    pub prompt: Vec<u32>,
    /// Where the conversation before the reply's opening ends in `prompt`:
    /// the state cache checkpoints there too
    /// (`GenerateRequest::checkpoint_at`).
    pub history_end: Option<usize>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Set when the prompt ends inside an opened reasoning block and the
    /// request limits its length (the [`Backend::Script`] test facility
    /// replies verbatim and ignores it).
    pub reasoning_budget: Option<ReasoningBudget>,
    /// Installed in the engine for this job (a constraint, log
    /// probabilities: see [`crate::constrain::StepWatch`]); the
    /// [`Backend::Script`] test facility replies verbatim without it.
    pub hook: Option<Box<dyn StepHook>>,
    pub cancel: Arc<AtomicBool>,
    pub events: UnboundedSender<WorkerEvent>,
}

/// Ends the model's reasoning after `tokens` generated tokens unless the
/// model closed it itself: the worker then writes `close` (sent to the
/// client like generated tokens, and counted with them) and generation
/// goes on from the kept state, prefilling only those tokens.
#[derive(Debug, Clone)]
pub struct ReasoningBudget {
    /// Most generated tokens of reasoning.
    pub tokens: usize,
    /// `</think>` tokenized: seeing it generated ends the watch. (Qwen3.x
    /// have it as one token; a tokenizer that splits it matches only the
    /// same split.)
    pub end: Vec<u32>,
    /// What closes the reasoning (`\n</think>\n\n` tokenized).
    pub close: Vec<u32>,
}

/// What the engine sends back, in order: `Started`, `Token`s, `Done`.
#[derive(Debug)]
pub enum WorkerEvent {
    /// The job left the queue; prefill begins.
    Started,
    /// The log probabilities of the token that follows (sent before it).
    Logprob(crate::constrain::TokenLogprob),
    Token(u32),
    Done(Result<Finished, String>),
}

#[derive(Debug, Clone)]
pub struct Finished {
    pub finish: FinishReason,
    pub stats: GenerationStats,
}

/// Where tokens come from.
pub enum Backend {
    /// The model, the prompt cache that persists conversation prefixes
    /// across restarts when configured, and the RAM cache of conversation
    /// states above it.
    Engine(Box<Engine>, Option<Arc<PromptCache>>, Box<StateCache>),
    /// TEST FACILITY (`serve --test-script`): instead of sampling, each
    /// request emits the script's reply to its prompt (see [`Script`]),
    /// tokenized, then EOS. `codec` turns prompts back into text for the
    /// script's rules.
    Script {
        script: Script<Vec<u32>>,
        codec: Arc<TextCodec>,
        eos: Option<u32>,
    },
}

/// Shared view of the queue.
#[derive(Debug, Default)]
pub struct QueueState {
    /// Jobs submitted and not yet taken by the engine thread.
    pub pending: AtomicUsize,
    /// True while a job runs.
    pub busy: AtomicBool,
    pub served: AtomicUsize,
    /// Last finished generation's figures (for /health and the page).
    pub last_stats: Mutex<Option<GenerationStats>>,
}

/// Handle to the engine thread.
pub struct Worker {
    tx: Mutex<mpsc::Sender<Job>>,
    pub capacity: usize,
    pub state: Arc<QueueState>,
}

#[derive(Debug)]
pub struct QueueFull;

/// The engine's side of a [`Worker`]: takes the jobs in order on the thread
/// that built the backend, until every handle to the worker is gone.
pub struct EngineLoop {
    backend: Backend,
    rx: mpsc::Receiver<Job>,
    state: Arc<QueueState>,
}

impl EngineLoop {
    /// Runs jobs until the worker's last handle is dropped.
    pub fn run(self) {
        run(self.backend, self.rx, self.state)
    }
}

impl Worker {
    /// Builds the backend on this thread: the returned loop must run here
    /// (the engine is not `Send`).
    pub fn here<F>(
        capacity: usize,
        make: F,
    ) -> anyhow::Result<(Worker, Arc<TextCodec>, Info, EngineLoop)>
    where
        F: FnOnce() -> anyhow::Result<(Backend, Arc<TextCodec>, Info)>,
    {
        let (backend, codec, info) = make()?;
        let (tx, rx) = mpsc::channel::<Job>();
        let state = Arc::new(QueueState::default());
        let worker = Worker {
            tx: Mutex::new(tx),
            capacity,
            state: state.clone(),
        };
        let engine = EngineLoop { backend, rx, state };
        Ok((worker, codec, info, engine))
    }

    /// Starts the engine thread; `backend` is built on it.
    pub fn start<F>(capacity: usize, make: F) -> anyhow::Result<(Worker, Arc<TextCodec>, Info)>
    where
        F: FnOnce() -> anyhow::Result<(Backend, Arc<TextCodec>, Info)> + Send + 'static,
    {
        let (ready_tx, ready_rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("slipstream-engine".into())
            .spawn(move || match Worker::here(capacity, make) {
                Ok((worker, codec, info, engine)) => {
                    let _ = ready_tx.send(Ok((worker, codec, info)));
                    engine.run();
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })?;
        ready_rx
            .recv()
            .map_err(|_| anyhow::anyhow!("the engine thread died while opening the model"))?
    }

    /// Queues a job, or refuses it when `capacity` jobs already wait.
    pub fn submit(&self, job: Job) -> Result<(), QueueFull> {
        let prev = self.state.pending.fetch_add(1, Ordering::SeqCst);
        if prev >= self.capacity {
            self.state.pending.fetch_sub(1, Ordering::SeqCst);
            return Err(QueueFull);
        }
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        if tx.send(job).is_err() {
            self.state.pending.fetch_sub(1, Ordering::SeqCst);
            return Err(QueueFull);
        }
        Ok(())
    }
}

/// What the server needs to know about the model, read on the engine thread.
#[derive(Clone)]
pub struct Info {
    pub eos: Vec<u32>,
    pub max_position: usize,
    pub template: Option<Arc<slipstream_engine::ChatTemplate>>,
    /// The model's own chat template source (tool-call form, see
    /// [`crate::constrain::ToolForm`]).
    pub template_source: Option<String>,
    pub store: String,
    /// Logits per step.
    pub vocab_size: usize,
    /// Sampling settings the checkpoint recommends.
    pub generation: GenerationDefaults,
}

fn run(mut backend: Backend, rx: mpsc::Receiver<Job>, st: Arc<QueueState>) {
    while let Ok(mut job) = rx.recv() {
        st.pending.fetch_sub(1, Ordering::SeqCst);
        if job.cancel.load(Ordering::SeqCst) || job.events.is_closed() {
            let _ = job.events.send(WorkerEvent::Done(Err("cancelled".into())));
            continue;
        }
        st.busy.store(true, Ordering::SeqCst);
        let _ = job.events.send(WorkerEvent::Started);
        let events = job.events.clone();
        let cancel = job.cancel.clone();
        let mut on_token = |id: u32| {
            let ok = events.send(WorkerEvent::Token(id)).is_ok();
            if !ok {
                cancel.store(true, Ordering::SeqCst);
            }
            ok && !cancel.load(Ordering::SeqCst)
        };
        let result = match &mut backend {
            Backend::Engine(engine, cache, states) => {
                let mut restored = states.restore(&job.prompt, engine.new_state());
                if let Some(cache) = cache {
                    restore_longest_prefix(cache, &mut restored, &job.prompt);
                }
                // A panic in the model must not take the server down (the
                // conversation's state is lost with it; the cache keeps the rest).
                engine.set_step_hook(job.hook.take());
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    generate(engine, states, restored, &job, &mut on_token)
                }));
                engine.set_step_hook(None);
                match r {
                    Ok(Ok(f)) => Ok(f),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => {
                        engine.recover_after_panic();
                        Err("internal error in the engine".to_string())
                    }
                }
            }
            Backend::Script { script, codec, eos } => {
                let prompt = if script.reads_prompts() {
                    codec.decode(&job.prompt).unwrap_or_default()
                } else {
                    String::new()
                };
                match script.reply_to(&prompt) {
                    Some(reply) => Ok(play_reply(reply, *eos, &job, &mut on_token)),
                    None => Err("test script: no entry answers this prompt".to_string()),
                }
            }
        };
        if let Ok(f) = &result {
            *st.last_stats.lock().unwrap_or_else(|e| e.into_inner()) = Some(f.stats.clone());
        }
        st.busy.store(false, Ordering::SeqCst);
        st.served.fetch_add(1, Ordering::SeqCst);
        let _ = job.events.send(WorkerEvent::Done(result));
    }
}

/// Emits a scripted reply's tokens (at most the job's `max_new_tokens`),
/// then EOS, as a model would, a little apart so streams arrive in pieces.
fn play_reply(
    mut toks: Vec<u32>,
    eos: Option<u32>,
    job: &Job,
    on_token: &mut impl FnMut(u32) -> bool,
) -> Finished {
    toks.truncate(job.max_new_tokens);
    if toks.len() < job.max_new_tokens {
        toks.extend(eos);
    }
    let mut finish = FinishReason::Length;
    let mut n = 0;
    let t0 = std::time::Instant::now();
    for id in toks {
        n += 1;
        if !on_token(id) {
            finish = FinishReason::Cancelled;
            break;
        }
        if Some(id) == eos {
            finish = FinishReason::Stop;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    Finished {
        finish,
        stats: GenerationStats {
            prompt_tokens: job.prompt.len(),
            generated_tokens: n,
            time_to_first_token_s: 0.0,
            decode_tokens_per_s: n as f64 / t0.elapsed().as_secs_f64().max(1e-9),
            ..Default::default()
        },
    }
}

/// Runs `job` from the state `states` restored for it, sending each token
/// to `on_token` (false stops); with a reasoning budget, in two parts when
/// the budget closes the reasoning (see [`ReasoningBudget`]): the second
/// part restores the first from the cache and prefills only the closing.
fn generate(
    engine: &mut Engine,
    states: &mut StateCache,
    restored: Restored,
    job: &Job,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Finished, slipstream_engine::EngineError> {
    let mut req = GenerateRequest {
        prompt: job.prompt.clone(),
        max_new_tokens: job.max_new_tokens,
        sampling: job.sampling.clone(),
        stop_tokens: Vec::new(),
        keep_logits: false,
        cancel: Some(job.cancel.clone()),
        checkpoint_at: job.history_end,
    };
    let Some(budget) = &job.reasoning_budget else {
        let g = engine.generate_cached(states, restored, &req, on_token)?;
        return Ok(Finished {
            finish: g.finish,
            stats: g.stats,
        });
    };
    let eos = engine.eos_tokens().to_vec();
    let mut generated: Vec<u32> = Vec::new();
    let mut closed = false;
    let mut over_budget = false;
    let first = engine.generate_cached(states, restored, &req, &mut |id| {
        generated.push(id);
        if !on_token(id) {
            return false;
        }
        closed |= !budget.end.is_empty() && generated.ends_with(&budget.end);
        if !closed && generated.len() >= budget.tokens && !eos.contains(&id) {
            over_budget = true;
            return false;
        }
        true
    })?;
    if !over_budget || job.cancel.load(Ordering::SeqCst) {
        return Ok(Finished {
            finish: first.finish,
            stats: first.stats,
        });
    }
    let room = job.max_new_tokens.saturating_sub(generated.len());
    let close = &budget.close[..budget.close.len().min(room)];
    // The hook learns the written close as if it were generated.
    let mut hook = engine.set_step_hook(None);
    if let Some(h) = hook.as_mut() {
        for &id in close {
            h.accept(id).map_err(slipstream_engine::EngineError::Hook)?;
        }
    }
    engine.set_step_hook(hook);
    for &id in close {
        if !on_token(id) {
            let stats = followed_by(first.stats, None, close.len());
            return Ok(Finished {
                finish: FinishReason::Cancelled,
                stats,
            });
        }
    }
    if room == close.len() {
        return Ok(Finished {
            finish: FinishReason::Length,
            stats: followed_by(first.stats, None, close.len()),
        });
    }
    req.prompt = [job.prompt.as_slice(), &generated, close].concat();
    req.max_new_tokens = room - close.len();
    let restored = states.restore(&req.prompt, engine.new_state());
    let rest = engine.generate_cached(states, restored, &req, on_token)?;
    Ok(Finished {
        finish: rest.finish,
        stats: followed_by(first.stats, Some(rest.stats), close.len()),
    })
}

/// The figures of a generation that went on after `forced` written tokens
/// with `rest` (rates stay the first part's).
fn followed_by(
    mut first: GenerationStats,
    rest: Option<GenerationStats>,
    forced: usize,
) -> GenerationStats {
    first.generated_tokens += forced;
    if let Some(r) = rest {
        first.generated_tokens += r.generated_tokens;
        first.peak_rss_bytes = first.peak_rss_bytes.max(r.peak_rss_bytes);
        first.expert_hits += r.expert_hits;
        first.expert_misses += r.expert_misses;
        first.expert_bytes_read += r.expert_bytes_read;
        first.expert_fills += r.expert_fills;
    }
    first
}

/// Replaces the restored state by the prompt cache's longest prefix of
/// `prompt` when that covers more of the prompt (after a restart, or when
/// the RAM tier evicted the conversation).
fn restore_longest_prefix(cache: &PromptCache, restored: &mut Restored, prompt: &[u32]) {
    let kept = restored.state.tokens.len();
    if kept >= prompt.len() {
        return;
    }
    if let Some(snap) = cache.lookup(prompt) {
        if snap.state.tokens.len() > kept {
            tracing::info!(
                "prompt cache: restored {} of {} prompt tokens",
                snap.state.tokens.len(),
                prompt.len()
            );
            *restored = Restored {
                state: snap.state,
                checkpoints: Vec::new(),
                resident: Some(snap.resident),
            };
        }
    }
}
