//! The decoder stack both architectures share: embed, layers of
//! (norm, mixer, residual, norm, MoE, residual), final norm, head.

use std::time::Instant;

use slipstream_core::{ExpertSource, ModelConfig, Tensor};

use crate::backend::{Backend, CpuBackend, NormKind};
use crate::blocks::{Attention, GatedDeltaNet, Moe, MoeTimes, Route};
use crate::mtp::MtpHead;
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
    /// How inputs enter the head's 4-bit product.
    pub head_act: slipstream_kernels::Activations,
    /// The multi-token-prediction layers, by depth; empty without a head
    /// (see [`crate::mtp`]).
    pub mtp: Vec<MtpHead>,
}

/// Called once per pass with the pass's final-normed hidden rows
/// (`[n, hidden]`) and `n`.
pub(crate) type HiddenSink<'a, A> = &'a mut dyn FnMut(&A, usize) -> Result<(), ModelError>;

/// A CPU [`HiddenSink`] body: appends each pass's rows to `hidden`.
pub(crate) fn append_rows(
    hidden: &mut Vec<f32>,
) -> impl FnMut(&Vec<f32>, usize) -> Result<(), ModelError> + '_ {
    |rows, _n| {
        hidden.extend_from_slice(rows);
        Ok(())
    }
}

/// What the passes of one [`Transformer::run`] report to besides the
/// logits they return.
pub(crate) struct Taps<'o, 'p, 'h, A> {
    pub(crate) observer: Option<RouteObserver<'o>>,
    pub(crate) phases: Option<&'p mut PhaseTimes>,
    pub(crate) hidden: Option<HiddenSink<'h, A>>,
}

fn set_attention_activations(a: &mut Attention, act: slipstream_kernels::Activations) {
    for l in [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj] {
        l.act = act;
    }
}

fn set_moe_activations(moe: &mut Moe, act: slipstream_kernels::Activations) {
    moe.act = act;
    moe.router.act = act;
    if let Some((mlp, gate)) = &mut moe.shared {
        for l in [
            &mut mlp.gate_proj,
            &mut mlp.up_proj,
            &mut mlp.down_proj,
            gate,
        ] {
            l.act = act;
        }
    }
}

impl Transformer {
    /// Sets how inputs enter every 4-bit product of the CPU backend
    /// (projections, experts, head). [`slipstream_kernels::Activations::Exact`]
    /// (the default) keeps parity with the reference; `Int16` is faster at a
    /// small input-rounding error. Results stay independent of cache sizes,
    /// batching and threads either way.
    pub fn set_activations(&mut self, act: slipstream_kernels::Activations) {
        self.head_act = act;
        for layer in &mut self.layers {
            match &mut layer.mixer {
                Mixer::Attention(a) => set_attention_activations(a, act),
                Mixer::Linear(g) => {
                    for l in [
                        &mut g.in_proj_qkv,
                        &mut g.in_proj_z,
                        &mut g.in_proj_b,
                        &mut g.in_proj_a,
                        &mut g.out_proj,
                    ] {
                        l.act = act;
                    }
                }
            }
            set_moe_activations(&mut layer.moe, act);
        }
        for head in &mut self.mtp {
            head.fc.act = act;
            set_attention_activations(&mut head.attn, act);
            set_moe_activations(&mut head.moe, act);
        }
    }

    /// A fresh state for one sequence.
    pub fn new_state(&self) -> ModelState {
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

    /// [`Transformer::forward`] that also returns the hidden state after the
    /// final norm of every token (`[tokens, hidden]`): the input of the MTP
    /// head ([`Transformer::mtp_forward`]). The logits are bit-identical
    /// to `forward`'s.
    pub fn forward_hidden(
        &self,
        state: &mut ModelState,
        tokens: &[u32],
        experts: &mut dyn ExpertSource,
        want: Logits,
    ) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
        let mut hidden = Vec::with_capacity(tokens.len() * self.config.hidden_size);
        let logits = self.forward_timed_hidden(state, tokens, experts, want, None, &mut hidden)?;
        Ok((logits, hidden))
    }

    /// [`Transformer::forward_timed`] that also appends every token's
    /// hidden state after the final norm (`[tokens, hidden]`) to `hidden`
    /// (the MTP head's input). The logits are bit-identical to
    /// `forward_timed`'s.
    pub fn forward_timed_hidden(
        &self,
        state: &mut ModelState,
        tokens: &[u32],
        experts: &mut dyn ExpertSource,
        want: Logits,
        phases: Option<&mut PhaseTimes>,
        hidden: &mut Vec<f32>,
    ) -> Result<Vec<f32>, ModelError> {
        let mut sink = append_rows(hidden);
        let taps = Taps {
            observer: None,
            phases,
            hidden: Some(&mut sink),
        };
        self.run_with_taps(
            &mut CpuBackend::default(),
            state,
            tokens,
            experts,
            want,
            taps,
        )
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
        observer: Option<RouteObserver<'_>>,
        phases: Option<&mut PhaseTimes>,
    ) -> Result<Vec<f32>, ModelError> {
        self.run(
            &mut CpuBackend::default(),
            state,
            tokens,
            experts,
            want,
            observer,
            phases,
        )
    }

    /// The decoder stack on `backend`: the one place the layer sequence is
    /// written. Inputs longer than the backend's
    /// [`Backend::max_pass_tokens`] run as several passes (the numbers do
    /// not depend on the split). See [`Transformer::forward_timed`].
    #[allow(clippy::too_many_arguments)]
    pub fn run<B: Backend>(
        &self,
        backend: &mut B,
        state: &mut ModelState,
        tokens: &[u32],
        experts: &mut dyn ExpertSource,
        want: Logits,
        observer: Option<RouteObserver<'_>>,
        phases: Option<&mut PhaseTimes>,
    ) -> Result<Vec<f32>, ModelError> {
        let taps = Taps {
            observer,
            phases,
            hidden: None,
        };
        self.run_with_taps(backend, state, tokens, experts, want, taps)
    }

    /// [`Transformer::run`] that puts every row of each pass through the
    /// final norm (row by row: the logits are the same bits), for a backend
    /// that keeps those rows itself (the CUDA backend's
    /// `collect_hidden`, the MTP head's input).
    pub fn run_norming_every_row<B: Backend>(
        &self,
        backend: &mut B,
        state: &mut ModelState,
        tokens: &[u32],
        experts: &mut dyn ExpertSource,
        want: Logits,
        phases: Option<&mut PhaseTimes>,
    ) -> Result<Vec<f32>, ModelError> {
        let mut ignore = |_: &B::Act, _: usize| Ok(());
        let taps = Taps {
            observer: None,
            phases,
            hidden: Some(&mut ignore),
        };
        self.run_with_taps(backend, state, tokens, experts, want, taps)
    }

    /// [`Transformer::run`] with every tap: it also hands each pass's
    /// final-normed hidden rows to `taps.hidden` when given.
    pub(crate) fn run_with_taps<B: Backend>(
        &self,
        backend: &mut B,
        state: &mut ModelState,
        tokens: &[u32],
        experts: &mut dyn ExpertSource,
        want: Logits,
        mut taps: Taps<'_, '_, '_, B::Act>,
    ) -> Result<Vec<f32>, ModelError> {
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        if state.layers.len() != self.layers.len() {
            return Err(ModelError::State("state was made for another model".into()));
        }
        if let Some(&tok) = tokens
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return Err(ModelError::Token {
                token: tok,
                vocab: self.config.vocab_size,
            });
        }
        let step = backend.max_pass_tokens().max(1);
        let mut logits = Vec::new();
        let chunks: Vec<&[u32]> = tokens.chunks(step).collect();
        let last = chunks.len() - 1;
        for (i, chunk) in chunks.into_iter().enumerate() {
            let w = match want {
                Logits::All => Logits::All,
                Logits::Last if i == last => Logits::Last,
                _ => Logits::None,
            };
            let part = self.pass(backend, state, chunk, experts, w, &mut taps)?;
            logits.extend_from_slice(&part);
        }
        Ok(logits)
    }

    /// One pass of `tokens` (at most the backend's pass length).
    fn pass<B: Backend>(
        &self,
        backend: &mut B,
        state: &mut ModelState,
        tokens: &[u32],
        experts: &mut dyn ExpertSource,
        want: Logits,
        taps: &mut Taps<'_, '_, '_, B::Act>,
    ) -> Result<Vec<f32>, ModelError> {
        let t_total = Instant::now();
        let n = tokens.len();
        let mut clock = Clock {
            last: Some(t_total),
            ..Clock::default()
        };
        backend.begin_pass(state.tokens.len(), n)?;
        let mut x = backend.embed(self, tokens)?;
        let mut routes = Vec::new();
        let mut moe_times = MoeTimes::default();
        clock.lap(Phase::Norms);
        for (li, lstate) in state.layers.iter_mut().enumerate() {
            let xn = backend.norm(self, &x, NormKind::Input(li), n)?;
            clock.lap(Phase::Norms);
            backend.mixer(self, li, &mut x, &xn, n, lstate)?;
            clock.lap(match self.layers[li].mixer {
                Mixer::Attention(_) => Phase::Full,
                Mixer::Linear(_) => Phase::Linear,
            });
            let xn = backend.norm(self, &x, NormKind::PostAttn(li), n)?;
            clock.lap(Phase::Norms);
            routes.clear();
            backend.moe(
                self,
                li,
                &mut x,
                &xn,
                n,
                experts,
                &mut routes,
                &mut moe_times,
            )?;
            clock.lap(Phase::Moe);
            if let Some(obs) = taps.observer.as_mut() {
                obs(li, &routes);
            }
            clock.lap(Phase::Other);
        }
        state.tokens.extend_from_slice(tokens);

        let m = match want {
            Logits::None => 0,
            Logits::Last => 1,
            Logits::All => n,
        };
        let mut logits = Vec::new();
        if let Some(sink) = taps.hidden.as_mut() {
            // Every row normed (row by row, so the tail's bits are those
            // of norming the tail alone), then the head on the last m.
            let xn = backend.norm(self, &x, NormKind::Final, n)?;
            sink(&xn, n)?;
            clock.lap(Phase::Norms);
            if m > 0 {
                let rows = backend.tail(self, &xn, n, m)?;
                logits = backend.head(self, &rows, m, m)?;
                clock.lap(Phase::Head);
            }
        } else if m > 0 {
            let rows = backend.tail(self, &x, n, m)?;
            clock.lap(Phase::Other);
            let xn = backend.norm(self, &rows, NormKind::Final, m)?;
            clock.lap(Phase::Norms);
            logits = backend.head(self, &xn, m, m)?;
            clock.lap(Phase::Head);
        }
        if let Some(p) = taps.phases.as_deref_mut() {
            // The MoE's own split: router -> norms+router, shared + routed
            // FFN -> expert FFN, the rest of its time -> expert-read wait.
            let moe_inner = moe_times.router_ns + moe_times.shared_ns + moe_times.routed_ffn_ns;
            p.tokens += n as u64;
            p.forward_calls += 1;
            p.expert_ffn_ns += moe_times.shared_ns + moe_times.routed_ffn_ns;
            p.shared_expert_ns += moe_times.shared_ns;
            p.norms_router_ns += clock.ns(Phase::Norms) + moe_times.router_ns;
            p.expert_wait_ns += clock.ns(Phase::Moe).saturating_sub(moe_inner);
            p.linear_attn_ns += clock.ns(Phase::Linear);
            p.full_attn_ns += clock.ns(Phase::Full);
            p.head_ns += clock.ns(Phase::Head);
            p.total_ns += t_total.elapsed().as_nanos() as u64;
        }
        Ok(logits)
    }
}

/// What a lap of [`Clock`] is counted as.
#[derive(Debug, Clone, Copy)]
enum Phase {
    Norms,
    Linear,
    Full,
    Moe,
    Head,
    Other,
}

/// Laps of one forward pass (nanoseconds per [`Phase`]).
#[derive(Default)]
struct Clock {
    last: Option<Instant>,
    t: [u64; 6],
}

impl Clock {
    /// Adds the time since the previous lap to `phase`.
    fn lap(&mut self, phase: Phase) {
        let now = Instant::now();
        self.t[phase as usize] += self.last.map_or(0, |l| (now - l).as_nanos() as u64);
        self.last = Some(now);
    }

    /// The nanoseconds counted as `phase`.
    fn ns(&self, phase: Phase) -> u64 {
        self.t[phase as usize]
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
