//! One streamed request (OpenAI chat completions or Anthropic messages),
//! timed from the client: time to the first token event, total time, and
//! the token counts the server reports.
//!
//! The figures come from what both servers send: OpenAI usage
//! (`prompt_tokens`, `prompt_tokens_details.cached_tokens`), Anthropic usage
//! (`input_tokens` new, `cache_read_input_tokens` reused: the last event
//! that has both wins), slipstream's `slipstream.time_to_first_token_s`, and
//! llama-server's `timings` (`prompt_n` tokens prefilled, `cache_n` taken from
//! its cache, `prompt_ms`), which win where present.

use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

/// What one request measured. Times in seconds from sending the request.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Measured {
    /// The first chunk that carries a generated token (content, reasoning,
    /// a tool call) or the finish reason, whichever comes first: a role-only
    /// opening chunk does not count.
    pub ttft_s: Option<f64>,
    /// Until the stream ended.
    pub total_s: f64,
    /// Prompt tokens as the server counted them.
    pub prompt_tokens: Option<u64>,
    /// Prompt tokens the server did not prefill (taken from its cache).
    pub reused_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// The server's own prefill time, when it reports one (slipstream's
    /// time to first token, llama-server's `prompt_ms`).
    pub server_prefill_s: Option<f64>,
    /// Why the request failed, when it did.
    pub error: Option<String>,
}

impl Measured {
    /// Prompt tokens the server prefilled.
    pub fn new_tokens(&self) -> Option<u64> {
        Some(
            self.prompt_tokens?
                .saturating_sub(self.reused_tokens.unwrap_or(0)),
        )
    }
}

/// Sends `body` (a streamed chat request) to `url` and measures it; a
/// failure of any kind is recorded in [`Measured::error`], not returned.
pub async fn measure(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    timeout: Duration,
) -> Measured {
    let start = Instant::now();
    let mut m = Measured::default();
    let outcome = tokio::time::timeout(timeout, stream(client, url, body, start, &mut m)).await;
    m.total_s = start.elapsed().as_secs_f64();
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) => m.error = Some(e),
        Err(_) => {
            m.error = Some(format!(
                "no complete reply within {:.0} s",
                timeout.as_secs_f64()
            ))
        }
    }
    if m.error.is_none() && m.ttft_s.is_none() {
        m.error = Some("the stream ended without a token or a finish reason".into());
    }
    m
}

async fn stream(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    start: Instant,
    m: &mut Measured,
) -> Result<(), String> {
    let mut resp = client
        .post(url)
        .json(body)
        .send()
        .await
        .map_err(|e| format!("sending the request: {e}"))?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        return Err(format!("HTTP {status}: {}", clip(&text, 400)));
    }
    let mut sse = SseBuffer::default();
    let mut done = false;
    while !done {
        let chunk = resp
            .chunk()
            .await
            .map_err(|e| format!("reading the stream: {e}"))?;
        let Some(bytes) = chunk else { break };
        for data in sse.push(&bytes) {
            if data == "[DONE]" {
                done = true;
                break;
            }
            let v: Value = serde_json::from_str(&data)
                .map_err(|e| format!("a stream event is not JSON ({e}): {}", clip(&data, 200)))?;
            if v["type"] == "message_stop" {
                done = true;
            }
            if let Some(e) = v.get("error") {
                return Err(format!(
                    "the server reported an error: {}",
                    clip(&e.to_string(), 400)
                ));
            }
            if m.ttft_s.is_none() && carries_token(&v) {
                m.ttft_s = Some(start.elapsed().as_secs_f64());
            }
            read_figures(&v, m);
        }
    }
    if !done {
        return Err("the stream ended before [DONE] or message_stop".into());
    }
    Ok(())
}

/// Whether an event carries a generated token or the finish reason.
fn carries_token(event: &Value) -> bool {
    let nonempty = |v: &Value| v.as_str().is_some_and(|s| !s.is_empty());
    match event["type"].as_str() {
        // Anthropic: text, thinking or tool-argument deltas, a tool_use
        // block's start (its name is generated), the stop reason.
        Some("content_block_delta") => {
            let d = &event["delta"];
            nonempty(&d["text"]) || nonempty(&d["thinking"]) || nonempty(&d["partial_json"])
        }
        Some("content_block_start") => event["content_block"]["type"] == "tool_use",
        Some("message_delta") => event["delta"]["stop_reason"].is_string(),
        _ => {
            let Some(choice) = event.pointer("/choices/0") else {
                return false;
            };
            let delta = &choice["delta"];
            nonempty(&delta["content"])
                || nonempty(&delta["reasoning_content"])
                || delta["tool_calls"]
                    .as_array()
                    .is_some_and(|a| !a.is_empty())
                || choice["finish_reason"].as_str().is_some()
        }
    }
}

/// Token counts and server timings from a chunk, where it has them.
fn read_figures(chunk: &Value, m: &mut Measured) {
    let anthropic_usage = chunk
        .pointer("/message/usage")
        .or_else(|| chunk.get("usage"))
        .filter(|u| u["cache_read_input_tokens"].is_u64() && u["input_tokens"].is_u64());
    if let Some(u) = anthropic_usage {
        let (new, reused) = (
            u["input_tokens"].as_u64().unwrap_or(0),
            u["cache_read_input_tokens"].as_u64().unwrap_or(0),
        );
        m.prompt_tokens = Some(new + reused);
        m.reused_tokens = Some(reused);
    }
    if let Some(n) = chunk
        .pointer("/usage/output_tokens")
        .and_then(Value::as_u64)
    {
        m.completion_tokens = Some(n);
    }
    if let Some(u) = chunk
        .get("usage")
        .filter(|u| u.is_object() && anthropic_usage.is_none())
    {
        if let Some(p) = u["prompt_tokens"].as_u64() {
            m.prompt_tokens = Some(p);
        }
        if let Some(c) = u["completion_tokens"].as_u64() {
            m.completion_tokens = Some(c);
        }
        if let Some(c) = u
            .pointer("/prompt_tokens_details/cached_tokens")
            .and_then(Value::as_u64)
        {
            // llama-server's timings, when present, say the same and win below.
            m.reused_tokens.get_or_insert(c);
        }
    }
    if let Some(s) = chunk
        .pointer("/slipstream/time_to_first_token_s")
        .and_then(Value::as_f64)
    {
        m.server_prefill_s = Some(s);
    }
    if let Some(t) = chunk.get("timings").filter(|t| t.is_object()) {
        let cache_n = t["cache_n"].as_u64();
        let prompt_n = t["prompt_n"].as_u64();
        if let Some(c) = cache_n {
            m.reused_tokens = Some(c);
        }
        if let (Some(c), Some(p)) = (cache_n, prompt_n) {
            m.prompt_tokens = Some(c + p);
        }
        if let Some(ms) = t["prompt_ms"].as_f64() {
            m.server_prefill_s = Some(ms / 1000.0);
        }
        if let Some(n) = t["predicted_n"].as_u64() {
            m.completion_tokens.get_or_insert(n);
        }
    }
}

fn clip(s: &str, n: usize) -> String {
    if s.len() <= n {
        return s.to_string();
    }
    let mut end = n;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// Splits a server-sent-events byte stream into the `data` of its events.
#[derive(Default)]
struct SseBuffer {
    pending: Vec<u8>,
}

impl SseBuffer {
    /// Adds bytes; returns the data of every event completed by them
    /// (multi-line data joined by newlines; comments and other fields
    /// skipped). Works on bytes, so a character split across chunks stays
    /// whole; `\r` is dropped (`\r\n` line ends).
    fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.pending
            .extend(bytes.iter().copied().filter(|&b| b != b'\r'));
        let mut out = Vec::new();
        while let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.pending.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event[..end]);
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sse_events_split_across_chunks() {
        let mut b = SseBuffer::default();
        assert!(b.push(b"data: {\"a\"").is_empty());
        assert_eq!(b.push(b":1}\n\n: ping\n\ndata: [DO"), vec!["{\"a\":1}"]);
        assert_eq!(b.push(b"NE]\r\n\r\n"), vec!["[DONE]"]);
        assert_eq!(b.push(b"event: x\ndata: a\ndata: b\n\n"), vec!["a\nb"]);
    }

    /// The figures of a stream of `events`, read in order.
    fn figures(events: &[Value]) -> Measured {
        let mut m = Measured::default();
        for event in events {
            read_figures(event, &mut m);
        }
        m
    }

    #[test]
    fn tokens_and_figures_from_both_servers() {
        for (event, carries) in [
            (
                json!({"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}),
                false,
            ),
            (json!({"choices": [{"delta": {"content": "x"}}]}), true),
            (
                json!({"choices": [{"delta": {"reasoning_content": "x"}}]}),
                true,
            ),
            (json!({"choices": [{"delta": {"tool_calls": [{}]}}]}), true),
            (
                json!({"choices": [{"delta": {}, "finish_reason": "stop"}]}),
                true,
            ),
            (json!({"choices": [], "usage": {}}), false),
            (json!({"type": "message_start", "message": {}}), false),
            (
                json!({"type": "content_block_start", "content_block": {"type": "text", "text": ""}}),
                false,
            ),
            (
                json!({"type": "content_block_delta", "delta": {"type": "text_delta", "text": ""}}),
                false,
            ),
            (
                json!({"type": "content_block_delta", "delta": {"type": "thinking_delta", "thinking": "h"}}),
                true,
            ),
            (
                json!({"type": "content_block_start", "content_block": {"type": "tool_use", "name": "Read"}}),
                true,
            ),
            (
                json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens"}}),
                true,
            ),
            (json!({"type": "ping"}), false),
        ] {
            assert_eq!(carries_token(&event), carries, "{event}");
        }

        let m = figures(&[
            json!({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 90}},
            "slipstream": {"time_to_first_token_s": 0.5}}),
        ]);
        assert_eq!(
            (m.prompt_tokens, m.reused_tokens, m.new_tokens()),
            (Some(100), Some(90), Some(10))
        );
        assert_eq!(m.server_prefill_s, Some(0.5));

        let m = figures(&[
            json!({"choices": [{"delta": {}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 120, "completion_tokens": 8, "prompt_tokens_details": {"cached_tokens": 0}},
            "timings": {"cache_n": 100, "prompt_n": 20, "prompt_ms": 1500.0, "predicted_n": 8}}),
        ]);
        assert_eq!(
            (m.prompt_tokens, m.reused_tokens, m.new_tokens()),
            (Some(120), Some(100), Some(20))
        );
        assert_eq!(m.server_prefill_s, Some(1.5));
        assert_eq!(m.completion_tokens, Some(8));

        // Anthropic, slipstream's way: message_start counts the whole prompt
        // before prefill, message_delta splits it.
        let m = figures(&[
            json!({"type": "message_start", "message": {"usage": {"input_tokens": 100,
                "output_tokens": 0, "cache_read_input_tokens": 0}}}),
            json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                "usage": {"input_tokens": 10, "output_tokens": 8, "cache_read_input_tokens": 90}}),
        ]);
        assert_eq!(
            (m.prompt_tokens, m.reused_tokens, m.completion_tokens),
            (Some(100), Some(90), Some(8))
        );
        // llama-server's way: message_start after prefill, message_delta with output tokens only.
        let m = figures(&[
            json!({"type": "message_start", "message": {"usage": {"input_tokens": 20,
                "output_tokens": 0, "cache_read_input_tokens": 100}}}),
            json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 8}}),
        ]);
        assert_eq!(
            (m.prompt_tokens, m.reused_tokens, m.completion_tokens),
            (Some(120), Some(100), Some(8))
        );
    }
}
