//! Tokenizer and chat template.

use minijinja::{context, Environment, Error as JinjaError, ErrorKind};
use serde::Serialize;

use crate::EngineError;

/// The model's tokenizer (HF `tokenizer.json`).
pub struct TextCodec {
    tokenizer: tokenizers::Tokenizer,
}

impl TextCodec {
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, EngineError> {
        let tokenizer = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| EngineError::Tokenizer(format!("cannot load tokenizer.json: {e}")))?;
        Ok(TextCodec { tokenizer })
    }

    /// Text to ids. Special tokens written in the text (`<|im_start|>`) are
    /// recognised; no BOS/EOS is added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text to ids, if it is at most `max_tokens` tokens; the memory this
    /// takes follows `max_tokens`, not the length of `text`.
    ///
    /// The text is encoded in pieces of at most [`PIECE_BYTES`]. Pieces
    /// end, where the text allows, between a letter and a space before
    /// another letter: a boundary of every pre-tokenizer here, so the
    /// pieces' ids are the whole text's. Where a piece must end elsewhere
    /// (a long run without such a space) its count may differ from the
    /// whole text's by a few tokens, so such a text is encoded once more
    /// whole when it came out near the limit. Past the limit, pieces are
    /// only counted (their ids dropped), so the error can say how long the
    /// text is, up to [`COUNT_PAST_LIMIT`] tokens or 8 times the limit.
    pub fn encode_within(&self, text: &str, max_tokens: usize) -> Result<Bounded, EngineError> {
        // Cut pieces may count a few tokens more or less than the whole;
        // this much over the limit is over it for certain.
        let slack = |cuts: usize| {
            if cuts == 0 {
                0
            } else {
                max_tokens / 8 + 64 * cuts
            }
        };
        let mut ids = Vec::new();
        let (mut counted, mut cuts, mut start) = (0usize, 0usize, 0usize);
        let mut over = false;
        while start < text.len() {
            let (end, exact) = piece_end(text, start);
            let piece = self.encode(&text[start..end])?;
            counted += piece.len();
            cuts += usize::from(!exact);
            start = end;
            let limit = max_tokens.saturating_add(slack(cuts));
            if counted > limit {
                over = true;
                ids = Vec::new();
                if counted > limit.saturating_mul(8).max(COUNT_PAST_LIMIT) {
                    return Ok(Bounded::TooLong {
                        counted,
                        whole: false,
                    });
                }
            } else {
                ids.extend(piece);
            }
        }
        if over {
            return Ok(Bounded::TooLong {
                counted,
                whole: cuts == 0,
            });
        }
        if cuts > 0 {
            // Near the limit: the whole text decides (its size is now
            // bounded by the limit).
            ids = self.encode(text)?;
        }
        if ids.len() > max_tokens {
            return Ok(Bounded::TooLong {
                counted: ids.len(),
                whole: true,
            });
        }
        Ok(Bounded::Fits(ids))
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, EngineError> {
        self.tokenizer
            .decode(ids, false)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The HF tokenizer itself (for token tries of constrained decoding).
    pub fn tokenizer(&self) -> &tokenizers::Tokenizer {
        &self.tokenizer
    }
}

/// Tokens [`TextCodec::encode_within`] counts past its limit at least
/// before it stops (time, not memory: past the limit it keeps no ids).
pub const COUNT_PAST_LIMIT: usize = 1 << 20;

/// Most bytes [`TextCodec::encode_within`] encodes at once.
pub const PIECE_BYTES: usize = 64 << 10;

/// Bytes of text per token above which a text (or a body carrying it) is
/// taken to exceed a token limit without encoding it: several times what
/// prose, code or CJK text take (3-5 bytes a token).
pub const BYTES_PER_TOKEN_BOUND: usize = 24;

/// Most bytes of text (or request body) worth reading for a prompt of at
/// most `max_tokens` tokens: [`BYTES_PER_TOKEN_BOUND`] a token, at least
/// 1 MiB.
pub fn text_bytes_bound(max_tokens: usize) -> usize {
    max_tokens
        .saturating_mul(BYTES_PER_TOKEN_BOUND)
        .max(1 << 20)
}

/// What [`TextCodec::encode_within`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bounded {
    /// The ids of the whole text, at most the limit.
    Fits(Vec<u32>),
    /// More tokens than the limit: `counted` were counted, all the text's
    /// when `whole`, else those before counting stopped (see
    /// [`COUNT_PAST_LIMIT`]) or an estimate from cut pieces.
    TooLong { counted: usize, whole: bool },
}

/// Where the piece of `text` from `start` ends (a char boundary), and
/// whether it ends at a pre-token boundary (see
/// [`TextCodec::encode_within`]).
fn piece_end(text: &str, start: usize) -> (usize, bool) {
    let end = start + PIECE_BYTES;
    if end >= text.len() {
        return (text.len(), true);
    }
    let b = text.as_bytes();
    // The latest "letter, space, letter" in the piece's second half; the
    // space starts the next piece.
    let lo = start + PIECE_BYTES / 2;
    if let Some(i) = (lo..end)
        .rev()
        .find(|&i| b[i] == b' ' && b[i - 1].is_ascii_alphabetic() && b[i + 1].is_ascii_alphabetic())
    {
        return (i, true);
    }
    let mut cut = end;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    (cut, false)
}

/// Turns a growing list of generated ids into text pieces, holding back
/// bytes that do not yet form complete UTF-8 characters.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    emitted: usize,
}

impl StreamDecoder {
    /// Adds one id; returns the new text it completes (maybe empty).
    pub fn push(&mut self, codec: &TextCodec, id: u32) -> Result<String, EngineError> {
        self.ids.push(id);
        let text = codec.decode(&self.ids)?;
        if text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let piece = text.get(self.emitted..).unwrap_or("").to_string();
        self.emitted = text.len().max(self.emitted);
        Ok(piece)
    }
}

/// One chat message.
#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// Renders the checkpoint's Jinja chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

/// `tojson` as `transformers` defines it for chat templates:
/// `json.dumps(x, ensure_ascii=False)` with Python's `", "` / `": "`
/// separators (and `indent` when given), so tool definitions tokenize as
/// they do in the reference. Output is marked safe (no HTML escaping).
fn tojson_like_transformers(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_python_json(&json, indent, 0, &mut out);
    Ok(minijinja::Value::from_safe_string(out))
}

fn write_python_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::Value::String(k.clone()).to_string());
                out.push_str(": ");
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

fn raise_exception(msg: String) -> Result<String, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    pub fn new(source: &str) -> Result<Self, EngineError> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson_like_transformers);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| EngineError::Template(format!("chat template does not parse: {e}")))?;
        Ok(ChatTemplate { env })
    }

    /// Renders `messages` and, when asked, the assistant turn's opening.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> Result<String, EngineError> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| EngineError::Template(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            enable_thinking => enable_thinking,
        })
        .map_err(|e| EngineError::Template(format!("chat template failed: {e}")))
    }

    /// Renders with a full context, as `transformers`' `apply_chat_template`
    /// passes it: `messages` (with `tool_calls` and `tool` results), `tools`,
    /// `add_generation_prompt`, `enable_thinking` and any other variable the
    /// template reads. `context` must be a JSON object.
    pub fn render_json(&self, context: &serde_json::Value) -> Result<String, EngineError> {
        if !context.is_object() {
            return Err(EngineError::Template(
                "chat template context must be a JSON object".into(),
            ));
        }
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| EngineError::Template(e.to_string()))?;
        tmpl.render(minijinja::Value::from_serialize(context))
            .map_err(|e| EngineError::Template(format!("chat template failed: {e}")))
    }

    /// Whether the template reads a `tools` variable (renders tool
    /// definitions itself).
    pub fn supports_tools(&self) -> bool {
        self.env
            .get_template("chat")
            .map(|t| t.undeclared_variables(false).contains("tools"))
            .unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demo_codec() -> TextCodec {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../models/demo/tokenizer.json"
        );
        TextCodec::from_bytes(&std::fs::read(path).unwrap()).unwrap()
    }

    /// Prose of about `bytes` bytes: words, numbers, punctuation, blank
    /// lines and indentation, varied by a simple generator.
    fn prose(bytes: usize) -> String {
        let words = [
            "the", "model", "reads", "experts", "from", "disk", "while", "(x)", "42,", "über",
            "漢字", "fn", "main()", "{", "}", "-", "don't", "Z9", "tab\t", "end.",
        ];
        let mut s = String::new();
        let mut x = 12345u64;
        while s.len() < bytes {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let w = words[(x >> 33) as usize % words.len()];
            s.push_str(w);
            s.push_str(match (x >> 20) % 13 {
                0 => "\n\n",
                1 => "\n    ",
                2 => ".\n",
                _ => " ",
            });
        }
        s
    }

    #[test]
    fn bounded_encode_gives_the_whole_texts_ids_or_stops_at_the_limit() {
        let codec = demo_codec();
        let text = prose(3 * PIECE_BYTES + 777);
        let whole = codec.encode(&text).unwrap();
        let n = whole.len();
        assert_eq!(codec.encode_within(&text, n).unwrap(), Bounded::Fits(whole));
        // Just over: the exact count, as the whole text's.
        assert_eq!(
            codec.encode_within(&text, n - 1).unwrap(),
            Bounded::TooLong {
                counted: n,
                whole: true
            }
        );
        // Far over: still counted to the end (no ids kept past the limit).
        assert_eq!(
            codec.encode_within(&text, n / 10).unwrap(),
            Bounded::TooLong {
                counted: n,
                whole: true
            }
        );
        assert_eq!(codec.encode_within("", 0).unwrap(), Bounded::Fits(vec![]));
    }

    #[test]
    fn bounded_encode_of_text_without_spaces_is_exact_near_the_limit() {
        let codec = demo_codec();
        // No "letter space letter" anywhere: every piece is cut mid-run,
        // some cuts inside a multi-byte character's neighbourhood.
        let text: String = (0..(2 * PIECE_BYTES + 100))
            .map(|i| ['a', 'é', '7', '_', '漢', 'Q'][(i * 7 + i / 3) % 6])
            .collect();
        let whole = codec.encode(&text).unwrap();
        let n = whole.len();
        assert_eq!(codec.encode_within(&text, n).unwrap(), Bounded::Fits(whole));
        assert!(matches!(
            codec.encode_within(&text, n - 1).unwrap(),
            Bounded::TooLong { .. }
        ));
        // Megabytes against a small limit: counting stops a piece past
        // COUNT_PAST_LIMIT.
        let big = text.repeat(40);
        let tokens_in_big = 40 * n;
        assert!(tokens_in_big > COUNT_PAST_LIMIT + PIECE_BYTES);
        match codec.encode_within(&big, 1000).unwrap() {
            Bounded::TooLong {
                counted,
                whole: false,
            } => assert!(
                counted > COUNT_PAST_LIMIT && counted < COUNT_PAST_LIMIT + PIECE_BYTES,
                "{counted}"
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn text_bound_follows_the_context_with_a_floor() {
        assert_eq!(text_bytes_bound(1), 1 << 20);
        assert_eq!(text_bytes_bound(1 << 20), 24 << 20);
        assert_eq!(text_bytes_bound(usize::MAX), usize::MAX);
    }

    const CHATML: &str = "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.strip() }}<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}";

    #[test]
    fn renders_chatml_with_python_methods() {
        let t = ChatTemplate::new(CHATML).unwrap();
        let out = t
            .render(
                &[ChatMessage {
                    role: "user".into(),
                    content: " hi ".into(),
                }],
                true,
                false,
            )
            .unwrap();
        assert_eq!(out, "<|im_start|>user\nhi<|im_end|><|im_start|>assistant");
    }

    #[test]
    fn renders_full_json_context_with_tools() {
        let src = "{%- if tools %}T:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}{%- for m in messages %}[{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}]{% endfor %}{% if add_generation_prompt %}A{% endif %}";
        let t = ChatTemplate::new(src).unwrap();
        assert!(t.supports_tools());
        assert!(!ChatTemplate::new(CHATML).unwrap().supports_tools());
        let ctx = serde_json::json!({
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
                ]},
                {"role": "tool", "content": "42"}
            ],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "add_generation_prompt": true,
            "enable_thinking": false
        });
        let out = t.render_json(&ctx).unwrap();
        // minijinja's `tojson` is compact (Python's `json.dumps` puts spaces
        // after `,` and `:`).
        assert_eq!(out, "T:f;[user:hi][assistant:<f {\"x\": 1}>][tool:42]A");
        assert!(t.render_json(&serde_json::json!([1])).is_err());
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let t = ChatTemplate::new("{{ x | tojson }}|{{ y | tojson(indent=2) }}").unwrap();
        let out = t
            .env
            .get_template("chat")
            .unwrap()
            .render(minijinja::context! {
                x => serde_json::json!({"name": "f", "p": [1, 2.5, "é<>"], "e": {}}),
                y => serde_json::json!({"a": [1]}),
            })
            .unwrap();
        // json.dumps(x, ensure_ascii=False) and json.dumps(y, indent=2).
        assert_eq!(
            out,
            "{\"name\": \"f\", \"p\": [1, 2.5, \"é<>\"], \"e\": {}}|{\n  \"a\": [\n    1\n  ]\n}"
        );
    }

    #[test]
    fn broken_template_is_an_error() {
        assert!(ChatTemplate::new("{% for %}").is_err());
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}").unwrap();
        let err = t.render(&[], false, false).unwrap_err();
        assert!(err.to_string().contains("no system role"));
    }
}
