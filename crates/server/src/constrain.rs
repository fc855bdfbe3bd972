//! Constrained decoding with `llguidance`: a request's structured-output
//! format (OpenAI `response_format`, Responses `text.format`, Anthropic
//! `output_config.format`) or forced tool call (`tool_choice` required /
//! any / named) becomes a Lark grammar, and a [`StepWatch`] installed in
//! the engine as its [`StepHook`] masks every token the grammar does not
//! allow. The same hook collects log probabilities when asked.
//!
//! Thinking: when the prompt ends inside an opened `<think>` block the
//! model thinks freely and the grammar applies from the token after its
//! `</think>` (a reasoning budget's forced close counts), so a forced
//! format costs no reasoning. A format or call allows up to 2 whitespace
//! characters before the value (models write `\n\n` after `</think>`).
//!
//! Tool calls follow the template's form: the XML form of Qwen3.5/3.6
//! (`<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n
//! </function>\n</tool_call>`) when the chat template writes
//! `<function=`, else the JSON form of Qwen3 (`<tool_call>\n{"name": ...,
//! "arguments": {...}}\n</tool_call>`). XML parameters come in the
//! schema's property order, the required ones always, each string value
//! free text up to its `</parameter>`, any other value JSON that follows
//! its schema; JSON arguments follow the tool's schema whole.
//!
//! `strict: false` in a json_schema format is enforced all the same: a
//! schema the server was given is a schema it keeps.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use slipstream_engine::StepHook;
use tokio::sync::mpsc::UnboundedSender;

use crate::worker::WorkerEvent;

/// Log probabilities of one generated token: the model's distribution
/// after the request's penalties, before the constraint's mask, the
/// temperature and truncation (OpenAI's and vLLM's choice).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// The tokenizer as llguidance sees it, and the parser factory built over
/// it: made once per server on the first request that needs it.
pub struct Constraints {
    factory: ParserFactory,
}

/// A tokenizer environment over the model's HF tokenizer: the trie of
/// every token's bytes, and the tokenizer's own encoding.
struct HfEnv {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for HfEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s) {
            Ok(text) => match self.tokenizer.encode(text, false) {
                Ok(enc) => enc.get_ids().to_vec(),
                Err(_) => self.trie.greedy_tokenize(s),
            },
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

impl Constraints {
    /// Builds the trie of `tokenizer` padded to the model's `vocab` logits
    /// (ids the tokenizer lacks become never-allowed special tokens);
    /// `eos` is the token a finished grammar allows.
    pub fn new(tokenizer: &tokenizers::Tokenizer, vocab: usize, eos: u32) -> Result<Self, String> {
        let json_text = tokenizer
            .to_string(false)
            .map_err(|e| format!("serializing the tokenizer: {e}"))?;
        let json: Value =
            serde_json::from_str(&json_text).map_err(|e| format!("reading the tokenizer: {e}"))?;
        // llguidance asserts on some malformed vocabularies: a panic here
        // is a tokenizer it cannot read, not a server crash.
        let bytes = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
            .map_err(|_| "the tokenizer's vocabulary cannot be read as bytes".to_string())?
            .map_err(|e| format!("the tokenizer's vocabulary: {e}"))?;
        let n = vocab.max(bytes.len());
        let mut words = bytes;
        words.resize(n, Vec::new());
        for (id, w) in words.iter_mut().enumerate() {
            if w.is_empty() {
                let mut name = format!(".<[{id}]>").into_bytes();
                name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
                *w = name;
            }
        }
        let info = TokRxInfo::new(n as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: llguidance::toktrie::TokEnv = Arc::new(HfEnv {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Constraints { factory })
    }

    /// The bytes of token `id` (a special token's name without its marker).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let trie = self.factory.tok_env().tok_trie();
        if id as usize >= trie.vocab_size() {
            return Vec::new();
        }
        let b = trie.token(id);
        match b.first() {
            Some(&TokTrie::SPECIAL_TOKEN_MARKER) => b[1..].to_vec(),
            _ => b.to_vec(),
        }
    }

    /// A matcher for `grammar`; a grammar llguidance refuses is an error
    /// naming why.
    pub fn matcher(&self, grammar: &str) -> Result<Matcher, String> {
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_lark(grammar.to_string()));
        let m = Matcher::new(parser);
        match m.get_error() {
            Some(e) => Err(e),
            None => Ok(m),
        }
    }

    /// Whether `text` is a special token of the vocabulary (then Lark
    /// names it `<[id]>`, not as a string).
    fn special_id(&self, text: &str) -> Option<u32> {
        let trie = self.factory.tok_env().tok_trie();
        let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
        marked.extend_from_slice(text.as_bytes());
        trie.token_id(&marked)
    }
}

/// How the chat template writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolForm {
    /// Qwen3.5/3.6: `<function=NAME>` and `<parameter=KEY>` tags.
    Xml,
    /// Qwen3: `{"name": ..., "arguments": ...}` inside `<tool_call>`.
    Json,
}

impl ToolForm {
    /// The form a chat template's source writes.
    pub fn of_template(source: Option<&str>) -> ToolForm {
        match source {
            Some(s) if !s.contains("<function=") && s.contains("\"arguments\"") => ToolForm::Json,
            _ => ToolForm::Xml,
        }
    }
}

/// What a request forces the reply to be.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// A JSON value following this schema (`{"type": "object"}` for
    /// `json_object`).
    Json(Value),
    /// Tool calls only: to one of `tools` (`(name, parameters schema)`),
    /// exactly one call when `single`, else one or more.
    Tools {
        tools: Vec<(String, Value)>,
        single: bool,
        form: ToolForm,
    },
}

/// What a request's `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (the default).
    Auto,
    /// No tools offered.
    None,
    /// At least one call, to any tool (OpenAI `required`, Anthropic `any`).
    Required,
    /// A call to this tool.
    Named(String),
}

/// A structured-output format as OpenAI writes it: chat's
/// `response_format` (`{"type": "json_schema", "json_schema": {"schema":
/// ...}}`) or, with `flat`, the Responses API's `text.format` (`{"type":
/// "json_schema", "schema": ...}`). `None` for plain text; an error names
/// what is wrong (the caller adds the field).
pub fn openai_format(v: &Value, flat: bool) -> Result<Option<Constraint>, String> {
    if v.is_null() {
        return Ok(None);
    }
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::Json(json!({"type": "object"})))),
        Some("json_schema") => {
            let holder = if flat { Some(v) } else { v.get("json_schema") };
            let Some(holder) = holder.filter(|h| h.is_object()) else {
                return Err("`json_schema` must be an object holding `schema`".into());
            };
            for key in holder.as_object().into_iter().flat_map(|o| o.keys()) {
                if !matches!(
                    key.as_str(),
                    "type" | "name" | "schema" | "strict" | "description"
                ) {
                    return Err(format!("unknown field `{key}`"));
                }
            }
            match holder.get("schema") {
                Some(schema) if schema.is_object() || schema.is_boolean() => {
                    Ok(Some(Constraint::Json(schema.clone())))
                }
                _ => Err("`schema` must be a JSON schema object".into()),
            }
        }
        Some(other) => Err(format!(
            "unknown type `{other}` (text, json_object, json_schema)"
        )),
        None => Err("`type` is required (text, json_object, json_schema)".into()),
    }
}

/// The constraint a forced `choice` puts on calls to `tools` (OpenAI
/// form: `{"type": "function", "function": {"name", "parameters"}}`);
/// `None` unless a call is forced. `single`: parallel calls are off.
pub fn tool_constraint(
    choice: &ToolChoice,
    tools: &[Value],
    single: bool,
    form: ToolForm,
) -> Result<Option<Constraint>, String> {
    let all = tools.iter().filter_map(|t| {
        let f = t.get("function")?;
        let name = f.get("name")?.as_str()?.to_string();
        let schema = f
            .get("parameters")
            .cloned()
            .unwrap_or_else(|| json!({"type": "object"}));
        Some((name, schema))
    });
    let (tools, single): (Vec<(String, Value)>, bool) = match choice {
        ToolChoice::Auto | ToolChoice::None => return Ok(None),
        ToolChoice::Required => (all.collect(), single),
        ToolChoice::Named(n) => (all.filter(|(name, _)| name == n).take(1).collect(), true),
    };
    if tools.is_empty() {
        return Err(match choice {
            ToolChoice::Named(n) => format!("names `{n}`, which is not among the tools"),
            _ => "forces a tool call, but no tools are given".into(),
        });
    }
    Ok(Some(Constraint::Tools {
        tools,
        single,
        form,
    }))
}

/// A Lark string literal of `s`.
fn lit(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// The schema with llguidance's compact separators (`", "`, `": "`, as
/// Python's `json.dumps` writes): no whitespace freedom for a small model
/// to loop in.
fn compact(schema: &Value) -> Value {
    let mut s = match schema {
        Value::Object(o) => o.clone(),
        // `true` or a missing schema: anything.
        _ => serde_json::Map::new(),
    };
    s.insert(
        "x-guidance".into(),
        json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
    );
    Value::Object(s)
}

impl Constraint {
    /// The Lark grammar of this constraint over `c`'s vocabulary; with
    /// `after_thinking`, up to 2 whitespace characters may come first.
    pub fn grammar(&self, c: &Constraints, after_thinking: bool) -> String {
        let lead = if after_thinking {
            "/[ \\t\\r\\n]{0,2}/ "
        } else {
            ""
        };
        match self {
            Constraint::Json(schema) => {
                format!("start: {lead}value\nvalue: %json {}\n", compact(schema))
            }
            Constraint::Tools {
                tools,
                single,
                form,
            } => {
                let tag = |t: &str| match c.special_id(t) {
                    Some(id) => format!("<[{id}]>"),
                    None => lit(t),
                };
                let (open, close) = (tag("<tool_call>"), tag("</tool_call>"));
                let mut g = String::new();
                let calls = if *single {
                    "call".to_string()
                } else {
                    "call (\"\\n\" call)*".to_string()
                };
                g.push_str(&format!("start: {lead}{calls}\n"));
                let alts: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
                g.push_str(&format!("call: {}\n", alts.join(" | ")));
                for (i, (name, schema)) in tools.iter().enumerate() {
                    match form {
                        ToolForm::Json => g.push_str(&format!(
                            "call_{i}: {open} {} args_{i} {} {close}\nargs_{i}: %json {}\n",
                            lit(&format!("\n{{\"name\": {}, \"arguments\": ", lit(name))),
                            lit("}\n"),
                            compact(schema),
                        )),
                        ToolForm::Xml => {
                            let params = xml_params(i, schema, &mut g);
                            g.push_str(&format!(
                                "call_{i}: {open} {} {params} {} {close}\n",
                                lit(&format!("\n<function={name}>\n")),
                                lit("</function>\n"),
                            ));
                        }
                    }
                }
                g
            }
        }
    }
}

/// Rules for tool `i`'s XML parameters, appended to `g`; returns the
/// sequence that writes them (the required always, the others optional,
/// in the schema's order).
fn xml_params(i: usize, schema: &Value, g: &mut String) -> String {
    let props = schema.get("properties").and_then(Value::as_object);
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut seq = Vec::new();
    for (j, (key, sub)) in props.into_iter().flatten().enumerate() {
        let rule = format!("p_{i}_{j}");
        let is_string = sub.get("type").and_then(Value::as_str) == Some("string");
        let choices: Option<Vec<&str>> = sub
            .get("enum")
            .and_then(Value::as_array)
            .map(|e| e.iter().filter_map(Value::as_str).collect())
            .or_else(|| sub.get("const").and_then(Value::as_str).map(|c| vec![c]));
        let head = lit(&format!("<parameter={key}>\n"));
        let close = lit("\n</parameter>\n");
        if let (true, Some(choices)) = (is_string, choices.filter(|c| !c.is_empty())) {
            // Written raw, as the template writes strings.
            let alts: Vec<String> = choices.iter().map(|c| lit(c)).collect();
            g.push_str(&format!("{rule}: {head} ({}) {close}\n", alts.join(" | ")));
        } else if is_string {
            // Free text up to the first `\n</parameter>\n` (lazy: the
            // shortest match ends the value), at most `maxLength` chars.
            let body = match sub.get("maxLength").and_then(Value::as_u64) {
                Some(n) => format!("(.|\\n){{0,{n}}}"),
                None => "(.|\\n)*".into(),
            };
            g.push_str(&format!(
                "{rule}: {head} v_{i}_{j}\nv_{i}_{j}[lazy]: /{body}\\n<\\/parameter>\\n/\n"
            ));
        } else {
            g.push_str(&format!(
                "{rule}: {head} j_{i}_{j} {}\nj_{i}_{j}: %json {}\n",
                lit("\n</parameter>\n"),
                compact(sub)
            ));
        }
        if required.contains(&key.as_str()) {
            seq.push(rule);
        } else {
            seq.push(format!("{rule}?"));
        }
    }
    if seq.is_empty() {
        "\"\"".into()
    } else {
        seq.join(" ")
    }
}

/// The engine's per-step hook for one request: the grammar (once the
/// reasoning is over) and the log probabilities.
pub struct StepWatch {
    matcher: Option<Matcher>,
    /// The tokens of `</think>` while the model still thinks: the grammar
    /// waits for them.
    think_end: Option<Vec<u32>>,
    /// The last tokens accepted, to spot `think_end`.
    recent: Vec<u32>,
    /// How many top tokens to report with each token's log probability
    /// (`None`: no log probabilities).
    logprobs: Option<usize>,
    /// The row's log-sum-exp and the unmasked row, kept from `mask` for
    /// `accept`.
    pending: Option<(f32, Vec<(u32, f32)>)>,
    row: Vec<f32>,
    events: UnboundedSender<WorkerEvent>,
}

impl StepWatch {
    /// `think_end`: the prompt ends inside an open reasoning block closed
    /// by these tokens, after which `matcher` applies.
    pub fn new(
        matcher: Option<Matcher>,
        think_end: Option<Vec<u32>>,
        logprobs: Option<usize>,
        events: UnboundedSender<WorkerEvent>,
    ) -> Self {
        StepWatch {
            matcher,
            think_end: think_end.filter(|t| !t.is_empty()),
            recent: Vec::new(),
            logprobs,
            pending: None,
            row: Vec::new(),
            events,
        }
    }
}

/// `ln(sum(exp(logits)))` over the finite logits; `-inf` when none is.
fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = logits
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return max;
    }
    let sum: f64 = logits
        .iter()
        .filter(|v| v.is_finite())
        .map(|&v| ((v - max) as f64).exp())
        .sum();
    max + sum.ln() as f32
}

/// The `n` largest finite logits as `(id, logit)`, largest first, ties to
/// the lower id.
fn top_n(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return top;
    }
    for (i, &v) in logits.iter().enumerate() {
        if !v.is_finite() || (top.len() == n && v <= top[n - 1].1) {
            continue;
        }
        let at = top.partition_point(|&(_, t)| t >= v);
        top.insert(at, (i as u32, v));
        top.truncate(n);
    }
    top
}

impl StepHook for StepWatch {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        if let Some(n) = self.logprobs {
            let lse = log_sum_exp(logits);
            let top = top_n(logits, n)
                .into_iter()
                .map(|(i, v)| (i, v - lse))
                .collect();
            self.row.clear();
            self.row.extend_from_slice(logits);
            self.pending = Some((lse, top));
        }
        if self.think_end.is_some() {
            return Ok(());
        }
        let Some(m) = self.matcher.as_mut() else {
            return Ok(());
        };
        // A finished grammar allows EOS only.
        let allowed = m
            .compute_mask_or_eos()
            .map_err(|e| format!("constraint: {e}"))?;
        if allowed.is_zero() {
            return Err("constraint: no token can continue the output".into());
        }
        for (i, v) in logits.iter_mut().enumerate() {
            if !allowed.is_allowed(i as u32) {
                *v = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    fn accept(&mut self, token: u32) -> Result<(), String> {
        if let Some((lse, top)) = self.pending.take() {
            let logprob = self
                .row
                .get(token as usize)
                .map_or(f32::NEG_INFINITY, |v| v - lse);
            let _ = self.events.send(WorkerEvent::Logprob(TokenLogprob {
                token,
                logprob,
                top,
            }));
        }
        if let Some(end) = &self.think_end {
            self.recent.push(token);
            if self.recent.ends_with(end) {
                self.think_end = None;
                self.recent.clear();
            } else if self.recent.len() > end.len() {
                self.recent.remove(0);
            }
            return Ok(());
        }
        if let Some(m) = self.matcher.as_mut() {
            if !m.is_stopped() {
                m.consume_token(token)
                    .map_err(|e| format!("constraint: {e}"))?;
            }
        }
        Ok(())
    }
}

/// OpenAI's `logprobs.content` entries for `entries`; `bytes(id)` gives a
/// token's bytes.
pub fn openai_logprobs(entries: &[TokenLogprob], bytes: &dyn Fn(u32) -> Vec<u8>) -> Value {
    let one = |id: u32, logprob: f32| {
        let b = bytes(id);
        json!({
            "token": String::from_utf8_lossy(&b),
            "logprob": logprob.max(-9999.0),
            "bytes": b,
        })
    };
    Value::Array(
        entries
            .iter()
            .map(|e| {
                let mut v = one(e.token, e.logprob);
                v["top_logprobs"] = Value::Array(e.top.iter().map(|&(i, l)| one(i, l)).collect());
                v
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests_support {
    use super::*;
    use llguidance::toktrie::ApproximateTokEnv;

    /// A factory over single-byte tokens (and a few specials).
    pub fn bytes_only() -> Constraints {
        let env = ApproximateTokEnv::single_byte_env();
        let mut factory = ParserFactory::new_simple(&env).unwrap();
        factory.quiet();
        Constraints { factory }
    }

    /// Whether the grammar accepts `text` whole (byte by byte).
    pub fn accepts(c: &Constraints, grammar: &str, text: &str) -> bool {
        let mut m = c.matcher(grammar).unwrap();
        for &b in text.as_bytes() {
            let Ok(mask) = m.compute_mask() else {
                return false;
            };
            if !mask.is_allowed(b as u32) || m.consume_token(b as u32).is_err() {
                return false;
            }
        }
        m.is_accepting().unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::*;
    use super::*;

    #[test]
    fn json_schema_grammar_keeps_the_schema() {
        let c = bytes_only();
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}},
            "required": ["n"], "additionalProperties": false});
        let g = Constraint::Json(schema.clone()).grammar(&c, false);
        assert!(accepts(&c, &g, "{\"n\": 5}"), "{g}");
        assert!(accepts(&c, &g, "{\"n\": -12}"));
        assert!(!accepts(&c, &g, "\n{\"n\": -12}"));
        let after = Constraint::Json(schema).grammar(&c, true);
        assert!(accepts(&c, &after, "\n\n{\"n\": -12}"));
        assert!(!accepts(&c, &g, "{\"n\": \"5\"}"));
        assert!(!accepts(&c, &g, "{\"m\": 5}"));
        assert!(!accepts(&c, &g, "{}"));
    }

    #[test]
    fn xml_tool_grammar_follows_the_tools_schema() {
        let c = bytes_only();
        let tools = vec![
            (
                "read".to_string(),
                json!({"type": "object", "properties": {
                    "path": {"type": "string"}, "limit": {"type": "integer"}},
                    "required": ["path"]}),
            ),
            ("noop".to_string(), json!({"type": "object"})),
        ];
        let g = Constraint::Tools {
            tools: tools.clone(),
            single: false,
            form: ToolForm::Xml,
        }
        .grammar(&c, false);
        let call = "<tool_call>\n<function=read>\n<parameter=path>\na b\nc\n</parameter>\n<parameter=limit>\n7\n</parameter>\n</function>\n</tool_call>";
        assert!(accepts(&c, &g, call), "{g}");
        let noop = "<tool_call>\n<function=noop>\n</function>\n</tool_call>";
        assert!(accepts(&c, &g, &format!("{call}\n{noop}")));
        // The required parameter missing, a value of the wrong type, an
        // unknown function, or plain text: refused.
        assert!(!accepts(
            &c,
            &g,
            "<tool_call>\n<function=read>\n</function>\n</tool_call>"
        ));
        assert!(!accepts(&c, &g, "<tool_call>\n<function=read>\n<parameter=path>\nx\n</parameter>\n<parameter=limit>\nmany\n</parameter>\n</function>\n</tool_call>"));
        assert!(!accepts(
            &c,
            &g,
            "<tool_call>\n<function=write>\n</function>\n</tool_call>"
        ));
        assert!(!accepts(&c, &g, "hello"));
        let g = Constraint::Tools {
            tools: vec![(
                "pick".into(),
                json!({"type": "object", "properties": {
                    "mode": {"type": "string", "enum": ["r", "w"]},
                    "tag": {"type": "string", "maxLength": 3}},
                    "required": ["mode", "tag"]}),
            )],
            single: true,
            form: ToolForm::Xml,
        }
        .grammar(&c, false);
        let pick = |mode: &str, tag: &str| {
            format!("<tool_call>\n<function=pick>\n<parameter=mode>\n{mode}\n</parameter>\n<parameter=tag>\n{tag}\n</parameter>\n</function>\n</tool_call>")
        };
        assert!(accepts(&c, &g, &pick("w", "abc")), "{g}");
        assert!(!accepts(&c, &g, &pick("x", "abc")));
        assert!(!accepts(&c, &g, &pick("r", "abcd")));
        let single = Constraint::Tools {
            tools,
            single: true,
            form: ToolForm::Xml,
        }
        .grammar(&c, false);
        assert!(!accepts(&c, &single, &format!("{call}\n{noop}")));
        assert!(accepts(&c, &single, noop));
    }

    #[test]
    fn json_tool_grammar_writes_qwen3_calls() {
        let c = bytes_only();
        let g = Constraint::Tools {
            tools: vec![(
                "f".into(),
                json!({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}),
            )],
            single: true,
            form: ToolForm::Json,
        }
        .grammar(&c, false);
        assert!(
            accepts(
                &c,
                &g,
                "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": true}}\n</tool_call>"
            ),
            "{g}"
        );
        assert!(!accepts(
            &c,
            &g,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>"
        ));
    }

    #[test]
    fn tool_form_follows_the_template() {
        assert_eq!(ToolForm::of_template(Some("<function=x>")), ToolForm::Xml);
        assert_eq!(
            ToolForm::of_template(Some(
                "{\"name\": <function-name>, \"arguments\": <args-json-object>}"
            )),
            ToolForm::Json
        );
        assert_eq!(ToolForm::of_template(None), ToolForm::Xml);
    }

    #[test]
    fn logprob_helpers_match_a_hand_reference() {
        let logits = [1.0f32, f32::NEG_INFINITY, 3.0, 3.0, 0.0];
        let lse = log_sum_exp(&logits);
        let expect = (1f64.exp() + 2.0 * 3f64.exp() + 1.0).ln() as f32;
        assert!((lse - expect).abs() < 1e-6);
        assert_eq!(top_n(&logits, 3), vec![(2, 3.0), (3, 3.0), (0, 1.0)]);
        assert_eq!(top_n(&logits, 0), vec![]);
        assert_eq!(log_sum_exp(&[f32::NEG_INFINITY]), f32::NEG_INFINITY);
    }
}
