//! Verify passes for speculative decoding: one multi-token pass over the
//! last accepted token and the drafts that records what a rollback needs,
//! and the rollback itself.
//!
//! What a rollback to `keep` tokens of the pass restores, per layer kind:
//! full attention drops its K/V rows after the kept position (a length, no
//! copy); a Gated DeltaNet layer takes back its recurrent and conv state
//! after the kept token, which only a recording of the pass can give (the
//! recurrence cannot be undone), so [`Transformer::forward_verify`] records
//! the state after every token but the last. A plain pass records nothing.

use slipstream_core::ExpertSource;

use crate::backend::CpuBackend;
use crate::state::{LayerState, LinearState, ModelState};
use crate::transformer::{append_rows, HiddenSink, Logits, PhaseTimes, Taps, Transformer};
use crate::ModelError;

/// What a verify pass of `n` tokens recorded: enough to roll the state
/// back to any of its `n` positions.
#[derive(Debug, Clone, Default)]
pub struct StateTrail {
    /// The state's position before the pass.
    pub start: usize,
    /// Tokens in the pass.
    pub n: usize,
    /// Per layer (state order): for a Gated DeltaNet layer the state after
    /// each of the first `n - 1` tokens; empty for attention layers.
    pub linear: Vec<Vec<LinearState>>,
}

/// The result of [`Transformer::forward_verify`].
#[derive(Debug, Clone)]
pub struct VerifyPass {
    /// Every token's logits: `[n, vocab]`, each row the bits of a
    /// one-token pass at that position.
    pub logits: Vec<f32>,
    /// Every token's hidden state after the final norm (`[n, hidden]`),
    /// the MTP head's input; empty unless asked for.
    pub hidden: Vec<f32>,
    pub trail: StateTrail,
}

impl Transformer {
    /// Runs `tokens` (the last accepted token and the drafts after it) as
    /// one pass on the CPU and returns every row's logits, the final-normed
    /// hidden rows when `want_hidden`, and the trail that
    /// [`ModelState::rollback`] takes. The state advances by all of
    /// `tokens`, exactly as [`Transformer::forward`] would. On error the
    /// state must be discarded.
    pub fn forward_verify(
        &self,
        state: &mut ModelState,
        tokens: &[u32],
        experts: &mut dyn ExpertSource,
        want_hidden: bool,
        phases: Option<&mut PhaseTimes>,
    ) -> Result<VerifyPass, ModelError> {
        let mut trail = StateTrail {
            start: state.tokens.len(),
            n: tokens.len(),
            linear: vec![Vec::new(); self.layers.len()],
        };
        let mut hidden = Vec::new();
        let logits = {
            let mut backend = CpuBackend::recording(&mut trail);
            let mut sink = append_rows(&mut hidden);
            let taps = Taps {
                observer: None,
                phases,
                hidden: want_hidden.then_some(&mut sink as HiddenSink<'_, Vec<f32>>),
            };
            self.run_with_taps(&mut backend, state, tokens, experts, Logits::All, taps)?
        };
        Ok(VerifyPass {
            logits,
            hidden,
            trail,
        })
    }
}

impl ModelState {
    /// Rolls the state back to the first `keep` tokens (`1..=trail.n`) of
    /// the verify pass that recorded `trail`, as if only those had run:
    /// attention K/V lengths cut, Gated DeltaNet states taken from the
    /// trail, tokens cut. `last_logits` is left to the caller.
    pub fn rollback(&mut self, trail: &StateTrail, keep: usize) -> Result<(), ModelError> {
        if keep == 0 || keep > trail.n || self.tokens.len() != trail.start + trail.n {
            return Err(ModelError::State(format!(
                "rollback to {keep} of {} tokens from position {} (the state holds {})",
                trail.n,
                trail.start,
                self.tokens.len()
            )));
        }
        if keep == trail.n {
            return Ok(());
        }
        let position = trail.start + keep;
        for (l, layer) in self.layers.iter_mut().enumerate() {
            match layer {
                LayerState::Attn(a) => {
                    a.k.truncate(position * a.kv_dim);
                    a.v.truncate(position * a.kv_dim);
                }
                LayerState::Linear(s) => {
                    let saved = trail
                        .linear
                        .get(l)
                        .and_then(|t| t.get(keep - 1))
                        .ok_or_else(|| {
                            ModelError::State(format!("the trail has no state for layer {l}"))
                        })?;
                    s.clone_from(saved);
                }
            }
        }
        self.tokens.truncate(position);
        Ok(())
    }
}
