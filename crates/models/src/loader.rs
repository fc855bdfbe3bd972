//! Loading the shared blocks by canonical tensor name. Names and shapes
//! come from `slipstream_core::schema`, which the repacker writes by.

use slipstream_core::schema::{self, TensorSpec};
use slipstream_core::{ModelConfig, TensorSource};

use crate::blocks::*;
use crate::transformer::Transformer;
use crate::ModelError;

/// The canonical tensors of one layer, looked up by key.
struct LayerSpecs<'s> {
    src: &'s dyn TensorSource,
    specs: Vec<TensorSpec>,
}

impl<'s> LayerSpecs<'s> {
    fn new(src: &'s dyn TensorSource, cfg: &ModelConfig, layer: usize) -> Self {
        LayerSpecs {
            src,
            specs: schema::layer_tensors(cfg, layer),
        }
    }

    fn get(&self, key: &str) -> Result<&TensorSpec, ModelError> {
        schema::find(&self.specs, key)
            .ok_or_else(|| ModelError::Weight(format!("this layer kind has no tensor {key}")))
    }

    fn linear(&self, key: &str) -> Result<Linear, ModelError> {
        let s = self.get(key)?;
        Linear::load(self.src, &s.name, s.shape)
    }

    fn vector(&self, key: &str) -> Result<Vec<f32>, ModelError> {
        let s = self.get(key)?;
        load_vector(self.src, &s.name, s.shape[1])
    }

    fn matrix_f32(&self, key: &str) -> Result<Vec<f32>, ModelError> {
        let s = self.get(key)?;
        load_matrix_f32(self.src, &s.name, s.shape)
    }
}

pub fn attention(
    src: &dyn TensorSource,
    cfg: &ModelConfig,
    layer: usize,
) -> Result<Attention, ModelError> {
    let t = LayerSpecs::new(src, cfg, layer);
    Ok(Attention {
        q_proj: t.linear("attn.q_proj")?,
        k_proj: t.linear("attn.k_proj")?,
        v_proj: t.linear("attn.v_proj")?,
        o_proj: t.linear("attn.o_proj")?,
        q_norm: t.vector("attn.q_norm")?,
        k_norm: t.vector("attn.k_norm")?,
        num_heads: cfg.num_attention_heads,
        num_kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.head_dim,
        output_gate: cfg.attn_output_gate,
        rope: Rope::new(cfg.rotary_dim, cfg.rope_theta),
        eps: cfg.rms_norm_eps,
    })
}

pub fn gated_delta_net(
    src: &dyn TensorSource,
    cfg: &ModelConfig,
    layer: usize,
) -> Result<GatedDeltaNet, ModelError> {
    let t = LayerSpecs::new(src, cfg, layer);
    Ok(GatedDeltaNet {
        in_proj_qkv: t.linear("gdn.in_proj_qkv")?,
        in_proj_z: t.linear("gdn.in_proj_z")?,
        in_proj_b: t.linear("gdn.in_proj_b")?,
        in_proj_a: t.linear("gdn.in_proj_a")?,
        conv: t.matrix_f32("gdn.conv")?,
        a_log: t.vector("gdn.A_log")?,
        dt_bias: t.vector("gdn.dt_bias")?,
        norm: t.vector("gdn.norm")?,
        out_proj: t.linear("gdn.out_proj")?,
        num_k_heads: cfg.linear_num_key_heads,
        k_dim: cfg.linear_key_head_dim,
        num_v_heads: cfg.linear_num_value_heads,
        v_dim: cfg.linear_value_head_dim,
        kernel: cfg.linear_conv_kernel,
        eps: cfg.rms_norm_eps,
    })
}

pub fn moe(src: &dyn TensorSource, cfg: &ModelConfig, layer: usize) -> Result<Moe, ModelError> {
    let t = LayerSpecs::new(src, cfg, layer);
    let shared = if cfg.shared_expert_intermediate_size > 0 {
        Some((
            Mlp {
                gate_proj: t.linear("moe.shared.gate_proj")?,
                up_proj: t.linear("moe.shared.up_proj")?,
                down_proj: t.linear("moe.shared.down_proj")?,
            },
            t.linear("moe.shared_gate")?,
        ))
    } else {
        None
    };
    Ok(Moe {
        layer,
        router: t.linear("moe.router")?,
        num_experts: cfg.num_experts,
        top_k: cfg.num_experts_per_tok,
        norm_topk_prob: cfg.norm_topk_prob,
        shared,
        hidden: cfg.hidden_size,
        act: slipstream_kernels::Activations::default(),
    })
}

/// Embedding, final norm and head; the head falls back to the embedding
/// only when the config ties them.
pub fn embed_and_head(
    src: &dyn TensorSource,
    cfg: &ModelConfig,
) -> Result<(slipstream_core::Tensor, Vec<f32>, slipstream_core::Tensor), ModelError> {
    let e = schema::embed_tensor(cfg);
    let embed = load_tensor(src, &e.name, e.shape)?;
    let n = schema::final_norm_tensor(cfg);
    let final_norm = load_vector(src, &n.name, n.shape[1])?;
    let head = schema::lm_head_tensor(cfg);
    // A tied config may still carry its own head (repack keeps one it finds).
    let lm_head = if cfg.tie_word_embeddings && !src.has_tensor(&head.name) {
        embed.clone()
    } else {
        load_tensor(src, &head.name, head.shape)?
    };
    Ok((embed, final_norm, lm_head))
}

/// Assembles a [`Transformer`] from per-layer mixers.
pub fn assemble(
    src: &dyn TensorSource,
    cfg: &ModelConfig,
    mixer: impl Fn(usize) -> Result<crate::transformer::Mixer, ModelError>,
) -> Result<Transformer, ModelError> {
    let (embed, final_norm, lm_head) = embed_and_head(src, cfg)?;
    let layers = (0..cfg.num_layers())
        .map(|l| {
            let t = LayerSpecs::new(src, cfg, l);
            Ok(crate::transformer::Layer {
                input_norm: t.vector("input_norm")?,
                mixer: mixer(l)?,
                post_attn_norm: t.vector("post_attn_norm")?,
                moe: moe(src, cfg, l)?,
            })
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let mtp = (cfg.num_layers()..cfg.total_layers())
        .map(|l| mtp_head(src, cfg, l))
        .collect::<Result<Vec<_>, ModelError>>()?;
    Ok(Transformer {
        config: cfg.clone(),
        embed,
        layers,
        final_norm,
        lm_head,
        head_act: slipstream_kernels::Activations::default(),
        mtp,
    })
}

/// The MTP layer at pool layer `layer` (`cfg.num_layers()..cfg.total_layers()`).
pub fn mtp_head(
    src: &dyn TensorSource,
    cfg: &ModelConfig,
    layer: usize,
) -> Result<crate::mtp::MtpHead, ModelError> {
    let t = LayerSpecs::new(src, cfg, layer);
    Ok(crate::mtp::MtpHead {
        embed_norm: t.vector("mtp.embed_norm")?,
        hidden_norm: t.vector("mtp.hidden_norm")?,
        fc: t.linear("mtp.fc")?,
        input_norm: t.vector("input_norm")?,
        attn: attention(src, cfg, layer)?,
        post_attn_norm: t.vector("post_attn_norm")?,
        moe: moe(src, cfg, layer)?,
        final_norm: t.vector("mtp.final_norm")?,
    })
}
