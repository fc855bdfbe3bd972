//! The decoder stack both architectures share: embed, layers of
//! (norm, mixer, residual, norm, MoE, residual), final norm, head.

use std::time::Instant;

use slipstream_core::{ExpertSource, ModelConfig, Tensor};
use slipstream_kernels as k;

use crate::blocks::{rms_norm_rows, Attention, GatedDeltaNet, Moe, MoeTimes, Route};
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
        observer: Option<RouteObserver<'_>>,
    ) -> Result<Vec<f32>, ModelError> {
        self.forward_timed(state, tokens, experts, want, observer, None)
    }

    /// [`Transformer::forward`] that adds the time of each phase to
    /// `phases` when given (and counts the tokens). Results are identical
    /// to `forward`'s.
    pub fn forward_timed(
        &self,
        state: &mut ModelState,
        tokens: &[u32],
        experts: &mut dyn ExpertSource,
        want: Logits,
        mut observer: Option<RouteObserver<'_>>,
        phases: Option<&mut PhaseTimes>,
    ) -> Result<Vec<f32>, ModelError> {
        let t_total = Instant::now();
        let h = self.config.hidden_size;
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut clock = Clock {
            last: Some(t_total),
            ..Clock::default()
        };
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
        let mut moe_times = MoeTimes::default();
        clock.lap(NORMS);
        for (li, (layer, lstate)) in self.layers.iter().zip(state.layers.iter_mut()).enumerate() {
            let xn = rms_norm_rows(&x, &layer.input_norm, eps);
            clock.lap(NORMS);
            let mixed = match (&layer.mixer, lstate) {
                (Mixer::Attention(a), LayerState::Attn(s)) => {
                    let m = a.forward(&xn, n, s);
                    clock.lap(FULL);
                    m
                }
                (Mixer::Linear(g), LayerState::Linear(s)) => {
                    let m = g.forward(&xn, n, s);
                    clock.lap(LINEAR);
                    m
                }
                _ => return Err(ModelError::State(format!("layer {li} state kind mismatch"))),
            };
            add_into(&mut x, &mixed);
            clock.lap(OTHER);
            let xn = rms_norm_rows(&x, &layer.post_attn_norm, eps);
            clock.lap(NORMS);
            routes.clear();
            let moe = layer.moe.forward_timed(
                &xn,
                n,
                experts,
                Some(&mut routes),
                Some(&mut moe_times),
            )?;
            clock.lap(MOE);
            if let Some(obs) = observer.as_mut() {
                obs(li, &routes);
            }
            add_into(&mut x, &moe);
            clock.lap(OTHER);
        }
        state.tokens.extend_from_slice(tokens);

        let rows: &[f32] = match want {
            Logits::None => &[],
            Logits::Last => &x[(n - 1) * h..],
            Logits::All => &x,
        };
        let m = rows.len() / h;
        let mut logits = Vec::new();
        if m > 0 {
            clock.lap(OTHER);
            let xn = rms_norm_rows(rows, &self.final_norm, eps);
            clock.lap(NORMS);
            logits = vec![0.0f32; m * self.config.vocab_size];
            k::matmul(&self.lm_head.view(), &xn, m, &mut logits);
            clock.lap(HEAD);
        }
        if let Some(p) = phases {
            // The MoE's own split: router -> norms+router, shared + routed
            // FFN -> expert FFN, the rest of its time -> expert-read wait.
            let moe_inner = moe_times.router_ns + moe_times.shared_ns + moe_times.routed_ffn_ns;
            p.tokens += n as u64;
            p.forward_calls += 1;
            p.expert_ffn_ns += moe_times.shared_ns + moe_times.routed_ffn_ns;
            p.shared_expert_ns += moe_times.shared_ns;
            p.norms_router_ns += clock.t[NORMS] + moe_times.router_ns;
            p.expert_wait_ns += clock.t[MOE].saturating_sub(moe_inner);
            p.linear_attn_ns += clock.t[LINEAR];
            p.full_attn_ns += clock.t[FULL];
            p.head_ns += clock.t[HEAD];
            p.total_ns += t_total.elapsed().as_nanos() as u64;
        }
        Ok(logits)
    }
}

const NORMS: usize = 0;
const LINEAR: usize = 1;
const FULL: usize = 2;
const MOE: usize = 3;
const HEAD: usize = 4;
const OTHER: usize = 5;

/// Laps of one forward pass (nanoseconds per phase index).
#[derive(Default)]
struct Clock {
    last: Option<Instant>,
    t: [u64; 6],
}

impl Clock {
    /// Adds the time since the previous lap to phase `i`.
    fn lap(&mut self, i: usize) {
        let now = Instant::now();
        self.t[i] += self.last.map_or(0, |l| (now - l).as_nanos() as u64);
        self.last = Some(now);
    }
}

/// Where forward passes spent their time, accumulated over calls of
/// [`Transformer::forward_timed`] (nanoseconds).
///
/// `expert_ffn_ns` is the routed experts' feed-forward plus the shared
/// expert (`shared_expert_ns` of it); `norms_router_ns` the RMSNorms,
/// embedding lookup and router; `expert_wait_ns` the time the MoE spent in
/// the expert store outside the feed-forward callback (starting reads,
/// waiting for them, verifying). `other` in [`PhaseTimes::report`] is
/// `total - (sum of the phases)`: residual adds, buffers, combine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PhaseTimes {
    pub tokens: u64,
    pub forward_calls: u64,
    pub total_ns: u64,
    pub expert_ffn_ns: u64,
    pub shared_expert_ns: u64,
    pub linear_attn_ns: u64,
    pub full_attn_ns: u64,
    pub head_ns: u64,
    pub norms_router_ns: u64,
    pub expert_wait_ns: u64,
    /// The store's own read-wait counter, when the caller sets it (e.g. from
    /// `StoreCounters::read_wait_ns`); reported beside the model's view.
    pub store_read_wait_ns: Option<u64>,
}

impl PhaseTimes {
    /// Time not attributed to a phase.
    pub fn other_ns(&self) -> u64 {
        self.total_ns.saturating_sub(
            self.expert_ffn_ns
                + self.linear_attn_ns
                + self.full_attn_ns
                + self.head_ns
                + self.norms_router_ns
                + self.expert_wait_ns,
        )
    }

    /// `self - earlier` (for a window such as decode only).
    pub fn since(&self, earlier: &PhaseTimes) -> PhaseTimes {
        PhaseTimes {
            tokens: self.tokens - earlier.tokens,
            forward_calls: self.forward_calls - earlier.forward_calls,
            total_ns: self.total_ns - earlier.total_ns,
            expert_ffn_ns: self.expert_ffn_ns - earlier.expert_ffn_ns,
            shared_expert_ns: self.shared_expert_ns - earlier.shared_expert_ns,
            linear_attn_ns: self.linear_attn_ns - earlier.linear_attn_ns,
            full_attn_ns: self.full_attn_ns - earlier.full_attn_ns,
            head_ns: self.head_ns - earlier.head_ns,
            norms_router_ns: self.norms_router_ns - earlier.norms_router_ns,
            expert_wait_ns: self.expert_wait_ns - earlier.expert_wait_ns,
            store_read_wait_ns: match (self.store_read_wait_ns, earlier.store_read_wait_ns) {
                (Some(a), Some(b)) => Some(a - b),
                (a, _) => a,
            },
        }
    }

    /// A per-token breakdown over `tokens` tokens (e.g. the decoded ones;
    /// 0 uses the tokens counted), like:
    /// `per token 40.7 ms: expert FFN 6.5 (16 %), linear attention 6.1, ...`.
    pub fn report(&self, tokens: u64) -> String {
        let tokens = if tokens == 0 { self.tokens } else { tokens }.max(1);
        let ms = |ns: u64| ns as f64 / 1e6 / tokens as f64;
        let total = ms(self.total_ns);
        let pct = |v: f64| if total > 0.0 { 100.0 * v / total } else { 0.0 };
        let mut s = format!("per token {total:.2} ms over {tokens} tokens:");
        let items = [
            ("expert FFN", self.expert_ffn_ns),
            ("linear attention", self.linear_attn_ns),
            ("full attention", self.full_attn_ns),
            ("output head", self.head_ns),
            ("norms+router", self.norms_router_ns),
            ("expert-read wait", self.expert_wait_ns),
            ("other", self.other_ns()),
        ];
        for (i, (name, ns)) in items.iter().enumerate() {
            let v = ms(*ns);
            s.push_str(&format!(
                "{} {name} {v:.2} ({:.0} %)",
                if i == 0 { "" } else { "," },
                pct(v)
            ));
        }
        s.push_str(&format!(
            " | shared expert {:.2} ms of the FFN",
            ms(self.shared_expert_ns)
        ));
        if let Some(w) = self.store_read_wait_ns {
            s.push_str(&format!(", store read wait {:.2} ms", ms(w)));
        }
        s
    }
}

fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
