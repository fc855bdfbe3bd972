//! The device copy of the model: each layer's dense weights, KV cache,
//! Gated DeltaNet states and expert slots, uploaded by [`CudaModel::new`].

use super::*;

/// An attention layer: projections, q/k norms, RoPE frequencies, dims
/// (nh, nkv, hd), and its K and V caches (`[cap, nkv * hd]` f32, grown).
pub(super) struct DAttn {
    pub(super) q: DWeight,
    pub(super) k: DWeight,
    pub(super) v: DWeight,
    pub(super) o: DWeight,
    pub(super) q_norm: DBuf,
    pub(super) k_norm: DBuf,
    pub(super) inv_freq: DBuf,
    pub(super) half: usize,
    pub(super) dims: (usize, usize, usize),
    pub(super) gated: bool,
    pub(super) eps: f32,
    pub(super) kc: DBuf,
    pub(super) vc: DBuf,
    /// Rows the caches hold.
    pub(super) cap: usize,
}

/// A Gated DeltaNet layer: projections, convolution and recurrence
/// parameters, dims (nk, dk, nv, dv), and its conv and recurrent states.
pub(super) struct DGdn {
    pub(super) qkv: DWeight,
    pub(super) z: DWeight,
    pub(super) b: DWeight,
    pub(super) a: DWeight,
    pub(super) out: DWeight,
    pub(super) conv: DBuf,
    pub(super) a_log: DBuf,
    pub(super) dt_bias: DBuf,
    pub(super) norm: DBuf,
    pub(super) conv_state: DBuf,
    pub(super) rec_state: DBuf,
    pub(super) c: usize,
    pub(super) kernel: usize,
    pub(super) dims: (usize, usize, usize, usize),
    pub(super) eps: f32,
}

impl DGdn {
    /// The recurrence over this layer's state with `inputs` (conv output,
    /// z, b, a) into `core`.
    pub(super) fn step(&self, inputs: [DevPtr; 4], core: DevPtr) -> GdnStep {
        let [conv_out, z, b, a] = inputs;
        GdnStep {
            conv_out,
            z,
            b,
            a,
            a_log: self.a_log.ptr,
            dt_bias: self.dt_bias.ptr,
            norm: self.norm.ptr,
            state: self.rec_state.ptr,
            dims: self.dims,
            eps: self.eps,
            core,
        }
    }
}

/// A layer's token mixer.
pub(super) enum DMixer {
    Attn(Box<DAttn>),
    Gdn(Box<DGdn>),
}

/// A layer's shared expert and its sigmoid gate.
pub(super) struct DShared {
    /// `[gate; PASS_TOKENS]` then `[up; PASS_TOKENS]` device addresses: the
    /// bases table of a launch with one pair per token of a pass.
    pub(super) bases: DBuf,
    pub(super) gate: DWeight,
    pub(super) up: DWeight,
    pub(super) down: DWeight,
    pub(super) sgate: DWeight,
}

/// One decoder layer: norms, mixer, router, shared expert, and its
/// routed experts' VRAM slots (with their cache bookkeeping).
pub(super) struct DLayer {
    pub(super) input_norm: DBuf,
    pub(super) post_norm: DBuf,
    pub(super) mixer: DMixer,
    pub(super) router: DWeight,
    pub(super) shared: Option<DShared>,
    pub(super) cache: LayerCache,
    pub(super) slots: DBuf,
    /// The pinned RAM tier: its slot bookkeeping and `slots * rec` bytes.
    pub(super) ram: Option<(LayerCache, PinnedHostSlice<u8>)>,
    /// With device routing: `[num_experts]` u64, each expert's VRAM record.
    pub(super) addr_table: Option<DBuf>,
}

impl CudaModel {
    /// Uploads the dense weights of `m` and sizes the VRAM expert cache.
    /// `parts` are the expert record parts (gate, up, down) as the `.slip`
    /// manifest describes them: quant type and `[rows, cols]`.
    pub fn new(
        m: &Transformer,
        parts: [(QuantType, [usize; 2]); 3],
        opts: &CudaOptions,
    ) -> Result<CudaModel> {
        let tuning = &opts.tuning;
        let mut gpu = Gpu::new(opts.device, tuning)?;
        gpu.gdn_rows = tuning.gdn_form == GdnForm::Rows;
        let c = &m.config;
        let (h, e, k) = (c.hidden_size, c.num_experts, c.num_experts_per_tok);
        let up_w = |l: &Linear| gpu.upload_weight(&l.w.view());
        let mut offs = 0usize;
        let mut tmpl = [(WDesc::default(), 0u64, 0usize); 3];
        for (i, (q, shape)) in parts.iter().enumerate() {
            let nb = q.nbytes(shape[0], shape[1]);
            tmpl[i] = (
                WDesc::new(*q, shape[0], shape[1], DevPtr::NULL)?,
                offs as u64,
                nb,
            );
            offs += align(nb);
        }
        let rec_bytes = offs;
        let inter = parts[0].1[0];
        if parts[1].1 != [inter, h] || parts[2].1 != [h, inter] || parts[0].1 != [inter, h] {
            return Err(CudaError::Invalid(
                "expert parts do not match the config's shapes".into(),
            ));
        }
        let slots = opts.vram_slots.unwrap_or(e).clamp(1, e);
        let mut layers = Vec::with_capacity(m.layers.len());
        let mut max_c = 0usize;
        let mut max_core = 0usize;
        let mut max_q = 0usize;
        let mut max_kv = 0usize;
        let mut max_nv = 0usize;
        let mut shared_inter = 0usize;
        for layer in &m.layers {
            let mixer = match &layer.mixer {
                Mixer::Attention(a) => {
                    let (nh, nkv, hd) = (a.num_heads, a.num_kv_heads, a.head_dim);
                    max_q = max_q.max(a.q_proj.out_dim()).max(nh * hd);
                    max_kv = max_kv.max(nkv * hd);
                    let cap = 256;
                    DMixer::Attn(Box::new(DAttn {
                        q: up_w(&a.q_proj)?,
                        k: up_w(&a.k_proj)?,
                        v: up_w(&a.v_proj)?,
                        o: up_w(&a.o_proj)?,
                        q_norm: gpu.upload_f32(&a.q_norm)?,
                        k_norm: gpu.upload_f32(&a.k_norm)?,
                        inv_freq: gpu.upload_f32(&a.rope.inv_freq)?,
                        half: a.rope.inv_freq.len(),
                        dims: (nh, nkv, hd),
                        gated: a.output_gate,
                        eps: a.eps,
                        kc: gpu.alloc(cap * nkv * hd * 4)?,
                        vc: gpu.alloc(cap * nkv * hd * 4)?,
                        cap,
                    }))
                }
                Mixer::Linear(g) => {
                    let cd = g.conv_dim();
                    max_c = max_c.max(cd);
                    max_core = max_core.max(g.num_v_heads * g.v_dim);
                    max_nv = max_nv.max(g.num_v_heads);
                    DMixer::Gdn(Box::new(DGdn {
                        qkv: up_w(&g.in_proj_qkv)?,
                        z: up_w(&g.in_proj_z)?,
                        b: up_w(&g.in_proj_b)?,
                        a: up_w(&g.in_proj_a)?,
                        out: up_w(&g.out_proj)?,
                        conv: gpu.upload_f32(&g.conv)?,
                        a_log: gpu.upload_f32(&g.a_log)?,
                        dt_bias: gpu.upload_f32(&g.dt_bias)?,
                        norm: gpu.upload_f32(&g.norm)?,
                        conv_state: gpu.alloc((g.kernel - 1) * cd * 4)?,
                        rec_state: gpu.alloc(g.num_v_heads * g.k_dim * g.v_dim * 4)?,
                        c: cd,
                        kernel: g.kernel,
                        dims: (g.num_k_heads, g.k_dim, g.num_v_heads, g.v_dim),
                        eps: g.eps,
                    }))
                }
            };
            let shared = match &layer.moe.shared {
                Some((mlp, sg)) => {
                    shared_inter = shared_inter.max(mlp.gate_proj.out_dim());
                    let gate = up_w(&mlp.gate_proj)?;
                    let up = up_w(&mlp.up_proj)?;
                    let table: Vec<u64> = [gate.desc.codes.raw(); PASS_TOKENS]
                        .into_iter()
                        .chain([up.desc.codes.raw(); PASS_TOKENS])
                        .collect();
                    let bytes: Vec<u8> = table.iter().flat_map(|a| a.to_le_bytes()).collect();
                    Some(DShared {
                        bases: gpu.upload(&bytes)?,
                        gate,
                        up,
                        down: up_w(&mlp.down_proj)?,
                        sgate: up_w(sg)?,
                    })
                }
                None => None,
            };
            layers.push(DLayer {
                input_norm: gpu.upload_f32(&layer.input_norm)?,
                post_norm: gpu.upload_f32(&layer.post_attn_norm)?,
                mixer,
                router: up_w(&layer.moe.router)?,
                shared,
                cache: LayerCache::new(opts.policy.build(e), e, slots),
                slots: gpu.alloc(slots * rec_bytes)?,
                addr_table: None,
                ram: match opts.ram_slots {
                    Some(r) => {
                        let r = r.clamp(1, e);
                        // SAFETY: pinned host memory, written only by the
                        // host between copies (ordered by `copy_done`).
                        let mem = unsafe { gpu.ctx.alloc_pinned::<u8>(r * rec_bytes)? };
                        Some((LayerCache::new(opts.policy.build(e), e, r), mem))
                    }
                    None => None,
                },
            });
        }
        let f = |n: usize| gpu.alloc(n.max(1) * 4);
        // Scratch for a pass of up to PASS_TOKENS tokens.
        let fp = |n: usize| f(n * PASS_TOKENS);
        let i32s = |v: Vec<i32>| -> Result<DBuf> {
            gpu.upload(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
        };
        let nh_max = m
            .layers
            .iter()
            .filter_map(|l| match &l.mixer {
                Mixer::Attention(a) => Some((a.num_heads, a.head_dim)),
                _ => None,
            })
            .fold((1, 1), |a, b| (a.0.max(b.0), a.1.max(b.1)));
        // SAFETY: pinned host allocations; only touched through the slices
        // cudarc hands out, after the copies reading them completed.
        let (staging, bases_host, route_host, logits_host) = unsafe {
            (
                gpu.ctx.alloc_pinned::<u8>((k + 1) * rec_bytes)?,
                gpu.ctx.alloc_pinned::<u64>(3 * k)?,
                gpu.ctx.alloc_pinned::<f32>(2 * k)?,
                gpu.ctx.alloc_pinned::<f32>(c.vocab_size)?,
            )
        };
        Ok(CudaModel {
            acts: [fp(h)?, fp(h)?, fp(h)?, fp(h)?],
            scratch: Scratch {
                q_all: fp(max_q)?,
                k_all: fp(max_kv)?,
                v_all: fp(max_kv)?,
                q: fp(max_q)?,
                gate: fp(max_q)?,
                attn: fp(max_q)?,
                att_scratch: f(Gpu::attn_scratch_f32(nh_max.0, nh_max.1, 256))?,
                mixed: fp(h)?,
                qkv: fp(max_c)?,
                z: fp(max_core)?,
                b: fp(max_nv)?,
                a: fp(max_nv)?,
                conv: fp(max_c)?,
                core: fp(max_core)?,
                logits: fp(e)?,
                route: f(2 * k)?,
                h: fp(k * inter)?,
                sh_h: fp(shared_inter)?,
                sh_out: fp(h)?,
                sg: fp(1)?,
                bases: gpu.alloc(3 * k * PASS_TOKENS * 8)?,
                xrow: i32s(
                    (0..k * PASS_TOKENS)
                        .map(|p| (p / k.max(1)) as i32)
                        .collect(),
                )?,
                xrow_id: i32s((0..PASS_TOKENS as i32).collect())?,
                ids: gpu.alloc(16)?,
                pass_ids: gpu.alloc(PASS_TOKENS * 4)?,
                grp_off: f(e + 1)?,
                grp_list: fp(k)?,
                // One row; `head` grows it for more (outside any graph).
                vocab: f(c.vocab_size)?,
                argmax: f(1)?,
                spill: gpu.alloc(k * rec_bytes)?,
                route_all: fp(2 * k * m.layers.len().max(1))?,
            },
            sample_scratch: if c.vocab_size <= MAX_VOCAB {
                Some(gpu.sample_scratch(c.vocab_size)?)
            } else {
                None
            },
            embed: gpu.upload_weight(&m.embed.view())?,
            lm_head: gpu.upload_weight(&m.lm_head.view())?,
            final_norm: gpu.upload_f32(&m.final_norm)?,
            staging,
            bases_host,
            route_host,
            logits_host,
            route_pub: if !tuning.route_mapped {
                None
            } else {
                // Where mapping fails, the copy + event path stays.
                gpu.alloc_mapped(2 * k + 1).ok()
            },
            route_seq: 0,
            device_routing: false,
            graphs: tuning.graphs,
            graph: None,
            mode: PassMode::Plain,
            pending_residual: None,
            pass_out: None,
            routes_pending: false,
            copy_done: None,
            parts: tmpl,
            rec_bytes,
            top_k: k,
            num_experts: e,
            hidden: h,
            vocab: c.vocab_size,
            eps: c.rms_norm_eps,
            renorm: c.norm_topk_prob,
            pos: 0,
            pass_n: 1,
            pass_tokens: tuning.pass_tokens.clamp(1, PASS_TOKENS),
            routes_n: 0,
            tc_use: tuning.tensor_core_passes,
            prompt_precision: tuning.prompt_precision,
            device_routing_allowed: tuning.device_routing,
            prompt_pass: false,
            verify: None,
            hidden_rows: None,
            stats: CudaStats::default(),
            layers,
            gpu,
        })
    }
}
