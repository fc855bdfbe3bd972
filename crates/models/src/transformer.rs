//! The decoder stack both architectures share: embed, layers of
//! (norm, mixer, residual, norm, MoE, residual), final norm, head.

use slipstream_core::{ExpertSource, ModelConfig, Tensor};
use slipstream_kernels as k;

use crate::blocks::{rms_norm_rows, Attention, GatedDeltaNet, Moe, Route};
use crate::state::{AttnState, LayerState, LinearState, ModelState};
use crate::ModelError;

/// The token mixer of one layer.
#[derive(Debug, Clone)]
pub enum Mixer {
    Attention(Attention),
    Linear(GatedDeltaNet),
}

#[derive(Debug, Clone)]
pub struct Layer {
    /// `[hidden]`, multiplicative.
    pub input_norm: Vec<f32>,
    pub mixer: Mixer,
    pub post_attn_norm: Vec<f32>,
    pub moe: Moe,
}

/// Which logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// None (prefill chunks before the last).
    None,
    /// The last token's row only: `[vocab]`.
    Last,
    /// Every token's row: `[tokens, vocab]`.
    All,
}

/// Called after each layer's routing with `(layer, routes of the chunk)`.
pub type RouteObserver<'a> = &'a mut dyn FnMut(usize, &[Route]);

#[derive(Debug, Clone)]
pub struct Transformer {
    pub config: ModelConfig,
    /// `[vocab, hidden]`
    pub embed: Tensor,
    pub layers: Vec<Layer>,
    /// `[hidden]`, multiplicative.
    pub final_norm: Vec<f32>,
    /// `[vocab, hidden]`; the embedding when tied.
    pub lm_head: Tensor,
}

impl Transformer {
    /// A fresh state for one sequence.
    pub fn new_state(&self) -> ModelState {
        let c = &self.config;
        let layers = self
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Attention(a) => {
                    LayerState::Attn(AttnState::new(a.num_kv_heads * a.head_dim))
                }
                Mixer::Linear(g) => LayerState::Linear(LinearState {
                    conv: vec![0.0; (g.kernel - 1) * g.conv_dim()],
                    recurrent: vec![0.0; g.num_v_heads * g.k_dim * g.v_dim],
                }),
            })
            .collect();
        let _ = c;
        ModelState {
            layers,
            tokens: Vec::new(),
            last_logits: Vec::new(),
        }
    }

    /// Runs `tokens` through the model after the state's tokens and returns
    /// the logits asked for. On error the state is left partially advanced
    /// and must be discarded.
    pub fn forward(
        &self,
        state: &mut ModelState,
        tokens: &[u32],
        experts: &mut dyn ExpertSource,
        want: Logits,
        mut observer: Option<RouteObserver<'_>>,
    ) -> Result<Vec<f32>, ModelError> {
        let h = self.config.hidden_size;
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        if state.layers.len() != self.layers.len() {
            return Err(ModelError::State("state was made for another model".into()));
        }
        let embed = self.embed.view();
        let mut x = vec![0.0f32; n * h];
        for (t, &tok) in tokens.iter().enumerate() {
            if tok as usize >= self.config.vocab_size {
                return Err(ModelError::Token {
                    token: tok,
                    vocab: self.config.vocab_size,
                });
            }
            k::dequantize_row(&embed, tok as usize, &mut x[t * h..][..h]);
        }
        let eps = self.config.rms_norm_eps;
        let mut routes = Vec::new();
        for (li, (layer, lstate)) in self.layers.iter().zip(state.layers.iter_mut()).enumerate() {
            let xn = rms_norm_rows(&x, &layer.input_norm, eps);
            let mixed = match (&layer.mixer, lstate) {
                (Mixer::Attention(a), LayerState::Attn(s)) => a.forward(&xn, n, s),
                (Mixer::Linear(g), LayerState::Linear(s)) => g.forward(&xn, n, s),
                _ => return Err(ModelError::State(format!("layer {li} state kind mismatch"))),
            };
            add_into(&mut x, &mixed);
            let xn = rms_norm_rows(&x, &layer.post_attn_norm, eps);
            routes.clear();
            let moe = layer.moe.forward(&xn, n, experts, Some(&mut routes))?;
            if let Some(obs) = observer.as_mut() {
                obs(li, &routes);
            }
            add_into(&mut x, &moe);
        }
        state.tokens.extend_from_slice(tokens);

        let rows: &[f32] = match want {
            Logits::None => return Ok(Vec::new()),
            Logits::Last => &x[(n - 1) * h..],
            Logits::All => &x,
        };
        let m = rows.len() / h;
        let xn = rms_norm_rows(rows, &self.final_norm, eps);
        let mut logits = vec![0.0f32; m * self.config.vocab_size];
        k::matmul(&self.lm_head.view(), &xn, m, &mut logits);
        Ok(logits)
    }
}

fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
