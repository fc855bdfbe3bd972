//! Where the layer sequence runs. [`crate::Transformer::run`] walks the
//! decoder stack once for every backend (embed, per layer: norm, mixer +
//! residual, norm, MoE + residual; final norm, head); a [`Backend`] does
//! each step on its own memory. [`CpuBackend`] is the CPU code (host
//! vectors, the blocks in `blocks.rs`); the CUDA backend (crate
//! `slipstream-cuda`) keeps activations and state in device memory.

use slipstream_core::ExpertSource;

use crate::blocks::{rms_norm_rows, MoeTimes, Route};
use crate::speculative::StateTrail;
use crate::state::{LayerState, LinearState};
use crate::transformer::{Mixer, Transformer};
use crate::ModelError;

/// Which RMSNorm weight a [`Backend::norm`] applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// Layer `l`'s input norm.
    Input(usize),
    /// Layer `l`'s post-attention norm.
    PostAttn(usize),
    /// The final norm before the head.
    Final,
}

/// The steps of a forward pass on one kind of memory. Activations are
/// `[n, hidden]` rows of type `Act`.
pub trait Backend {
    type Act;

    /// The most tokens one pass may hold (longer inputs are split into
    /// passes of this many tokens by [`Transformer::run`]; results do not
    /// depend on it).
    fn max_pass_tokens(&self) -> usize {
        usize::MAX
    }

    /// Called once per pass before the layers with the state's position
    /// (tokens already consumed) and the pass's length.
    fn begin_pass(&mut self, _position: usize, _n: usize) -> Result<(), ModelError> {
        Ok(())
    }

    /// Embedding rows of `tokens` (ids already checked against the vocabulary).
    fn embed(&mut self, m: &Transformer, tokens: &[u32]) -> Result<Self::Act, ModelError>;

    /// RMSNorm of each row of `x` (`n` rows).
    fn norm(
        &mut self,
        m: &Transformer,
        x: &Self::Act,
        which: NormKind,
        n: usize,
    ) -> Result<Self::Act, ModelError>;

    /// `x += mixer_l(xn)` (attention or Gated DeltaNet of layer `l`).
    fn mixer(
        &mut self,
        m: &Transformer,
        l: usize,
        x: &mut Self::Act,
        xn: &Self::Act,
        n: usize,
        state: &mut LayerState,
    ) -> Result<(), ModelError>;

    /// `x += moe_l(xn)`; appends the chunk's routes to `routes` (a backend
    /// that routes on the device without the host, the CUDA backend with
    /// every expert resident, leaves them out).
    #[allow(clippy::too_many_arguments)]
    fn moe(
        &mut self,
        m: &Transformer,
        l: usize,
        x: &mut Self::Act,
        xn: &Self::Act,
        n: usize,
        experts: &mut dyn ExpertSource,
        routes: &mut Vec<Route>,
        times: &mut MoeTimes,
    ) -> Result<(), ModelError>;

    /// Logits `[rows, vocab]` of the last `rows` of the `n` rows of `xn`
    /// (already final-normed), copied to the host.
    fn head(
        &mut self,
        m: &Transformer,
        xn: &Self::Act,
        n: usize,
        rows: usize,
    ) -> Result<Vec<f32>, ModelError>;

    /// The last `rows` rows of `x` (`n` rows) as a new activation.
    fn tail(
        &mut self,
        m: &Transformer,
        x: &Self::Act,
        n: usize,
        rows: usize,
    ) -> Result<Self::Act, ModelError>;
}

/// The CPU backend: host `Vec<f32>` activations and the blocks' own code.
/// Its numbers are the reference every other backend is tested against.
/// `CpuBackend::default()` runs plain passes; a verify pass
/// ([`Transformer::forward_verify`]) gives it a trail to record every Gated
/// DeltaNet layer's states into (recording changes no number).
#[derive(Default)]
pub struct CpuBackend<'t> {
    trail: Option<&'t mut StateTrail>,
}

impl<'t> CpuBackend<'t> {
    /// A backend that records into `trail`, which must hold a slot per layer.
    pub(crate) fn recording(trail: &'t mut StateTrail) -> Self {
        CpuBackend { trail: Some(trail) }
    }

    /// Where layer `l`'s Gated DeltaNet states go: nowhere on a plain pass.
    fn trail_slot(&mut self, l: usize) -> Result<Option<&mut Vec<LinearState>>, ModelError> {
        match self.trail.as_deref_mut() {
            Some(trail) => trail
                .linear
                .get_mut(l)
                .map(Some)
                .ok_or_else(|| ModelError::State(format!("no trail for layer {l}"))),
            None => Ok(None),
        }
    }
}

impl Backend for CpuBackend<'_> {
    type Act = Vec<f32>;

    fn embed(&mut self, m: &Transformer, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let h = m.config.hidden_size;
        let embed = m.embed.view();
        let mut x = vec![0.0f32; tokens.len() * h];
        for (t, &tok) in tokens.iter().enumerate() {
            slipstream_kernels::dequantize_row(&embed, tok as usize, &mut x[t * h..][..h]);
        }
        Ok(x)
    }

    fn norm(
        &mut self,
        m: &Transformer,
        x: &Vec<f32>,
        which: NormKind,
        _n: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let w = match which {
            NormKind::Input(l) => &m.layers[l].input_norm,
            NormKind::PostAttn(l) => &m.layers[l].post_attn_norm,
            NormKind::Final => &m.final_norm,
        };
        Ok(rms_norm_rows(x, w, m.config.rms_norm_eps))
    }

    fn mixer(
        &mut self,
        m: &Transformer,
        l: usize,
        x: &mut Vec<f32>,
        xn: &Vec<f32>,
        n: usize,
        state: &mut LayerState,
    ) -> Result<(), ModelError> {
        let mixed = match (&m.layers[l].mixer, state) {
            (Mixer::Attention(a), LayerState::Attn(s)) => a.forward(xn, n, s),
            (Mixer::Linear(g), LayerState::Linear(s)) => {
                g.forward_recording(xn, n, s, self.trail_slot(l)?)
            }
            _ => return Err(ModelError::State(format!("layer {l} state kind mismatch"))),
        };
        add_into(x, &mixed);
        Ok(())
    }

    fn moe(
        &mut self,
        m: &Transformer,
        l: usize,
        x: &mut Vec<f32>,
        xn: &Vec<f32>,
        n: usize,
        experts: &mut dyn ExpertSource,
        routes: &mut Vec<Route>,
        times: &mut MoeTimes,
    ) -> Result<(), ModelError> {
        let out = m.layers[l]
            .moe
            .forward_timed(xn, n, experts, Some(routes), Some(times))?;
        add_into(x, &out);
        Ok(())
    }

    fn head(
        &mut self,
        m: &Transformer,
        xn: &Vec<f32>,
        _n: usize,
        rows: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let mut logits = vec![0.0f32; rows * m.config.vocab_size];
        slipstream_kernels::matmul_act(
            slipstream_kernels::Isa::detect(),
            m.head_act,
            &m.lm_head.view(),
            xn,
            rows,
            &mut logits,
        );
        Ok(logits)
    }

    fn tail(
        &mut self,
        m: &Transformer,
        x: &Vec<f32>,
        n: usize,
        rows: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let h = m.config.hidden_size;
        Ok(x[(n - rows) * h..].to_vec())
    }
}

pub(crate) fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
