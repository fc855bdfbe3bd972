//! Verify passes for speculative decoding on the device: passes over the
//! last accepted token and the drafts that record what a rollback needs,
//! and the rollback itself. Nothing goes through the host.
//!
//! An attention layer rolls back by length: the next pass writes its K/V
//! rows over the dropped ones. A Gated DeltaNet layer's states cannot be
//! undone, so a recorded pass keeps, per such layer, the recurrent state
//! before it, the convolution's window (its state before the pass, then
//! the pass's inputs) and the recurrence's inputs (the convolution's
//! output, z, b, a). A rollback to `keep` tokens restores the recurrent
//! state and runs the recurrence over the first `keep` tokens again (the
//! same kernel on the same inputs, which gives each token the bits it got
//! in the pass, as it gives a prompt's tokens the same bits at any pass
//! length), and takes the conv state from the window: its rows `keep ..
//! keep + kernel - 1`.

use super::*;

/// One Gated DeltaNet layer's record of a verify pass (f32 buffers sized
/// for `cap` tokens).
pub(super) struct GdnTrail {
    /// `[nv, dk, dv]`: the recurrent state before the pass.
    rec_before: DBuf,
    /// `[kernel - 1 + cap, C]`: the conv state before the pass, then the
    /// pass's convolution inputs.
    window: DBuf,
    /// `[cap, C]`, `[cap, nv * dv]`, `[cap, nv]`, `[cap, nv]`: the
    /// recurrence's inputs.
    conv_out: DBuf,
    z: DBuf,
    b: DBuf,
    a: DBuf,
}

/// The verify pass being recorded, or the last one recorded.
pub(super) struct VerifyTrail {
    /// The position before the pass.
    start: usize,
    /// Tokens of the pass (set by [`CudaModel::begin_verify`]).
    n: usize,
    /// Tokens the buffers hold.
    cap: usize,
    /// While the pass runs: its passes record.
    recording: bool,
    /// Per layer: `Some` for a Gated DeltaNet layer.
    layers: Vec<Option<GdnTrail>>,
}

impl CudaModel {
    /// Records the passes of the next `n` tokens (from the current
    /// position) for [`CudaModel::rollback`], until
    /// [`CudaModel::end_verify`]. The passes run as any other generated
    /// token's (the decode kernels, the same bits), without a graph.
    pub fn begin_verify(&mut self, n: usize) -> Result<()> {
        if n == 0 || n > PASS_TOKENS {
            return Err(CudaError::Invalid(format!(
                "a verify pass of {n} tokens (1..={PASS_TOKENS})"
            )));
        }
        let cap = self.verify.as_ref().map_or(0, |v| v.cap);
        if cap < n {
            self.verify = None;
            let cap = n.next_power_of_two();
            let mut layers = Vec::with_capacity(self.layers.len());
            for l in &self.layers {
                layers.push(match &l.mixer {
                    DMixer::Gdn(d) => {
                        let (_, _, nv, dv) = d.dims;
                        let f = |len: usize| self.gpu.alloc(len * 4);
                        Some(GdnTrail {
                            rec_before: f(d.rec_state.len_f32())?,
                            window: f((d.kernel - 1 + cap) * d.c)?,
                            conv_out: f(cap * d.c)?,
                            z: f(cap * nv * dv)?,
                            b: f(cap * nv)?,
                            a: f(cap * nv)?,
                        })
                    }
                    DMixer::Attn(_) => None,
                });
            }
            self.verify = Some(VerifyTrail {
                start: 0,
                n: 0,
                cap,
                recording: false,
                layers,
            });
        }
        let pos = self.pos;
        let v = self.verify.as_mut().expect("allocated above");
        v.start = pos;
        v.n = n;
        v.recording = true;
        Ok(())
    }

    /// Ends the recording of a verify pass; the record stays for
    /// [`CudaModel::rollback`].
    pub fn end_verify(&mut self) {
        if let Some(v) = self.verify.as_mut() {
            v.recording = false;
        }
    }

    /// Drops the verify record (the device state is replaced): no rollback
    /// until the next verify pass.
    pub(super) fn end_verify_recording(&mut self) {
        if let Some(v) = self.verify.as_mut() {
            v.recording = false;
            v.n = 0;
        }
    }

    /// Whether the current pass records for a verify pass.
    pub(super) fn verify_recording(&self) -> bool {
        self.verify.as_ref().is_some_and(|v| v.recording)
    }

    /// Records layer `l`'s Gated DeltaNet inputs of the current pass: before
    /// its convolution (`before_conv`: the states and the convolution's
    /// inputs) or after it (the recurrence's inputs).
    pub(super) fn record_gdn(&self, l: usize, before_conv: bool) -> Result<()> {
        let n = self.pass_n;
        let (Some(v), DMixer::Gdn(d)) = (self.verify.as_ref(), &self.layers[l].mixer) else {
            return Ok(());
        };
        if !v.recording {
            return Ok(());
        }
        let Some(t) = v.layers[l].as_ref() else {
            return Err(CudaError::Invalid(format!(
                "layer {l} has no verify record"
            )));
        };
        let off = self.pos - v.start;
        if off + n > v.cap.min(v.n) {
            return Err(CudaError::Invalid(format!(
                "a verify pass of {} tokens got a pass of {n} at {off}",
                v.n
            )));
        }
        let (g, c, hist) = (&self.gpu, d.c, d.kernel - 1);
        let (_, _, nv, dv) = d.dims;
        let s = &self.scratch;
        if before_conv {
            if off == 0 {
                g.copy_f32(&t.rec_before, 0, &d.rec_state, 0, d.rec_state.len_f32())?;
                g.copy_f32(&t.window, 0, &d.conv_state, 0, hist * c)?;
            }
            return g.copy_f32(&t.window, (hist + off) * c, &s.qkv, 0, n * c);
        }
        g.copy_f32(&t.conv_out, off * c, &s.conv, 0, n * c)?;
        g.copy_f32(&t.z, off * nv * dv, &s.z, 0, n * nv * dv)?;
        g.copy_f32(&t.b, off * nv, &s.b, 0, n * nv)?;
        g.copy_f32(&t.a, off * nv, &s.a, 0, n * nv)
    }

    /// Rolls the device state back to the first `keep` tokens (`1..=n`) of
    /// the last recorded verify pass of `n` tokens, as if only those had
    /// run. The pass must be the last thing the device ran.
    pub fn rollback(&mut self, keep: usize) -> Result<()> {
        let Some(v) = self.verify.as_mut() else {
            return Err(CudaError::Invalid(
                "a rollback without a verify pass".into(),
            ));
        };
        v.recording = false;
        let (start, n) = (v.start, v.n);
        if keep == 0 || keep > n || self.pos != start + n {
            return Err(CudaError::Invalid(format!(
                "rollback to {keep} of {n} tokens from position {start} (the device holds {})",
                self.pos
            )));
        }
        if keep == n {
            return Ok(());
        }
        self.abort_capture();
        self.pending_residual = None;
        self.pass_out = None;
        self.collect_device_routes()?;
        let v = self.verify.as_ref().expect("checked above");
        for (l, layer) in self.layers.iter().enumerate() {
            let (DMixer::Gdn(d), Some(t)) = (&layer.mixer, v.layers[l].as_ref()) else {
                continue;
            };
            let g = &self.gpu;
            g.copy_f32(&d.rec_state, 0, &t.rec_before, 0, d.rec_state.len_f32())?;
            // The outputs were the pass's: these go to scratch.
            let inputs = [t.conv_out.ptr, t.z.ptr, t.b.ptr, t.a.ptr];
            let step = d.step(inputs, self.scratch.core.ptr);
            g.gdn_step(&step, keep)?;
            let hist = d.kernel - 1;
            g.copy_f32(&d.conv_state, 0, &t.window, keep * d.c, hist * d.c)?;
        }
        self.pos = start + keep;
        Ok(())
    }
}
