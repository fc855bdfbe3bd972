//! Turns the model's raw output text, as it streams, into content,
//! reasoning (`<think>…</think>`) and tool calls, in both forms the Qwen
//! family emits:
//!
//! - Qwen3: `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`
//! - Qwen3-Coder / Qwen3.5 / Qwen3.6:
//!   `<tool_call><function=f><parameter=p>value</parameter></function></tool_call>`
//!
//! Tool calls stream: see [`tool_call`] for how a call's arguments are
//! written as they come and where a value ends. A `<tool_call>` inside
//! `<think>` is a call too: the reasoning stops before it and resumes after
//! it (the block is open until `</think>`).
//!
//! Pure: no I/O, fed text pieces cut anywhere (even inside a tag), it
//! emits the same events as when fed the whole text at once (consecutive
//! pieces of one kind merged). Text that may still turn into a tag is held
//! back until it is known.

mod tool_call;

use serde_json::{Map, Value};

pub use tool_call::parse_json_call;
use tool_call::{CallParser, Status};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TOOL_OPEN: &str = "<tool_call>";
const TOOL_CLOSE: &str = "</tool_call>";

/// One parsed tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// Always a JSON object. For a cut call: the parameters written, the
    /// last one as far as it went.
    pub arguments: Value,
    /// The arguments as JSON text: exactly the concatenation of the call's
    /// [`OutputEvent::ToolCallArgs`] pieces. `arguments` serialized when
    /// the call is complete; a prefix of that when it was cut.
    pub arguments_json: String,
    /// The text ended inside the call (the token limit, a stop string or
    /// the model's end): `arguments_json` is unfinished JSON.
    pub cut: bool,
}

/// What the parser emits. A tool call is `ToolCallStart`, one or more
/// `ToolCallArgs`, then `ToolCallEnd`, with nothing between.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputEvent {
    Content(String),
    Reasoning(String),
    /// A call begins: its name is complete.
    ToolCallStart {
        name: String,
    },
    /// The next piece of the open call's arguments JSON text.
    ToolCallArgs(String),
    /// The open call ended; the whole call.
    ToolCallEnd(ToolCall),
}

#[derive(Debug)]
enum Mode {
    Content,
    Reasoning,
    /// Inside a `<tool_call>` block.
    Tool(Box<CallParser>),
}

/// Streaming parser of model output.
#[derive(Debug)]
pub struct OutputParser {
    mode: Mode,
    buf: String,
    parse_tools: bool,
    /// The open tool call began inside `<think>`: reasoning resumes after it.
    call_in_reasoning: bool,
    /// Drop whitespace at the start of the next content (after `</think>`
    /// or a tool call).
    trim_content: bool,
    /// Drop whitespace at the start of the reasoning.
    trim_reasoning: bool,
    /// The tools' JSON schemas by name, to keep string parameters of the
    /// XML form strings (and stream them).
    schemas: Map<String, Value>,
}

impl OutputParser {
    /// `in_reasoning`: the prompt already opened a `<think>` block.
    /// `parse_tools`: recognise `<tool_call>` (else it is plain content).
    pub fn new(in_reasoning: bool, parse_tools: bool) -> Self {
        OutputParser {
            mode: if in_reasoning {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            buf: String::new(),
            parse_tools,
            call_in_reasoning: false,
            trim_content: false,
            trim_reasoning: in_reasoning,
            schemas: Map::new(),
        }
    }

    /// Tool definitions in OpenAI form (`{"type":"function","function":{"name",
    /// "parameters"}}`) or Anthropic form (`{"name","input_schema"}`).
    pub fn with_tool_schemas(mut self, tools: &[Value]) -> Self {
        for t in tools {
            let f = t.get("function").unwrap_or(t);
            let Some(name) = f.get("name").and_then(Value::as_str) else {
                continue;
            };
            let schema = f
                .get("parameters")
                .or_else(|| f.get("input_schema"))
                .cloned()
                .unwrap_or(Value::Null);
            self.schemas.insert(name.to_string(), schema);
        }
        self
    }

    /// Feeds a piece of text; returns the events it completes.
    pub fn push(&mut self, text: &str) -> Vec<OutputEvent> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match &mut self.mode {
                Mode::Content => {
                    let mut tags: Vec<&str> = vec![THINK_OPEN];
                    if self.parse_tools {
                        tags.push(TOOL_OPEN);
                    }
                    match find_first(&self.buf, &tags) {
                        Some((pos, tag)) => {
                            let before = self.buf[..pos].to_string();
                            self.emit_content(&before, &mut out);
                            self.buf.drain(..pos + tag.len());
                            if tag == THINK_OPEN {
                                self.mode = Mode::Reasoning;
                                self.trim_reasoning = true;
                            } else {
                                self.open_call(false);
                            }
                        }
                        None => {
                            let keep = held_suffix(&self.buf, &tags);
                            let emit = self.buf[..self.buf.len() - keep].to_string();
                            self.emit_content(&emit, &mut out);
                            self.buf.drain(..self.buf.len() - keep);
                            return out;
                        }
                    }
                }
                Mode::Reasoning => {
                    let mut tags: Vec<&str> = vec![THINK_CLOSE];
                    if self.parse_tools {
                        tags.push(TOOL_OPEN);
                    }
                    match find_first(&self.buf, &tags) {
                        Some((pos, tag)) => {
                            let before = self.buf[..pos].to_string();
                            self.emit_reasoning(&before, true, &mut out);
                            self.buf.drain(..pos + tag.len());
                            if tag == THINK_CLOSE {
                                self.mode = Mode::Content;
                                self.trim_content = true;
                            } else {
                                self.open_call(true);
                            }
                        }
                        None => {
                            let keep = held_suffix(&self.buf, &tags);
                            // Trailing whitespace may end the block: hold it too.
                            let body = &self.buf[..self.buf.len() - keep];
                            let ws = body.len() - body.trim_end().len();
                            let emit = body[..body.len() - ws].to_string();
                            self.emit_reasoning(&emit, false, &mut out);
                            self.buf.drain(..emit.len());
                            return out;
                        }
                    }
                }
                Mode::Tool(call) => match call.push(&mut self.buf, &self.schemas, &mut out) {
                    Status::Open => return out,
                    Status::Closed => self.close_call(None, &mut out),
                    Status::NotACall(text) => self.close_call(Some(text), &mut out),
                },
            }
        }
    }

    /// Ends the text: flushes what was held back. An unfinished tool call
    /// ends (cut, unless it was only missing its closing tags); a block
    /// that is no call is returned as text.
    pub fn finish(&mut self) -> Vec<OutputEvent> {
        let mut out = Vec::new();
        if let Mode::Tool(call) = &mut self.mode {
            let text = call.finish(&mut self.buf, &self.schemas, &mut out);
            self.close_call(text, &mut out);
        }
        let rest = std::mem::take(&mut self.buf);
        match &self.mode {
            Mode::Content | Mode::Tool(_) => self.emit_content(&rest, &mut out),
            Mode::Reasoning => self.emit_reasoning(&rest, true, &mut out),
        }
        self.mode = Mode::Content;
        out
    }

    fn open_call(&mut self, in_reasoning: bool) {
        self.call_in_reasoning = in_reasoning;
        self.mode = Mode::Tool(Box::new(CallParser::new()));
    }

    /// Leaves a `<tool_call>` block; `not_a_call`: its text, when it was
    /// no call.
    fn close_call(&mut self, not_a_call: Option<String>, out: &mut Vec<OutputEvent>) {
        let in_reasoning = self.call_in_reasoning;
        self.mode = if in_reasoning {
            Mode::Reasoning
        } else {
            Mode::Content
        };
        match not_a_call {
            Some(text) if in_reasoning => push_merged(out, OutputEvent::Reasoning(text)),
            Some(text) => push_merged(out, OutputEvent::Content(text)),
            None if in_reasoning => self.trim_reasoning = true,
            None => self.trim_content = true,
        }
    }

    fn emit_content(&mut self, text: &str, out: &mut Vec<OutputEvent>) {
        let text = if self.trim_content {
            let t = text.trim_start();
            if t.is_empty() {
                return;
            }
            self.trim_content = false;
            t
        } else {
            text
        };
        if !text.is_empty() {
            push_merged(out, OutputEvent::Content(text.to_string()));
        }
    }

    fn emit_reasoning(&mut self, text: &str, end: bool, out: &mut Vec<OutputEvent>) {
        let mut text = if self.trim_reasoning {
            let t = text.trim_start();
            if t.is_empty() {
                return;
            }
            self.trim_reasoning = false;
            t
        } else {
            text
        };
        if end {
            text = text.trim_end();
        }
        if !text.is_empty() {
            push_merged(out, OutputEvent::Reasoning(text.to_string()));
        }
    }
}

/// Appends `ev`, merged into the last event when both are text of one kind
/// or pieces of one call's arguments.
fn push_merged(out: &mut Vec<OutputEvent>, ev: OutputEvent) {
    match (out.last_mut(), ev) {
        (Some(OutputEvent::Content(a)), OutputEvent::Content(b)) => a.push_str(&b),
        (Some(OutputEvent::Reasoning(a)), OutputEvent::Reasoning(b)) => a.push_str(&b),
        (Some(OutputEvent::ToolCallArgs(a)), OutputEvent::ToolCallArgs(b)) => a.push_str(&b),
        (_, ev) => out.push(ev),
    }
}

/// Earliest occurrence of any of `tags`.
fn find_first<'a>(s: &str, tags: &[&'a str]) -> Option<(usize, &'a str)> {
    tags.iter()
        .filter_map(|t| s.find(t).map(|p| (p, *t)))
        .min_by_key(|(p, _)| *p)
}

/// Length of the longest suffix of `s` that is a proper prefix of a tag.
pub(crate) fn held_suffix(s: &str, tags: &[&str]) -> usize {
    let mut best = 0;
    for tag in tags {
        let max = tag.len().saturating_sub(1).min(s.len());
        for n in (1..=max).rev() {
            if n <= best {
                break;
            }
            if s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]) {
                best = n;
                break;
            }
        }
    }
    best
}

/// Finds stop strings in streamed text, holding back what may begin one.
#[derive(Debug, Default)]
pub struct StopFilter {
    stops: Vec<String>,
    held: String,
}

impl StopFilter {
    pub fn new(stops: Vec<String>) -> Self {
        StopFilter {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    /// Feeds text; returns the text now safe to emit and the stop string
    /// matched, if one was (then everything from it on is dropped).
    pub fn push(&mut self, text: &str) -> (String, Option<String>) {
        self.held.push_str(text);
        if self.stops.is_empty() {
            return (std::mem::take(&mut self.held), None);
        }
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|p| (p, s.clone())))
            .min_by_key(|(p, _)| *p);
        if let Some((pos, stop)) = first {
            let out = self.held[..pos].to_string();
            self.held.clear();
            return (out, Some(stop));
        }
        let tags: Vec<&str> = self.stops.iter().map(String::as_str).collect();
        let keep = held_suffix(&self.held, &tags);
        let out = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (out, None)
    }

    /// What is still held back (the text ended without a stop).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn run_whole(p: &mut OutputParser, text: &str) -> Vec<OutputEvent> {
        let mut ev = p.push(text);
        ev.extend(p.finish());
        merge(ev)
    }

    fn merge(ev: Vec<OutputEvent>) -> Vec<OutputEvent> {
        let mut out = Vec::new();
        for e in ev {
            push_merged(&mut out, e);
        }
        out
    }

    /// Feeds `text` in pieces cut at `cuts` (byte offsets on char
    /// boundaries); the events, unmerged.
    fn run_cut(mut p: OutputParser, text: &str, cuts: &[usize]) -> Vec<OutputEvent> {
        let mut ev = Vec::new();
        let mut from = 0;
        for &c in cuts {
            ev.extend(p.push(&text[from..c]));
            from = c;
        }
        ev.extend(p.push(&text[from..]));
        ev.extend(p.finish());
        ev
    }

    /// Checks what holds of every event sequence: a call is start, pieces,
    /// end with nothing between, and its pieces concatenate to its
    /// `arguments_json`, which is `arguments` serialized (a prefix of it for
    /// a cut call).
    fn check_calls(ev: &[OutputEvent]) {
        let mut open: Option<String> = None;
        for e in ev {
            match (e, open.as_mut()) {
                (OutputEvent::ToolCallStart { .. }, None) => open = Some(String::new()),
                (OutputEvent::ToolCallArgs(p), Some(text)) => text.push_str(p),
                (OutputEvent::ToolCallEnd(c), Some(text)) => {
                    assert_eq!(*text, c.arguments_json, "pieces of {c:?}");
                    let full = c.arguments.to_string();
                    if c.cut {
                        assert!(full.starts_with(text.as_str()), "{full} / {text}");
                    } else {
                        assert_eq!(full, c.arguments_json);
                    }
                    open = None;
                }
                (e, open) => assert!(
                    open.is_none(),
                    "{e:?} inside a call (or a call event outside one)"
                ),
            }
        }
        assert!(open.is_none(), "a call never ended");
    }

    /// Feeds `text` cut at every split point and in single characters; the
    /// merged events must equal those of the whole text.
    fn check_cuts_with(make: impl Fn() -> OutputParser, text: &str, want: &[OutputEvent]) {
        let whole = run_whole(&mut make(), text);
        assert_eq!(whole, want, "whole text");
        let idx: Vec<usize> = text.char_indices().map(|(i, _)| i).skip(1).collect();
        for &i in &idx {
            for &j in idx.iter().filter(|&&j| j >= i).step_by(7) {
                let ev = run_cut(make(), text, &[i, j]);
                check_calls(&ev);
                assert_eq!(merge(ev), want, "cut at {i},{j}");
            }
        }
        let ev = run_cut(make(), text, &idx);
        check_calls(&ev);
        assert_eq!(merge(ev), want, "char by char");
    }

    fn check_all_cuts(in_reasoning: bool, tools: bool, text: &str, want: &[OutputEvent]) {
        check_cuts_with(|| OutputParser::new(in_reasoning, tools), text, want);
    }

    /// The merged events of a complete call.
    fn call(name: &str, args: Value) -> [OutputEvent; 3] {
        call_text(name, args.clone(), &args.to_string(), false)
    }

    fn call_text(name: &str, args: Value, text: &str, cut: bool) -> [OutputEvent; 3] {
        [
            OutputEvent::ToolCallStart { name: name.into() },
            OutputEvent::ToolCallArgs(text.into()),
            OutputEvent::ToolCallEnd(ToolCall {
                name: name.into(),
                arguments: args,
                arguments_json: text.into(),
                cut,
            }),
        ]
    }

    fn with_tools(in_reasoning: bool) -> OutputParser {
        let tools = vec![
            json!({"type": "function", "function": {"name": "write_file", "parameters": {
            "type": "object", "properties": {"path": {"type": "string"},
            "content": {"type": "string"}, "mode": {"type": "integer"},
            "opts": {"type": "object"}}}}}),
        ];
        OutputParser::new(in_reasoning, true).with_tool_schemas(&tools)
    }

    #[test]
    fn plain_content_passes_through() {
        check_all_cuts(
            false,
            true,
            "Hello <b>world</b> a<b",
            &[OutputEvent::Content("Hello <b>world</b> a<b".into())],
        );
    }

    #[test]
    fn reasoning_is_kept_apart() {
        check_all_cuts(
            false,
            false,
            "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
            &[
                OutputEvent::Reasoning("Let me think.".into()),
                OutputEvent::Content("The answer is 4.".into()),
            ],
        );
        // The template opened the block already.
        check_all_cuts(
            true,
            false,
            "step one\nstep two\n</think>\n\nDone",
            &[
                OutputEvent::Reasoning("step one\nstep two".into()),
                OutputEvent::Content("Done".into()),
            ],
        );
    }

    #[test]
    fn qwen3_json_tool_call() {
        let text = "I'll check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let mut want = vec![OutputEvent::Content("I'll check.\n".into())];
        want.extend(call("get_weather", json!({"city": "Paris", "days": 3})));
        want.extend(call("now", json!({})));
        check_all_cuts(false, true, text, &want);
    }

    #[test]
    fn json_tool_call_with_a_close_tag_in_a_string() {
        let text = "<tool_call>{\"name\": \"w\", \"arguments\": {\"s\": \"a</tool_call>\\\"b\"}}</tool_call>ok";
        let mut want = call("w", json!({"s": "a</tool_call>\"b"})).to_vec();
        want.push(OutputEvent::Content("ok".into()));
        check_all_cuts(false, true, text, &want);
    }

    #[test]
    fn qwen3_coder_xml_tool_call() {
        let text = "<think>\nneed file\n</think>\n\n<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/main.rs\n</parameter>\n<parameter=limit>\n20\n</parameter>\n<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n</function>\n</tool_call>";
        let mut want = vec![OutputEvent::Reasoning("need file".into())];
        want.extend(call(
            "read_file",
            json!({"path": "src/main.rs", "limit": 20, "opts": {"a": [1, 2]}}),
        ));
        check_all_cuts(false, true, text, &want);
    }

    #[test]
    fn xml_string_parameters_follow_the_schema() {
        let tools = vec![
            json!({"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"code": {"type": "string"}, "n": {"type": "integer"}}}}}),
        ];
        let mut p = OutputParser::new(false, true).with_tool_schemas(&tools);
        let ev = run_whole(
            &mut p,
            "<tool_call>\n<function=f>\n<parameter=code>\n123\n</parameter>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>",
        );
        assert_eq!(ev, call("f", json!({"code": "123", "n": 5})));
    }

    #[test]
    fn string_values_stream_as_they_are_written() {
        let mut p = with_tools(false);
        let ev = p.push("Writing.\n<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\nimport os\n\"hi\"\\");
        assert_eq!(
            ev,
            [
                OutputEvent::Content("Writing.\n".into()),
                OutputEvent::ToolCallStart {
                    name: "write_file".into()
                },
                OutputEvent::ToolCallArgs(
                    "{\"path\":\"a.py\",\"content\":\"import os\\n\\\"hi\\\"\\\\".into()
                ),
            ]
        );
        // The last newline waits: it may be the one before the close.
        assert_eq!(
            p.push("\nx = 1\n"),
            [OutputEvent::ToolCallArgs("\\nx = 1".into())]
        );
        // A non-string value is written whole when it closes.
        assert_eq!(
            p.push("</parameter>\n<parameter=mode>\n64"),
            [OutputEvent::ToolCallArgs("\",\"mode\":".into())]
        );
        let mut ev = p.push("4\n</parameter>\n</function>\n</tool_call>");
        ev.extend(p.finish());
        let args = json!({"path": "a.py", "content": "import os\n\"hi\"\\\nx = 1", "mode": 644});
        assert_eq!(
            ev,
            [
                OutputEvent::ToolCallArgs("644}".into()),
                OutputEvent::ToolCallEnd(ToolCall {
                    name: "write_file".into(),
                    arguments_json: args.to_string(),
                    arguments: args,
                    cut: false,
                })
            ]
        );
    }

    #[test]
    fn close_tags_inside_a_value_are_value_text() {
        // Only `</parameter>` followed by a next tag ends a value.
        let content =
            "a</tool_call>\n</function>\nb</parameter>\nc</parameter><parameter\n</parameter>";
        let text = format!("<tool_call>\n<function=write_file>\n<parameter=content>\n{content}\n</parameter>\n<parameter=path>\np\n</parameter>\n</function>\n</tool_call>\nDone.");
        let mut want = call("write_file", json!({"content": content, "path": "p"})).to_vec();
        want.push(OutputEvent::Content("Done.".into()));
        check_cuts_with(|| with_tools(false), &text, &want);
    }

    #[test]
    fn a_call_inside_think_is_a_call() {
        let text = "<think>\nI need the file.\n<tool_call>\n<function=read_file>\n<parameter=path>\nx\n</parameter>\n</function>\n</tool_call>\nNow wait.\n</think>\n\nAsked.";
        let mut want = vec![OutputEvent::Reasoning("I need the file.".into())];
        want.extend(call("read_file", json!({"path": "x"})));
        want.push(OutputEvent::Reasoning("Now wait.".into()));
        want.push(OutputEvent::Content("Asked.".into()));
        check_all_cuts(false, true, text, &want);
        // The template opened the block; the model stops after the call.
        let text = "Reading it.\n<tool_call>\n<function=read_file>\n<parameter=path>\nx\n</parameter>\n</function>\n</tool_call>";
        let mut want = vec![OutputEvent::Reasoning("Reading it.".into())];
        want.extend(call("read_file", json!({"path": "x"})));
        check_all_cuts(true, true, text, &want);
    }

    #[test]
    fn a_cut_call_is_reported_cut() {
        // Inside a string value: the JSON stays open.
        let text = "<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\nline 1\nli";
        let want = call_text(
            "write_file",
            json!({"path": "a.py", "content": "line 1\nli"}),
            "{\"path\":\"a.py\",\"content\":\"line 1\\nli",
            true,
        );
        check_cuts_with(|| with_tools(false), text, &want);
        // Inside a typed value: its key is written, the value never.
        let text = "<tool_call>\n<function=write_file>\n<parameter=mode>\n64";
        let want = call_text("write_file", json!({"mode": 64}), "{\"mode\":", true);
        check_cuts_with(|| with_tools(false), text, &want);
        // Inside a parameter's name.
        let text =
            "<tool_call>\n<function=write_file>\n<parameter=path>\na\n</parameter>\n<parameter=con";
        let want = call_text("write_file", json!({"path": "a"}), "{\"path\":\"a\"", true);
        check_cuts_with(|| with_tools(false), text, &want);
        // After a whole parameter, the closing tags missing: complete.
        let text = "<tool_call>\n<function=write_file>\n<parameter=path>\na\n</parameter>\n</fun";
        check_cuts_with(
            || with_tools(false),
            text,
            &call("write_file", json!({"path": "a"})),
        );
        // Before the name is complete: not a call.
        let text = "<tool_call>\n<function=write_fi";
        check_cuts_with(
            || with_tools(false),
            text,
            &[OutputEvent::Content(text.into())],
        );
    }

    #[test]
    fn a_repeated_parameter_is_dropped() {
        let text = "<tool_call>\n<function=write_file>\n<parameter=path>\na\n</parameter>\n<parameter=path>\nb\n</parameter>\n<parameter=mode>\n1\n</parameter>\n</function>\n</tool_call>";
        check_cuts_with(
            || with_tools(false),
            text,
            &call("write_file", json!({"path": "a", "mode": 1})),
        );
    }

    #[test]
    fn tools_off_leaves_tags_as_content() {
        let text = "<tool_call>{\"name\":\"f\"}</tool_call>";
        check_all_cuts(false, false, text, &[OutputEvent::Content(text.into())]);
    }

    #[test]
    fn broken_tool_call_is_content() {
        let text = "<tool_call>not json</tool_call>";
        check_all_cuts(false, true, text, &[OutputEvent::Content(text.into())]);
        let text = "<tool_call><function=</tool_call>";
        check_all_cuts(false, true, text, &[OutputEvent::Content(text.into())]);
        // Unterminated but complete JSON still parses at the end.
        let ev = run_whole(
            &mut OutputParser::new(false, true),
            "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}",
        );
        assert_eq!(ev, call("f", json!({"x": 1})));
    }

    #[test]
    fn multibyte_text_is_never_split() {
        check_all_cuts(
            false,
            true,
            "héllo <tö ✓ <think>ü</think>é",
            &[
                OutputEvent::Content("héllo <tö ✓ ".into()),
                OutputEvent::Reasoning("ü".into()),
                OutputEvent::Content("é".into()),
            ],
        );
    }

    /// Value text made of pieces that look like the tags.
    fn value_text() -> impl Strategy<Value = String> {
        const PIECES: &[&str] = &[
            "a",
            "é",
            "✓",
            " ",
            "\n",
            "\n\n",
            "<",
            ">",
            "/",
            "\"",
            "\\",
            "{",
            "}",
            "\t",
            "</parameter>",
            "</tool_call>",
            "</function>",
            "<parameter",
            "<tool_call>",
            "</think>",
            "<function",
        ];
        prop::collection::vec(prop::sample::select(PIECES), 0..14).prop_map(|v| v.concat())
    }

    /// Whether the `</parameter>` rule would end `v` early.
    fn closes_early(v: &str) -> bool {
        v.match_indices(PARAM_CLOSE_TAG).any(|(p, _)| {
            let next = v[p + PARAM_CLOSE_TAG.len()..].trim_start();
            ["<parameter=", "</function>", "</tool_call>"]
                .iter()
                .any(|t| next.starts_with(t))
        })
    }

    const PARAM_CLOSE_TAG: &str = "</parameter>";

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        /// Random values, random cut points: the same events as the whole
        /// text, the values back as written, the pieces adding up.
        #[test]
        fn random_calls_cut_anywhere(
            content in value_text(),
            path in value_text(),
            mode in any::<i32>(),
            think in any::<bool>(),
            cut_at in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
            truncate in prop::option::of(any::<prop::sample::Index>()),
        ) {
            prop_assume!(!closes_early(&content) && !closes_early(&path));
            let text = format!("{}Go.\n<tool_call>\n<function=write_file>\n<parameter=content>\n{content}\n</parameter>\n<parameter=mode>\n{mode}\n</parameter>\n<parameter=path>\n{path}\n</parameter>\n</function>\n</tool_call>\nDone.",
                if think { "<think>" } else { "" });
            let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).skip(1).collect();
            // The whole text, or a prefix (a reply cut by the token limit).
            let text = match truncate {
                Some(ix) => &text[..bounds[ix.index(bounds.len())]],
                None => text.as_str(),
            };
            let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).skip(1).collect();
            let whole = run_whole(&mut with_tools(false), text);
            check_calls(&whole);
            if !bounds.is_empty() {
                let mut cuts: Vec<usize> = cut_at.iter().map(|ix| bounds[ix.index(bounds.len())]).collect();
                cuts.sort();
                cuts.dedup();
                let ev = run_cut(with_tools(false), text, &cuts);
                check_calls(&ev);
                prop_assert_eq!(merge(ev), whole.clone());
            }
            if truncate.is_none() {
                let args = json!({"content": content, "mode": mode, "path": path});
                let end = whole.iter().find_map(|e| match e {
                    OutputEvent::ToolCallEnd(c) => Some(c.clone()),
                    _ => None,
                });
                prop_assert_eq!(end.map(|c| (c.arguments, c.cut)), Some((args, false)));
                let done = if think {
                    OutputEvent::Reasoning("Done.".into())
                } else {
                    OutputEvent::Content("Done.".into())
                };
                prop_assert_eq!(whole.last(), Some(&done));
            }
        }
    }

    #[test]
    fn stop_strings_are_found_across_pieces() {
        let text = "one two STOP three";
        for i in 0..=text.len() {
            let mut f = StopFilter::new(vec!["STOP".into(), "xyz".into()]);
            let (a, s1) = f.push(&text[..i]);
            let (b, s2) = if s1.is_some() {
                (String::new(), s1)
            } else {
                f.push(&text[i..])
            };
            assert_eq!(format!("{a}{b}"), "one two ");
            assert_eq!(s2.as_deref(), Some("STOP"));
        }
        let mut f = StopFilter::new(vec!["STOP".into()]);
        let (a, s) = f.push("no ST");
        assert_eq!((a.as_str(), s), ("no ", None));
        assert_eq!(f.finish(), "ST");
    }
}
