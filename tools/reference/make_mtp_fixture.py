#!/usr/bin/env python3
"""Reference fixture for the MTP (multi-token prediction) head of qwen3_5_moe.

`transformers` 5.23.0 has no class that runs Qwen3.5's `mtp.*` head (its
qwen3_5_moe model drops those tensors), so the reference is written here in
float64 numpy from the published math, independently of the Rust code:

  * main model: MODEL_SPEC.md section 1 (same recurrent form as numpy_check.py);
  * MTP head, as vLLM's `qwen3_5_mtp.py` (Qwen3_5MultiTokenPredictor) and
    llama.cpp's `models/qwen35moe.cpp` (graph_mtp) compute it:
        x   = fc( concat( pre_fc_norm_embedding(embed(x_{t+1})),
                          pre_fc_norm_hidden(h_t) ) )        # fc: [H, 2H]
        x   = x + gated_attention(input_layernorm(x))       # own KV cache
        x   = x + moe(post_attention_layernorm(x))          # routed + shared
        out = lm_head( mtp.norm(x) )                         # shared lm_head
    where h_t is the main model's hidden state at position t AFTER its final
    norm (what both feed the head), every RMSNorm is zero-centred (1 + w), and
    MTP row t sits at RoPE position t.

Writes tests/fixtures/qwen3_5_moe_mtp/: config.json (text_config with
mtp_num_hidden_layers = 1), model.safetensors (f32; main experts fused,
the MTP layer's experts per expert: both layouts vLLM loads), and
  logits.npy      [T, V]    main-model logits after each token
  hidden.npy      [T, H]    main-model hidden state after the final norm
  mtp_logits.npy  [T-1, V]  MTP logits of row t (h_t, token t+1) -> token t+2
  reference.json  tokens, seed, versions, margins.

Run with the pinned venv (only numpy and safetensors are needed):
    tools/reference/.venv/bin/python tools/reference/make_mtp_fixture.py
Re-running gives byte-identical files.
"""
import json
import sys
from pathlib import Path

import numpy as np
import safetensors
from safetensors.numpy import save_file

FIX = Path(__file__).resolve().parent.parent.parent / "tests" / "fixtures" / "qwen3_5_moe_mtp"
SEED = 20260
T = 12

TEXT = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "mtp_num_hidden_layers": 1,
    "eos_token_id": 2,
}


def rms(x, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def silu(x):
    return x / (1 + np.exp(-x))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def softplus(x):
    return np.log1p(np.exp(x))


# ----------------------------------------------------------------------------- weights


def make_weights(rng):
    c = TEXT
    H, V, E, I, SI = c["hidden_size"], c["vocab_size"], c["num_experts"], c["moe_intermediate_size"], c[
        "shared_expert_intermediate_size"]
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    nk, dk, nv, dv = c["linear_num_key_heads"], c["linear_key_head_dim"], c["linear_num_value_heads"], c[
        "linear_value_head_dim"]
    W = {}

    def mat(name, rows, cols, scale=1.0):
        W[name] = (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def norm(name, n):
        # Zero-centred, perturbed so that 1 + w matters.
        W[name] = (0.3 * rng.standard_normal(n)).astype(np.float32)

    def attn_moe(p, fused):
        norm(p + "input_layernorm.weight", H)
        norm(p + "post_attention_layernorm.weight", H)
        mat(p + "mlp.gate.weight", E, H, 3.0)  # a sharp router: clear top-k gaps
        mat(p + "mlp.shared_expert.gate_proj.weight", SI, H)
        mat(p + "mlp.shared_expert.up_proj.weight", SI, H)
        mat(p + "mlp.shared_expert.down_proj.weight", H, SI)
        mat(p + "mlp.shared_expert_gate.weight", 1, H)
        g = (rng.standard_normal((E, I, H)) / np.sqrt(H)).astype(np.float32)
        u = (rng.standard_normal((E, I, H)) / np.sqrt(H)).astype(np.float32)
        d = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
        if fused:
            W[p + "mlp.experts.gate_up_proj"] = np.concatenate([g, u], axis=1)
            W[p + "mlp.experts.down_proj"] = d
        else:
            for e in range(E):
                W[f"{p}mlp.experts.{e}.gate_proj.weight"] = g[e]
                W[f"{p}mlp.experts.{e}.up_proj.weight"] = u[e]
                W[f"{p}mlp.experts.{e}.down_proj.weight"] = d[e]

    def full_attn(p):
        mat(p + "self_attn.q_proj.weight", nh * hd * 2, H)
        mat(p + "self_attn.k_proj.weight", nkv * hd, H)
        mat(p + "self_attn.v_proj.weight", nkv * hd, H)
        mat(p + "self_attn.o_proj.weight", H, nh * hd)
        norm(p + "self_attn.q_norm.weight", hd)
        norm(p + "self_attn.k_norm.weight", hd)

    pre = "model.language_model."
    W[pre + "embed_tokens.weight"] = rng.standard_normal((V, H)).astype(np.float32)
    for l, kind in enumerate(c["layer_types"]):
        p = f"{pre}layers.{l}."
        if kind == "full_attention":
            full_attn(p)
        else:
            conv_dim = 2 * nk * dk + nv * dv
            q = p + "linear_attn."
            mat(q + "in_proj_qkv.weight", conv_dim, H)
            mat(q + "in_proj_z.weight", nv * dv, H)
            mat(q + "in_proj_b.weight", nv, H)
            mat(q + "in_proj_a.weight", nv, H)
            W[q + "conv1d.weight"] = (0.5 * rng.standard_normal((conv_dim, 1, 4))).astype(np.float32)
            W[q + "A_log"] = np.log(rng.uniform(1, 16, nv)).astype(np.float32)
            W[q + "dt_bias"] = rng.uniform(-1, 1, nv).astype(np.float32)
            W[q + "norm.weight"] = (1 + 0.3 * rng.standard_normal(dv)).astype(np.float32)
            mat(q + "out_proj.weight", H, nv * dv)
        attn_moe(p, fused=True)
    norm(pre + "norm.weight", H)
    mat("lm_head.weight", V, H, 4.0)
    # The MTP head (top-level `mtp.*`, as in the official checkpoints).
    norm("mtp.pre_fc_norm_embedding.weight", H)
    norm("mtp.pre_fc_norm_hidden.weight", H)
    mat("mtp.fc.weight", H, 2 * H)
    full_attn("mtp.layers.0.")
    attn_moe("mtp.layers.0.", fused=False)
    norm("mtp.norm.weight", H)
    return {k: np.ascontiguousarray(v) for k, v in W.items()}


# ----------------------------------------------------------------------------- math


class Ctx:
    def __init__(self, c):
        self.c = c
        self.H, self.eps = c["hidden_size"], c["rms_norm_eps"]
        self.nh, self.nkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        rp = c["rope_parameters"]
        self.rot = int(self.hd * rp["partial_rotary_factor"])
        self.inv = rp["rope_theta"] ** (-np.arange(0, self.rot, 2) / self.rot)
        self.E, self.K, self.I = c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
        self.gaps = []  # router k-th vs (k+1)-th logit gaps


def norm1(x, w, eps):
    return rms(x, eps) * (1 + w)


def attention(W, p, h, t, kv, x):
    nh, nkv, hd, eps, rot, inv = x.nh, x.nkv, x.hd, x.eps, x.rot, x.inv
    qg = (W[p + "self_attn.q_proj.weight"] @ h).reshape(nh, 2 * hd)
    q, gate = qg[:, :hd], qg[:, hd:].reshape(-1)
    k = (W[p + "self_attn.k_proj.weight"] @ h).reshape(nkv, hd)
    v = (W[p + "self_attn.v_proj.weight"] @ h).reshape(nkv, hd)
    q = norm1(q, W[p + "self_attn.q_norm.weight"], eps)
    k = norm1(k, W[p + "self_attn.k_norm.weight"], eps)
    cos, sin = np.cos(t * inv), np.sin(t * inv)

    def rope(z):
        z = z.copy()
        a, b = z[:, : rot // 2].copy(), z[:, rot // 2: rot].copy()
        z[:, : rot // 2] = a * cos - b * sin
        z[:, rot // 2: rot] = b * cos + a * sin
        return z

    q, k = rope(q), rope(k)
    kv[0].append(k)
    kv[1].append(v)
    Ks, Vs = np.stack(kv[0]), np.stack(kv[1])
    o = np.zeros((nh, hd))
    for hh in range(nh):
        g = hh // (nh // nkv)
        sc = Ks[:, g] @ q[hh] / np.sqrt(hd)
        w = np.exp(sc - sc.max())
        w /= w.sum()
        o[hh] = w @ Vs[:, g]
    return W[p + "self_attn.o_proj.weight"] @ (o.reshape(-1) * sigmoid(gate))


def experts_of(W, p, E, I):
    if p + "mlp.experts.gate_up_proj" in W:
        gu, dn = W[p + "mlp.experts.gate_up_proj"], W[p + "mlp.experts.down_proj"]
        return [(gu[e, :I], gu[e, I:], dn[e]) for e in range(E)]
    return [(W[f"{p}mlp.experts.{e}.gate_proj.weight"], W[f"{p}mlp.experts.{e}.up_proj.weight"],
             W[f"{p}mlp.experts.{e}.down_proj.weight"]) for e in range(E)]


def moe(W, p, h, x):
    r = W[p + "mlp.gate.weight"] @ h
    pr = np.exp(r - r.max())
    pr /= pr.sum()
    order = np.argsort(-pr, kind="stable")
    x.gaps.append(r[order[x.K - 1]] - r[order[x.K]])
    top = order[: x.K]
    wts = pr[top] / pr[top].sum()
    ex = experts_of(W, p, x.E, x.I)
    y = np.zeros(x.H)
    for e, wt in zip(top, wts):
        gp, up, dn = ex[e]
        y += wt * (dn @ (silu(gp @ h) * (up @ h)))
    se = W[p + "mlp.shared_expert.down_proj.weight"] @ (
        silu(W[p + "mlp.shared_expert.gate_proj.weight"] @ h) * (W[p + "mlp.shared_expert.up_proj.weight"] @ h))
    return y + sigmoid(W[p + "mlp.shared_expert_gate.weight"] @ h)[0] * se


def run_main(W, x, tokens):
    """-> (logits [T, V], hidden after the final norm [T, H])."""
    c, eps = x.c, x.eps
    nk, dk, nv, dv = c["linear_num_key_heads"], c["linear_key_head_dim"], c["linear_num_value_heads"], c[
        "linear_value_head_dim"]
    pre = "model.language_model."
    L = c["num_hidden_layers"]
    kv = [([], []) for _ in range(L)]
    conv = [None] * L
    S = [np.zeros((nv, dk, dv)) for _ in range(L)]
    logits, hidden = [], []
    for t, tok in enumerate(tokens):
        h_res = W[pre + "embed_tokens.weight"][tok].astype(np.float64)
        for l in range(L):
            p = f"{pre}layers.{l}."
            h = norm1(h_res, W[p + "input_layernorm.weight"], eps)
            if c["layer_types"][l] == "full_attention":
                mix = attention(W, p, h, t, kv[l], x)
            else:
                q_ = p + "linear_attn."
                qkv = W[q_ + "in_proj_qkv.weight"] @ h
                z = (W[q_ + "in_proj_z.weight"] @ h).reshape(nv, dv)
                b = W[q_ + "in_proj_b.weight"] @ h
                a = W[q_ + "in_proj_a.weight"] @ h
                cw = W[q_ + "conv1d.weight"][:, 0, :]
                if conv[l] is None:
                    conv[l] = np.zeros((qkv.shape[0], cw.shape[1] - 1))
                win = np.concatenate([conv[l], qkv[:, None]], 1)
                conv[l] = win[:, 1:]
                y = silu((win * cw).sum(1))
                q = y[: nk * dk].reshape(nk, dk)
                k = y[nk * dk: 2 * nk * dk].reshape(nk, dk)
                v = y[2 * nk * dk:].reshape(nv, dv)
                q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * dk ** -0.5
                k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
                beta = sigmoid(b)
                g = -np.exp(W[q_ + "A_log"]) * softplus(a + W[q_ + "dt_bias"])
                o = np.zeros((nv, dv))
                for j in range(nv):
                    kh = j // (nv // nk)
                    St = S[l][j] * np.exp(g[j])
                    delta = beta[j] * (v[j] - St.T @ k[kh])
                    St = St + np.outer(k[kh], delta)
                    S[l][j] = St
                    o[j] = St.T @ q[kh]
                o = rms(o, eps) * W[q_ + "norm.weight"] * silu(z)
                mix = W[q_ + "out_proj.weight"] @ o.reshape(-1)
            h_res = h_res + mix
            h_res = h_res + moe(W, p, norm1(h_res, W[p + "post_attention_layernorm.weight"], eps), x)
        hn = norm1(h_res, W[pre + "norm.weight"], eps)
        hidden.append(hn)
        logits.append(W["lm_head.weight"] @ hn)
    return np.stack(logits), np.stack(hidden)


def run_mtp(W, x, hidden, next_tokens):
    """Row t: main hidden h_t (after the final norm) and token t+1 -> logits for t+2."""
    eps = x.eps
    p = "mtp.layers.0."
    kv = ([], [])
    out = []
    for t, (h_t, tok) in enumerate(zip(hidden, next_tokens)):
        e = norm1(W["model.language_model.embed_tokens.weight"][tok].astype(np.float64),
                  W["mtp.pre_fc_norm_embedding.weight"], eps)
        hn = norm1(h_t, W["mtp.pre_fc_norm_hidden.weight"], eps)
        r = W["mtp.fc.weight"] @ np.concatenate([e, hn])
        r = r + attention(W, p, norm1(r, W[p + "input_layernorm.weight"], eps), t, kv, x)
        r = r + moe(W, p, norm1(r, W[p + "post_attention_layernorm.weight"], eps), x)
        out.append(W["lm_head.weight"] @ norm1(r, W["mtp.norm.weight"], eps))
    return np.stack(out)


def top2_margin(lg):
    s = np.sort(lg, -1)
    return float(((s[:, -1] - s[:, -2]) / np.abs(lg).max()).min())


def main():
    FIX.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    W = make_weights(rng)
    tokens = [int(t) for t in rng.integers(3, TEXT["vocab_size"], T)]
    Wd = {k: v.astype(np.float64) for k, v in W.items()}
    x = Ctx(TEXT)
    logits, hidden = run_main(Wd, x, tokens)
    mtp = run_mtp(Wd, x, hidden[:-1], tokens[1:])
    gap = float(min(x.gaps))
    # A near tie in expert choice would let f32 rounding flip an expert.
    assert gap > 1e-3, f"router top-k gap {gap} too small; pick another seed"

    config = {
        "model_type": "qwen3_5_moe",
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "tie_word_embeddings": False,
        "text_config": TEXT,
    }
    (FIX / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(W, str(FIX / "model.safetensors"), metadata={"format": "pt"})
    np.save(FIX / "logits.npy", logits.astype(np.float32))
    np.save(FIX / "hidden.npy", hidden.astype(np.float32))
    np.save(FIX / "mtp_logits.npy", mtp.astype(np.float32))
    ref = {
        "tokens": tokens,
        "seed": SEED,
        "numpy": np.__version__,
        "safetensors": safetensors.__version__,
        "router_topk_gap_min": gap,
        "main_top2_margin_min": top2_margin(logits),
        "mtp_top2_margin_min": top2_margin(mtp),
        "mtp_greedy": [int(i) for i in mtp.argmax(-1)],
    }
    (FIX / "reference.json").write_text(json.dumps(ref, indent=2) + "\n")
    size = sum(f.stat().st_size for f in FIX.iterdir())
    print(f"wrote {FIX} ({size} bytes); router gap {gap:.3e}; "
          f"mtp top-2 margin {ref['mtp_top2_margin_min']:.3e}")


if __name__ == "__main__":
    sys.exit(main())
