//! The normalised model configuration every downstream crate reads.
//! Parsing of checkpoint-specific `config.json` files lives in `repack`.

use serde::{Deserialize, Serialize};

/// Supported model families.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Architecture {
    /// Qwen3.5 / Qwen3.6 MoE: Gated DeltaNet + gated attention, shared expert.
    Qwen35Moe,
    /// Qwen3 MoE: full attention in every layer, no shared expert.
    Qwen3Moe,
}

impl Architecture {
    pub fn name(&self) -> &'static str {
        match self {
            Architecture::Qwen35Moe => "qwen3_5_moe",
            Architecture::Qwen3Moe => "qwen3_moe",
        }
    }
}

/// The token mixer of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    FullAttention,
    LinearAttention,
}

/// Hyper-parameters of a model, independent of the checkpoint format.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub rms_norm_eps: f32,
    /// One entry per layer.
    pub layer_types: Vec<LayerKind>,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,

    // Full attention.
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Leading dims of each head that RoPE rotates (NeoX half rotation).
    pub rotary_dim: usize,
    pub rope_theta: f64,
    /// q_proj emits [query, gate] per head and the output is gated by sigmoid(gate).
    pub attn_output_gate: bool,

    // Gated DeltaNet (linear attention); zero when the model has none.
    pub linear_num_key_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_num_value_heads: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel: usize,

    // Mixture of experts.
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    /// Zero when the model has no shared expert.
    pub shared_expert_intermediate_size: usize,
    /// Renormalise the top-k router weights to sum to one.
    pub norm_topk_prob: bool,
}

impl ModelConfig {
    pub fn num_layers(&self) -> usize {
        self.layer_types.len()
    }

    /// Channels of the GDN qkv projection (and its causal conv).
    pub fn linear_conv_dim(&self) -> usize {
        2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// Checks internal consistency; the error names the offending field.
    pub fn validate(&self) -> Result<(), crate::CoreError> {
        let bad = |m: String| Err(crate::CoreError::Invalid(m));
        if self.vocab_size == 0 || self.hidden_size == 0 || self.layer_types.is_empty() {
            return bad("config has zero vocab, hidden size or layers".into());
        }
        let has_full = self.layer_types.contains(&LayerKind::FullAttention);
        if has_full {
            if self.num_attention_heads == 0
                || self.num_key_value_heads == 0
                || self.head_dim == 0
                || !self
                    .num_attention_heads
                    .is_multiple_of(self.num_key_value_heads)
            {
                return bad(format!(
                    "attention heads {} must be a positive multiple of kv heads {}",
                    self.num_attention_heads, self.num_key_value_heads
                ));
            }
            if self.rotary_dim > self.head_dim || !self.rotary_dim.is_multiple_of(2) {
                return bad(format!(
                    "rotary dim {} must be even and <= head dim {}",
                    self.rotary_dim, self.head_dim
                ));
            }
        }
        if self.layer_types.contains(&LayerKind::LinearAttention)
            && (self.linear_num_key_heads == 0
                || !self
                    .linear_num_value_heads
                    .is_multiple_of(self.linear_num_key_heads)
                || self.linear_conv_kernel == 0)
        {
            return bad(format!(
                "linear value heads {} must be a positive multiple of key heads {}",
                self.linear_num_value_heads, self.linear_num_key_heads
            ));
        }
        if self.num_experts == 0
            || self.num_experts_per_tok == 0
            || self.num_experts_per_tok > self.num_experts
        {
            return bad(format!(
                "experts per token {} must be in 1..={}",
                self.num_experts_per_tok, self.num_experts
            ));
        }
        Ok(())
    }
}
