#!/usr/bin/env python3
"""GGUF parity fixtures for slipstream (tests/fixtures/gguf_*/).

Each fixture is a tiny random Hugging Face model converted to GGUF by
llama.cpp's own converter, plus the `transformers` reference logits computed
on exactly the weights the GGUF holds (dequantized where quantized):

  gguf_qwen35moe_f16    qwen3_5_moe, convert_hf_to_gguf.py --outtype f16
  gguf_qwen35moe_q8_0   the same model, --outtype q8_0 (the converter's own Q8_0)
  gguf_qwen35moe_kquant qwen3_5_moe with hidden 256, converted at f32, then
                        tensors re-encoded as Q4_0 / Q8_0 / BF16 (gguf-py's
                        quantizers) and Q4_K / Q5_K / Q6_K (random blocks:
                        gguf-py implements only their dequantization, so the
                        blocks are drawn at random and the reference uses
                        gguf-py's dequantized values)
  gguf_qwen3moe_q4_0    qwen3_moe, converted at f32, experts as Q4_0, the
                        rest Q8_0 (gguf-py quantizers)
  gguf_qwen3next_f16    qwen3_next (Qwen3NextForCausalLM), --outtype f16: the
                        converter splits in_proj_qkvz into attn_qkv /
                        attn_gate and keeps in_proj_ba fused as ssm_ba
  gguf_qwen3next_q8_0   the same model, --outtype q8_0

Every qwen3_5_moe model has linear_num_value_heads > linear_num_key_heads, so
the converter's value-head reorder (grouped -> tiled) is exercised and a
wrong inverse fails the Rust parity test. The inverse mapping below (GGUF ->
HF state dict) is itself checked: applied to the f32 conversion it must give
back the original HF weights.

Environment (tools/reference/README.md): the pinned venv plus the
llama-cpp-python 0.3.36 sdist, whose vendor/llama.cpp holds the converter and
gguf-py 0.19.0 (nothing is built):

  pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/sd
  tar xzf /tmp/sd/llama_cpp_python-0.3.36.tar.gz -C /tmp/sd
  LLAMA_CPP_DIR=/tmp/sd/llama_cpp_python-0.3.36/vendor/llama.cpp \
    tools/reference/.venv/bin/python tools/reference/make_gguf_fixtures.py

The converter rejects the fixtures' trained tokenizer (its pre-tokenizer hash
is not in its table); we tell it the pre-tokenizer is "gpt-2", which is what
the fixtures' tokenizer is (byte-level BPE with the GPT-2 split regex); it only
sets tokenizer.ggml.pre.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_fixtures as mf  # noqa: E402

LLAMA = Path(os.environ.get("LLAMA_CPP_DIR", "/tmp/gg/llama_cpp_python-0.3.36/vendor/llama.cpp"))
sys.path.insert(0, str(LLAMA / "gguf-py"))
import gguf  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import GGUFReader, GGUFWriter, GGUFValueType  # noqa: E402
from gguf import quants  # noqa: E402

assert gguf.__file__.startswith(str(LLAMA)), gguf.__file__

CONVERT_WRAPPER = """
import sys, runpy
sys.path.insert(0, {llama!r}); sys.path.insert(0, {gguf_py!r})
import conversion.base as b
b.TextModel.get_vocab_base_pre = lambda self, tok: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
runpy.run_path({script!r}, run_name="__main__")
"""


# ----------------------------------------------------------------------------- conversion


def convert(hf_dir: Path, outtype: str, out: Path, no_mtp: bool):
    wrapper = out.parent / "convert_wrapper.py"
    wrapper.write_text(CONVERT_WRAPPER.format(llama=str(LLAMA), gguf_py=str(LLAMA / "gguf-py"),
                                              script=str(LLAMA / "convert_hf_to_gguf.py")))
    args = [sys.executable, str(wrapper), str(hf_dir), "--outtype", outtype, "--outfile", str(out)]
    if no_mtp:
        args.append("--no-mtp")
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def read_gguf(path: Path):
    """(metadata fields, {name: (qtype, dequantized f32 array in numpy/torch order, raw)})."""
    r = GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        shape = [int(x) for x in reversed(t.shape)]
        raw = np.array(t.data)
        if t.tensor_type in (QT.F32,):
            deq = raw.astype(np.float32).reshape(shape)
        elif t.tensor_type == QT.BF16:
            deq = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
        else:
            deq = quants.dequantize(raw, t.tensor_type).astype(np.float32).reshape(shape)
        out[t.name] = (t.tensor_type, deq, raw)
    return r, out


def copy_fields(reader: GGUFReader, writer: GGUFWriter):
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)


def random_kquant(shape, qtype, std, rng: np.random.Generator) -> np.ndarray:
    """Random but well-formed K-quant blocks for a [rows, cols] tensor whose
    dequantized values have roughly `std` and zero mean per block."""
    rows, cols = shape
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // bs
    blocks = rng.integers(0, 256, size=(n, ts), dtype=np.uint8)

    def set_f16(b, off, v):
        b[:, off:off + 2] = np.asarray(v, dtype=np.float16).reshape(-1, 1).view(np.uint8).reshape(-1, 2)

    def deq(b):
        return quants.dequantize(b, qtype).reshape(n, bs).astype(np.float64)

    if qtype in (QT.Q4_K, QT.Q5_K):
        # value = d * A - dmin * B: pick dmin so each block has mean 0.
        set_f16(blocks, 0, np.ones(n)); set_f16(blocks, 2, np.zeros(n))
        a = deq(blocks)
        set_f16(blocks, 0, np.zeros(n)); set_f16(blocks, 2, -np.ones(n))
        b = deq(blocks)
        d = rng.uniform(0.5, 1.5, n)
        dmin = d * a.mean(1) / np.maximum(b.mean(1), 1e-3)
        s0 = (d[:, None] * a - dmin[:, None] * b).std()
        c = std / s0
        set_f16(blocks, 0, d * c); set_f16(blocks, 2, dmin * c)
    elif qtype == QT.Q6_K:
        set_f16(blocks, ts - 2, np.ones(n))
        s0 = deq(blocks).std()
        set_f16(blocks, ts - 2, rng.uniform(0.5, 1.5, n) * std / s0)
    else:
        raise ValueError(qtype)
    return blocks.reshape(rows, cols // bs * ts)


def requantize(src: Path, dst: Path, plan: dict, arch: str, rng):
    """Rewrites an f32 GGUF with tensor types from `plan` (name suffix -> type)."""
    reader, tensors = read_gguf(src)
    w = GGUFWriter(str(dst), arch)
    copy_fields(reader, w)
    for t in reader.tensors:
        _, deq, _ = tensors[t.name]
        qtype = None
        for suffix, q in plan.items():
            if t.name.endswith(suffix):
                qtype = q
        if qtype is None or qtype == QT.F32:
            w.add_tensor(t.name, deq.astype(np.float32))
            continue
        shape = deq.shape
        flat = deq.reshape(-1, shape[-1])
        if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
            data = random_kquant(flat.shape, qtype, float(flat.std()), rng)
        elif qtype == QT.F16:
            w.add_tensor(t.name, deq.astype(np.float16))
            continue
        else:  # Q4_0, Q8_0, BF16
            data = quants.quantize(flat, qtype)
        data = data.reshape(*shape[:-1], data.shape[-1])
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ----------------------------------------------------------------------------- GGUF -> HF


def untile(x: np.ndarray, axis: int, nk: int, r: int, d: int) -> np.ndarray:
    """Inverse of the converter's _reorder_v_heads: tiled [r, nk, d] -> grouped [nk, r, d]."""
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(r, nk, d, *rest).swapaxes(0, 1).reshape(nk * r * d, *rest)
    return np.moveaxis(x, 0, axis)


def hf_state_qwen35(t: dict, cfg) -> dict:
    """HF Qwen3_5MoeForCausalLM state dict from dequantized GGUF tensors."""
    g = lambda n: t[n][1]  # noqa: E731
    sd = {"model.embed_tokens.weight": g("token_embd.weight"),
          "model.norm.weight": g("output_norm.weight") - 1.0,
          "lm_head.weight": g("output.weight")}
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = nv // nk
    for l, kind in enumerate(cfg.layer_types):
        b, p = f"blk.{l}.", f"model.layers.{l}."
        sd[p + "input_layernorm.weight"] = g(b + "attn_norm.weight") - 1.0
        sd[p + "post_attention_layernorm.weight"] = g(b + "post_attention_norm.weight") - 1.0
        if kind == "linear_attention":
            a = p + "linear_attn."
            qkv = g(b + "attn_qkv.weight")
            qk = 2 * nk * dk
            sd[a + "in_proj_qkv.weight"] = np.concatenate([qkv[:qk], untile(qkv[qk:], 0, nk, r, dv)])
            sd[a + "in_proj_z.weight"] = untile(g(b + "attn_gate.weight"), 0, nk, r, dv)
            sd[a + "in_proj_b.weight"] = untile(g(b + "ssm_beta.weight"), 0, nk, r, 1)
            sd[a + "in_proj_a.weight"] = untile(g(b + "ssm_alpha.weight"), 0, nk, r, 1)
            conv = g(b + "ssm_conv1d.weight")
            conv = np.concatenate([conv[:qk], untile(conv[qk:], 0, nk, r, dv)])
            sd[a + "conv1d.weight"] = conv[:, None, :]
            a_log = np.log(-g(b + "ssm_a").astype(np.float64)).astype(np.float32)
            sd[a + "A_log"] = untile(a_log, 0, nk, r, 1)
            sd[a + "dt_bias"] = untile(g(b + "ssm_dt.bias"), 0, nk, r, 1)
            sd[a + "norm.weight"] = g(b + "ssm_norm.weight")
            sd[a + "out_proj.weight"] = untile(g(b + "ssm_out.weight"), 1, nk, r, dv)
        else:
            a = p + "self_attn."
            for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                           ("o_proj", "attn_output")):
                sd[a + hf + ".weight"] = g(b + gg + ".weight")
            sd[a + "q_norm.weight"] = g(b + "attn_q_norm.weight") - 1.0
            sd[a + "k_norm.weight"] = g(b + "attn_k_norm.weight") - 1.0
        m = p + "mlp."
        sd[m + "gate.weight"] = g(b + "ffn_gate_inp.weight")
        sd[m + "experts.gate_up_proj"] = np.concatenate(
            [g(b + "ffn_gate_exps.weight"), g(b + "ffn_up_exps.weight")], axis=1)
        sd[m + "experts.down_proj"] = g(b + "ffn_down_exps.weight")
        for hf, gg in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"),
                       ("down_proj", "ffn_down_shexp")):
            sd[m + "shared_expert." + hf + ".weight"] = g(b + gg + ".weight")
        sd[m + "shared_expert_gate.weight"] = g(b + "ffn_gate_inp_shexp.weight").reshape(1, -1)
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in sd.items()}


def hf_state_qwen3next(t: dict, cfg) -> dict:
    """HF Qwen3NextForCausalLM state dict from dequantized GGUF tensors: the
    converter's attn_qkv / attn_gate interleaved back into in_proj_qkvz per
    key head; ssm_ba is in_proj_ba as it is."""
    g = lambda n: t[n][1]  # noqa: E731
    sd = {"model.embed_tokens.weight": g("token_embd.weight"),
          "model.norm.weight": g("output_norm.weight") - 1.0,
          "lm_head.weight": g("output.weight")}
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = nv // nk
    for l, kind in enumerate(cfg.layer_types):
        b, p = f"blk.{l}.", f"model.layers.{l}."
        sd[p + "input_layernorm.weight"] = g(b + "attn_norm.weight") - 1.0
        sd[p + "post_attention_layernorm.weight"] = g(b + "post_attention_norm.weight") - 1.0
        if kind == "linear_attention":
            a = p + "linear_attn."
            qkv = g(b + "attn_qkv.weight")
            H = qkv.shape[1]
            q = qkv[:nk * dk].reshape(nk, dk, H)
            k = qkv[nk * dk:2 * nk * dk].reshape(nk, dk, H)
            v = qkv[2 * nk * dk:].reshape(nk, r * dv, H)
            z = g(b + "attn_gate.weight").reshape(nk, r * dv, H)
            sd[a + "in_proj_qkvz.weight"] = np.concatenate([q, k, v, z], axis=1).reshape(-1, H)
            sd[a + "in_proj_ba.weight"] = g(b + "ssm_ba.weight")
            sd[a + "conv1d.weight"] = g(b + "ssm_conv1d.weight")[:, None, :]
            sd[a + "A_log"] = np.log(-g(b + "ssm_a").astype(np.float64)).astype(np.float32)
            sd[a + "dt_bias"] = g(b + "ssm_dt.bias")
            sd[a + "norm.weight"] = g(b + "ssm_norm.weight")
            sd[a + "out_proj.weight"] = g(b + "ssm_out.weight")
        else:
            a = p + "self_attn."
            for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                           ("o_proj", "attn_output")):
                sd[a + hf + ".weight"] = g(b + gg + ".weight")
            sd[a + "q_norm.weight"] = g(b + "attn_q_norm.weight") - 1.0
            sd[a + "k_norm.weight"] = g(b + "attn_k_norm.weight") - 1.0
        m = p + "mlp."
        sd[m + "gate.weight"] = g(b + "ffn_gate_inp.weight")
        sd[m + "experts.gate_up_proj"] = np.concatenate(
            [g(b + "ffn_gate_exps.weight"), g(b + "ffn_up_exps.weight")], axis=1)
        sd[m + "experts.down_proj"] = g(b + "ffn_down_exps.weight")
        for hf, gg in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"),
                       ("down_proj", "ffn_down_shexp")):
            sd[m + "shared_expert." + hf + ".weight"] = g(b + gg + ".weight")
        sd[m + "shared_expert_gate.weight"] = g(b + "ffn_gate_inp_shexp.weight").reshape(1, -1)
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in sd.items()}


def hf_state_qwen3moe(t: dict, cfg) -> dict:
    g = lambda n: t[n][1]  # noqa: E731
    sd = {"model.embed_tokens.weight": g("token_embd.weight"),
          "model.norm.weight": g("output_norm.weight"),
          "lm_head.weight": g("output.weight")}
    for l in range(cfg.num_hidden_layers):
        b, p = f"blk.{l}.", f"model.layers.{l}."
        sd[p + "input_layernorm.weight"] = g(b + "attn_norm.weight")
        sd[p + "post_attention_layernorm.weight"] = g(b + "ffn_norm.weight")
        a = p + "self_attn."
        for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                       ("o_proj", "attn_output"), ("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
            sd[a + hf + ".weight"] = g(b + gg + ".weight")
        m = p + "mlp."
        sd[m + "gate.weight"] = g(b + "ffn_gate_inp.weight")
        sd[m + "experts.gate_up_proj"] = np.concatenate(
            [g(b + "ffn_gate_exps.weight"), g(b + "ffn_up_exps.weight")], axis=1)
        sd[m + "experts.down_proj"] = g(b + "ffn_down_exps.weight")
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in sd.items()}


# ----------------------------------------------------------------------------- models


def qwen35_cfg(vocab, small: bool):
    cfg = mf.qwen35_text_config(vocab)
    if small:  # hidden 64: f16 / q8_0 fixtures
        cfg.hidden_size = 64
        cfg.num_hidden_layers = 3
        cfg.layer_types = ["linear_attention", "linear_attention", "full_attention"]
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 2, 32
        cfg.linear_num_key_heads, cfg.linear_num_value_heads = 2, 6
        cfg.linear_key_head_dim = cfg.linear_value_head_dim = 16
        cfg.num_experts, cfg.num_experts_per_tok = 4, 2
        cfg.moe_intermediate_size = cfg.shared_expert_intermediate_size = 32
    else:  # hidden 256: K-quant rows
        cfg.hidden_size = 256
        cfg.num_hidden_layers = 2
        cfg.layer_types = ["linear_attention", "full_attention"]
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 2, 1, 64
        cfg.rope_parameters["mrope_section"] = [4, 2, 2]  # rotary 16 -> 8 pairs
        cfg.linear_num_key_heads, cfg.linear_num_value_heads = 2, 4
        cfg.linear_key_head_dim = cfg.linear_value_head_dim = 32
        cfg.num_experts, cfg.num_experts_per_tok = 4, 2
        cfg.moe_intermediate_size = cfg.shared_expert_intermediate_size = 64
    return cfg


def qwen3moe_cfg(vocab):
    cfg = mf.qwen3moe_config(vocab)
    cfg.num_hidden_layers = 2
    cfg.num_experts = 4
    cfg.moe_intermediate_size = 32
    return cfg


def qwen3next_cfg(vocab):
    cfg = mf.qwen3next_config(vocab)
    cfg.num_experts, cfg.num_experts_per_tok = 4, 2
    return cfg


CLASSES = {"qwen3_5_moe": mf.Qwen3_5MoeForCausalLM, "qwen3_moe": mf.Qwen3MoeForCausalLM,
           "qwen3_next": mf.Qwen3NextForCausalLM}
HF_STATE = {"qwen3_5_moe": hf_state_qwen35, "qwen3_moe": hf_state_qwen3moe, "qwen3_next": hf_state_qwen3next}


def build(kind, cfg, seed):
    torch.manual_seed(seed)
    cls = CLASSES[kind]
    model = cls(cfg).float()
    mf.perturb(model, torch.Generator().manual_seed(seed), kind)
    model.config._experts_implementation = "eager"
    model.config._attn_implementation = "eager"
    return model


def save_hf(kind, model, out: Path, tok_dir: Path, specials):
    out.mkdir(parents=True)
    if kind == "qwen3_5_moe":
        mf.write_json(out / "config.json", mf.qwen35_full_config_dict(model.config))
        sd = mf.qwen35_checkpoint_state(model, fused=True)
    elif kind == "qwen3_next":
        mf.write_json(out / "config.json", mf.qwen3next_config_dict(model.config))
        sd = mf.per_expert_state(model)
    else:
        d = model.config.to_dict()
        for k in ("_attn_implementation", "_experts_implementation"):
            d.pop(k, None)
        d["architectures"] = ["Qwen3MoeForCausalLM"]
        d = {("num_experts" if k == "num_local_experts" else k): v for k, v in d.items()}
        d["dtype"] = "float32"
        mf.write_json(out / "config.json", d)
        sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    mf.write_json(out / "generation_config.json", mf.generation_config(specials[2]))
    mf.save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    mf.copy_tok(tok_dir, out)


def load_state(model, sd):
    own = model.state_dict()
    assert set(own) == set(sd), (sorted(set(own) ^ set(sd)))
    for k, v in sd.items():
        assert own[k].shape == v.shape, (k, own[k].shape, v.shape)
    model.load_state_dict(sd, strict=True)


def check_inverse(kind, model, f32_gguf: Path):
    """The GGUF -> HF inverse gives back the original weights."""
    _, t = read_gguf(f32_gguf)
    inv = HF_STATE[kind](t, model.config)
    own = model.state_dict()
    worst = 0.0
    for k, v in inv.items():
        d = (own[k].float() - v).abs().max().item()
        worst = max(worst, d)
        # norms come back as (w + 1) - 1 and A_log as log(exp(A_log)): a few ulp
        assert d < 1e-6, (k, d)
    print(f"    inverse of the f32 conversion: max |diff| {worst:.2e}")


FIXTURES = {
    # name: (kind, small, seed0, how)
    "gguf_qwen35moe_f16": ("qwen3_5_moe", True, 5000, "f16"),
    "gguf_qwen35moe_q8_0": ("qwen3_5_moe", True, 5000, "q8_0"),
    "gguf_qwen35moe_kquant": ("qwen3_5_moe", False, 6000, "kquant"),
    "gguf_qwen3moe_q4_0": ("qwen3_moe", True, 7000, "q4_0"),
    "gguf_qwen3next_f16": ("qwen3_next", True, 8000, "f16"),
    "gguf_qwen3next_q8_0": ("qwen3_next", True, 8000, "q8_0"),
}

KQUANT_PLAN = {
    "token_embd.weight": QT.Q4_K,
    "output.weight": QT.Q6_K,
    "attn_qkv.weight": QT.Q5_K,     # V rows permuted: whole block rows
    "attn_gate.weight": QT.Q4_0,    # rows permuted
    "ssm_alpha.weight": QT.Q8_0,
    "ssm_beta.weight": QT.Q8_0,
    "ssm_out.weight": QT.Q4_0,      # columns permuted: dequantized on import
    "attn_q.weight": QT.Q4_K,
    "attn_k.weight": QT.Q8_0,
    "attn_v.weight": QT.BF16,
    "attn_output.weight": QT.Q4_0,
    "ffn_gate_exps.weight": QT.Q4_K,
    "ffn_up_exps.weight": QT.Q5_K,
    "ffn_down_exps.weight": QT.Q8_0,
    "ffn_gate_shexp.weight": QT.Q6_K,
    "ffn_up_shexp.weight": QT.Q4_K,
    "ffn_down_shexp.weight": QT.Q4_0,
}

Q3_PLAN = {
    "token_embd.weight": QT.Q8_0,
    "output.weight": QT.Q8_0,
    "attn_q.weight": QT.Q8_0,
    "attn_k.weight": QT.Q8_0,
    "attn_v.weight": QT.Q8_0,
    "attn_output.weight": QT.Q8_0,
    "ffn_gate_exps.weight": QT.Q4_0,
    "ffn_up_exps.weight": QT.Q4_0,
    "ffn_down_exps.weight": QT.Q4_0,
}


def make(name, tok_dir, prompt_ids, specials, vocab, work: Path):
    kind, small, seed0, how = FIXTURES[name]
    for seed in range(seed0, seed0 + 100):
        cfg = {"qwen3_5_moe": lambda: qwen35_cfg(vocab, small), "qwen3_moe": lambda: qwen3moe_cfg(vocab),
               "qwen3_next": lambda: qwen3next_cfg(vocab)}[kind]()
        model = build(kind, cfg, seed)
        if how == "f16":  # weights exactly representable: the f16 file is lossless
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.half().float())
        wd = work / f"{name}-{seed}"
        hf = wd / "hf"
        save_hf(kind, model, hf, tok_dir, specials)
        f32 = wd / "f32.gguf"
        convert(hf, "f32", f32, no_mtp=kind != "qwen3_moe")
        check_inverse(kind, model, f32)
        final = wd / "model.gguf"
        if how in ("f16", "q8_0"):
            convert(hf, how, final, no_mtp=kind != "qwen3_moe")
        else:
            arch = "qwen35moe" if kind == "qwen3_5_moe" else "qwen3moe"
            plan = KQUANT_PLAN if how == "kquant" else Q3_PLAN
            requantize(f32, final, plan, arch, np.random.default_rng(seed))
        _, t = read_gguf(final)
        sd = HF_STATE[kind](t, model.config)
        load_state(model, sd)
        ok, logits, info = mf.run_reference(model, prompt_ids, vocab, specials)
        print(f"  {name} seed {seed}: ok={ok} {info}")
        if ok:
            break
    else:
        raise SystemExit(f"no good seed for {name}")
    out = mf.fresh_dir(name)
    shutil.copy(final, out / "model.gguf")
    types = sorted({t[0].name for t in read_gguf(final)[1].values()})
    mf.write_reference(out, prompt_ids, logits, info, "the GGUF's tensors, dequantized by gguf-py 0.19.0",
                       {"seed": seed, "gguf_tensor_types": types,
                        "converter": "llama-cpp-python 0.3.36 sdist vendor/llama.cpp/convert_hf_to_gguf.py",
                        "how": how})
    return out


def main():
    print(f"torch {torch.__version__} transformers {mf.transformers.__version__} gguf-py {LLAMA}")
    assert mf.transformers.__version__ == "5.23.0"
    tok = mf.train_tokenizer(HERE / "tokenizer_corpus.txt", mf.VOCAB)
    vocab = tok.get_vocab_size()
    specials = [tok.token_to_id(s) for s in mf.SPECIALS]
    tok_dir = Path(tempfile.mkdtemp())
    mf.save_tokenizer(tok, tok_dir)
    prompt_ids = tok.encode(mf.PROMPT_TEXT).ids
    only = set(sys.argv[1:])
    work = Path(tempfile.mkdtemp())
    try:
        for name in FIXTURES:
            if not only or name in only:
                print(name)
                make(name, tok_dir, prompt_ids, specials, vocab, work)
    finally:
        shutil.rmtree(work)
        shutil.rmtree(tok_dir)
    total = 0
    for d in sorted(mf.FIX.glob("gguf_*")):
        size = sum(f.stat().st_size for f in d.iterdir())
        total += size
        print(f"{d.name}: {size / 1e6:.2f} MB")
    print(f"total {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
