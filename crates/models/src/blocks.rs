//! Shared building blocks: linear layers, full attention, Gated DeltaNet,
//! mixture of experts. Architecture files assemble layers from these.
//!
//! Activations are row-major `[tokens, features]` f32.

use std::time::Instant;

use rayon::prelude::*;
use slipstream_core::{ExpertRequest, ExpertSource, ExpertWeights, Tensor, TensorSource};
use slipstream_kernels as k;

use crate::ops;
use crate::state::{AttnState, LinearState};
use crate::ModelError;

/// A weight matrix `[out, in]` applied as `y = W x`.
#[derive(Debug, Clone)]
pub struct Linear {
    pub w: Tensor,
    /// How inputs enter 4-bit products (see [`k::Activations`]).
    pub act: k::Activations,
}

impl Linear {
    pub fn load(src: &dyn TensorSource, name: &str, shape: [usize; 2]) -> Result<Self, ModelError> {
        Ok(Linear {
            w: load_tensor(src, name, shape)?,
            act: k::Activations::default(),
        })
    }

    pub fn out_dim(&self) -> usize {
        self.w.rows
    }

    /// x: [n, in] -> returns [n, out]
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut y = vec![0.0f32; n * self.w.rows];
        k::matmul_act(k::Isa::detect(), self.act, &self.w.view(), x, n, &mut y);
        y
    }
}

/// Loads a tensor and checks its shape.
pub fn load_tensor(
    src: &dyn TensorSource,
    name: &str,
    shape: [usize; 2],
) -> Result<Tensor, ModelError> {
    let t = src
        .tensor(name)
        .map_err(|e| ModelError::Weight(format!("{name}: {e}")))?;
    if [t.rows, t.cols] != shape {
        return Err(ModelError::Weight(format!(
            "{name} has shape [{}, {}], the config needs {shape:?}",
            t.rows, t.cols
        )));
    }
    Ok(t)
}

/// Loads a vector (`[1, n]`) and dequantizes it to f32.
pub fn load_vector(src: &dyn TensorSource, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
    let t = load_tensor(src, name, [1, n])?;
    let mut v = vec![0.0; n];
    k::dequantize_row(&t.view(), 0, &mut v);
    Ok(v)
}

/// Loads a small matrix fully dequantized to f32 (conv weights).
pub fn load_matrix_f32(
    src: &dyn TensorSource,
    name: &str,
    shape: [usize; 2],
) -> Result<Vec<f32>, ModelError> {
    let t = load_tensor(src, name, shape)?;
    let mut v = vec![0.0; shape[0] * shape[1]];
    for (r, row) in v.chunks_mut(shape[1]).enumerate() {
        k::dequantize_row(&t.view(), r, row);
    }
    Ok(v)
}

/// Applies an RMSNorm to each row of `x` ([n, dim]) into a new buffer.
pub fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let dim = w.len();
    let mut out = vec![0.0; x.len()];
    out.par_chunks_mut(dim)
        .zip(x.par_chunks(dim))
        .for_each(|(o, xi)| ops::rms_norm(xi, w, eps, o));
    out
}

/// Rotary embedding parameters (NeoX half rotation over the leading dims).
#[derive(Debug, Clone)]
pub struct Rope {
    /// `[rotary_dim / 2]`
    pub inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(rotary_dim: usize, theta: f64) -> Self {
        // Same f32 arithmetic as the reference: theta^(2i/d) then 1/x.
        let base = theta as f32;
        let inv_freq = (0..rotary_dim / 2)
            .map(|i| 1.0f32 / base.powf((2 * i) as f32 / rotary_dim as f32))
            .collect();
        Rope { inv_freq }
    }

    /// Rotates the first `rotary_dim` values of one head at `pos`.
    pub fn apply(&self, head: &mut [f32], pos: usize) {
        let half = self.inv_freq.len();
        for (i, &f) in self.inv_freq.iter().enumerate() {
            let angle = pos as f32 * f;
            let (sin, cos) = angle.sin_cos();
            let (x1, x2) = (head[i], head[i + half]);
            head[i] = x1 * cos - x2 * sin;
            head[i + half] = x2 * cos + x1 * sin;
        }
    }
}

/// Full (softmax) attention with GQA, q/k norms, (partial) RoPE and an
/// optional sigmoid output gate.
#[derive(Debug, Clone)]
pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    /// `[head_dim]`, multiplicative.
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub output_gate: bool,
    pub rope: Rope,
    pub eps: f32,
}

/// Prompt tokens whose attention runs as one task per KV head (their
/// queries share each key and value block read from memory).
const QUERY_BLOCK: usize = 8;

impl Attention {
    /// x: [n, hidden] (normed) at positions `state.len()..`; returns [n, hidden].
    pub fn forward(&self, x: &[f32], n: usize, state: &mut AttnState) -> Vec<f32> {
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let q_all = self.q_proj.forward(x, n);
        let mut k_all = self.k_proj.forward(x, n);
        let v_all = self.v_proj.forward(x, n);
        let start = state.len();
        let q_stride = if self.output_gate { 2 * hd } else { hd };

        // Queries: norm + rope per head, laid out KV-head-major
        // (`[nkv, n, group, hd]`) so a run of tokens' heads sharing a KV
        // head is contiguous; gates kept apart (`[n, nh, hd]`).
        let group = nh / nkv;
        let head_at = |t: usize, h: usize| ((h / group * n + t) * group + h % group) * hd;
        let mut q = vec![0.0f32; n * nh * hd];
        let mut gate = if self.output_gate {
            vec![0.0f32; n * nh * hd]
        } else {
            Vec::new()
        };
        for t in 0..n {
            for h in 0..nh {
                let src = &q_all[(t * nh + h) * q_stride..][..q_stride];
                let dst = &mut q[head_at(t, h)..][..hd];
                ops::rms_norm(&src[..hd], &self.q_norm, self.eps, dst);
                self.rope.apply(dst, start + t);
                if self.output_gate {
                    gate[(t * nh + h) * hd..][..hd].copy_from_slice(&src[hd..]);
                }
            }
            for h in 0..nkv {
                let kh = &mut k_all[(t * nkv + h) * hd..][..hd];
                ops::rms_norm_inplace(kh, &self.k_norm, self.eps);
                self.rope.apply(kh, start + t);
            }
        }
        state.append(&k_all, &v_all, n);

        // The query heads sharing a KV head walk the keys and values
        // together, QUERY_BLOCK tokens at a time, so each K and V row is
        // read from memory once per KV head and block: parallel over (KV
        // head, block). Each (token, head) still computes its dot products,
        // softmax and weighted sum in the same order as alone.
        let scale = 1.0 / (hd as f32).sqrt();
        let kv_stride = nkv * hd;
        let mut out_kv = vec![0.0f32; n * nh * hd];
        out_kv
            .par_chunks_mut(n * group * hd)
            .zip(q.par_chunks(n * group * hd))
            .enumerate()
            .for_each(|(kvh, (oh, qh))| {
                let kv = k::attention::KvRows {
                    k: &state.k[kvh * hd..],
                    v: &state.v[kvh * hd..],
                    stride: kv_stride,
                    hd,
                };
                let block = QUERY_BLOCK * group * hd;
                oh.par_chunks_mut(block)
                    .zip(qh.par_chunks(block))
                    .enumerate()
                    .for_each(|(b, (ob, qb))| {
                        let t0 = b * QUERY_BLOCK;
                        let tokens = ob.len() / (group * hd);
                        let first_keys = start + t0 + 1;
                        let keys = first_keys + tokens - 1;
                        let mut scores = vec![0.0f32; tokens * group * keys];
                        k::attention::attend_tokens(
                            k::Isa::detect(),
                            qb,
                            &kv,
                            tokens,
                            first_keys,
                            scale,
                            &mut scores,
                            ob,
                        );
                    });
            });
        // Back to `[n, nh, hd]`, through the output gate.
        let mut out = vec![0.0f32; n * nh * hd];
        out.par_chunks_mut(nh * hd).enumerate().for_each(|(t, ot)| {
            for (h, o) in ot.chunks_exact_mut(hd).enumerate() {
                o.copy_from_slice(&out_kv[head_at(t, h)..][..hd]);
                if self.output_gate {
                    for (oi, &gv) in o.iter_mut().zip(&gate[(t * nh + h) * hd..][..hd]) {
                        *oi *= ops::sigmoid(gv);
                    }
                }
            }
        });
        self.o_proj.forward(&out, n)
    }
}

/// Gated DeltaNet linear attention (Qwen3.5 / Qwen3-Next).
#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    pub in_proj_qkv: Linear,
    pub in_proj_z: Linear,
    pub in_proj_b: Linear,
    pub in_proj_a: Linear,
    /// `[conv_dim, kernel]`: tap j multiplies input t - (kernel-1) + j.
    pub conv: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// `[value_dim]`, plain (not 1+w).
    pub norm: Vec<f32>,
    pub out_proj: Linear,
    pub num_k_heads: usize,
    pub k_dim: usize,
    pub num_v_heads: usize,
    pub v_dim: usize,
    pub kernel: usize,
    pub eps: f32,
}

impl GatedDeltaNet {
    pub fn conv_dim(&self) -> usize {
        2 * self.num_k_heads * self.k_dim + self.num_v_heads * self.v_dim
    }

    /// x: [n, hidden] (normed); returns [n, hidden]. Carries conv and
    /// recurrent state in `state`, one token at a time (the recurrent form).
    pub fn forward(&self, x: &[f32], n: usize, state: &mut LinearState) -> Vec<f32> {
        self.forward_recording(x, n, state, None)
    }

    /// [`GatedDeltaNet::forward`] that, when `trail` is given, appends the
    /// state after each of the first `n - 1` tokens to it (the state after
    /// the last is `state` itself): what a speculative verify pass rolls
    /// back to. Recording copies states and changes no number.
    pub fn forward_recording(
        &self,
        x: &[f32],
        n: usize,
        state: &mut LinearState,
        trail: Option<&mut Vec<LinearState>>,
    ) -> Vec<f32> {
        let record = trail.is_some() && n > 1;
        let c = self.conv_dim();
        let (nk, dk, nv, dv, kk) = (
            self.num_k_heads,
            self.k_dim,
            self.num_v_heads,
            self.v_dim,
            self.kernel,
        );
        let qkv = self.in_proj_qkv.forward(x, n);
        let z = self.in_proj_z.forward(x, n);
        let b = self.in_proj_b.forward(x, n);
        let a = self.in_proj_a.forward(x, n);

        // Causal depthwise conv + SiLU over [history (kernel-1 rows) ++ qkv].
        let hist = kk - 1;
        let mut window = Vec::with_capacity((hist + n) * c);
        window.extend_from_slice(&state.conv);
        window.extend_from_slice(&qkv);
        let mut conv_out = vec![0.0f32; n * c];
        conv_out.par_chunks_mut(c).enumerate().for_each(|(t, row)| {
            for (ch, o) in row.iter_mut().enumerate() {
                let taps = &self.conv[ch * kk..][..kk];
                let mut acc = 0.0f32;
                for (j, &w) in taps.iter().enumerate() {
                    acc += w * window[(t + j) * c + ch];
                }
                *o = ops::silu(acc);
            }
        });
        let conv_after: Vec<Vec<f32>> = if record {
            (1..n)
                .map(|t| window[t * c..(t + hist) * c].to_vec())
                .collect()
        } else {
            Vec::new()
        };
        state.conv.copy_from_slice(&window[n * c..]);

        // Delta rule per value head; heads are independent.
        let ratio = nv / nk;
        let q_scale = 1.0 / (dk as f32).sqrt();
        let per_head: Vec<(Vec<f32>, Vec<f32>)> = state
            .recurrent
            .par_chunks_mut(dk * dv)
            .enumerate()
            .map(|(j, s)| {
                let mut head_out = vec![0.0f32; n * dv];
                // This head's state after each token but the last.
                let mut snaps = Vec::with_capacity(if record { (n - 1) * dk * dv } else { 0 });
                let kh = j / ratio;
                let mut q = vec![0.0f32; dk];
                let mut key = vec![0.0f32; dk];
                let mut delta = vec![0.0f32; dv];
                let mut o = vec![0.0f32; dv];
                let decay_rate = -self.a_log[j].exp();
                for t in 0..n {
                    let row = &conv_out[t * c..][..c];
                    q.copy_from_slice(&row[kh * dk..][..dk]);
                    key.copy_from_slice(&row[nk * dk + kh * dk..][..dk]);
                    let v = &row[2 * nk * dk + j * dv..][..dv];
                    ops::l2_normalize(&mut q, 1e-6);
                    ops::l2_normalize(&mut key, 1e-6);
                    for qi in q.iter_mut() {
                        *qi *= q_scale;
                    }
                    let beta = ops::sigmoid(b[t * nv + j]);
                    let g = decay_rate * ops::softplus(a[t * nv + j] + self.dt_bias[j]);
                    let decay = g.exp();
                    ops::delta_rule_step(
                        k::Isa::detect(),
                        s,
                        &key,
                        &q,
                        v,
                        decay,
                        beta,
                        &mut delta,
                        &mut o,
                    );
                    let inv = ops::inv_rms(&o, self.eps);
                    let zrow = &z[t * nv * dv + j * dv..][..dv];
                    let dst = &mut head_out[t * dv..][..dv];
                    for d in 0..dv {
                        dst[d] = (o[d] * inv) * self.norm[d] * ops::silu(zrow[d]);
                    }
                    if record && t + 1 < n {
                        snaps.extend_from_slice(s);
                    }
                }
                (head_out, snaps)
            })
            .collect();
        let mut core = vec![0.0f32; n * nv * dv];
        for (j, (head_out, _)) in per_head.iter().enumerate() {
            for t in 0..n {
                core[(t * nv + j) * dv..][..dv].copy_from_slice(&head_out[t * dv..][..dv]);
            }
        }
        if let (Some(trail), true) = (trail, record) {
            let per = dk * dv;
            for (t, conv) in conv_after.into_iter().enumerate() {
                let mut recurrent = Vec::with_capacity(nv * per);
                for (_, snaps) in &per_head {
                    recurrent.extend_from_slice(&snaps[t * per..][..per]);
                }
                trail.push(LinearState { conv, recurrent });
            }
        }
        self.out_proj.forward(&core, n)
    }
}

/// A dense SwiGLU feed-forward (the shared expert).
#[derive(Debug, Clone)]
pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl Mlp {
    /// x: [n, hidden] -> [n, hidden]
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut g = self.gate_proj.forward(x, n);
        let u = self.up_proj.forward(x, n);
        for (gi, ui) in g.iter_mut().zip(&u) {
            *gi = ops::silu(*gi) * ui;
        }
        self.down_proj.forward(&g, n)
    }
}

/// Routed mixture of experts with an optional gated shared expert.
#[derive(Debug, Clone)]
pub struct Moe {
    pub layer: usize,
    pub router: Linear,
    pub num_experts: usize,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub shared: Option<(Mlp, Linear)>,
    pub hidden: usize,
    /// How inputs enter the routed experts' 4-bit products.
    pub act: k::Activations,
}

/// Where [`Moe::forward_timed`] spent its time (nanoseconds, accumulated).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MoeTimes {
    /// Router matvec, softmax and top-k.
    pub router_ns: u64,
    /// The shared expert and its gate: the time they ran past the routed
    /// experts, which they run beside.
    pub shared_ns: u64,
    /// The routed experts' feed-forward (inside the store's callback).
    pub routed_ffn_ns: u64,
    /// In the store outside the callback: starting reads, waiting for them,
    /// verifying and copying (the expert-read wait seen by the model).
    pub wait_ns: u64,
}

/// One token's routing decision: expert ids and weights in rank order.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

impl Moe {
    /// Softmax over all experts, top-k (ties to the lower id), optional renorm.
    pub fn route(&self, logits: &[f32]) -> Route {
        let mut p = logits.to_vec();
        ops::softmax_inplace(&mut p);
        let mut idx: Vec<u32> = (0..self.num_experts as u32).collect();
        idx.sort_by(|&a, &b| {
            p[b as usize]
                .partial_cmp(&p[a as usize])
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.cmp(&b))
        });
        idx.truncate(self.top_k);
        let mut weights: Vec<f32> = idx.iter().map(|&e| p[e as usize]).collect();
        if self.norm_topk_prob {
            let sum: f32 = weights.iter().sum();
            for w in weights.iter_mut() {
                *w /= sum;
            }
        }
        Route {
            experts: idx,
            weights,
        }
    }

    /// x: [n, hidden] (normed) -> [n, hidden]. Each needed expert is fetched
    /// once for the chunk and run on every token that chose it. The result
    /// does not depend on the order the store delivers experts in: each
    /// (token, rank) output has its own buffer and they are summed in rank order.
    pub fn forward(
        &self,
        x: &[f32],
        n: usize,
        experts: &mut dyn ExpertSource,
        routes_out: Option<&mut Vec<Route>>,
    ) -> Result<Vec<f32>, ModelError> {
        self.forward_timed(x, n, experts, routes_out, None)
    }

    /// [`Moe::forward`] that adds its phases to `times` when given (the
    /// numbers are the same either way).
    pub fn forward_timed(
        &self,
        x: &[f32],
        n: usize,
        experts: &mut dyn ExpertSource,
        routes_out: Option<&mut Vec<Route>>,
        times: Option<&mut MoeTimes>,
    ) -> Result<Vec<f32>, ModelError> {
        let h = self.hidden;
        let kk = self.top_k;
        let t_router = Instant::now();
        let logits = self.router.forward(x, n);
        let routes: Vec<Route> = (0..n)
            .map(|t| self.route(&logits[t * self.num_experts..][..self.num_experts]))
            .collect();
        // tokens_of[e] = [(token, rank)]
        let mut tokens_of: Vec<Vec<(usize, usize)>> = vec![Vec::new(); self.num_experts];
        for (t, r) in routes.iter().enumerate() {
            for (rank, &e) in r.experts.iter().enumerate() {
                tokens_of[e as usize].push((t, rank));
            }
        }
        let needed: Vec<u32> = (0..self.num_experts as u32)
            .filter(|&e| !tokens_of[e as usize].is_empty())
            .collect();
        let counts: Vec<u32> = needed
            .iter()
            .map(|&e| tokens_of[e as usize].len() as u32)
            .collect();
        let request = ExpertRequest {
            layer: self.layer,
            experts: &needed,
            counts: &counts,
            tokens: n as u32,
        };
        let router_ns = t_router.elapsed().as_nanos() as u64;
        // Reads start now; the shared expert runs beside the routed ones
        // (and while their reads land).
        let t_begin = Instant::now();
        experts.begin(&request).map_err(ModelError::Store)?;
        let begin_ns = t_begin.elapsed().as_nanos() as u64;
        let mut per_rank = vec![0.0f32; n * kk * h];
        let mut ffn_ns = 0u64;
        // One expert's feed-forward on the tokens that chose it:
        // `[m, hidden]` out, unweighted.
        let run_expert = |e: u32, w: &ExpertWeights<'_>| -> Vec<f32> {
            let users = &tokens_of[e as usize];
            let mut gathered = Vec::with_capacity(users.len() * h);
            for &(t, _) in users {
                gathered.extend_from_slice(&x[t * h..][..h]);
            }
            let m = users.len();
            let inter = w.gate.rows;
            let mut g = vec![0.0f32; m * inter];
            let mut u = vec![0.0f32; m * inter];
            let (isa, act) = (k::Isa::detect(), self.act);
            k::matmul_act(isa, act, &w.gate, &gathered, m, &mut g);
            k::matmul_act(isa, act, &w.up, &gathered, m, &mut u);
            for (gi, ui) in g.iter_mut().zip(&u) {
                *gi = ops::silu(*gi) * ui;
            }
            let mut d = vec![0.0f32; m * h];
            k::matmul_act(isa, act, &w.down, &g, m, &mut d);
            d
        };
        let t_par = Instant::now();
        let ((shared, shared_ns), (routed, experts_ns)) = rayon::join(
            || {
                let t_shared = Instant::now();
                let shared = self.shared.as_ref().map(|(mlp, gate)| {
                    let s = mlp.forward(x, n);
                    let g = gate.forward(x, n);
                    (s, g)
                });
                (shared, t_shared.elapsed().as_nanos() as u64)
            },
            || {
                let t_experts = Instant::now();
                let r = experts.with_expert_batches(&request, &mut |batch| {
                    let t_ffn = Instant::now();
                    // Experts that are ready together run in parallel, one per
                    // thread: a decode step's experts are each too small to split
                    // well across threads. Each output has its own buffer, so the
                    // numbers do not depend on the batching.
                    let outs: Vec<Vec<f32>> = if batch.len() > 1 {
                        batch.par_iter().map(|(e, w)| run_expert(*e, w)).collect()
                    } else {
                        batch.iter().map(|(e, w)| run_expert(*e, w)).collect()
                    };
                    for ((e, _), d) in batch.iter().zip(&outs) {
                        for (i, &(t, rank)) in tokens_of[*e as usize].iter().enumerate() {
                            let wgt = routes[t].weights[rank];
                            let dst = &mut per_rank[(t * kk + rank) * h..][..h];
                            for (o, &v) in dst.iter_mut().zip(&d[i * h..][..h]) {
                                *o = v * wgt;
                            }
                        }
                    }
                    ffn_ns += t_ffn.elapsed().as_nanos() as u64;
                });
                (r, t_experts.elapsed().as_nanos() as u64)
            },
        );
        routed.map_err(ModelError::Store)?;
        let par_ns = t_par.elapsed().as_nanos() as u64;
        if let Some(t) = times {
            // The two sides overlap: the shared expert is charged only the
            // time it ran past the routed side, so the phases still add up
            // to the wall time.
            t.router_ns += router_ns;
            t.shared_ns += par_ns.saturating_sub(experts_ns).min(shared_ns);
            t.routed_ffn_ns += ffn_ns;
            t.wait_ns += begin_ns + experts_ns.saturating_sub(ffn_ns);
        }
        let mut out = vec![0.0f32; n * h];
        for t in 0..n {
            let o = &mut out[t * h..][..h];
            for rank in 0..kk {
                for (oi, &v) in o.iter_mut().zip(&per_rank[(t * kk + rank) * h..][..h]) {
                    *oi += v;
                }
            }
        }
        if let Some((s, g)) = shared {
            for t in 0..n {
                let sg = ops::sigmoid(g[t]);
                for (oi, &v) in out[t * h..][..h].iter_mut().zip(&s[t * h..][..h]) {
                    *oi += sg * v;
                }
            }
        }
        if let Some(dst) = routes_out {
            dst.extend(routes);
        }
        Ok(out)
    }
}
