//! The canonical tensors of a model: every name, shape and role a `.slip`
//! model of a [`ModelConfig`] holds, in on-disk order. The importers (HF,
//! MLX, GGUF), the synthetic-model writer and the loader all read this one
//! list; a new architecture edits it here.

use crate::config::{LayerKind, ModelConfig};

/// How a dense tensor is used, which decides how writers store it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorKind {
    /// A weight matrix (embedding, projections, head).
    Matrix,
    /// A small matrix that picks experts (`moe.router`, `moe.shared_gate`):
    /// kept at higher precision than other matrices.
    Router,
    /// An RMSNorm weight, multiplicative: always f32.
    Norm,
    /// A small per-channel parameter (`gdn.conv`, `gdn.A_log`,
    /// `gdn.dt_bias`): always f32.
    Small,
}

/// One dense tensor of the canonical layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Full canonical name, e.g. `layers.3.attn.q_proj`.
    pub name: String,
    /// The name without its `layers.{l}.` prefix, e.g. `attn.q_proj`.
    pub key: &'static str,
    /// The layer, or `None` for `embed`, `final_norm`, `lm_head`.
    pub layer: Option<usize>,
    /// `[rows, cols]` in elements; 1-D tensors are `[1, n]`.
    pub shape: [usize; 2],
    pub kind: TensorKind,
}

/// One part of a routed expert's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartSpec {
    /// `gate`, `up` or `down`.
    pub name: &'static str,
    /// `[rows, cols]` in elements.
    pub shape: [usize; 2],
}

fn spec(
    layer: Option<usize>,
    key: &'static str,
    shape: [usize; 2],
    kind: TensorKind,
) -> TensorSpec {
    let name = match layer {
        Some(l) => format!("layers.{l}.{key}"),
        None => key.to_string(),
    };
    TensorSpec {
        name,
        key,
        layer,
        shape,
        kind,
    }
}

/// The token embedding `[vocab, hidden]`.
pub fn embed_tensor(cfg: &ModelConfig) -> TensorSpec {
    spec(
        None,
        "embed",
        [cfg.vocab_size, cfg.hidden_size],
        TensorKind::Matrix,
    )
}

/// `final_norm`, then `lm_head` unless the config ties it to the embedding.
pub fn output_tensors(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let mut v = vec![final_norm_tensor(cfg)];
    if !cfg.tie_word_embeddings {
        v.push(lm_head_tensor(cfg));
    }
    v
}

/// The norm before the head `[1, hidden]`.
pub fn final_norm_tensor(cfg: &ModelConfig) -> TensorSpec {
    spec(None, "final_norm", [1, cfg.hidden_size], TensorKind::Norm)
}

/// The output head `[vocab, hidden]` (also written for a tied config whose
/// checkpoint carries one).
pub fn lm_head_tensor(cfg: &ModelConfig) -> TensorSpec {
    spec(
        None,
        "lm_head",
        [cfg.vocab_size, cfg.hidden_size],
        TensorKind::Matrix,
    )
}

/// The dense tensors of layer `layer` in `0..cfg.total_layers()`, in
/// on-disk order: `input_norm`, the mixer (`attn.*` or `gdn.*`),
/// `post_attn_norm`, `moe.router`, and the shared expert when the config
/// has one. An MTP layer (`layer >= cfg.num_layers()`) is a full-attention
/// layer framed by its own tensors: `mtp.embed_norm`, `mtp.hidden_norm`,
/// `mtp.fc` before it and `mtp.final_norm` after it (see [`MTP_KEYS`]).
///
/// # Panics
/// If `layer >= cfg.total_layers()`.
pub fn layer_tensors(cfg: &ModelConfig, layer: usize) -> Vec<TensorSpec> {
    use TensorKind::*;
    let kind = cfg
        .layer_kind(layer)
        .unwrap_or_else(|| panic!("layer {layer} is beyond the model's layers"));
    let is_mtp = layer >= cfg.num_layers();
    let l = Some(layer);
    let h = cfg.hidden_size;
    let mut v = Vec::new();
    if is_mtp {
        v.extend([
            spec(l, "mtp.embed_norm", [1, h], Norm),
            spec(l, "mtp.hidden_norm", [1, h], Norm),
            // Columns [0, h) take the normed embedding, [h, 2h) the normed
            // hidden state.
            spec(l, "mtp.fc", [h, 2 * h], Matrix),
        ]);
    }
    v.push(spec(l, "input_norm", [1, h], Norm));
    match kind {
        LayerKind::FullAttention => {
            let (nh, nkv, hd) = (
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
            );
            // With the output gate, q_proj emits [query, gate] per head.
            let q_rows = nh * hd * if cfg.attn_output_gate { 2 } else { 1 };
            v.extend([
                spec(l, "attn.q_proj", [q_rows, h], Matrix),
                spec(l, "attn.k_proj", [nkv * hd, h], Matrix),
                spec(l, "attn.v_proj", [nkv * hd, h], Matrix),
                spec(l, "attn.o_proj", [h, nh * hd], Matrix),
                spec(l, "attn.q_norm", [1, hd], Norm),
                spec(l, "attn.k_norm", [1, hd], Norm),
            ]);
        }
        LayerKind::LinearAttention => {
            let nv = cfg.linear_num_value_heads;
            let dv = cfg.linear_value_head_dim;
            let conv_dim = cfg.linear_conv_dim();
            v.extend([
                spec(l, "gdn.in_proj_qkv", [conv_dim, h], Matrix),
                spec(l, "gdn.in_proj_z", [nv * dv, h], Matrix),
                spec(l, "gdn.in_proj_b", [nv, h], Matrix),
                spec(l, "gdn.in_proj_a", [nv, h], Matrix),
                // Element [c, j] applies to input t - (K-1) + j.
                spec(l, "gdn.conv", [conv_dim, cfg.linear_conv_kernel], Small),
                spec(l, "gdn.A_log", [1, nv], Small),
                spec(l, "gdn.dt_bias", [1, nv], Small),
                spec(l, "gdn.norm", [1, dv], Norm),
                spec(l, "gdn.out_proj", [h, nv * dv], Matrix),
            ]);
        }
    }
    v.push(spec(l, "post_attn_norm", [1, h], Norm));
    v.push(spec(l, "moe.router", [cfg.num_experts, h], Router));
    let is = cfg.shared_expert_intermediate_size;
    if is > 0 {
        v.extend([
            spec(l, "moe.shared_gate", [1, h], Router),
            spec(l, "moe.shared.gate_proj", [is, h], Matrix),
            spec(l, "moe.shared.up_proj", [is, h], Matrix),
            spec(l, "moe.shared.down_proj", [h, is], Matrix),
        ]);
    }
    if is_mtp {
        // Replaces the model's final norm before the shared head.
        v.push(spec(l, "mtp.final_norm", [1, h], Norm));
    }
    v
}

/// The keys only MTP layers have (all multiplicative norms but `mtp.fc`).
pub const MTP_KEYS: [&str; 4] = [
    "mtp.embed_norm",
    "mtp.hidden_norm",
    "mtp.fc",
    "mtp.final_norm",
];

/// Every dense tensor of a model of `cfg`, in on-disk order: `embed`, each
/// layer's [`layer_tensors`] (main layers, then MTP layers), then
/// [`output_tensors`].
pub fn dense_tensors(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let mut v = vec![embed_tensor(cfg)];
    for l in 0..cfg.total_layers() {
        v.extend(layer_tensors(cfg, l));
    }
    v.extend(output_tensors(cfg));
    v
}

/// The parts of one routed expert's record, in record order:
/// `gate [I, H]`, `up [I, H]`, `down [H, I]`.
pub fn expert_parts(cfg: &ModelConfig) -> [PartSpec; 3] {
    let (h, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
    [
        PartSpec {
            name: "gate",
            shape: [i, h],
        },
        PartSpec {
            name: "up",
            shape: [i, h],
        },
        PartSpec {
            name: "down",
            shape: [h, i],
        },
    ]
}

/// The tensor of `specs` (one layer's, or the whole model's) with `key`.
pub fn find<'a>(specs: &'a [TensorSpec], key: &str) -> Option<&'a TensorSpec> {
    specs.iter().find(|s| s.key == key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Architecture;

    fn cfg(tied: bool) -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Qwen35Moe,
            vocab_size: 100,
            hidden_size: 64,
            rms_norm_eps: 1e-6,
            layer_types: vec![LayerKind::LinearAttention, LayerKind::FullAttention],
            tie_word_embeddings: tied,
            max_position_embeddings: 128,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            rotary_dim: 8,
            rope_theta: 1e4,
            attn_output_gate: true,
            linear_num_key_heads: 2,
            linear_key_head_dim: 8,
            linear_num_value_heads: 4,
            linear_value_head_dim: 8,
            linear_conv_kernel: 4,
            num_experts: 8,
            num_experts_per_tok: 2,
            moe_intermediate_size: 32,
            shared_expert_intermediate_size: 32,
            norm_topk_prob: true,
            mtp_num_layers: 0,
        }
    }

    #[test]
    fn names_are_unique_and_keys_find_their_tensor() {
        let c = cfg(false);
        let all = dense_tensors(&c);
        let names: std::collections::HashSet<_> = all.iter().map(|t| &t.name).collect();
        assert_eq!(names.len(), all.len());
        assert_eq!(all.first().unwrap().name, "embed");
        assert_eq!(all.last().unwrap().name, "lm_head");
        let l1 = layer_tensors(&c, 1);
        let q = find(&l1, "attn.q_proj").unwrap();
        assert_eq!(
            (q.name.as_str(), q.shape),
            ("layers.1.attn.q_proj", [128, 64])
        );
        assert!(find(&l1, "gdn.conv").is_none());
        assert_eq!(
            find(&layer_tensors(&c, 0), "gdn.conv").unwrap().shape,
            [64, 4]
        );
        // Tied: no lm_head is listed.
        assert_eq!(dense_tensors(&cfg(true)).len(), all.len() - 1);
        assert_eq!(
            expert_parts(&c).map(|p| p.shape),
            [[32, 64], [32, 64], [64, 32]]
        );
    }

    #[test]
    fn mtp_layer_follows_the_main_stack_as_full_attention() {
        let mut c = cfg(false);
        let plain = dense_tensors(&c);
        c.mtp_num_layers = 1;
        let all = dense_tensors(&c);
        let mtp = layer_tensors(&c, 2);
        // The main layers keep their names and order; the MTP layer comes
        // between them and the output tensors.
        assert_eq!(all.len(), plain.len() + mtp.len());
        assert_eq!(&all[..all.len() - 2 - mtp.len()], &plain[..plain.len() - 2]);
        assert_eq!(
            find(&mtp, "mtp.fc").map(|t| (t.name.as_str(), t.shape)),
            Some(("layers.2.mtp.fc", [64, 128]))
        );
        assert_eq!(find(&mtp, "attn.q_proj").unwrap().shape, [128, 64]);
        assert!(find(&mtp, "gdn.conv").is_none());
        for key in MTP_KEYS {
            assert!(find(&mtp, key).is_some(), "{key}");
            assert!(find(&layer_tensors(&c, 1), key).is_none(), "{key}");
        }
        let names: std::collections::HashSet<_> = all.iter().map(|t| &t.name).collect();
        assert_eq!(names.len(), all.len());
    }
}
