//! One generation as the handlers see it: submit to the queue, then pull
//! parsed output (content, reasoning, tool calls) until it finishes.
//! Dropping a [`Gen`] cancels its job (the client went away).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;
use slipstream_engine::{Bounded, FinishReason, GenerationStats, SamplingParams, StreamDecoder};
use tokio::sync::mpsc;

use crate::access::{GenFigures, RequestRecord};
use crate::constrain::{Constraint, Constraints, StepWatch, TokenLogprob};
use crate::error::{ApiError, Flavor};
use crate::parse::{OutputEvent, OutputParser, StopFilter};
use crate::worker::{Job, ReasoningBudget, WorkerEvent};
use crate::App;

/// What a handler asks for.
pub struct GenParams {
    pub prompt_text: String,
    /// The end of `prompt_text` that opens the reply (`Rendered::reply_opening`;
    /// empty for raw prompts).
    pub reply_opening: String,
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Parse `<think>` and `<tool_call>` (chat endpoints); raw text if false.
    pub parse: bool,
    pub parse_tools: bool,
    pub in_reasoning: bool,
    /// Most tokens of reasoning when the prompt ends inside an opened
    /// `<think>` (Anthropic `thinking.budget_tokens`); the server closes
    /// the reasoning after that many (see [`ReasoningBudget`]).
    pub reasoning_budget: Option<usize>,
    /// Tool definitions the parser types XML parameters by.
    pub tools: Vec<Value>,
    /// What the reply must be (structured output, forced tool calls).
    pub constraint: Option<Constraint>,
    /// Return each token's log probability with this many top tokens.
    pub logprobs: Option<usize>,
}

/// How a generation ended.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub finish: FinishReason,
    /// The stop string that ended it, if one did.
    pub stop_string: Option<String>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub stats: GenerationStats,
}

impl Outcome {
    /// Share of expert lookups served from the cache.
    pub fn expert_hit_rate(&self) -> f64 {
        let t = self.stats.expert_hits + self.stats.expert_misses;
        if t == 0 {
            1.0
        } else {
            self.stats.expert_hits as f64 / t as f64
        }
    }

    /// Extra figures (`slipstream` field of responses and usage chunks).
    pub fn figures(&self) -> Value {
        serde_json::json!({
            "reused_prompt_tokens": self.stats.reused_prompt_tokens,
            "time_to_first_token_s": self.stats.time_to_first_token_s,
            "prefill_tokens_per_s": self.stats.prefill_tokens_per_s,
            "decode_tokens_per_s": self.stats.decode_tokens_per_s,
            "expert_hits": self.stats.expert_hits,
            "expert_misses": self.stats.expert_misses,
            "expert_hit_rate": self.expert_hit_rate(),
            "peak_rss_bytes": self.stats.peak_rss_bytes,
            "speculation": self.stats.speculation,
        })
    }
}

/// A step of a generation.
#[derive(Debug)]
pub enum Step {
    /// The job left the queue.
    Started,
    Output(Vec<OutputEvent>),
    Done(Outcome),
    Failed(String),
}

/// Sets the cancel flag when dropped.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// A submitted generation.
pub struct Gen {
    rx: mpsc::UnboundedReceiver<WorkerEvent>,
    cancel: CancelOnDrop,
    app: Arc<App>,
    decoder: StreamDecoder,
    stop: StopFilter,
    parser: Option<OutputParser>,
    stop_string: Option<String>,
    pub prompt_tokens: usize,
    ended: bool,
    pending_done: Option<Outcome>,
    /// The access log's record of the request (see [`crate::access`]).
    record: Option<RequestRecord>,
    submitted: Instant,
    /// When the engine took the job.
    started: Option<Instant>,
    /// Tokens received so far.
    received: usize,
    /// The figures went to the record and the metrics.
    reported: bool,
    /// The log probabilities of the next token, when asked for.
    next_logprob: Option<TokenLogprob>,
    /// Log probabilities of the output tokens not yet taken
    /// ([`Gen::take_logprobs`]).
    logprobs: Vec<TokenLogprob>,
}

/// Where the tokens of `prompt` before `reply_opening` (the text the
/// template ends it with) end, when the opening's own tokens end `prompt`
/// (they do unless a merge crosses the boundary; then `None`).
fn history_end(app: &App, prompt: &[u32], reply_opening: &str) -> Option<usize> {
    if reply_opening.is_empty() {
        return None;
    }
    let opening = app.codec.encode(reply_opening).ok()?;
    (!opening.is_empty() && opening.len() < prompt.len() && prompt.ends_with(&opening))
        .then(|| prompt.len() - opening.len())
}

/// Tokenizes, checks the context limit and queues the job.
pub fn submit(app: &Arc<App>, flavor: Flavor, p: GenParams) -> Result<Gen, ApiError> {
    let limit = app.max_context;
    // Prompt tokens that leave room for one token of reply.
    let most = limit - 1;
    // Bounded: a prompt far past the limit is refused after about twice
    // the limit's tokens, not tokenized whole.
    let prompt = match app
        .codec
        .encode_within(&p.prompt_text, most)
        .map_err(|e| ApiError::bad_request(flavor, e.to_string()))?
    {
        Bounded::Fits(ids) => ids,
        Bounded::TooLong { counted: n, whole } => {
            let advice = overflow_advice(n, limit, app.info.max_position);
            let size = if whole {
                n.to_string()
            } else {
                format!("at least {n}")
            };
            tracing::warn!("refused a prompt of {size} tokens: {advice}");
            let message = match flavor {
                // Anthropic's own wording, which Claude Code matches exactly
                // (it then compacts the conversation); the advice is logged.
                Flavor::Anthropic => format!("prompt is too long: {n} tokens > {most} maximum"),
                Flavor::OpenAi => format!("the prompt is {size} tokens; {advice}"),
            };
            return Err(ApiError::bad_request(flavor, message).code("context_length_exceeded"));
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::bad_request(flavor, "the prompt is empty"));
    }
    let room = limit - prompt.len();
    let max_new = p.max_tokens.unwrap_or(room).min(room);
    if max_new == 0 {
        return Err(
            ApiError::bad_request(flavor, "max_tokens must be at least 1").param("max_tokens"),
        );
    }
    let reasoning_budget = match p.reasoning_budget.filter(|_| p.in_reasoning) {
        Some(tokens) => {
            let encode = |t: &str| {
                app.codec
                    .encode(t)
                    .map_err(|e| ApiError::internal(flavor, e.to_string()))
            };
            Some(ReasoningBudget {
                tokens,
                end: encode("</think>")?,
                close: encode("\n</think>\n\n")?,
            })
        }
        None => None,
    };
    let record = RequestRecord::current();
    if app.config.log_prompts {
        let id = record.as_ref().map_or(0, |r| r.id);
        tracing::info!(target: "slipstream::prompt", "#{id}: {} prompt tokens\n{}", prompt.len(), p.prompt_text);
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let hook = step_watch(app, flavor, &p, tx.clone())?;
    let cancel = Arc::new(AtomicBool::new(false));
    let n = prompt.len();
    let history_end = history_end(app, &prompt, &p.reply_opening);
    app.worker
        .submit(Job {
            history_end,
            prompt,
            max_new_tokens: max_new,
            sampling: p.sampling,
            reasoning_budget,
            hook,
            cancel: cancel.clone(),
            events: tx,
        })
        .map_err(|_| {
            ApiError::queue_full(flavor, app.worker.capacity, app.metrics.retry_after_s())
        })?;
    let parser = p
        .parse
        .then(|| OutputParser::new(p.in_reasoning, p.parse_tools).with_tool_schemas(&p.tools));
    Ok(Gen {
        rx,
        cancel: CancelOnDrop(cancel),
        app: app.clone(),
        decoder: StreamDecoder::default(),
        stop: StopFilter::new(p.stop),
        parser,
        stop_string: None,
        prompt_tokens: n,
        ended: false,
        pending_done: None,
        record,
        submitted: Instant::now(),
        started: None,
        received: 0,
        reported: false,
        next_logprob: None,
        logprobs: Vec::new(),
    })
}

/// The tokenizer as constrained decoding sees it (built on first use).
pub fn constraints(app: &App, flavor: Flavor) -> Result<Arc<Constraints>, ApiError> {
    app.constraints
        .get_or_init(|| {
            let eos = app.info.eos.first().copied().unwrap_or(0);
            Constraints::new(app.codec.tokenizer(), app.info.vocab_size, eos).map(Arc::new)
        })
        .clone()
        .map_err(|e| ApiError::internal(flavor, format!("constrained decoding: {e}")))
}

/// The engine hook a request needs: its constraint's matcher (a grammar
/// llguidance refuses is the client's error) and its log probabilities.
fn step_watch(
    app: &App,
    flavor: Flavor,
    p: &GenParams,
    events: mpsc::UnboundedSender<WorkerEvent>,
) -> Result<Option<Box<dyn slipstream_engine::StepHook>>, ApiError> {
    if p.constraint.is_none() && p.logprobs.is_none() {
        return Ok(None);
    }
    // Log probabilities name tokens by the table's bytes.
    constraints(app, flavor)?;
    let matcher = match &p.constraint {
        Some(c) => {
            let table = constraints(app, flavor)?;
            let grammar = c.grammar(&table, p.in_reasoning);
            let what = match c {
                Constraint::Json(_) => "the output format",
                Constraint::Tools { .. } => "the tools' schemas",
            };
            Some(table.matcher(&grammar).map_err(|e| {
                ApiError::bad_request(flavor, format!("{what} cannot be enforced: {e}"))
            })?)
        }
        None => None,
    };
    let think_end = if p.in_reasoning {
        Some(
            app.codec
                .encode("</think>")
                .map_err(|e| ApiError::internal(flavor, e.to_string()))?,
        )
    } else {
        None
    };
    Ok(Some(Box::new(StepWatch::new(
        matcher, think_end, p.logprobs, events,
    ))))
}

/// What a user can do about a prompt of `n` tokens that does not fit a
/// context of `limit` tokens, on a model of `max_position` positions.
pub fn overflow_advice(n: usize, limit: usize, max_position: usize) -> String {
    let most = limit.saturating_sub(1);
    let cut = n.saturating_sub(most);
    let mut s = format!(
        "this server takes at most {most} prompt tokens (its context of {limit} tokens holds the prompt and at least one token of reply): cut at least {cut} tokens"
    );
    if limit < max_position {
        s.push_str(&format!(
            ", or restart the server with a larger --max-context (this model supports up to {max_position})"
        ));
    } else {
        s.push_str(&format!(
            "; {limit} tokens is all this model supports (max_position_embeddings), so a longer prompt needs a model with more positions"
        ));
    }
    s
}

impl Drop for Gen {
    fn drop(&mut self) {
        // Dropped before its end: the client went away.
        self.report(None, "cancelled");
    }
}

impl Gen {
    /// The next step; `None` after `Done` or `Failed`. Cancel-safe.
    pub async fn next(&mut self) -> Option<Step> {
        if let Some(o) = self.pending_done.take() {
            self.ended = true;
            return Some(Step::Done(o));
        }
        if self.ended {
            return None;
        }
        loop {
            let Some(ev) = self.rx.recv().await else {
                self.ended = true;
                self.report(None, "error");
                return Some(Step::Failed("the engine thread stopped".into()));
            };
            match ev {
                WorkerEvent::Started => {
                    let now = Instant::now();
                    self.started = Some(now);
                    if let Some(r) = &self.record {
                        let wait = (now - self.submitted).as_secs_f64();
                        r.update(|f| f.wait_s = Some(wait));
                    }
                    return Some(Step::Started);
                }
                WorkerEvent::Logprob(l) => self.next_logprob = Some(l),
                WorkerEvent::Token(id) => {
                    self.received += 1;
                    let logprob = self.next_logprob.take();
                    if let Some(r) = &self.record {
                        let (n, prompt) = (self.received, self.prompt_tokens);
                        r.update(|f| {
                            f.generated_tokens = n;
                            f.prompt_tokens = prompt;
                        });
                    }
                    if self.stop_string.is_some() || self.app.info.eos.contains(&id) {
                        continue;
                    }
                    self.logprobs.extend(logprob);
                    let piece = match self.decoder.push(&self.app.codec, id) {
                        Ok(p) => p,
                        Err(e) => {
                            self.ended = true;
                            self.cancel.0.store(true, Ordering::SeqCst);
                            self.report(None, "error");
                            return Some(Step::Failed(e.to_string()));
                        }
                    };
                    if piece.is_empty() {
                        continue;
                    }
                    let (text, hit) = self.stop.push(&piece);
                    if hit.is_some() {
                        // Stop the engine; the rest of its tokens are dropped.
                        self.stop_string = hit;
                        self.cancel.0.store(true, Ordering::SeqCst);
                    }
                    let ev = self.feed(&text);
                    if !ev.is_empty() {
                        return Some(Step::Output(ev));
                    }
                }
                WorkerEvent::Done(r) => {
                    self.ended = true;
                    let f = match r {
                        Ok(f) => f,
                        Err(e) => {
                            self.report(None, "error");
                            return Some(Step::Failed(e));
                        }
                    };
                    let mut ev = if self.stop_string.is_none() {
                        let rest = self.stop.finish();
                        self.feed(&rest)
                    } else {
                        Vec::new()
                    };
                    if let Some(p) = &mut self.parser {
                        ev.extend(p.finish());
                    }
                    let finish = if self.stop_string.is_some() {
                        FinishReason::Stop
                    } else {
                        f.finish
                    };
                    let outcome = Outcome {
                        finish,
                        stop_string: self.stop_string.clone(),
                        prompt_tokens: self.prompt_tokens,
                        completion_tokens: f.stats.generated_tokens,
                        stats: f.stats,
                    };
                    let label = match outcome.finish {
                        FinishReason::Stop => "stop",
                        FinishReason::Length => "length",
                        FinishReason::Cancelled => "cancelled",
                    };
                    self.report(Some(&outcome), label);
                    if ev.is_empty() {
                        return Some(Step::Done(outcome));
                    }
                    // Deliver the tail first, then Done on the next call.
                    self.pending_done = Some(outcome);
                    return Some(Step::Output(ev));
                }
            }
        }
    }

    /// The log probabilities of the output tokens received since the last
    /// call (empty unless the request asked for them), in order.
    pub fn take_logprobs(&mut self) -> Vec<TokenLogprob> {
        std::mem::take(&mut self.logprobs)
    }

    /// The bytes of token `id`, as log probabilities report it.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        match self.app.constraints.get() {
            Some(Ok(c)) => c.token_bytes(id),
            _ => self
                .app
                .codec
                .decode(&[id])
                .unwrap_or_default()
                .into_bytes(),
        }
    }

    /// Runs the generation to its end, handing each output event to `f`;
    /// the error of a failed generation.
    pub async fn collect(&mut self, mut f: impl FnMut(OutputEvent)) -> Result<Outcome, String> {
        loop {
            match self.next().await {
                Some(Step::Started) => {}
                Some(Step::Output(evs)) => evs.into_iter().for_each(&mut f),
                Some(Step::Done(o)) => return Ok(o),
                Some(Step::Failed(e)) => return Err(e),
                None => return Err("generation ended early".into()),
            }
        }
    }

    /// Hands the generation's figures to the request's record and the
    /// metrics, once: from `outcome` when it ended, else from what arrived.
    fn report(&mut self, outcome: Option<&Outcome>, finish: &'static str) {
        if std::mem::replace(&mut self.reported, true) {
            return;
        }
        let figures = match outcome {
            Some(o) => GenFigures {
                prompt_tokens: o.prompt_tokens,
                reused_prompt_tokens: o.stats.reused_prompt_tokens,
                generated_tokens: o.completion_tokens,
                wait_s: None,
                time_to_first_token_s: Some(o.stats.time_to_first_token_s),
                decode_tokens_per_s: Some(o.stats.decode_tokens_per_s),
                drafted_tokens: o.stats.speculation.as_ref().map_or(0, |s| s.drafted),
                accepted_drafts: o.stats.speculation.as_ref().map_or(0, |s| s.accepted),
                finish: Some(finish),
            },
            None => GenFigures {
                prompt_tokens: self.prompt_tokens,
                generated_tokens: self.received,
                finish: Some(finish),
                ..GenFigures::default()
            },
        };
        let wait_s = self.started.map(|t| (t - self.submitted).as_secs_f64());
        let figures = GenFigures { wait_s, ..figures };
        if let Some(r) = &self.record {
            r.update(|f| *f = figures.clone());
        }
        // Only whole jobs tell how long the next one may take.
        let engine_s = outcome.and(self.started.map(|t| t.elapsed().as_secs_f64()));
        self.app.metrics.record_generation(&figures, engine_s);
    }

    fn feed(&mut self, text: &str) -> Vec<OutputEvent> {
        if text.is_empty() {
            return Vec::new();
        }
        match &mut self.parser {
            Some(p) => p.push(text),
            None => vec![OutputEvent::Content(text.to_string())],
        }
    }
}

/// An SSE body fed by a task; when the client goes away the receiver is
/// dropped, the task sees it and drops its `Gen` (which cancels).
fn sse_body(rx: mpsc::Receiver<String>) -> axum::body::Body {
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|s| (Ok::<_, std::convert::Infallible>(s), rx))
    });
    axum::body::Body::from_stream(stream)
}

/// Response headers of an SSE stream.
fn sse_response(body: axum::body::Body) -> axum::response::Response {
    axum::response::Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .header("x-accel-buffering", "no")
        .body(body)
        .unwrap_or_default()
}

/// An SSE response whose messages `task` sends: it is spawned with the
/// sending end, and its sends fail once the client goes away.
pub fn spawn_sse<T>(task: impl FnOnce(mpsc::Sender<String>) -> T) -> axum::response::Response
where
    T: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<String>(64);
    tokio::spawn(task(tx));
    sse_response(sse_body(rx))
}

/// Waits for the next step while sending keep-alives; `None` when the
/// client is gone (the caller returns, dropping the `Gen`).
async fn next_or_ping(
    gen: &mut Gen,
    tx: &mpsc::Sender<String>,
    ping: &str,
    interval: std::time::Duration,
) -> Option<Option<Step>> {
    loop {
        tokio::select! {
            step = gen.next() => return Some(step),
            _ = tx.closed() => return None,
            _ = tokio::time::sleep(interval) => {
                if tx.send(ping.to_string()).await.is_err() {
                    return None;
                }
            }
        }
    }
}

/// Streams a generation: sends what `on_step` makes of each step (SSE
/// messages, and whether the stream ends there) with keep-alive `ping`s
/// between steps, until the stream ends or the client goes away (dropping
/// `gen` then cancels the job). `on_step` also gets the generation, for
/// what arrives beside the steps (its log probabilities).
pub async fn pump(
    mut gen: Gen,
    tx: mpsc::Sender<String>,
    ping: &str,
    interval: std::time::Duration,
    mut on_step: impl FnMut(Step, &mut Gen) -> (Vec<String>, bool),
) {
    loop {
        let Some(Some(step)) = next_or_ping(&mut gen, &tx, ping, interval).await else {
            return;
        };
        let (msgs, end) = on_step(step, &mut gen);
        for m in msgs {
            if tx.send(m).await.is_err() {
                return;
            }
        }
        if end {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::overflow_advice;

    #[test]
    fn overflow_advice_is_one_the_user_can_follow() {
        let below = overflow_advice(5000, 4096, 32768);
        assert!(below.contains("cut at least 905 tokens"), "{below}");
        assert!(
            below.contains("--max-context") && below.contains("32768"),
            "{below}"
        );
        let at = overflow_advice(5000, 4096, 4096);
        assert!(at.contains("cut at least 905 tokens"), "{at}");
        assert!(!at.contains("--max-context"), "{at}");
        assert!(at.contains("a model with more positions"), "{at}");
    }
}
