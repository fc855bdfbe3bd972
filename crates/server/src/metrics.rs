//! `/metrics`: the server's counters in the Prometheus text format
//! (version 0.0.4), written by hand: a handful of counters, gauges and two
//! histograms need no registry.
//!
//! - `slipstream_requests_total{endpoint,status}`: requests by route
//!   (`unmatched` for paths no route serves) and status (499: the client
//!   went away first), counted when they end.
//! - `slipstream_generations_total{finish}`: generations by how they ended
//!   (`stop`, `length`, `cancelled`, `error`).
//! - `slipstream_prompt_tokens_total`, `slipstream_reused_prompt_tokens_total`
//!   (restored from a kept state instead of prefilled),
//!   `slipstream_generated_tokens_total`.
//! - `slipstream_draft_tokens_total`, `slipstream_accepted_draft_tokens_total`:
//!   speculative decoding's drafts, and those verified and kept.
//! - `slipstream_time_to_first_token_seconds` and
//!   `slipstream_decode_tokens_per_second`: histograms over generations.
//! - `slipstream_queue_depth`, `slipstream_queue_capacity`, `slipstream_busy`
//!   (1 while a generation runs), `slipstream_uptime_seconds`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use crate::access::GenFigures;
use crate::App;

/// Upper bounds of the time-to-first-token buckets, seconds.
const TTFT_BUCKETS: [f64; 11] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];
/// Upper bounds of the decode-rate buckets, tokens per second.
const DECODE_BUCKETS: [f64; 10] = [1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 50.0, 100.0, 200.0];

#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    /// Observations per bucket (not cumulative), the last one `+Inf`.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
        }
    }

    fn observe(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        let i = self
            .bounds
            .iter()
            .position(|b| v <= *b)
            .unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += v;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, c) in self.counts.iter().enumerate() {
            cumulative += c;
            let le = self
                .bounds
                .get(i)
                .map_or_else(|| "+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {cumulative}");
    }
}

#[derive(Debug)]
struct Counters {
    /// By (endpoint, status).
    requests: BTreeMap<(String, u16), u64>,
    /// By finish reason.
    generations: BTreeMap<&'static str, u64>,
    prompt_tokens: u64,
    reused_prompt_tokens: u64,
    generated_tokens: u64,
    draft_tokens: u64,
    accepted_draft_tokens: u64,
    ttft: Histogram,
    decode: Histogram,
    /// Moving average of a job's seconds on the engine (for `Retry-After`).
    job_seconds: Option<f64>,
}

/// The server's counters.
#[derive(Debug)]
pub struct Metrics {
    counters: Mutex<Counters>,
    request_ids: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            counters: Mutex::new(Counters {
                requests: BTreeMap::new(),
                generations: BTreeMap::new(),
                prompt_tokens: 0,
                reused_prompt_tokens: 0,
                generated_tokens: 0,
                draft_tokens: 0,
                accepted_draft_tokens: 0,
                ttft: Histogram::new(&TTFT_BUCKETS),
                decode: Histogram::new(&DECODE_BUCKETS),
                job_seconds: None,
            }),
            request_ids: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Counters> {
        self.counters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next request's number, from 1.
    pub fn next_request_id(&self) -> u64 {
        self.request_ids.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Counts a finished request.
    pub fn record_request(&self, endpoint: &str, status: u16) {
        *self
            .lock()
            .requests
            .entry((endpoint.to_string(), status))
            .or_default() += 1;
    }

    /// Counts a finished generation; `engine_s`: seconds the engine spent
    /// on it, when it ran.
    pub fn record_generation(&self, g: &GenFigures, engine_s: Option<f64>) {
        let mut c = self.lock();
        *c.generations
            .entry(g.finish.unwrap_or("error"))
            .or_default() += 1;
        c.prompt_tokens += g.prompt_tokens as u64;
        c.reused_prompt_tokens += g.reused_prompt_tokens as u64;
        c.generated_tokens += g.generated_tokens as u64;
        c.draft_tokens += g.drafted_tokens;
        c.accepted_draft_tokens += g.accepted_drafts;
        if let Some(t) = g.time_to_first_token_s {
            c.ttft.observe(t);
        }
        if let Some(r) = g.decode_tokens_per_s.filter(|r| *r > 0.0) {
            c.decode.observe(r);
        }
        if let Some(s) = engine_s {
            c.job_seconds = Some(match c.job_seconds {
                Some(avg) => 0.7 * avg + 0.3 * s,
                None => s,
            });
        }
    }

    /// Seconds a refused client should wait: a queue slot frees when the
    /// running job ends, so about one job's time (its recent average),
    /// 1 to 30 s.
    pub fn retry_after_s(&self) -> u64 {
        let avg = self.lock().job_seconds.unwrap_or(1.0);
        (avg.ceil() as u64).clamp(1, 30)
    }

    /// The text exposition; `queue`: the worker's shared view.
    pub fn render(&self, app: &App) -> String {
        let c = self.lock();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP slipstream_requests_total HTTP requests by route and status, counted when they end.\n# TYPE slipstream_requests_total counter"
        );
        for ((endpoint, status), n) in &c.requests {
            let _ = writeln!(
                out,
                "slipstream_requests_total{{endpoint=\"{}\",status=\"{status}\"}} {n}",
                label(endpoint)
            );
        }
        let _ = writeln!(
            out,
            "# HELP slipstream_generations_total Generations by how they ended.\n# TYPE slipstream_generations_total counter"
        );
        for (finish, n) in &c.generations {
            let _ = writeln!(
                out,
                "slipstream_generations_total{{finish=\"{finish}\"}} {n}"
            );
        }
        for (name, help, v) in [
            (
                "slipstream_prompt_tokens_total",
                "Prompt tokens of generations.",
                c.prompt_tokens,
            ),
            (
                "slipstream_reused_prompt_tokens_total",
                "Prompt tokens restored from a kept state instead of prefilled.",
                c.reused_prompt_tokens,
            ),
            (
                "slipstream_generated_tokens_total",
                "Tokens generated.",
                c.generated_tokens,
            ),
            (
                "slipstream_draft_tokens_total",
                "Tokens drafted by speculative decoding.",
                c.draft_tokens,
            ),
            (
                "slipstream_accepted_draft_tokens_total",
                "Drafted tokens verified and kept.",
                c.accepted_draft_tokens,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        }
        c.ttft.write(
            &mut out,
            "slipstream_time_to_first_token_seconds",
            "Seconds from the engine taking a job to its first token.",
        );
        c.decode.write(
            &mut out,
            "slipstream_decode_tokens_per_second",
            "Decode rate of generations, tokens after the first per second.",
        );
        drop(c);
        let st = &app.worker.state;
        for (name, help, v) in [
            (
                "slipstream_queue_depth",
                "Requests waiting for the engine.",
                st.pending.load(Ordering::SeqCst) as f64,
            ),
            (
                "slipstream_queue_capacity",
                "Requests that may wait; more are refused (429/529).",
                app.worker.capacity as f64,
            ),
            (
                "slipstream_busy",
                "1 while a generation runs.",
                u8::from(st.busy.load(Ordering::SeqCst)) as f64,
            ),
            (
                "slipstream_uptime_seconds",
                "Seconds since the server started.",
                app.started.elapsed().as_secs_f64(),
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        out
    }
}

/// A label value escaped for the text format.
fn label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// `GET /metrics`.
pub async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.metrics.render(&app),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative() {
        let mut h = Histogram::new(&[1.0, 2.0]);
        for v in [0.5, 1.0, 1.5, 7.0, f64::NAN] {
            h.observe(v);
        }
        let mut s = String::new();
        h.write(&mut s, "x", "help");
        assert_eq!(
            s,
            "# HELP x help\n# TYPE x histogram\nx_bucket{le=\"1\"} 2\nx_bucket{le=\"2\"} 3\nx_bucket{le=\"+Inf\"} 4\nx_sum 10\nx_count 4\n"
        );
    }

    #[test]
    fn retry_after_follows_recent_jobs() {
        let m = Metrics::default();
        assert_eq!(m.retry_after_s(), 1);
        let g = GenFigures::default();
        m.record_generation(&g, Some(4.2));
        assert_eq!(m.retry_after_s(), 5);
        m.record_generation(&g, Some(1000.0));
        assert_eq!(m.retry_after_s(), 30);
    }
}
