//! The sequence state between the device and the host: what snapshots, the
//! prompt cache and the server's state cache hold. The device keeps the
//! host's layouts (KV rows `[tokens, kv_heads * head_dim]` f32, conv
//! `[kernel - 1, conv_dim]`, recurrent `[value_heads, key_dim, value_dim]`),
//! so a state moves as plain copies, bit for bit, and a state the CPU
//! backend wrote resumes here and the other way round.

use slipstream_models::state::LinearState;
use slipstream_models::ModelState;

use super::*;

impl CudaModel {
    /// Tokens the device state holds.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Copies the device state into `state.layers`: attention layers end
    /// up with [`Self::position`] KV rows, of which those the host already
    /// holds (a prefix of this sequence's, by the caller's word) are kept
    /// and the rest read. `state` must be shaped by this model's
    /// `Transformer::new_state`; its tokens and logits are the caller's.
    pub fn read_state(&mut self, state: &mut ModelState) -> Result<()> {
        self.check_shape(state)?;
        self.abort_capture();
        self.gpu.sync()?;
        let pos = self.pos;
        for (l, host) in self.layers.iter().zip(state.layers.iter_mut()) {
            match (&l.mixer, host) {
                (DMixer::Attn(a), LayerState::Attn(h)) => {
                    // The rows the host holds are this sequence's prefix:
                    // only the rest comes over.
                    let row = a.dims.1 * a.dims.2;
                    let have = h.len().min(pos);
                    h.k.truncate(have * row);
                    h.v.truncate(have * row);
                    let n = (pos - have) * row;
                    h.k.extend(self.gpu.read_f32(&a.kc, have * row, n)?);
                    h.v.extend(self.gpu.read_f32(&a.vc, have * row, n)?);
                }
                (DMixer::Gdn(g), LayerState::Linear(h)) => {
                    *h = LinearState {
                        conv: self.gpu.read_f32(&g.conv_state, 0, h.conv.len())?,
                        recurrent: self.gpu.read_f32(&g.rec_state, 0, h.recurrent.len())?,
                    };
                }
                _ => return Err(CudaError::Invalid("layer kinds differ".into())),
            }
        }
        Ok(())
    }

    /// Makes the device hold `state` (its layers as [`Self::read_state`] or
    /// the CPU backend left them): the next pass starts at
    /// `state.position()`. The KV caches grow as needed.
    pub fn write_state(&mut self, state: &ModelState) -> Result<()> {
        self.check_shape(state)?;
        let pos = state.position();
        self.abort_capture();
        self.end_verify_recording();
        self.pending_residual = None;
        self.pass_out = None;
        self.collect_device_routes()?;
        for l in 0..self.layers.len() {
            match &state.layers[l] {
                LayerState::Attn(h) => {
                    if h.len() != pos || h.v.len() != h.k.len() {
                        return Err(CudaError::Invalid(format!(
                            "layer {l} holds {} keys and {} values for {pos} tokens",
                            h.k.len() / h.kv_dim.max(1),
                            h.v.len() / h.kv_dim.max(1)
                        )));
                    }
                    self.ensure_kv(l, pos.max(1))?;
                    if let DMixer::Attn(a) = &self.layers[l].mixer {
                        self.gpu.write_f32(&a.kc, &h.k)?;
                        self.gpu.write_f32(&a.vc, &h.v)?;
                    }
                }
                LayerState::Linear(h) => {
                    if let DMixer::Gdn(g) = &self.layers[l].mixer {
                        self.gpu.write_f32(&g.conv_state, &h.conv)?;
                        self.gpu.write_f32(&g.rec_state, &h.recurrent)?;
                    }
                }
            }
        }
        self.pos = pos;
        Ok(())
    }

    /// Whether `state` has this model's layer kinds and state sizes.
    fn check_shape(&self, state: &ModelState) -> Result<()> {
        if state.layers.len() != self.layers.len() {
            return Err(CudaError::Invalid(format!(
                "the state has {} layers, the model {}",
                state.layers.len(),
                self.layers.len()
            )));
        }
        for (i, (l, h)) in self.layers.iter().zip(&state.layers).enumerate() {
            let fits = match (&l.mixer, h) {
                (DMixer::Attn(a), LayerState::Attn(h)) => h.kv_dim == a.dims.1 * a.dims.2,
                (DMixer::Gdn(g), LayerState::Linear(h)) => {
                    h.recurrent.len() * 4 == g.rec_state.bytes
                        && h.conv.len() * 4 == g.conv_state.bytes
                }
                _ => false,
            };
            if !fits {
                return Err(CudaError::Invalid(format!(
                    "layer {i}'s state does not fit this model"
                )));
            }
        }
        Ok(())
    }
}
