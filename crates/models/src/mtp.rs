//! The multi-token-prediction (MTP) head of Qwen3.5 / Qwen3.6 (`mtp.*` in
//! the checkpoints, `nextn` layers in llama.cpp's GGUF): from the main
//! model's output at position `t` and the embedding of token `t+1` it
//! predicts token `t+2`.
//!
//! For each row: `x = fc([embed_norm(embed(x_{t+1})), hidden_norm(h_t)])`,
//! then one gated full-attention MoE decoder layer (its own KV cache, its
//! routed experts in the pool as layer `num_layers + depth`), then its own
//! `final_norm` (which takes the place of the model's final norm) and the
//! model's shared `lm_head`.
//!
//! `h_t` is the main model's hidden state **after** its final norm: vLLM
//! (`qwen3_5_mtp.py`) and llama.cpp (`models/qwen35moe.cpp`, "post-norm
//! hidden state feeds both the LM head and the MTP seed") both feed that;
//! [`Transformer::forward_hidden`] returns it. A second draft step feeds
//! the head's own normed output ([`MtpOutput::hidden`]) as the next `h`.

use slipstream_core::ExpertSource;

use crate::backend::add_into;
use crate::blocks::{rms_norm_rows, Attention, Linear, Moe};
use crate::state::AttnState;
use crate::transformer::{Logits, Transformer};
use crate::ModelError;

/// One MTP layer: the projection into the decoder layer, the layer, and the
/// norm before the shared head.
#[derive(Debug, Clone)]
pub struct MtpHead {
    /// `[hidden]`, multiplicative: applied to the next token's embedding.
    pub embed_norm: Vec<f32>,
    /// `[hidden]`, multiplicative: applied to the main model's hidden state.
    pub hidden_norm: Vec<f32>,
    /// `[hidden, 2 * hidden]`: columns `[0, hidden)` take the normed
    /// embedding, `[hidden, 2 * hidden)` the normed hidden state.
    pub fc: Linear,
    /// The decoder layer: `x += attn(input_norm(x))`,
    /// `x += moe(post_attn_norm(x))`; `moe.layer` is its pool layer.
    pub input_norm: Vec<f32>,
    pub attn: Attention,
    pub post_attn_norm: Vec<f32>,
    pub moe: Moe,
    /// `[hidden]`, multiplicative: replaces the model's final norm.
    pub final_norm: Vec<f32>,
}

/// The decode state of the MTP layers: one KV cache per layer. Row `i` of
/// a sequence's MTP input (main position `i`, token `i + 1`) sits at
/// position `i` of the cache, as in vLLM and llama.cpp.
#[derive(Debug, Clone, PartialEq)]
pub struct MtpState {
    /// One per MTP layer (by depth).
    pub layers: Vec<AttnState>,
}

impl MtpState {
    /// Rows held by the cache of MTP layer `depth` (its next position).
    pub fn position(&self, depth: usize) -> usize {
        self.layers.get(depth).map_or(0, |s| s.len())
    }

    /// Drops every row at position `len` and after from every layer's
    /// cache (after rejected drafts).
    pub fn truncate(&mut self, len: usize) {
        for s in &mut self.layers {
            let keep = len.min(s.len()) * s.kv_dim;
            s.k.truncate(keep);
            s.v.truncate(keep);
        }
    }
}

/// What [`Transformer::mtp_forward`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct MtpOutput {
    /// Logits for token `t + 2` of the rows asked for: `[rows, vocab]`.
    pub logits: Vec<f32>,
    /// The head's output after its final norm, every row: `[n, hidden]`
    /// (the `h` of a further draft step).
    pub hidden: Vec<f32>,
}

impl Transformer {
    /// MTP layers the model carries (0 without a head).
    pub fn mtp_depth(&self) -> usize {
        self.mtp.len()
    }

    /// A fresh MTP state (empty caches), `None` for a model without MTP.
    pub fn new_mtp_state(&self) -> Option<MtpState> {
        if self.mtp.is_empty() {
            return None;
        }
        let layers = self
            .mtp
            .iter()
            .map(|m| AttnState::new(m.attn.num_kv_heads * m.attn.head_dim))
            .collect();
        Some(MtpState { layers })
    }

    /// Runs MTP layer `depth` on `n = tokens.len()` rows at positions
    /// `state.position(depth)..`: row `i` takes `hidden[i]` (`[n, hidden]`,
    /// the main model's final-normed output at some position `t`, or a
    /// previous MTP step's [`MtpOutput::hidden`]) and `tokens[i]` (the
    /// token at `t + 1`), and yields logits for the token at `t + 2`
    /// (`want` picks the rows). On error the state must be discarded.
    pub fn mtp_forward(
        &self,
        depth: usize,
        state: &mut MtpState,
        hidden: &[f32],
        tokens: &[u32],
        experts: &mut dyn ExpertSource,
        want: Logits,
    ) -> Result<MtpOutput, ModelError> {
        let head = self.mtp.get(depth).ok_or_else(|| {
            ModelError::Config(format!(
                "the model has {} MTP layers, no layer {depth}",
                self.mtp.len()
            ))
        })?;
        let cache = state
            .layers
            .get_mut(depth)
            .filter(|c| c.kv_dim == head.attn.num_kv_heads * head.attn.head_dim)
            .ok_or_else(|| ModelError::State("MTP state was made for another model".into()))?;
        let (h, n, eps) = (
            self.config.hidden_size,
            tokens.len(),
            self.config.rms_norm_eps,
        );
        if hidden.len() != n * h {
            return Err(ModelError::State(format!(
                "MTP input has {} hidden values for {n} tokens of width {h}",
                hidden.len()
            )));
        }
        if let Some(&token) = tokens
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return Err(ModelError::Token {
                token,
                vocab: self.config.vocab_size,
            });
        }
        if n == 0 {
            return Ok(MtpOutput {
                logits: Vec::new(),
                hidden: Vec::new(),
            });
        }
        let embed = self.embed.view();
        let mut e = vec![0.0f32; n * h];
        for (row, &tok) in e.chunks_exact_mut(h).zip(tokens) {
            slipstream_kernels::dequantize_row(&embed, tok as usize, row);
        }
        let e = rms_norm_rows(&e, &head.embed_norm, eps);
        let hn = rms_norm_rows(hidden, &head.hidden_norm, eps);
        let mut cat = Vec::with_capacity(n * 2 * h);
        for (er, hr) in e.chunks_exact(h).zip(hn.chunks_exact(h)) {
            cat.extend_from_slice(er);
            cat.extend_from_slice(hr);
        }
        let mut x = head.fc.forward(&cat, n);

        let xn = rms_norm_rows(&x, &head.input_norm, eps);
        add_into(&mut x, &head.attn.forward(&xn, n, cache));
        let xn = rms_norm_rows(&x, &head.post_attn_norm, eps);
        add_into(&mut x, &head.moe.forward(&xn, n, experts, None)?);

        let out = rms_norm_rows(&x, &head.final_norm, eps);
        let rows = match want {
            Logits::None => 0,
            Logits::Last => 1,
            Logits::All => n,
        };
        let mut logits = vec![0.0f32; rows * self.config.vocab_size];
        if rows > 0 {
            slipstream_kernels::matmul_act(
                slipstream_kernels::Isa::detect(),
                self.head_act,
                &self.lm_head.view(),
                &out[(n - rows) * h..],
                rows,
                &mut logits,
            );
        }
        Ok(MtpOutput {
            logits,
            hidden: out,
        })
    }
}
