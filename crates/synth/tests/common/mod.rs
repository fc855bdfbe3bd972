//! The small models the synth tests write.

use slipstream_core::config::LayerKind;
use slipstream_core::{Architecture, ModelConfig};
use slipstream_synth::{Skew, SynthOptions};
use std::path::PathBuf;

/// A small model of `arch`: two layers (linear then full attention for the
/// hybrids), 32 experts of width 64, hidden 256, vocabulary 512.
pub fn tiny(arch: Architecture) -> ModelConfig {
    let hybrid = arch.is_hybrid();
    ModelConfig {
        architecture: arch,
        vocab_size: 512,
        hidden_size: 256,
        rms_norm_eps: 1e-6,
        layer_types: if hybrid {
            vec![LayerKind::LinearAttention, LayerKind::FullAttention]
        } else {
            vec![LayerKind::FullAttention; 2]
        },
        tie_word_embeddings: false,
        max_position_embeddings: 4096,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 64,
        rotary_dim: if hybrid { 32 } else { 64 },
        rope_theta: 1e6,
        attn_output_gate: hybrid,
        linear_num_key_heads: if hybrid { 2 } else { 0 },
        linear_key_head_dim: if hybrid { 64 } else { 0 },
        linear_num_value_heads: if hybrid { 4 } else { 0 },
        linear_value_head_dim: if hybrid { 64 } else { 0 },
        linear_conv_kernel: if hybrid { 4 } else { 0 },
        num_experts: 32,
        num_experts_per_tok: 4,
        moe_intermediate_size: 64,
        shared_expert_intermediate_size: if hybrid { 64 } else { 0 },
        norm_topk_prob: true,
        mtp_num_layers: 0,
    }
}

/// What to write: `cfg` at `output`, named "tiny", written `batch`
/// experts at a time.
pub fn options(
    cfg: &ModelConfig,
    output: PathBuf,
    seed: u64,
    skew: Skew,
    batch: usize,
) -> SynthOptions {
    SynthOptions {
        config: cfg.clone(),
        seed,
        skew,
        output,
        preset_name: "tiny".into(),
        batch,
        overwrite: Default::default(),
    }
}
