//! Qwen3 MoE (`qwen3_moe`): full attention in every layer (q/k norm, full
//! RoPE, no output gate), routed experts without a shared expert.

use slipstream_core::config::LayerKind;
use slipstream_core::{Architecture, ModelConfig, TensorSource};

use crate::loader;
use crate::transformer::{Mixer, Transformer};
use crate::ModelError;

pub fn load(cfg: &ModelConfig, src: &dyn TensorSource) -> Result<Transformer, ModelError> {
    if cfg.architecture != Architecture::Qwen3Moe {
        return Err(ModelError::Config("not a qwen3_moe config".into()));
    }
    if cfg
        .layer_types
        .iter()
        .any(|k| *k != LayerKind::FullAttention)
        || cfg.attn_output_gate
        || cfg.shared_expert_intermediate_size != 0
    {
        return Err(ModelError::Config(
            "qwen3_moe has only full attention, no output gate and no shared expert".into(),
        ));
    }
    loader::assemble(src, cfg, |l| {
        Ok(Mixer::Attention(loader::attention(src, cfg, l)?))
    })
}
