//! [`Backend`] for [`CudaModel`]: what [`Transformer::run`] calls per pass.

use super::*;

impl Backend for CudaModel {
    type Act = DAct;

    fn max_pass_tokens(&self) -> usize {
        if self.device_routing {
            self.pass_tokens
        } else {
            1
        }
    }

    fn begin_pass(&mut self, position: usize, n: usize) -> std::result::Result<(), ModelError> {
        self.abort_capture();
        // A residual left by a pass that failed midway belongs to no pass.
        self.pending_residual = None;
        self.pass_out = None;
        self.collect_device_routes().map_err(err)?;
        if position == 0 {
            self.reset().map_err(err)?;
        } else if position != self.pos {
            return Err(ModelError::State(format!(
                "the CUDA backend holds {} tokens of state, the pass starts at {position} \
                 (a state from elsewhere is written with write_state first)",
                self.pos
            )));
        }
        if n == 0 || n > self.max_pass_tokens() {
            return Err(ModelError::State(format!(
                "the CUDA backend runs 1..={} tokens per pass here, got {n}",
                self.max_pass_tokens()
            )));
        }
        self.pass_n = n;
        self.gpu.tensor_cores = match self.tc_use {
            TensorCoreUse::Never => false,
            TensorCoreUse::Prompt => self.prompt_pass,
            TensorCoreUse::Always => true,
        };
        self.gpu.prompt_int8 = self.prompt_pass
            && self.gpu.tensor_cores
            && self.prompt_precision == PromptPrecision::Int8;
        // The pass graph holds the generated tokens' kernels: a prompt pass
        // on other kernels (tensor cores: the prompt attention takes its
        // position from the host) runs without it.
        if n > 1
            || (self.prompt_pass && self.tc_use != TensorCoreUse::Never)
            || self.verify_recording()
        {
            self.mode = PassMode::Plain;
            return Ok(());
        }
        self.choose_mode(position).map_err(err)
    }

    fn embed(&mut self, _m: &Transformer, tokens: &[u32]) -> std::result::Result<DAct, ModelError> {
        if tokens.len() != self.pass_n {
            return Err(ModelError::State(format!(
                "the pass was begun for {} tokens, got {}",
                self.pass_n,
                tokens.len()
            )));
        }
        if let &[_, _, ..] = tokens {
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            let r = self
                .gpu
                .write(&self.scratch.pass_ids, 0, &bytes)
                .and_then(|()| {
                    self.gpu.embed_rows(
                        &self.embed.desc,
                        self.scratch.pass_ids.ptr,
                        self.act(DAct::X).ptr,
                        tokens.len(),
                    )
                });
            self.guard(r)?;
            return Ok(DAct::X);
        }
        let id = tokens[0];
        // The token id, then its position (read by the attention kernels).
        let words = [f32::from_bits(id), f32::from_bits(self.pos as u32)];
        self.gpu.write_f32(&self.scratch.ids, &words).map_err(err)?;
        let r = match self.mode {
            PassMode::Replay => match &self.graph {
                Some(g) => g.exec.launch().map_err(CudaError::from),
                None => Err(CudaError::Invalid("graph replay without a graph".into())),
            },
            PassMode::Capture => self
                .gpu
                .stream
                .begin_capture(
                    cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )
                .map_err(CudaError::from)
                .and_then(|()| {
                    self.gpu.embed_rows(
                        &self.embed.desc,
                        self.scratch.ids.ptr,
                        self.act(DAct::X).ptr,
                        1,
                    )
                }),
            PassMode::Plain => self.gpu.embed_rows(
                &self.embed.desc,
                self.scratch.ids.ptr,
                self.act(DAct::X).ptr,
                1,
            ),
        };
        self.guard(r)?;
        if self.mode == PassMode::Replay {
            self.stats.graph_replays += 1;
        }
        Ok(DAct::X)
    }

    fn norm(
        &mut self,
        _m: &Transformer,
        x: &DAct,
        which: NormKind,
        n: usize,
    ) -> std::result::Result<DAct, ModelError> {
        let w = match which {
            NormKind::Input(l) => self.layers[l].input_norm.ptr,
            NormKind::PostAttn(l) => self.layers[l].post_norm.ptr,
            NormKind::Final => self.final_norm.ptr,
        };
        let out = match x {
            DAct::X | DAct::Xn => DAct::Xn,
            DAct::T | DAct::Tn => DAct::Tn,
        };
        if self.mode == PassMode::Replay && which != NormKind::Final {
            return Ok(out);
        }
        let r = if self.pending_residual == Some(*x) {
            self.pending_residual = None;
            self.gpu.add_rms_norm(
                self.act(*x).ptr,
                self.scratch.mixed.ptr,
                w,
                self.act(out).ptr,
                n,
                self.hidden,
                self.eps,
            )
        } else {
            self.flush_residual().and_then(|()| {
                self.gpu.rms_norm(
                    self.act(*x).ptr,
                    w,
                    self.act(out).ptr,
                    n,
                    self.hidden,
                    self.eps,
                )
            })
        };
        self.guard(r)?;
        if which == NormKind::Final {
            let r = self.keep_hidden(out, n);
            self.guard(r)?;
        }
        Ok(out)
    }

    fn mixer(
        &mut self,
        _m: &Transformer,
        l: usize,
        x: &mut DAct,
        xn: &DAct,
        _n: usize,
        _state: &mut LayerState,
    ) -> std::result::Result<(), ModelError> {
        if self.mode == PassMode::Replay {
            return Ok(());
        }
        let r = match self.layers[l].mixer {
            DMixer::Attn(_) => self.attention(l, *x, *xn),
            DMixer::Gdn(_) => self.gdn(l, *x, *xn),
        };
        self.guard(r)
    }

    fn moe(
        &mut self,
        _m: &Transformer,
        l: usize,
        x: &mut DAct,
        xn: &DAct,
        _n: usize,
        experts: &mut dyn ExpertSource,
        routes: &mut Vec<Route>,
        times: &mut MoeTimes,
    ) -> std::result::Result<(), ModelError> {
        let last = l + 1 == self.layers.len();
        match self.mode {
            // The graph's router kernels leave the ids for the counters.
            PassMode::Replay => {
                self.routes_pending = true;
                self.routes_n = 1;
            }
            _ => {
                let r = self.flush_residual();
                self.guard(r)?;
                let r = self.moe(l, *x, *xn, experts, routes, times);
                if let Err(e) = self.guard(r)? {
                    self.abort_capture();
                    return Err(ModelError::Store(e));
                }
                if last && self.mode == PassMode::Capture {
                    let r = self.finish_capture();
                    self.guard(r)?;
                }
            }
        }
        if last {
            self.mode = PassMode::Plain;
            self.pass_out = Some(*x);
            self.pos += self.pass_n;
            self.stats.tokens += self.pass_n as u64;
        }
        Ok(())
    }

    fn head(
        &mut self,
        _m: &Transformer,
        xn: &DAct,
        n: usize,
        rows: usize,
    ) -> std::result::Result<Vec<f32>, ModelError> {
        if rows > n || n > PASS_TOKENS {
            return Err(ModelError::State(format!(
                "logits of {rows} rows of a {n}-row activation"
            )));
        }
        let xn_p = self.act(*xn).ptr.add_f32((n - rows) * self.hidden);
        if self.scratch.vocab.len_f32() < rows * self.vocab {
            self.scratch.vocab = self.gpu.alloc(rows * self.vocab * 4).map_err(err)?;
        }
        self.gpu
            .matvec(&self.lm_head.desc, xn_p, self.scratch.vocab.ptr, rows)
            .map_err(err)?;
        if rows > 1 {
            let logits = self
                .gpu
                .read_f32(&self.scratch.vocab, 0, rows * self.vocab)
                .map_err(err)?;
            self.collect_device_routes().map_err(err)?;
            return Ok(logits);
        }
        // One row: through pinned memory, one synchronisation per
        // generated token.
        self.read_logits_row().map_err(err)
    }

    fn tail(
        &mut self,
        _m: &Transformer,
        x: &DAct,
        n: usize,
        rows: usize,
    ) -> std::result::Result<DAct, ModelError> {
        if rows > n || n > PASS_TOKENS {
            return Err(ModelError::State(format!(
                "the last {rows} rows of a {n}-row activation"
            )));
        }
        let r = self.flush_residual();
        self.guard(r)?;
        let r = self.gpu.copy_f32(
            self.act(DAct::T),
            0,
            self.act(*x),
            (n - rows) * self.hidden,
            rows * self.hidden,
        );
        self.guard(r)?;
        Ok(DAct::T)
    }
}
