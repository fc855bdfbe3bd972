//! The access log: one line per request at `info` on the target
//! `slipstream::access`, written when the request is done (for a stream:
//! its last event sent, or the client gone, and its generation ended),
//! and the request counts of `/metrics`.
//!
//! A line: method, path, status, seconds, then the generation's figures
//! when the request ran one, e.g.
//! `POST /v1/chat/completions 200 1.234s #7 prompt=120 reused=100
//! generated=50 wait=0.000s ttft=0.210s decode=12.3tok/s finish=stop`.
//! Status 499 is a client that went away before the reply was ready;
//! ` disconnected` ends the line of a stream the client left early.
//!
//! Handlers need not do anything: the middleware runs each request in a
//! task-local scope holding its [`RequestRecord`], which
//! [`crate::gen::submit`] picks up; the generation fills it in, even from
//! the task that streams the reply.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, Method};
use axum::middleware::Next;
use axum::response::Response;
use futures_util::StreamExt;

use crate::App;

/// What a request's generation did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenFigures {
    pub prompt_tokens: usize,
    /// Prompt tokens restored from a kept state instead of prefilled.
    pub reused_prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Seconds in the queue before the engine took the job.
    pub wait_s: Option<f64>,
    /// Seconds from the engine taking the job to the first token.
    pub time_to_first_token_s: Option<f64>,
    pub decode_tokens_per_s: Option<f64>,
    /// Speculative decoding: tokens drafted, and those verified and kept.
    pub drafted_tokens: u64,
    pub accepted_drafts: u64,
    /// `stop`, `length`, `cancelled` or `error`; `None` while it runs.
    pub finish: Option<&'static str>,
}

/// A request's record, shared by the middleware, the body of a streamed
/// reply and the request's generation (which may outlive the handler, in a
/// stream's task); the line is logged when the last of them lets go.
#[derive(Clone)]
pub struct RequestRecord {
    /// The request's number since the server started (also on the
    /// `--log-prompts` lines).
    pub id: u64,
    entry: Arc<Mutex<Pending>>,
}

tokio::task_local! {
    static CURRENT: RequestRecord;
}

impl RequestRecord {
    /// The record of the request this task is handling, if any.
    pub fn current() -> Option<RequestRecord> {
        CURRENT.try_with(Clone::clone).ok()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.entry.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Updates the generation's figures (created empty on first use).
    pub fn update(&self, f: impl FnOnce(&mut GenFigures)) {
        f(self.lock().figures.get_or_insert_with(GenFigures::default));
    }
}

/// One finished request, as logged.
#[derive(Debug, Clone, PartialEq)]
pub struct AccessEntry {
    pub id: u64,
    pub method: Method,
    pub path: String,
    /// 499: the client went away before the reply was ready.
    pub status: u16,
    pub seconds: f64,
    pub generation: Option<GenFigures>,
    /// A streamed reply the client left before its end.
    pub disconnected: bool,
}

/// The log line of `e`.
pub fn access_line(e: &AccessEntry) -> String {
    use std::fmt::Write;
    let mut s = format!(
        "{} {} {} {:.3}s #{}",
        e.method, e.path, e.status, e.seconds, e.id
    );
    if let Some(g) = &e.generation {
        let _ = write!(
            s,
            " prompt={} reused={} generated={}",
            g.prompt_tokens, g.reused_prompt_tokens, g.generated_tokens
        );
        if let Some(w) = g.wait_s {
            let _ = write!(s, " wait={w:.3}s");
        }
        if let Some(t) = g.time_to_first_token_s {
            let _ = write!(s, " ttft={t:.3}s");
        }
        if let Some(r) = g.decode_tokens_per_s {
            let _ = write!(s, " decode={r:.1}tok/s");
        }
        if g.drafted_tokens > 0 {
            let _ = write!(s, " drafts={}/{}", g.accepted_drafts, g.drafted_tokens);
        }
        let _ = write!(s, " finish={}", g.finish.unwrap_or("running"));
    }
    if e.disconnected {
        s.push_str(" disconnected");
    }
    s
}

/// A request being served; logs it when dropped.
struct Pending {
    app: Arc<App>,
    started: Instant,
    id: u64,
    method: Method,
    path: String,
    /// The route (`/v1/responses/{id}`), the label of `/metrics`.
    endpoint: String,
    /// `None` until the reply's head is ready.
    status: Option<u16>,
    figures: Option<GenFigures>,
    streaming: bool,
    stream_ended: bool,
}

impl Drop for Pending {
    fn drop(&mut self) {
        let entry = AccessEntry {
            id: self.id,
            method: self.method.clone(),
            path: std::mem::take(&mut self.path),
            status: self.status.unwrap_or(499),
            seconds: self.started.elapsed().as_secs_f64(),
            generation: self.figures.take(),
            disconnected: self.streaming && !self.stream_ended,
        };
        self.app
            .metrics
            .record_request(&self.endpoint, entry.status);
        tracing::info!(target: "slipstream::access", "{}", access_line(&entry));
    }
}

/// The middleware: runs the request with its record in scope; the record
/// logs it once the reply, its stream and its generation are all done.
pub async fn log_requests(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let id = app.metrics.next_request_id();
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let record = RequestRecord {
        id,
        entry: Arc::new(Mutex::new(Pending {
            app,
            started: Instant::now(),
            id,
            method: req.method().clone(),
            path: req.uri().path().to_string(),
            endpoint,
            status: None,
            figures: None,
            streaming: false,
            stream_ended: false,
        })),
    };
    let resp = CURRENT.scope(record.clone(), next.run(req)).await;
    let is_stream = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    {
        let mut e = record.lock();
        e.status = Some(resp.status().as_u16());
        e.streaming = is_stream;
    }
    if !is_stream {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let body = futures_util::stream::unfold(
        (body.into_data_stream(), record),
        |(mut body, record)| async move {
            match body.next().await {
                Some(chunk) => Some((chunk, (body, record))),
                None => {
                    record.lock().stream_ended = true;
                    None
                }
            }
        },
    );
    Response::from_parts(parts, axum::body::Body::from_stream(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_name_the_request_and_its_generation() {
        let mut e = AccessEntry {
            id: 3,
            method: Method::GET,
            path: "/nope".into(),
            status: 404,
            seconds: 0.0012,
            generation: None,
            disconnected: false,
        };
        assert_eq!(access_line(&e), "GET /nope 404 0.001s #3");
        e.method = Method::POST;
        e.path = "/v1/messages".into();
        e.status = 200;
        e.generation = Some(GenFigures {
            prompt_tokens: 120,
            reused_prompt_tokens: 100,
            generated_tokens: 50,
            wait_s: Some(0.5),
            time_to_first_token_s: Some(0.21),
            decode_tokens_per_s: Some(12.345),
            drafted_tokens: 40,
            accepted_drafts: 31,
            finish: Some("length"),
        });
        e.disconnected = true;
        assert_eq!(
            access_line(&e),
            "POST /v1/messages 200 0.001s #3 prompt=120 reused=100 generated=50 wait=0.500s ttft=0.210s decode=12.3tok/s drafts=31/40 finish=length disconnected"
        );
    }
}
