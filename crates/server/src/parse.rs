//! Turns the model's raw output text, as it streams, into content,
//! reasoning (`<think>…</think>`) and tool calls, in both forms the Qwen
//! family emits:
//!
//! - Qwen3: `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`
//! - Qwen3-Coder / Qwen3.5 / Qwen3.6:
//!   `<tool_call><function=f><parameter=p>value</parameter></function></tool_call>`
//!
//! Pure: no I/O, fed text pieces cut anywhere (even inside a tag), it
//! emits the same events as when fed the whole text at once. Text that may
//! still turn into a tag is held back until it is known.

use serde_json::{Map, Value};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TOOL_OPEN: &str = "<tool_call>";
const TOOL_CLOSE: &str = "</tool_call>";

/// One parsed tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// Always a JSON object.
    pub arguments: Value,
}

/// What the parser emits.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputEvent {
    Content(String),
    Reasoning(String),
    ToolCall(ToolCall),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Content,
    Reasoning,
    Tool,
}

/// Streaming parser of model output.
#[derive(Debug)]
pub struct OutputParser {
    mode: Mode,
    buf: String,
    parse_tools: bool,
    /// Drop whitespace at the start of the next content (after `</think>`
    /// or a tool call).
    trim_content: bool,
    /// Drop whitespace at the start of the reasoning.
    trim_reasoning: bool,
    /// Parameter types by tool name, then parameter name (from the JSON
    /// schemas), to keep string parameters of the XML form strings.
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
            match self.mode {
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
                                self.mode = Mode::Tool;
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
                Mode::Reasoning => match self.buf.find(THINK_CLOSE) {
                    Some(pos) => {
                        let before = self.buf[..pos].to_string();
                        self.emit_reasoning(&before, true, &mut out);
                        self.buf.drain(..pos + THINK_CLOSE.len());
                        self.mode = Mode::Content;
                        self.trim_content = true;
                    }
                    None => {
                        let keep = held_suffix(&self.buf, &[THINK_CLOSE]);
                        // Trailing whitespace may end the block: hold it too.
                        let body = &self.buf[..self.buf.len() - keep];
                        let ws = body.len() - body.trim_end().len();
                        let emit = body[..body.len() - ws].to_string();
                        self.emit_reasoning(&emit, false, &mut out);
                        self.buf.drain(..emit.len());
                        return out;
                    }
                },
                Mode::Tool => match self.buf.find(TOOL_CLOSE) {
                    Some(pos) => {
                        let body = self.buf[..pos].to_string();
                        self.buf.drain(..pos + TOOL_CLOSE.len());
                        self.mode = Mode::Content;
                        self.trim_content = true;
                        match parse_tool_call(&body, &self.schemas) {
                            Some(call) => out.push(OutputEvent::ToolCall(call)),
                            None => {
                                out.push(OutputEvent::Content(format!(
                                    "{TOOL_OPEN}{body}{TOOL_CLOSE}"
                                )));
                            }
                        }
                    }
                    None => return out,
                },
            }
        }
    }

    /// Ends the text: flushes what was held back. An unfinished tool call
    /// is parsed if it can be, else returned as content.
    pub fn finish(&mut self) -> Vec<OutputEvent> {
        let rest = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        match self.mode {
            Mode::Content => self.emit_content(&rest, &mut out),
            Mode::Reasoning => self.emit_reasoning(&rest, true, &mut out),
            Mode::Tool => match parse_tool_call(&rest, &self.schemas) {
                Some(call) => out.push(OutputEvent::ToolCall(call)),
                None => self.emit_content(&format!("{TOOL_OPEN}{rest}"), &mut out),
            },
        }
        self.mode = Mode::Content;
        out
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

fn push_merged(out: &mut Vec<OutputEvent>, ev: OutputEvent) {
    match (out.last_mut(), ev) {
        (Some(OutputEvent::Content(a)), OutputEvent::Content(b)) => a.push_str(&b),
        (Some(OutputEvent::Reasoning(a)), OutputEvent::Reasoning(b)) => a.push_str(&b),
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

/// Parses the body of a `<tool_call>` block, JSON or XML form.
pub fn parse_tool_call(body: &str, schemas: &Map<String, Value>) -> Option<ToolCall> {
    let body = body.trim();
    if body.starts_with("<function=") {
        return parse_xml_call(body, schemas);
    }
    let v: Value = serde_json::from_str(body).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(o @ Value::Object(_)) => o,
            _ => return None,
        },
        Some(o @ Value::Object(_)) => o.clone(),
        Some(_) => return None,
    };
    Some(ToolCall { name, arguments })
}

fn parse_xml_call(body: &str, schemas: &Map<String, Value>) -> Option<ToolCall> {
    let rest = body.strip_prefix("<function=")?;
    let gt = rest.find('>')?;
    let name = rest[..gt].trim().to_string();
    if name.is_empty() {
        return None;
    }
    let mut rest = &rest[gt + 1..];
    let props = schemas
        .get(&name)
        .and_then(|s| s.get("properties"))
        .and_then(Value::as_object);
    let mut args = Map::new();
    while let Some(start) = rest.find("<parameter=") {
        let after = &rest[start + "<parameter=".len()..];
        let gt = after.find('>')?;
        let pname = after[..gt].trim().to_string();
        let value_and_rest = &after[gt + 1..];
        // A parameter ends at `</parameter>`, or (sloppy output) at the next
        // parameter or the end of the function.
        let end = ["</parameter>", "<parameter=", "</function>"]
            .iter()
            .filter_map(|t| value_and_rest.find(t).map(|p| (p, *t)))
            .min_by_key(|(p, _)| *p);
        let (raw, next) = match end {
            Some((p, "</parameter>")) => (&value_and_rest[..p], &value_and_rest[p + 12..]),
            Some((p, _)) => (&value_and_rest[..p], &value_and_rest[p..]),
            None => (value_and_rest, ""),
        };
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let ty = props
            .and_then(|p| p.get(&pname))
            .and_then(|s| s.get("type"))
            .and_then(Value::as_str);
        args.insert(pname, typed_value(raw, ty));
        rest = next;
    }
    Some(ToolCall {
        name,
        arguments: Value::Object(args),
    })
}

/// A parameter's text as the schema types it; without a schema, JSON when
/// it parses as JSON, else the string.
fn typed_value(raw: &str, ty: Option<&str>) -> Value {
    match ty {
        Some("string") => Value::String(raw.to_string()),
        _ => match serde_json::from_str::<Value>(raw.trim()) {
            Ok(v) => v,
            Err(_) => Value::String(raw.to_string()),
        },
    }
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

    /// Feeds `text` cut at every split point and in single characters; the
    /// merged events must equal those of the whole text.
    fn check_all_cuts(in_reasoning: bool, tools: bool, text: &str, want: &[OutputEvent]) {
        let whole = run_whole(&mut OutputParser::new(in_reasoning, tools), text);
        assert_eq!(whole, want, "whole text");
        let idx: Vec<usize> = text.char_indices().map(|(i, _)| i).skip(1).collect();
        for &i in &idx {
            for &j in idx.iter().filter(|&&j| j >= i).step_by(7) {
                let mut p = OutputParser::new(in_reasoning, tools);
                let mut ev = p.push(&text[..i]);
                ev.extend(p.push(&text[i..j]));
                ev.extend(p.push(&text[j..]));
                ev.extend(p.finish());
                assert_eq!(merge(ev), want, "cut at {i},{j}");
            }
        }
        let mut p = OutputParser::new(in_reasoning, tools);
        let mut ev = Vec::new();
        for c in text.chars() {
            ev.extend(p.push(&c.to_string()));
        }
        ev.extend(p.finish());
        assert_eq!(merge(ev), want, "char by char");
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
        check_all_cuts(
            false,
            true,
            text,
            &[
                OutputEvent::Content("I'll check.\n".into()),
                OutputEvent::ToolCall(ToolCall {
                    name: "get_weather".into(),
                    arguments: json!({"city": "Paris", "days": 3}),
                }),
                OutputEvent::ToolCall(ToolCall {
                    name: "now".into(),
                    arguments: json!({}),
                }),
            ],
        );
    }

    #[test]
    fn qwen3_coder_xml_tool_call() {
        let text = "<think>\nneed file\n</think>\n\n<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/main.rs\n</parameter>\n<parameter=limit>\n20\n</parameter>\n<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n</function>\n</tool_call>";
        check_all_cuts(
            false,
            true,
            text,
            &[
                OutputEvent::Reasoning("need file".into()),
                OutputEvent::ToolCall(ToolCall {
                    name: "read_file".into(),
                    arguments: json!({"path": "src/main.rs", "limit": 20, "opts": {"a": [1, 2]}}),
                }),
            ],
        );
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
        assert_eq!(
            ev,
            vec![OutputEvent::ToolCall(ToolCall {
                name: "f".into(),
                arguments: json!({"code": "123", "n": 5}),
            })]
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
        // Unterminated but complete JSON still parses at the end.
        let ev = run_whole(
            &mut OutputParser::new(false, true),
            "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}",
        );
        assert_eq!(
            ev,
            vec![OutputEvent::ToolCall(ToolCall {
                name: "f".into(),
                arguments: json!({"x": 1})
            })]
        );
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
