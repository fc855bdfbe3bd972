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
