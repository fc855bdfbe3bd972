#!/usr/bin/env python3
"""Independent float64 numpy re-implementation of qwen3_5_moe / qwen3_moe written from
MODEL_SPEC.md (token-by-token recurrent form, no transformers import), checked against
tests/fixtures/*/logits.npy. Also reads the MLX 4-bit fixture with its own unpacking.

    tools/reference/.venv/bin/python tools/reference/numpy_check.py
"""
import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

FIX = Path(__file__).resolve().parent.parent.parent / "tests" / "fixtures"


def bf16_to_f64(a):
    return a


def load_all(d):
    import torch  # only for bf16 -> float conversion of safetensors
    from safetensors.torch import load_file as tload

    sd = {}
    for f in sorted(d.glob("*.safetensors")):
        for k, v in tload(str(f)).items():
            if v.dtype == torch.uint32:
                sd[k] = v.to(torch.int64).numpy()
            else:
                sd[k] = v.to(torch.float64).numpy()
    return sd


def rms(x, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def silu(x):
    return x / (1 + np.exp(-x))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def softplus(x):
    return np.log1p(np.exp(x))


def dequant(wq, s, b, bits, group=64):
    per = 32 // bits
    q = (wq[..., None] >> (np.arange(per) * bits)) & ((1 << bits) - 1)
    q = q.reshape(*wq.shape[:-1], -1).astype(np.float64)
    return np.repeat(s, group, -1) * q + np.repeat(b, group, -1)


def from_mlx(sd, cfg):
    """MLX keys -> HF qwen3_5_moe checkpoint keys (model.language_model.*), unshifted norms."""
    q = cfg["quantization"]
    out = {}
    for k in list(sd):
        if k.endswith(".scales"):
            base = k[:-7]
            o = q.get(base)
            bits = o["bits"] if isinstance(o, dict) else q["bits"]
            out[base + ".weight"] = dequant(sd[base + ".weight"], sd[base + ".scales"], sd[base + ".biases"], bits)
    for k, v in sd.items():
        if k.endswith((".scales", ".biases")) or k in out:
            continue
        out[k] = v
    hf = {}
    for k, v in out.items():
        if k.startswith("language_model.lm_head"):
            nk = "lm_head" + k[len("language_model.lm_head"):]
        else:
            nk = "model.language_model." + k[len("language_model.model."):]
        if nk.endswith((".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                        ".k_norm.weight")) or nk == "model.language_model.norm.weight":
            v = v - 1.0
        if nk.endswith("conv1d.weight"):
            v = np.transpose(v, (0, 2, 1))
        if ".switch_mlp." in nk:
            nk = nk.replace(".switch_mlp.", ".experts.")
            hf.setdefault(nk.rsplit(".", 2)[0], {})[nk.rsplit(".", 2)[1]] = v
            continue
        hf[nk] = v
    for base in [k for k in list(hf) if isinstance(hf[k], dict)]:
        d = hf.pop(base)
        hf[base + ".gate_up_proj"] = np.concatenate([d["gate_proj"], d["up_proj"]], axis=1)
        hf[base + ".down_proj"] = d["down_proj"]
    return hf


def experts_of(W, p, E, I):
    """-> list of (gate [I,H], up [I,H], down [H,I]) for both layouts."""
    if p + "experts.gate_up_proj" in W:
        gu, dn = W[p + "experts.gate_up_proj"], W[p + "experts.down_proj"]
        return [(gu[e, :I], gu[e, I:], dn[e]) for e in range(E)]
    return [(W[f"{p}experts.{e}.gate_proj.weight"], W[f"{p}experts.{e}.up_proj.weight"],
             W[f"{p}experts.{e}.down_proj.weight"]) for e in range(E)]


def run_qwen35(W, c, tokens):
    H, eps = c["hidden_size"], c["rms_norm_eps"]
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    rp = c["rope_parameters"]
    rot = int(hd * rp["partial_rotary_factor"])
    inv = rp["rope_theta"] ** (-np.arange(0, rot, 2) / rot)
    nk, dk, nv, dv = c["linear_num_key_heads"], c["linear_key_head_dim"], c["linear_num_value_heads"], c["linear_value_head_dim"]
    E, K, I = c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    pre = "model.language_model."
    L = c["num_hidden_layers"]
    kv = [([], []) for _ in range(L)]
    conv = [None] * L
    S = [np.zeros((nv, dk, dv)) for _ in range(L)]
    ex = [experts_of(W, f"{pre}layers.{l}.mlp.", E, I) for l in range(L)]
    logits = []
    for t, tokid in enumerate(tokens):
        x = W[pre + "embed_tokens.weight"][tokid].copy()
        for l in range(L):
            p = f"{pre}layers.{l}."
            h = rms(x, eps) * (1 + W[p + "input_layernorm.weight"])
            if c["layer_types"][l] == "full_attention":
                qg = (W[p + "self_attn.q_proj.weight"] @ h).reshape(nh, 2 * hd)
                q, gate = qg[:, :hd], qg[:, hd:].reshape(-1)
                k = (W[p + "self_attn.k_proj.weight"] @ h).reshape(nkv, hd)
                v = (W[p + "self_attn.v_proj.weight"] @ h).reshape(nkv, hd)
                q = rms(q, eps) * (1 + W[p + "self_attn.q_norm.weight"])
                k = rms(k, eps) * (1 + W[p + "self_attn.k_norm.weight"])
                ang = t * inv
                cos, sin = np.cos(ang), np.sin(ang)

                def rope(z):
                    z = z.copy()
                    a, b = z[:, : rot // 2].copy(), z[:, rot // 2: rot].copy()
                    z[:, : rot // 2] = a * cos - b * sin
                    z[:, rot // 2: rot] = b * cos + a * sin
                    return z

                q, k = rope(q), rope(k)
                kv[l][0].append(k)
                kv[l][1].append(v)
                Ks, Vs = np.stack(kv[l][0]), np.stack(kv[l][1])  # [T, nkv, hd]
                o = np.zeros((nh, hd))
                for hh in range(nh):
                    g = hh // (nh // nkv)
                    sc = Ks[:, g] @ q[hh] / np.sqrt(hd)
                    w = np.exp(sc - sc.max())
                    w /= w.sum()
                    o[hh] = w @ Vs[:, g]
                mix = W[p + "self_attn.o_proj.weight"] @ (o.reshape(-1) * sigmoid(gate))
            else:
                qkv = W[p + "linear_attn.in_proj_qkv.weight"] @ h
                z = (W[p + "linear_attn.in_proj_z.weight"] @ h).reshape(nv, dv)
                b = W[p + "linear_attn.in_proj_b.weight"] @ h
                a = W[p + "linear_attn.in_proj_a.weight"] @ h
                cw = W[p + "linear_attn.conv1d.weight"][:, 0, :]  # [C, 4]
                ks = cw.shape[1]
                if conv[l] is None:
                    conv[l] = np.zeros((qkv.shape[0], ks - 1))
                win = np.concatenate([conv[l], qkv[:, None]], 1)
                conv[l] = win[:, 1:]
                y = silu((win * cw).sum(1))
                q = y[: nk * dk].reshape(nk, dk)
                k = y[nk * dk: 2 * nk * dk].reshape(nk, dk)
                v = y[2 * nk * dk:].reshape(nv, dv)
                q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * dk ** -0.5
                k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
                beta = sigmoid(b)
                g = -np.exp(W[p + "linear_attn.A_log"]) * softplus(a + W[p + "linear_attn.dt_bias"])
                o = np.zeros((nv, dv))
                for j in range(nv):
                    kh = j // (nv // nk)
                    St = S[l][j] * np.exp(g[j])
                    delta = beta[j] * (v[j] - St.T @ k[kh])
                    St = St + np.outer(k[kh], delta)
                    S[l][j] = St
                    o[j] = St.T @ q[kh]
                o = rms(o, eps) * W[p + "linear_attn.norm.weight"] * silu(z)
                mix = W[p + "linear_attn.out_proj.weight"] @ o.reshape(-1)
            x = x + mix
            h = rms(x, eps) * (1 + W[p + "post_attention_layernorm.weight"])
            r = W[p + "mlp.gate.weight"] @ h
            pr = np.exp(r - r.max())
            pr /= pr.sum()
            top = np.argsort(-pr, kind="stable")[:K]
            wts = pr[top] / pr[top].sum()
            y = np.zeros(H)
            for e, wt in zip(top, wts):
                gp, up, dn = ex[l][e]
                y += wt * (dn @ (silu(gp @ h) * (up @ h)))
            se = W[p + "mlp.shared_expert.down_proj.weight"] @ (
                silu(W[p + "mlp.shared_expert.gate_proj.weight"] @ h) * (W[p + "mlp.shared_expert.up_proj.weight"] @ h))
            y += sigmoid(W[p + "mlp.shared_expert_gate.weight"] @ h)[0] * se
            x = x + y
        x = rms(x, eps) * (1 + W[pre + "norm.weight"])
        logits.append(W["lm_head.weight"] @ x)
    return np.stack(logits)


def run_qwen3moe(W, c, tokens):
    H, eps = c["hidden_size"], c["rms_norm_eps"]
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    inv = c["rope_parameters"]["rope_theta"] ** (-np.arange(0, hd, 2) / hd)
    E, K, I = c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    L = c["num_hidden_layers"]
    kv = [([], []) for _ in range(L)]
    ex = [experts_of(W, f"model.layers.{l}.mlp.", E, I) for l in range(L)]
    logits = []
    for t, tokid in enumerate(tokens):
        x = W["model.embed_tokens.weight"][tokid].copy()
        for l in range(L):
            p = f"model.layers.{l}."
            h = rms(x, eps) * W[p + "input_layernorm.weight"]
            q = (W[p + "self_attn.q_proj.weight"] @ h).reshape(nh, hd)
            k = (W[p + "self_attn.k_proj.weight"] @ h).reshape(nkv, hd)
            v = (W[p + "self_attn.v_proj.weight"] @ h).reshape(nkv, hd)
            q = rms(q, eps) * W[p + "self_attn.q_norm.weight"]
            k = rms(k, eps) * W[p + "self_attn.k_norm.weight"]
            cos, sin = np.cos(t * inv), np.sin(t * inv)

            def rope(z):
                a, b = z[:, : hd // 2], z[:, hd // 2:]
                return np.concatenate([a * cos - b * sin, b * cos + a * sin], 1)

            q, k = rope(q), rope(k)
            kv[l][0].append(k)
            kv[l][1].append(v)
            Ks, Vs = np.stack(kv[l][0]), np.stack(kv[l][1])
            o = np.zeros((nh, hd))
            for hh in range(nh):
                g = hh // (nh // nkv)
                sc = Ks[:, g] @ q[hh] / np.sqrt(hd)
                w = np.exp(sc - sc.max())
                w /= w.sum()
                o[hh] = w @ Vs[:, g]
            x = x + W[p + "self_attn.o_proj.weight"] @ o.reshape(-1)
            h = rms(x, eps) * W[p + "post_attention_layernorm.weight"]
            r = W[p + "mlp.gate.weight"] @ h
            pr = np.exp(r - r.max())
            pr /= pr.sum()
            top = np.argsort(-pr, kind="stable")[:K]
            wts = pr[top] / pr[top].sum() if c["norm_topk_prob"] else pr[top]
            y = np.zeros(H)
            for e, wt in zip(top, wts):
                gp, up, dn = ex[l][e]
                y += wt * (dn @ (silu(gp @ h) * (up @ h)))
            x = x + y
        x = rms(x, eps) * W["model.norm.weight"]
        logits.append(W["lm_head.weight"] @ x)
    return np.stack(logits)


def main():
    worst = 0.0
    for name in ["qwen3_5_moe_fused", "qwen3_5_moe_split", "qwen3_moe", "qwen3_5_moe_mlx4"]:
        d = FIX / name
        cfg = json.load(open(d / "config.json"))
        ref = json.load(open(d / "reference.json"))
        toks = ref["prompt_tokens"] + ref["greedy_tokens"]
        W = load_all(d)
        if name == "qwen3_moe":
            lg = run_qwen3moe(W, cfg, toks)
        else:
            if "quantization" in cfg:
                W = from_mlx(W, cfg)
            lg = run_qwen35(W, cfg["text_config"], toks)
        L = np.load(d / "logits.npy")
        diff = np.abs(lg - L).max()
        P = len(ref["prompt_tokens"])
        am = lg[P - 1: P - 1 + 8].argmax(-1).tolist()
        print(f"{name}: numpy f64 vs logits.npy max|d| = {diff:.2e} (max|logit| {np.abs(L).max():.2f}); "
              f"greedy match {am == ref['greedy_tokens']}")
        worst = max(worst, diff)
        assert am == ref["greedy_tokens"]
    assert worst < 5e-3, worst
    print("OK")


if __name__ == "__main__":
    sys.exit(main())
