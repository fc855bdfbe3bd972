//! Agent sessions pay only for new tokens: over both APIs, a conversation's
//! later turns reuse what they share with it, also after a side request
//! (a title or memory request sharing only the system prompt) in between.

mod common;

use common::{config, rt, server_with_states};
use serde_json::{json, Value};
use slipstream_server::{RunningServer, ServerConfig, StateCacheSpec};

/// A template with the Qwen3.5/3.6 rules: it drops the reasoning of turns
/// before the last query, so every turn's prompt diverges where the
/// previous reply began.
const QWEN_LIKE: &str = include_str!("fixtures/qwen_like_template.jinja");

fn server(qwen_like: bool) -> RunningServer {
    let config = ServerConfig {
        chat_template: qwen_like.then(|| QWEN_LIKE.to_string()),
        ..config()
    };
    server_with_states(
        config,
        StateCacheSpec {
            max_bytes: Some(1 << 30),
            checkpoint_interval: Some(8),
        },
    )
}

/// A request that must succeed; its JSON body.
async fn post_ok(s: &RunningServer, path: &str, body: Value) -> Value {
    let (status, v) = common::post(s, path, body).await;
    assert_eq!(status, 200, "{v}");
    v
}

const SYSTEM: &str = "You are a careful coding agent. Read files before you edit them, keep \
    changes small, and explain what you did in one short paragraph at the end.";

/// The user turns of the conversation; long enough that a missed reuse shows.
fn user_turn(i: usize) -> String {
    format!(
        "Step {i}: the tool printed the following listing of the project, please look at it \
         and say which file to open next. src/main.rs src/lib.rs src/parse.rs src/render.rs \
         tests/basic.rs Cargo.toml README.md (turn {i})"
    )
}

/// One turn's figures: prompt tokens and reused tokens.
struct Turn {
    prompt: u64,
    reused: u64,
    reply: String,
}

async fn openai_turn(s: &RunningServer, history: &[Value]) -> Turn {
    let mut messages = vec![json!({"role": "system", "content": SYSTEM})];
    messages.extend_from_slice(history);
    let r = post_ok(
        s,
        "/v1/chat/completions",
        json!({"model": "demo", "messages": messages, "max_tokens": 12, "temperature": 0}),
    )
    .await;
    Turn {
        prompt: r["usage"]["prompt_tokens"].as_u64().unwrap(),
        reused: r["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        reply: r["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_string(),
    }
}

async fn anthropic_turn(s: &RunningServer, history: &[Value]) -> Turn {
    let r = post_ok(
        s,
        "/v1/messages",
        json!({"model": "demo", "system": SYSTEM, "messages": history, "max_tokens": 12,
               "temperature": 0, "thinking": {"type": "adaptive"}}),
    )
    .await;
    let input = r["usage"]["input_tokens"].as_u64().unwrap();
    let read = r["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    Turn {
        prompt: input + read,
        reused: read,
        reply: r["content"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|b| b["type"] == "text")
            .and_then(|b| b["text"].as_str())
            .unwrap_or("")
            .to_string(),
    }
}

async fn turn(s: &RunningServer, anthropic: bool, history: &[Value]) -> Turn {
    if anthropic {
        anthropic_turn(s, history).await
    } else {
        openai_turn(s, history).await
    }
}

/// Three turns with a side request before each later one; from turn 2 on,
/// the reuse covers at least 95 % of the previous turn's prompt (which
/// every later prompt extends).
fn session(anthropic: bool, qwen_like: bool) {
    let s = server(qwen_like);
    rt().block_on(async {
        let mut history = vec![json!({"role": "user", "content": user_turn(1)})];
        let mut previous = turn(&s, anthropic, &history).await;
        assert_eq!(previous.reused, 0);
        for i in 2..=3 {
            let side =
                vec![json!({"role": "user", "content": "Write a five-word title for this chat."})];
            turn(&s, anthropic, &side).await;
            history.push(json!({"role": "assistant", "content": previous.reply.clone()}));
            history.push(json!({"role": "user", "content": user_turn(i)}));
            let t = turn(&s, anthropic, &history).await;
            assert!(
                t.reused as f64 >= 0.95 * previous.prompt as f64 && t.reused < t.prompt,
                "turn {i} (anthropic: {anthropic}, qwen-like template: {qwen_like}): reused {} of {}, the previous prompt had {}",
                t.reused,
                t.prompt,
                previous.prompt
            );
            previous = t;
        }
    });
}

#[test]
fn openai_turns_reuse_the_conversation_across_side_requests() {
    session(false, false);
}

#[test]
fn anthropic_turns_reuse_the_conversation_across_side_requests() {
    session(true, false);
}

#[test]
fn turns_reuse_the_conversation_when_the_template_drops_earlier_reasoning() {
    session(false, true);
    session(true, true);
}
