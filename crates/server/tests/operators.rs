//! What operators see: the access log (one line per request, generation
//! figures included), `--log-prompts`, `/metrics` in the Prometheus text
//! format, and `Retry-After` on a full queue.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use slipstream_server::ServerConfig;

/// Everything logged on the server's operator targets in this test
/// process (one global subscriber; tests pick their lines by content).
fn logs() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = buf.clone();
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(
                "slipstream::access=info,slipstream::prompt=info",
            ))
            .with_ansi(false)
            .with_writer(move || Sink(sink.clone()))
            .init();
        buf
    })
    .clone()
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Waits (at most 5 s) until the log holds a line with all of `parts`.
async fn log_line(parts: &[&str]) -> String {
    log_line_where(parts, |_| true).await
}

/// Waits (at most 5 s) until the log holds a line with all of `parts`
/// that `also` accepts.
async fn log_line_where(parts: &[&str], also: impl Fn(&str) -> bool) -> String {
    let logs = logs();
    let t0 = Instant::now();
    loop {
        let text = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
        if let Some(l) = text
            .lines()
            .find(|l| parts.iter().all(|p| l.contains(p)) && also(l))
        {
            return l.to_string();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "no log line with {parts:?} in:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn get_metrics(s: &slipstream_server::RunningServer) -> String {
    let r = reqwest::get(url(s, "/metrics")).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["content-type"],
        "text/plain; version=0.0.4; charset=utf-8"
    );
    r.text().await.unwrap()
}

/// Waits (at most 5 s) until `/metrics` holds every line of `want`.
async fn metrics_with(s: &slipstream_server::RunningServer, want: &[String]) -> String {
    let t0 = Instant::now();
    loop {
        let m = get_metrics(s).await;
        if want.iter().all(|w| m.lines().any(|l| l == w)) {
            return m;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "want {want:#?} in:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn access_log_prompts_and_metrics() {
    logs();
    let mut c = config();
    c.log_prompts = true;
    let s = scripted(c, &["Hello there, operator."]);
    rt().block_on(async {
        let body =
            json!({"model": "demo", "messages": [{"role": "user", "content": "marker-7f3a"}]});
        let (st, v) = post(&s, "/v1/chat/completions", body.clone()).await;
        assert_eq!(st, 200, "{v}");
        let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
        let generated = v["usage"]["completion_tokens"].as_u64().unwrap();
        let mut sb = body;
        sb["stream"] = json!(true);
        let (st, _) = post_stream(&s, "/v1/chat/completions", sb).await;
        assert_eq!(st, 200);
        let (st, _) = post(&s, "/v1/nope", json!({})).await;
        assert_eq!(st, 404);
        let (st, _) = post_raw(&s, "/v1/messages", "{not json").await;
        assert_eq!(st, 400);

        let figures = format!("prompt={prompt} reused=0 generated={generated} ");
        let line = log_line(&[
            "slipstream::access",
            "POST /v1/chat/completions 200",
            &figures,
        ])
        .await;
        assert!(
            line.contains("finish=stop") && line.contains("ttft="),
            "{line}"
        );
        log_line(&["slipstream::access", "POST /v1/nope 404"]).await;
        log_line(&["slipstream::access", "POST /v1/messages 400"]).await;
        // The rendered prompt, under the number of its request's line.
        let p = log_line(&["slipstream::prompt", &format!("{prompt} prompt tokens")]).await;
        let id = p.split('#').nth(1).unwrap().split(':').next().unwrap();
        let text = String::from_utf8_lossy(&logs().lock().unwrap()).into_owned();
        assert!(text.contains("marker-7f3a"));
        log_line(&["POST /v1/chat/completions 200", &format!(" #{id} ")]).await;

        let m = metrics_with(
            &s,
            &[
                "slipstream_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 2"
                    .into(),
                "slipstream_requests_total{endpoint=\"unmatched\",status=\"404\"} 1".into(),
                "slipstream_requests_total{endpoint=\"/v1/messages\",status=\"400\"} 1".into(),
            ],
        )
        .await;
        for want in [
            format!("slipstream_prompt_tokens_total {}", 2 * prompt),
            format!("slipstream_generated_tokens_total {}", 2 * generated),
            "slipstream_reused_prompt_tokens_total 0".into(),
            "slipstream_generations_total{finish=\"stop\"} 2".into(),
            "slipstream_time_to_first_token_seconds_count 2".into(),
            "slipstream_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2".into(),
            "slipstream_queue_depth 0".into(),
            "slipstream_queue_capacity 8".into(),
            "slipstream_busy 0".into(),
            "# TYPE slipstream_requests_total counter".into(),
        ] {
            assert!(m.lines().any(|l| l == want), "want {want} in:\n{m}");
        }
    });
}

#[test]
fn metrics_need_the_api_key_when_one_is_set() {
    let s = scripted(
        ServerConfig {
            api_key: Some("k3y".into()),
            ..config()
        },
        &["x"],
    );
    rt().block_on(async {
        let r = reqwest::get(url(&s, "/metrics")).await.unwrap();
        assert_eq!(r.status(), 401);
        let r = reqwest::Client::new()
            .get(url(&s, "/metrics"))
            .bearer_auth("k3y")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(r
            .text()
            .await
            .unwrap()
            .contains("slipstream_requests_total{endpoint=\"/metrics\",status=\"401\"} 1"));
    });
}

#[test]
fn a_full_queue_says_when_to_retry() {
    logs();
    let mut c = config();
    c.queue = 1;
    // Long enough to hold the engine while the queue fills.
    let long = "tick ".repeat(3000);
    let s = scripted(c, &[&long]);
    rt().block_on(async {
        let stream = json!({"model": "demo", "stream": true,
            "messages": [{"role": "user", "content": "count"}]});
        let (running, waiting) = fill_queue_of_one(&s, "/v1/chat/completions", &stream).await;
        metrics_with(
            &s,
            &["slipstream_queue_depth 1".into(), "slipstream_busy 1".into()],
        )
        .await;

        let client = reqwest::Client::new();
        let body = json!({"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
        for (path, status) in [("/v1/chat/completions", 429), ("/v1/messages", 529)] {
            let r = client.post(url(&s, path)).json(&body).send().await.unwrap();
            assert_eq!(r.status().as_u16(), status);
            let after: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
            assert!((1..=30).contains(&after), "Retry-After: {after}");
        }
        metrics_with(
            &s,
            &[
                "slipstream_requests_total{endpoint=\"/v1/chat/completions\",status=\"429\"} 1".into(),
                "slipstream_requests_total{endpoint=\"/v1/messages\",status=\"529\"} 1".into(),
            ],
        )
        .await;

        // The client that leaves mid-stream: its line says so, and what ran.
        drop(running);
        drop(waiting);
        let cancelled = ["POST /v1/chat/completions 200", "finish=cancelled", "disconnected"];
        log_line_where(&cancelled, |l| !l.contains("generated=0 ")).await;
        log_line_where(&cancelled, |l| l.contains("generated=0 ")).await;
        metrics_with(&s, &["slipstream_generations_total{finish=\"cancelled\"} 2".into()]).await;
    });
}
