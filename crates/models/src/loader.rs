//! Loading the shared blocks by canonical tensor name. Canonical names are
//! what the repacker writes; see ARCHITECTURE.md for the table.

use slipstream_core::{ModelConfig, TensorSource};

use crate::blocks::*;
use crate::transformer::Transformer;
use crate::ModelError;

pub fn attention(
    src: &dyn TensorSource,
    cfg: &ModelConfig,
    layer: usize,
) -> Result<Attention, ModelError> {
    let p = format!("layers.{layer}.attn");
    let (h, nh, nkv, hd) = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let q_rows = nh * hd * if cfg.attn_output_gate { 2 } else { 1 };
    Ok(Attention {
        q_proj: Linear::load(src, &format!("{p}.q_proj"), [q_rows, h])?,
        k_proj: Linear::load(src, &format!("{p}.k_proj"), [nkv * hd, h])?,
        v_proj: Linear::load(src, &format!("{p}.v_proj"), [nkv * hd, h])?,
        o_proj: Linear::load(src, &format!("{p}.o_proj"), [h, nh * hd])?,
        q_norm: load_vector(src, &format!("{p}.q_norm"), hd)?,
        k_norm: load_vector(src, &format!("{p}.k_norm"), hd)?,
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
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
    let p = format!("layers.{layer}.gdn");
    let h = cfg.hidden_size;
    let (nk, dk, nv, dv, kk) = (
        cfg.linear_num_key_heads,
        cfg.linear_key_head_dim,
        cfg.linear_num_value_heads,
        cfg.linear_value_head_dim,
        cfg.linear_conv_kernel,
    );
    let conv_dim = cfg.linear_conv_dim();
    Ok(GatedDeltaNet {
        in_proj_qkv: Linear::load(src, &format!("{p}.in_proj_qkv"), [conv_dim, h])?,
        in_proj_z: Linear::load(src, &format!("{p}.in_proj_z"), [nv * dv, h])?,
        in_proj_b: Linear::load(src, &format!("{p}.in_proj_b"), [nv, h])?,
        in_proj_a: Linear::load(src, &format!("{p}.in_proj_a"), [nv, h])?,
        conv: load_matrix_f32(src, &format!("{p}.conv"), [conv_dim, kk])?,
        a_log: load_vector(src, &format!("{p}.A_log"), nv)?,
        dt_bias: load_vector(src, &format!("{p}.dt_bias"), nv)?,
        norm: load_vector(src, &format!("{p}.norm"), dv)?,
        out_proj: Linear::load(src, &format!("{p}.out_proj"), [h, nv * dv])?,
        num_k_heads: nk,
        k_dim: dk,
        num_v_heads: nv,
        v_dim: dv,
        kernel: kk,
        eps: cfg.rms_norm_eps,
    })
}

pub fn moe(src: &dyn TensorSource, cfg: &ModelConfig, layer: usize) -> Result<Moe, ModelError> {
    let p = format!("layers.{layer}.moe");
    let h = cfg.hidden_size;
    let shared = if cfg.shared_expert_intermediate_size > 0 {
        let is = cfg.shared_expert_intermediate_size;
        Some((
            Mlp {
                gate_proj: Linear::load(src, &format!("{p}.shared.gate_proj"), [is, h])?,
                up_proj: Linear::load(src, &format!("{p}.shared.up_proj"), [is, h])?,
                down_proj: Linear::load(src, &format!("{p}.shared.down_proj"), [h, is])?,
            },
            Linear::load(src, &format!("{p}.shared_gate"), [1, h])?,
        ))
    } else {
        None
    };
    Ok(Moe {
        layer,
        router: Linear::load(src, &format!("{p}.router"), [cfg.num_experts, h])?,
        num_experts: cfg.num_experts,
        top_k: cfg.num_experts_per_tok,
        norm_topk_prob: cfg.norm_topk_prob,
        shared,
        hidden: h,
        act: slipstream_kernels::Activations::default(),
    })
}

/// Embedding, final norm and head; the head falls back to the embedding
/// only when the config ties them.
pub fn embed_and_head(
    src: &dyn TensorSource,
    cfg: &ModelConfig,
) -> Result<(slipstream_core::Tensor, Vec<f32>, slipstream_core::Tensor), ModelError> {
    let shape = [cfg.vocab_size, cfg.hidden_size];
    let embed = load_tensor(src, "embed", shape)?;
    let final_norm = load_vector(src, "final_norm", cfg.hidden_size)?;
    let lm_head = if cfg.tie_word_embeddings && !src.has_tensor("lm_head") {
        embed.clone()
    } else {
        load_tensor(src, "lm_head", shape)?
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
    let h = cfg.hidden_size;
    let layers = (0..cfg.num_layers())
        .map(|l| {
            Ok(crate::transformer::Layer {
                input_norm: load_vector(src, &format!("layers.{l}.input_norm"), h)?,
                mixer: mixer(l)?,
                post_attn_norm: load_vector(src, &format!("layers.{l}.post_attn_norm"), h)?,
                moe: moe(src, cfg, l)?,
            })
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    Ok(Transformer {
        config: cfg.clone(),
        embed,
        layers,
        final_norm,
        lm_head,
        head_act: slipstream_kernels::Activations::default(),
    })
}
