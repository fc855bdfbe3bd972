//! Qwen3.5 / Qwen3.6 MoE (`qwen3_5_moe`): layers alternate Gated DeltaNet
//! linear attention with gated full attention (partial RoPE, sigmoid output
//! gate); every layer ends in 256-expert top-8 routing plus a sigmoid-gated
//! shared expert. Zero-centred norms arrive pre-shifted (1+w) from repack.
//! Qwen3-Next (`qwen3_next`) runs here too: the same math once the importers
//! have split its fused `in_proj_qkvz` / `in_proj_ba` into the canonical
//! `gdn.*` tensors, with the router's renormalisation taken from its config.

use slipstream_core::config::LayerKind;
use slipstream_core::{ModelConfig, TensorSource};

use crate::loader;
use crate::transformer::{Mixer, Transformer};
use crate::ModelError;

pub fn load(cfg: &ModelConfig, src: &dyn TensorSource) -> Result<Transformer, ModelError> {
    if !cfg.architecture.is_hybrid() {
        return Err(ModelError::Config(format!(
            "not a qwen3_5_moe or qwen3_next config: {}",
            cfg.architecture.name()
        )));
    }
    if !cfg.attn_output_gate || cfg.shared_expert_intermediate_size == 0 {
        return Err(ModelError::Config(format!(
            "{} needs gated attention and a shared expert",
            cfg.architecture.name()
        )));
    }
    loader::assemble(src, cfg, |l| match cfg.layer_types[l] {
        LayerKind::FullAttention => Ok(Mixer::Attention(loader::attention(src, cfg, l)?)),
        LayerKind::LinearAttention => Ok(Mixer::Linear(loader::gated_delta_net(src, cfg, l)?)),
    })
}
