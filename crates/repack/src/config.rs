//! Reading a checkpoint's `config.json`, `generation_config.json` and
//! tokenizer files into a [`ModelConfig`] and the manifest's tokenizer fields.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;
use slipstream_core::config::{LayerKind, MAX_CONFIG_COUNT};
use slipstream_core::{Architecture, ModelConfig};
use slipstream_format::GenerationDefaults;

use crate::{RepackError, Result};

pub(crate) const SUPPORTED: &str = "qwen3_5_moe, qwen3_5_moe_text, qwen3_moe, qwen3_next";

pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let bytes = std::fs::read(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            RepackError::MissingFile {
                path: path.display().to_string(),
                what: "a required file".into(),
            }
        } else {
            RepackError::Io {
                path: path.display().to_string(),
                source: e,
            }
        }
    })?;
    serde_json::from_slice(&bytes).map_err(|e| RepackError::Json {
        path: path.display().to_string(),
        source: e,
    })
}

fn read_json_opt(path: &Path) -> Result<Option<Value>> {
    if path.is_file() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}

/// `config.json` with the text model's section picked out.
pub(crate) struct RawConfig {
    pub path: String,
    pub root: Value,
    /// `text_config` when present, else the root.
    pub text: Value,
    pub architecture: Architecture,
}

impl RawConfig {
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let root = read_json(&path)?;
        let model_type = root
            .get("model_type")
            .and_then(|v| v.as_str())
            .unwrap_or("");
        let text_type = root
            .get("text_config")
            .and_then(|t| t.get("model_type"))
            .and_then(|v| v.as_str());
        let architecture = match model_type {
            "qwen3_5_moe" | "qwen3_5_moe_text" => Architecture::Qwen35Moe,
            "qwen3_moe" => Architecture::Qwen3Moe,
            "qwen3_next" => Architecture::Qwen3Next,
            "" => {
                return Err(RepackError::UnknownArchitecture {
                    model_type: text_type.unwrap_or("(none)").to_string(),
                    supported: SUPPORTED,
                })
            }
            other => {
                return Err(RepackError::UnknownArchitecture {
                    model_type: other.to_string(),
                    supported: SUPPORTED,
                })
            }
        };
        let text = match root.get("text_config") {
            Some(t) if t.is_object() => t.clone(),
            _ => root.clone(),
        };
        Ok(RawConfig {
            path: path.display().to_string(),
            root,
            text,
            architecture,
        })
    }

    /// A field of the text config, falling back to the top level.
    pub fn field(&self, key: &str) -> Option<&Value> {
        self.text
            .get(key)
            .filter(|v| !v.is_null())
            .or_else(|| self.root.get(key).filter(|v| !v.is_null()))
    }

    fn bad(&self, msg: String) -> RepackError {
        RepackError::Config {
            path: self.path.clone(),
            message: msg,
        }
    }

    fn usize_req(&self, key: &str) -> Result<usize> {
        match self.field(key) {
            Some(v) => match v.as_u64() {
                Some(x) if x <= MAX_CONFIG_COUNT => Ok(x as usize),
                Some(x) => Err(self.bad(format!(
                    "\"{key}\" = {x} is beyond any model (at most {MAX_CONFIG_COUNT})"
                ))),
                None => Err(self.bad(format!(
                    "\"{key}\" must be a non-negative integer, found {v}"
                ))),
            },
            None => Err(self.bad(format!("missing \"{key}\""))),
        }
    }

    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        if self.field(key).is_some() {
            self.usize_req(key)
        } else {
            Ok(default)
        }
    }

    fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        match self.field(key) {
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.bad(format!("\"{key}\" must be a number, found {v}"))),
            None => Ok(None),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.field(key) {
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.bad(format!("\"{key}\" must be true or false, found {v}"))),
            None => Ok(default),
        }
    }

    fn unsupported(&self, feature: String) -> RepackError {
        RepackError::UnsupportedConfig {
            path: self.path.clone(),
            feature,
        }
    }

    /// The MLX `quantization` block, if any (`quantization_config` as fallback).
    pub fn mlx_quantization(&self) -> Option<&Value> {
        let q = self
            .root
            .get("quantization")
            .or_else(|| self.text.get("quantization"));
        q.or_else(|| {
            self.root
                .get("quantization_config")
                .filter(|q| q.get("quant_method").is_none())
        })
        .filter(|v| v.is_object())
    }

    /// A Hugging Face quantization method (fp8, gptq, awq, ...) that we cannot read.
    pub fn hf_quant_method(&self) -> Option<String> {
        self.root
            .get("quantization_config")
            .and_then(|q| q.get("quant_method"))
            .map(|m| {
                m.as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| m.to_string())
            })
    }

    /// Builds the normalised configuration, refusing features we do not run.
    pub fn model_config(&self) -> Result<ModelConfig> {
        let arch = self.architecture;
        // qwen3_5_moe and qwen3_next: hybrid layers, gated attention, shared expert.
        let qwen35 = arch.is_hybrid();
        let hidden = self.usize_req("hidden_size")?;
        let n_layers = self.usize_req("num_hidden_layers")?;
        let heads = self.usize_req("num_attention_heads")?;
        let kv_heads = self.usize_or("num_key_value_heads", heads)?;
        let head_dim = match self.field("head_dim") {
            Some(_) => self.usize_req("head_dim")?,
            None if heads > 0 => hidden / heads,
            None => 0,
        };

        // Sparse-step / dense-MLP layers would need a dense MLP path.
        let step = self.usize_or("decoder_sparse_step", 1)?;
        if step != 1 {
            return Err(self.unsupported(format!(
                "decoder_sparse_step = {step} (only 1, every layer MoE, is supported)"
            )));
        }
        if let Some(v) = self.field("mlp_only_layers") {
            if v.as_array().is_none_or(|a| !a.is_empty()) {
                return Err(self.unsupported(format!(
                    "mlp_only_layers = {v} (only an empty list, every layer MoE, is supported)"
                )));
            }
        }
        if self.bool_or("use_sliding_window", false)? {
            return Err(self.unsupported("use_sliding_window = true".into()));
        }
        if self.bool_or("attention_bias", false)? {
            return Err(self
                .unsupported("attention_bias = true (attention projections with biases)".into()));
        }
        if let Some(act) = self.field("hidden_act").and_then(|v| v.as_str()) {
            if act != "silu" {
                return Err(self.unsupported(format!("hidden_act = {act:?} (only \"silu\")")));
            }
        }

        // RoPE: theta lives in rope_parameters for recent transformers.
        let rope_params = self
            .field("rope_parameters")
            .or_else(|| self.field("rope_scaling"))
            .filter(|v| v.is_object());
        if let Some(rp) = rope_params {
            let ty = rp
                .get("rope_type")
                .or_else(|| rp.get("type"))
                .and_then(|v| v.as_str())
                .unwrap_or("default");
            if ty != "default" {
                return Err(self.unsupported(format!(
                    "rope type {ty:?} (only \"default\" RoPE is supported)"
                )));
            }
        }
        let rope_theta = rope_params
            .and_then(|rp| rp.get("rope_theta"))
            .and_then(|v| v.as_f64())
            .or(self.f64_opt("rope_theta")?)
            .unwrap_or(10000.0);
        let factor = rope_params
            .and_then(|rp| rp.get("partial_rotary_factor"))
            .and_then(|v| v.as_f64())
            .or(self.f64_opt("partial_rotary_factor")?)
            .unwrap_or(if qwen35 { 0.25 } else { 1.0 });
        let rotary_dim = (head_dim as f64 * factor).round() as usize;

        let layer_types = if qwen35 {
            match self.field("layer_types") {
                Some(v) => {
                    let arr = v
                        .as_array()
                        .ok_or_else(|| self.bad("\"layer_types\" must be a list".into()))?;
                    let mut out = Vec::new();
                    for t in arr {
                        out.push(match t.as_str() {
                            Some("full_attention") => LayerKind::FullAttention,
                            Some("linear_attention") => LayerKind::LinearAttention,
                            _ => {
                                return Err(self.unsupported(format!(
                                    "layer type {t} (supported: \"full_attention\", \"linear_attention\")"
                                )))
                            }
                        });
                    }
                    if out.len() != n_layers {
                        return Err(self.bad(format!(
                            "\"layer_types\" has {} entries but num_hidden_layers is {n_layers}",
                            out.len()
                        )));
                    }
                    out
                }
                None => {
                    let interval = self.usize_or("full_attention_interval", 4)?;
                    if interval == 0 {
                        return Err(self.bad("\"full_attention_interval\" must be positive".into()));
                    }
                    LayerKind::interleaved(n_layers, interval)
                }
            }
        } else {
            vec![LayerKind::FullAttention; n_layers]
        };
        let has_linear = layer_types.contains(&LayerKind::LinearAttention);

        let num_experts = match self.field("num_experts") {
            Some(_) => self.usize_req("num_experts")?,
            None => self.usize_req("num_local_experts")?,
        };
        let cfg = ModelConfig {
            architecture: arch,
            vocab_size: self.usize_req("vocab_size")?,
            hidden_size: hidden,
            rms_norm_eps: self.f64_opt("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            tie_word_embeddings: self.bool_or("tie_word_embeddings", false)?,
            max_position_embeddings: self.usize_or("max_position_embeddings", 32768)?,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rotary_dim,
            rope_theta,
            attn_output_gate: if qwen35 {
                self.bool_or("attn_output_gate", true)?
            } else {
                false
            },
            linear_num_key_heads: if has_linear {
                self.usize_or("linear_num_key_heads", 16)?
            } else {
                0
            },
            linear_key_head_dim: if has_linear {
                self.usize_or("linear_key_head_dim", 128)?
            } else {
                0
            },
            linear_num_value_heads: if has_linear {
                self.usize_or("linear_num_value_heads", 32)?
            } else {
                0
            },
            linear_value_head_dim: if has_linear {
                self.usize_or("linear_value_head_dim", 128)?
            } else {
                0
            },
            linear_conv_kernel: if has_linear {
                self.usize_or("linear_conv_kernel_dim", 4)?
            } else {
                0
            },
            layer_types,
            num_experts,
            num_experts_per_tok: self.usize_req("num_experts_per_tok")?,
            moe_intermediate_size: self.usize_req("moe_intermediate_size")?,
            shared_expert_intermediate_size: if qwen35 {
                self.usize_req("shared_expert_intermediate_size")?
            } else {
                0
            },
            // qwen3_5_moe always renormalises the top-k weights; qwen3_next
            // (Qwen2MoeTopKRouter) when `norm_topk_prob`, true by default.
            norm_topk_prob: match arch {
                Architecture::Qwen35Moe => true,
                Architecture::Qwen3Next => self.bool_or("norm_topk_prob", true)?,
                Architecture::Qwen3Moe => self.bool_or("norm_topk_prob", false)?,
            },
            // The importer drops it back to 0 when the checkpoint carries
            // no `mtp.*` tensors; a qwen3_next config declares none (the
            // importer counts the checkpoint's `mtp.layers.{k}`).
            mtp_num_layers: if qwen35 {
                self.usize_or("mtp_num_hidden_layers", 0)?
            } else {
                0
            },
        };
        cfg.validate().map_err(|e| self.bad(e.to_string()))?;
        Ok(cfg)
    }
}

/// Tokenizer-related manifest fields.
#[derive(Debug, Default)]
pub(crate) struct TokenizerInfo {
    pub tokenizer_json: Option<Vec<u8>>,
    pub chat_template: Option<String>,
    pub special_tokens: BTreeMap<String, String>,
    pub eos_token_ids: Vec<u32>,
    pub generation: Option<GenerationDefaults>,
}

/// The sampling settings of a `generation_config.json` (those vLLM reads:
/// `do_sample` and the length fields are not sampling defaults). A value
/// of the wrong type or out of range is refused by name.
pub(crate) fn generation_defaults(gen: &Value, path: &str) -> Result<GenerationDefaults> {
    let bad = |key: &str, why: &str| RepackError::Config {
        path: path.to_string(),
        message: format!("{key}: {why}, got {}", gen[key]),
    };
    let float = |key: &str, ok: fn(f64) -> bool, why: &str| -> Result<Option<f32>> {
        match gen.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_f64().filter(|x| x.is_finite() && ok(*x)) {
                Some(x) => Ok(Some(x as f32)),
                None => Err(bad(key, why)),
            },
        }
    };
    let top_k = match gen.get("top_k") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|k| usize::try_from(k).ok())
                .ok_or_else(|| bad("top_k", "must be an integer >= 0"))?,
        ),
    };
    Ok(GenerationDefaults {
        temperature: float("temperature", |x| x >= 0.0, "must be a number >= 0")?,
        top_p: float("top_p", |x| x > 0.0 && x <= 1.0, "must be in (0, 1]")?,
        top_k,
        min_p: float("min_p", |x| (0.0..=1.0).contains(&x), "must be in [0, 1]")?,
        repetition_penalty: float("repetition_penalty", |x| x > 0.0, "must be > 0")?,
        presence_penalty: float(
            "presence_penalty",
            |x| (-2.0..=2.0).contains(&x),
            "must be in [-2, 2]",
        )?,
        frequency_penalty: float(
            "frequency_penalty",
            |x| (-2.0..=2.0).contains(&x),
            "must be in [-2, 2]",
        )?,
    })
}

fn push_ids(v: Option<&Value>, out: &mut Vec<u32>) {
    match v {
        Some(Value::Number(n)) => {
            if let Some(id) = n.as_u64() {
                out.push(id as u32);
            }
        }
        Some(Value::Array(a)) => {
            for x in a {
                if let Some(id) = x.as_u64() {
                    out.push(id as u32);
                }
            }
        }
        _ => {}
    }
}

fn token_string(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    }
}

pub(crate) fn read_tokenizer_info(dir: &Path, raw: &RawConfig) -> Result<TokenizerInfo> {
    let mut info = TokenizerInfo::default();
    let mut eos = Vec::new();
    let gen_path = dir.join("generation_config.json");
    if let Some(gen) = read_json_opt(&gen_path)? {
        push_ids(gen.get("eos_token_id"), &mut eos);
        info.generation = Some(generation_defaults(&gen, &gen_path.display().to_string())?);
    }
    push_ids(raw.root.get("eos_token_id"), &mut eos);
    push_ids(raw.text.get("eos_token_id"), &mut eos);

    let tok_path = dir.join("tokenizer.json");
    let mut tokenizer: Option<Value> = None;
    if tok_path.is_file() {
        let bytes = std::fs::read(&tok_path).map_err(|e| RepackError::Io {
            path: tok_path.display().to_string(),
            source: e,
        })?;
        tokenizer = Some(
            serde_json::from_slice(&bytes).map_err(|e| RepackError::Json {
                path: tok_path.display().to_string(),
                source: e,
            })?,
        );
        info.tokenizer_json = Some(bytes);
    }

    let tc_path = dir.join("tokenizer_config.json");
    if let Some(tc) = read_json_opt(&tc_path)? {
        for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
            if let Some(s) = tc.get(key).and_then(token_string) {
                info.special_tokens.insert(key.to_string(), s);
            }
        }
        match tc.get("chat_template") {
            Some(Value::String(s)) => info.chat_template = Some(s.clone()),
            Some(Value::Array(list)) => {
                // [{name, template}, ...]: take "default", else the first.
                let pick = list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .or_else(|| list.first());
                info.chat_template = pick
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .map(str::to_string);
            }
            _ => {}
        }
    }
    // transformers >= 4.43 saves the template beside the config; it wins.
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        info.chat_template =
            Some(
                std::fs::read_to_string(&jinja).map_err(|e| RepackError::Io {
                    path: jinja.display().to_string(),
                    source: e,
                })?,
            );
    }

    if let (Some(eos_tok), Some(tok)) = (info.special_tokens.get("eos_token"), &tokenizer) {
        if let Some(added) = tok.get("added_tokens").and_then(|a| a.as_array()) {
            for t in added {
                if t.get("content").and_then(|c| c.as_str()) == Some(eos_tok.as_str()) {
                    if let Some(id) = t.get("id").and_then(|i| i.as_u64()) {
                        eos.push(id as u32);
                    }
                }
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    info.eos_token_ids = eos.into_iter().filter(|id| seen.insert(*id)).collect();
    Ok(info)
}
