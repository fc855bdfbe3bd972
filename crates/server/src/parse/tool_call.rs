//! One `<tool_call>` block as it streams. The XML form's arguments are
//! written as a JSON object while the model writes them: the call's start
//! as soon as `<function=NAME>` is complete, then JSON text pieces
//! (`{`, `"p":"`, the escaped value as it comes, `"`, ..., `}`). A string
//! parameter (by the tool's JSON schema) streams; any other is held until
//! it closes and then written whole, typed. The JSON form is held whole
//! until its `</tool_call>` and then written as one piece.
//!
//! Where a value ends: a `</parameter>` closes its value only when what
//! follows it (after whitespace) is `<parameter=`, `</function>` or
//! `</tool_call>`, or the text ends there; any other `</parameter>`, and any
//! `</tool_call>` or `</function>`, is part of the value. So a file that
//! contains these tags is written through whole; only the exact sequence
//! `</parameter>` + a next tag ends it.
//!
//! A repeated parameter is read and dropped (the first one counts), so the
//! JSON text never holds a key twice.

use serde_json::{Map, Value};

use super::{held_suffix, push_merged, OutputEvent, ToolCall, TOOL_CLOSE, TOOL_OPEN};

const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";
/// What may follow (after whitespace) a `</parameter>` that ends its value.
const AFTER_VALUE: [&str; 3] = [PARAM_OPEN, FUNCTION_CLOSE, TOOL_CLOSE];
/// What ends the stretch between parameters.
const BETWEEN_TAGS: [&str; 3] = [PARAM_OPEN, FUNCTION_CLOSE, TOOL_CLOSE];

#[derive(Debug)]
enum State {
    /// After `<tool_call>`: the form is not known yet.
    Opening,
    /// The JSON form, or a block that is no call: held whole until its
    /// `</tool_call>`.
    Whole,
    /// XML form, between parameters (what is not a tag here is dropped).
    Between,
    /// XML form, after `<parameter=`, before its `>`.
    ParamName,
    /// XML form, inside a parameter's value.
    Value(ValueState),
    /// XML form, after `</function>`, before `</tool_call>`.
    AfterFunction,
}

#[derive(Debug)]
struct ValueState {
    name: String,
    /// The schema's type name of the parameter, if it has one.
    ty: Option<String>,
    /// A string parameter: written piece by piece as a JSON string (any
    /// other is held, typed and written whole at its close).
    streamed: bool,
    /// A repeated parameter: read and dropped.
    dropped: bool,
    /// Nothing of the value read yet (its leading newline is no part of it).
    at_start: bool,
    /// The value's text so far.
    raw: String,
}

/// How a block stands after a step.
#[derive(Debug, PartialEq)]
pub(super) enum Status {
    /// More text is needed.
    Open,
    /// The block ended with its `</tool_call>`, which was consumed.
    Closed,
    /// The block ended and is no tool call: this text, tags included, is
    /// plain output.
    NotACall(String),
}

/// The parser of one `<tool_call>` block; the text after `<tool_call>` is
/// in the caller's buffer, from which each step consumes what it can.
#[derive(Debug)]
pub(super) struct CallParser {
    state: State,
    name: String,
    /// The parameters of the XML form read so far.
    args: Map<String, Value>,
    /// The arguments JSON text written so far: the concatenation of the
    /// call's `ToolCallArgs` pieces.
    text: String,
}

impl CallParser {
    pub(super) fn new() -> Self {
        CallParser {
            state: State::Opening,
            name: String::new(),
            args: Map::new(),
            text: String::new(),
        }
    }

    /// Consumes what it can of `buf`, emitting events to `out`.
    /// `schemas`: the tools' JSON schemas by name.
    pub(super) fn push(
        &mut self,
        buf: &mut String,
        schemas: &Map<String, Value>,
        out: &mut Vec<OutputEvent>,
    ) -> Status {
        self.advance(buf, schemas, out, false)
    }

    /// The text ended: ends the block with what `buf` holds. `None`: it
    /// was a call (complete, or cut: see [`ToolCall::cut`]); else the
    /// block's text as plain output.
    pub(super) fn finish(
        &mut self,
        buf: &mut String,
        schemas: &Map<String, Value>,
        out: &mut Vec<OutputEvent>,
    ) -> Option<String> {
        match self.advance(buf, schemas, out, true) {
            Status::Closed => return None,
            Status::NotACall(text) => return Some(text),
            Status::Open => {}
        }
        match std::mem::replace(&mut self.state, State::AfterFunction) {
            State::Opening | State::Whole => {
                let body = std::mem::take(buf);
                match parse_json_call(&body) {
                    Some(call) => {
                        self.emit_whole(call, out);
                        None
                    }
                    None => Some(format!("{TOOL_OPEN}{body}")),
                }
            }
            State::Between => {
                self.write("}", out);
                self.end(false, out);
                None
            }
            State::AfterFunction => {
                self.end(false, out);
                None
            }
            State::ParamName => {
                // A parameter name cut off: nothing of it was written.
                buf.clear();
                self.end(true, out);
                None
            }
            State::Value(v) => {
                if !v.dropped {
                    let value = typed_value(&v.raw, v.ty.as_deref());
                    self.args.insert(v.name, value);
                }
                self.end(true, out);
                None
            }
        }
    }

    /// One pass over `buf`; `at_end`: no more text will come.
    fn advance(
        &mut self,
        buf: &mut String,
        schemas: &Map<String, Value>,
        out: &mut Vec<OutputEvent>,
        at_end: bool,
    ) -> Status {
        loop {
            match &mut self.state {
                State::Opening => {
                    let ws = buf.len() - buf.trim_start().len();
                    let body = &buf[ws..];
                    if body.is_empty() {
                        return Status::Open;
                    }
                    if let Some(after) = body.strip_prefix(FUNCTION_OPEN) {
                        let Some(gt) = after.find('>') else {
                            return Status::Open;
                        };
                        let name = after[..gt].trim();
                        if name.is_empty() || name.contains(['<', '\n']) {
                            self.state = State::Whole;
                            continue;
                        }
                        self.name = name.to_string();
                        buf.drain(..ws + FUNCTION_OPEN.len() + gt + 1);
                        out.push(OutputEvent::ToolCallStart {
                            name: self.name.clone(),
                        });
                        self.write("{", out);
                        self.state = State::Between;
                    } else if FUNCTION_OPEN.starts_with(body) {
                        return Status::Open;
                    } else {
                        self.state = State::Whole;
                    }
                }
                State::Whole => {
                    let Some(p) = json_block_end(buf) else {
                        return Status::Open;
                    };
                    let body: String = buf[..p].to_string();
                    buf.drain(..p + TOOL_CLOSE.len());
                    return match parse_json_call(&body) {
                        Some(call) => {
                            self.emit_whole(call, out);
                            Status::Closed
                        }
                        None => Status::NotACall(format!("{TOOL_OPEN}{body}{TOOL_CLOSE}")),
                    };
                }
                State::Between => match super::find_first(buf, &BETWEEN_TAGS) {
                    Some((p, tag)) => {
                        buf.drain(..p + tag.len());
                        match tag {
                            PARAM_OPEN => self.state = State::ParamName,
                            FUNCTION_CLOSE => {
                                self.write("}", out);
                                self.state = State::AfterFunction;
                            }
                            _ => {
                                self.write("}", out);
                                self.end(false, out);
                                return Status::Closed;
                            }
                        }
                    }
                    None => {
                        let keep = if at_end {
                            0
                        } else {
                            held_suffix(buf, &BETWEEN_TAGS)
                        };
                        buf.drain(..buf.len() - keep);
                        return Status::Open;
                    }
                },
                State::ParamName => {
                    let Some(gt) = buf.find('>') else {
                        return Status::Open;
                    };
                    let name = buf[..gt].trim().to_string();
                    buf.drain(..gt + 1);
                    let ty = schemas
                        .get(&self.name)
                        .and_then(|s| s.get("properties"))
                        .and_then(|p| p.get(&name))
                        .and_then(|s| s.get("type"))
                        .and_then(Value::as_str)
                        .map(str::to_string);
                    let streamed = ty.as_deref() == Some("string");
                    let dropped = self.args.contains_key(&name);
                    if !dropped {
                        let mut piece = String::new();
                        if !self.args.is_empty() {
                            piece.push(',');
                        }
                        piece.push_str(&json_string(&name));
                        piece.push(':');
                        if streamed {
                            piece.push('"');
                        }
                        self.write(&piece, out);
                    }
                    self.state = State::Value(ValueState {
                        name,
                        ty,
                        streamed,
                        dropped,
                        at_start: true,
                        raw: String::new(),
                    });
                }
                State::Value(v) => {
                    if v.at_start {
                        if buf.is_empty() {
                            return Status::Open;
                        }
                        if buf.starts_with('\n') {
                            buf.drain(..1);
                        }
                        v.at_start = false;
                    }
                    match value_end(buf, at_end) {
                        ValueEnd::Closed(p) => {
                            let raw = &buf[..p];
                            let raw = raw.strip_suffix('\n').unwrap_or(raw);
                            v.raw.push_str(raw);
                            let State::Value(v) =
                                std::mem::replace(&mut self.state, State::Between)
                            else {
                                unreachable!("in the value state")
                            };
                            if !v.dropped {
                                let value = if v.streamed {
                                    let piece = format!("{}\"", json_string_body(raw));
                                    self.write(&piece, out);
                                    Value::String(v.raw)
                                } else {
                                    let value = typed_value(&v.raw, v.ty.as_deref());
                                    self.write(&value.to_string(), out);
                                    value
                                };
                                self.args.insert(v.name, value);
                            }
                            buf.drain(..p + PARAM_CLOSE.len());
                        }
                        ValueEnd::Open(n) => {
                            let mut n = n;
                            // A last newline may be the one before the close.
                            if !at_end && buf[..n].ends_with('\n') {
                                n -= 1;
                            }
                            let piece = &buf[..n];
                            v.raw.push_str(piece);
                            if v.streamed && !v.dropped && !piece.is_empty() {
                                let piece = json_string_body(piece);
                                self.write(&piece, out);
                            }
                            buf.drain(..n);
                            return Status::Open;
                        }
                    }
                }
                State::AfterFunction => match buf.find(TOOL_CLOSE) {
                    Some(p) => {
                        buf.drain(..p + TOOL_CLOSE.len());
                        self.end(false, out);
                        return Status::Closed;
                    }
                    None => {
                        let keep = if at_end {
                            0
                        } else {
                            held_suffix(buf, &[TOOL_CLOSE])
                        };
                        buf.drain(..buf.len() - keep);
                        return Status::Open;
                    }
                },
            }
        }
    }

    /// Writes a piece of the arguments' JSON text.
    fn write(&mut self, piece: &str, out: &mut Vec<OutputEvent>) {
        self.text.push_str(piece);
        push_merged(out, OutputEvent::ToolCallArgs(piece.to_string()));
    }

    fn end(&mut self, cut: bool, out: &mut Vec<OutputEvent>) {
        out.push(OutputEvent::ToolCallEnd(ToolCall {
            name: std::mem::take(&mut self.name),
            arguments: Value::Object(std::mem::take(&mut self.args)),
            arguments_json: std::mem::take(&mut self.text),
            cut,
        }));
    }

    /// A call read whole (the JSON form): start, one piece, end.
    fn emit_whole(&mut self, call: (String, Map<String, Value>), out: &mut Vec<OutputEvent>) {
        let (name, args) = call;
        out.push(OutputEvent::ToolCallStart { name: name.clone() });
        let args = Value::Object(args);
        self.write(&args.to_string(), out);
        self.name = name;
        if let Value::Object(m) = args {
            self.args = m;
        }
        self.end(false, out);
    }
}

/// Where a value stands in `buf`.
enum ValueEnd {
    /// It ends with the `</parameter>` at this byte offset.
    Closed(usize),
    /// It goes on: this many bytes of it are known to be value text.
    Open(usize),
}

fn value_end(buf: &str, at_end: bool) -> ValueEnd {
    let mut from = 0;
    while let Some(i) = buf[from..].find(PARAM_CLOSE) {
        let p = from + i;
        let next = buf[p + PARAM_CLOSE.len()..].trim_start();
        if AFTER_VALUE.iter().any(|t| next.starts_with(t)) {
            return ValueEnd::Closed(p);
        }
        // Not known yet what follows: a close only if a tag does, or the
        // text ends (then the next tag was cut off).
        if AFTER_VALUE.iter().any(|t| t.starts_with(next)) {
            return if at_end {
                ValueEnd::Closed(p)
            } else {
                ValueEnd::Open(p)
            };
        }
        from = p + 1;
    }
    if at_end {
        ValueEnd::Open(buf.len())
    } else {
        ValueEnd::Open(buf.len() - held_suffix(buf, &[PARAM_CLOSE]))
    }
}

/// The offset of the `</tool_call>` that ends a held block: for a block
/// that looks like JSON, the first one outside a JSON string.
fn json_block_end(buf: &str) -> Option<usize> {
    let json = buf.trim_start().starts_with('{');
    let mut from = 0;
    while let Some(i) = buf[from..].find(TOOL_CLOSE) {
        let p = from + i;
        if !json || !ends_in_string(&buf[..p]) {
            return Some(p);
        }
        from = p + 1;
    }
    None
}

/// Whether JSON text `s` ends inside a string.
fn ends_in_string(s: &str) -> bool {
    let (mut in_string, mut escaped) = (false, false);
    for c in s.chars() {
        if escaped {
            escaped = false;
        } else if in_string && c == '\\' {
            escaped = true;
        } else if c == '"' {
            in_string = !in_string;
        }
    }
    in_string
}

/// `s` as a JSON string literal.
fn json_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// `s` escaped as inside a JSON string literal, quotes left out. Escaping
/// is per character, so the pieces of a text escape to the pieces of its
/// escaping.
fn json_string_body(s: &str) -> String {
    let q = json_string(s);
    q[1..q.len() - 1].to_string()
}

/// Parses the body of a JSON-form block: `{"name": ..., "arguments": {...}}`
/// (`arguments` also as a JSON string, or named `parameters`).
pub fn parse_json_call(body: &str) -> Option<(String, Map<String, Value>)> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => Map::new(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(o)) => o,
            _ => return None,
        },
        Some(Value::Object(o)) => o.clone(),
        Some(_) => return None,
    };
    Some((name, arguments))
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
