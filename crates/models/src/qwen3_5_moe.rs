//! Qwen3.5 / Qwen3.6 MoE (`qwen3_5_moe`): layers alternate Gated DeltaNet
//! linear attention with gated full attention (partial RoPE, sigmoid output
//! gate); every layer ends in 256-expert top-8 routing plus a sigmoid-gated
//! shared expert. Zero-centred norms arrive pre-shifted (1+w) from repack.

use slipstream_core::config::LayerKind;
use slipstream_core::{Architecture, ModelConfig, TensorSource};

use crate::loader;
use crate::transformer::{Mixer, Transformer};
use crate::ModelError;

pub fn load(cfg: &ModelConfig, src: &dyn TensorSource) -> Result<Transformer, ModelError> {
    if cfg.architecture != Architecture::Qwen35Moe {
        return Err(ModelError::Config("not a qwen3_5_moe config".into()));
    }
    if !cfg.attn_output_gate || cfg.shared_expert_intermediate_size == 0 {
        return Err(ModelError::Config(
            "qwen3_5_moe needs gated attention and a shared expert".into(),
        ));
    }
    loader::assemble(src, cfg, |l| match cfg.layer_types[l] {
        LayerKind::FullAttention => Ok(Mixer::Attention(loader::attention(src, cfg, l)?)),
        LayerKind::LinearAttention => Ok(Mixer::Linear(loader::gated_delta_net(src, cfg, l)?)),
    })
}
