//! Results back to the host: logits rows, the device argmax and the
//! seeded draw.

use super::*;

impl CudaModel {
    /// Copies `n` words from `src` into `logits_host` and waits once: the
    /// pass's pending routes are read behind the same synchronisation
    /// (their read waits for the stream, which runs the copy first).
    pub(super) fn land_in_host(&mut self, src: DevPtr, n: usize) -> Result<()> {
        let g = &self.gpu;
        g.ctx.bind_to_thread()?;
        let host = self.logits_host.as_mut_slice()?;
        if n > host.len() {
            return Err(CudaError::Invalid(format!(
                "{n} words for a host buffer of {}",
                host.len()
            )));
        }
        // SAFETY: `src` holds at least `n` words (the callers' buffers) and
        // `host` at least `n`; the pinned buffer lives as long as `self`,
        // and is read only after the stream is synchronised.
        unsafe { result::memcpy_dtoh_async(&mut host[..n], src.raw(), g.stream.cu_stream()) }?;
        if self.routes_pending {
            self.collect_device_routes()
        } else {
            self.gpu.sync()
        }
    }

    /// From now on keeps every row that goes through the final norm
    /// (`[rows, hidden]` f32, pass after pass) for
    /// [`CudaModel::take_hidden`]: the MTP head's input. With
    /// `Transformer::run_norming_every_row` that is every token's row.
    pub fn collect_hidden(&mut self) {
        self.hidden_rows = Some(Vec::new());
    }

    /// The rows kept since [`CudaModel::collect_hidden`], which stops.
    pub fn take_hidden(&mut self) -> Vec<f32> {
        self.hidden_rows.take().unwrap_or_default()
    }

    /// Appends `rows` final-normed rows of `xn` while collecting.
    pub(super) fn keep_hidden(&mut self, xn: DAct, rows: usize) -> Result<()> {
        if self.hidden_rows.is_none() {
            return Ok(());
        }
        let got = self.gpu.read_f32(self.act(xn), 0, rows * self.hidden)?;
        if let Some(h) = self.hidden_rows.as_mut() {
            h.extend_from_slice(&got);
        }
        Ok(())
    }

    /// The first row of `scratch.vocab` (`[vocab]`).
    pub(super) fn read_logits_row(&mut self) -> Result<Vec<f32>> {
        self.land_in_host(self.scratch.vocab.ptr, self.vocab)?;
        Ok(self.logits_host.as_slice()?[..self.vocab].to_vec())
    }

    /// The device's choice of token (`scratch.argmax`).
    pub(super) fn read_choice(&mut self) -> Result<i32> {
        self.land_in_host(self.scratch.argmax.ptr, 1)?;
        Ok(self.logits_host.as_slice()?[0].to_bits() as i32)
    }

    /// Whether [`CudaModel::next_token`] can draw with a temperature (the
    /// vocabulary fits the seeded draw's integer sums).
    pub fn draws_on_device(&self) -> bool {
        self.sample_scratch.is_some()
    }

    /// The next token after a pass run without logits (`Logits::None`):
    /// the final norm, the output head and the choice on the device, so 4
    /// bytes come back instead of a row of logits. `draw: None` takes the
    /// argmax (ties to the lowest id, NaN never wins, all NaN: the last id,
    /// as the engine's `argmax`); `Some((settings, u))` the seeded draw,
    /// the token `slipstream_kernels::sample::draw` picks from the same row
    /// (the argmax when no logit is finite). The row stays on the device
    /// for [`CudaModel::last_logits`].
    pub fn next_token(
        &mut self,
        m: &Transformer,
        draw: Option<(DrawParams, f64)>,
    ) -> std::result::Result<u32, ModelError> {
        let Some(x) = self.pass_out else {
            return Err(ModelError::State(
                "next_token needs a pass completed just before it".into(),
            ));
        };
        let n = self.pass_n;
        let rows = self.tail(m, &x, n, 1)?;
        let xn = self.norm(m, &rows, NormKind::Final, 1)?;
        let xn_p = self.act(xn).ptr;
        let r = self
            .gpu
            .matvec(&self.lm_head.desc, xn_p, self.scratch.vocab.ptr, 1);
        self.guard(r)?;
        self.choose_in_vocab(draw)
    }

    /// The argmax of `scratch.vocab`'s first row, or the seeded draw from it
    /// (the argmax when no logit is finite), read back as a token id.
    pub(super) fn choose_in_vocab(
        &mut self,
        draw: Option<(DrawParams, f64)>,
    ) -> std::result::Result<u32, ModelError> {
        let (logits, out) = (self.scratch.vocab.ptr, self.scratch.argmax.ptr);
        let r = self
            .gpu
            .argmax(logits, self.vocab, out)
            .and_then(|()| match (draw, &self.sample_scratch) {
                (Some((p, u)), Some(s)) => self.gpu.sample(logits, self.vocab, &p, u, s, out),
                (Some(_), None) => Err(CudaError::Invalid(format!(
                    "a vocabulary of {} is over the device draw's {MAX_VOCAB}",
                    self.vocab
                ))),
                (None, _) => Ok(()),
            })
            .and_then(|()| self.read_choice());
        let id = self.guard(r)?;
        u32::try_from(id)
            .ok()
            .filter(|&t| (t as usize) < self.vocab)
            .ok_or_else(|| ModelError::State(format!("the device chose token {id}")))
    }

    /// The seeded draw from a row of logits the host holds (`[vocab]`:
    /// the first token after a prompt, rows kept for logprobs): the row
    /// goes to the device and the same kernels as [`CudaModel::next_token`]
    /// draw from it, so the token is the one `sample::draw` gives (the
    /// argmax when no logit is finite) at a fraction of the host
    /// reference's time.
    pub fn draw_row(
        &mut self,
        row: &[f32],
        p: DrawParams,
        u: f64,
    ) -> std::result::Result<u32, ModelError> {
        if row.len() != self.vocab {
            return Err(ModelError::State(format!(
                "a row of {} logits for a vocabulary of {}",
                row.len(),
                self.vocab
            )));
        }
        let r = self.gpu.write_f32(&self.scratch.vocab, row);
        self.guard(r)?;
        self.choose_in_vocab(Some((p, u)))
    }

    /// The logits row [`CudaModel::next_token`] last chose from (`[vocab]`).
    pub fn last_logits(&mut self) -> std::result::Result<Vec<f32>, ModelError> {
        let r = self.read_logits_row();
        self.guard(r)
    }
}
