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
    /// Qwen3-Next: the math of [`Architecture::Qwen35Moe`] (its checkpoints
    /// fuse the Gated DeltaNet input projections per key head; importers
    /// split them into the canonical `gdn.*` tensors), and the router
    /// renormalises only when the config says `norm_topk_prob`.
    Qwen3Next,
}

impl Architecture {
    pub fn name(&self) -> &'static str {
        match self {
            Architecture::Qwen35Moe => "qwen3_5_moe",
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::Qwen3Next => "qwen3_next",
        }
    }

    /// Gated DeltaNet / gated-attention hybrids with a gated shared expert
    /// (qwen3_5_moe and qwen3_next): one model code, zero-centred HF norms.
    pub fn is_hybrid(&self) -> bool {
        matches!(self, Architecture::Qwen35Moe | Architecture::Qwen3Next)
    }
}

/// The token mixer of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    FullAttention,
    LinearAttention,
}

impl LayerKind {
    /// The hybrid models' layout: `n_layers` layers of linear attention with
    /// every `full_every`-th one (counting from 1) full attention, as
    /// `full_attention_interval` describes it. `full_every` must be > 0.
    pub fn interleaved(n_layers: usize, full_every: usize) -> Vec<LayerKind> {
        (1..=n_layers)
            .map(|i| {
                if i % full_every == 0 {
                    LayerKind::FullAttention
                } else {
                    LayerKind::LinearAttention
                }
            })
            .collect()
    }
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

    /// Multi-token-prediction (MTP) layers after the main stack (Qwen3.5's
    /// `mtp_num_hidden_layers`; 0 when the model has none). Each is a gated
    /// full-attention MoE layer numbered `num_layers() + k` in the schema
    /// and the expert pool. Left out of manifests when 0, so files of
    /// models without MTP are unchanged.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mtp_num_layers: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// Largest count a config file may give for anything (layers, heads,
/// sizes, positions): readers refuse more before allocating by it.
pub const MAX_CONFIG_COUNT: u64 = 1 << 24;

/// Bounds far above any model this runtime runs, so a corrupted or hostile
/// config is an error rather than a huge allocation: `(field, value, most)`.
fn size_bounds(c: &ModelConfig) -> [(&'static str, usize, usize); 17] {
    [
        ("num_hidden_layers", c.layer_types.len(), 1024),
        ("mtp_num_hidden_layers", c.mtp_num_layers, 16),
        ("vocab_size", c.vocab_size, 1 << 22),
        ("hidden_size", c.hidden_size, 1 << 16),
        (
            "max_position_embeddings",
            c.max_position_embeddings,
            1 << 24,
        ),
        ("num_attention_heads", c.num_attention_heads, 1024),
        ("num_key_value_heads", c.num_key_value_heads, 1024),
        ("head_dim", c.head_dim, 4096),
        ("linear_num_key_heads", c.linear_num_key_heads, 1024),
        ("linear_num_value_heads", c.linear_num_value_heads, 1024),
        ("linear_key_head_dim", c.linear_key_head_dim, 4096),
        ("linear_value_head_dim", c.linear_value_head_dim, 4096),
        ("linear_conv_kernel", c.linear_conv_kernel, 64),
        ("num_experts", c.num_experts, 1 << 16),
        ("num_experts_per_tok", c.num_experts_per_tok, 1 << 16),
        ("moe_intermediate_size", c.moe_intermediate_size, 1 << 18),
        (
            "shared_expert_intermediate_size",
            c.shared_expert_intermediate_size,
            1 << 18,
        ),
    ]
}

impl ModelConfig {
    /// Layers of the main stack (MTP layers not counted).
    pub fn num_layers(&self) -> usize {
        self.layer_types.len()
    }

    /// Main layers plus MTP layers: the layers the expert pool holds.
    pub fn total_layers(&self) -> usize {
        self.num_layers() + self.mtp_num_layers
    }

    /// The mixer of layer `layer` in `0..total_layers()`: MTP layers are
    /// full attention. `None` beyond the last layer.
    pub fn layer_kind(&self, layer: usize) -> Option<LayerKind> {
        if layer < self.num_layers() {
            Some(self.layer_types[layer])
        } else if layer < self.total_layers() {
            Some(LayerKind::FullAttention)
        } else {
            None
        }
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
        for (field, value, most) in size_bounds(self) {
            if value > most {
                return bad(format!(
                    "{field} = {value} is beyond any supported model (at most {most})"
                ));
            }
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0 && self.rms_norm_eps < 1.0) {
            return bad(format!(
                "rms_norm_eps = {} must be a small positive number",
                self.rms_norm_eps
            ));
        }
        if self.max_position_embeddings == 0 || self.moe_intermediate_size == 0 {
            return bad(
                "max_position_embeddings and moe_intermediate_size must be positive".into(),
            );
        }
        if self.mtp_num_layers > 0 && !self.architecture.is_hybrid() {
            return bad(format!(
                "MTP layers are known only for qwen3_5_moe and qwen3_next, not {}",
                self.architecture.name()
            ));
        }
        let has_full =
            self.layer_types.contains(&LayerKind::FullAttention) || self.mtp_num_layers > 0;
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
            if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
                return bad(format!("rope_theta = {} must be positive", self.rope_theta));
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
