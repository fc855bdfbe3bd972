#!/usr/bin/env python3
"""Deterministic reference fixtures for slipstream (see tools/reference/README.md).

Writes tests/fixtures/{qwen3_5_moe_fused,qwen3_5_moe_split,qwen3_moe,qwen3_5_moe_mlx4,qwen3_next,
qwen3_next_mlx4}/
with config.json, safetensors weights, tokenizer.json, tokenizer_config.json,
logits.npy and reference.json.

Run with the pinned venv:  tools/reference/.venv/bin/python tools/reference/make_fixtures.py
"""

import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
FIX = REPO / "tests" / "fixtures"

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 512
PROMPT_TEXT = "We hold these truths to be self-evident, that all men are created equal."
N_GEN = 8

# ChatML, minijinja-compatible (no python-only methods).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

torch.set_num_threads(2)


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(corpus_path: Path, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus_path)], trainer)
    return tok


def tokenizer_config(model_max_length=32768):
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "errors": "replace",
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config(), f, indent=2)
        f.write("\n")


# ----------------------------------------------------------------------------- configs


def qwen35_text_config(vocab_size):
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=6,
        layer_types=[
            "linear_attention",
            "linear_attention",
            "full_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            # text-only: all three mrope grids carry the same position -> plain RoPE.
            # Sections sum to rotary_dim/2 = 4 (the real model: [11,11,10] for 32).
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        linear_num_key_heads=4,
        linear_key_head_dim=16,
        linear_num_value_heads=8,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        eos_token_id=SPECIALS.index("<|im_end|>"),
        pad_token_id=None,
        bos_token_id=None,
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def qwen35_full_config_dict(text_cfg):
    """config.json in the full-checkpoint style of Qwen/Qwen3.5-35B-A3B."""
    full = Qwen3_5MoeConfig(text_config=text_cfg.to_dict(), tie_word_embeddings=False)
    d = full.to_dict()
    tc = d["text_config"]
    # mlx-lm reads full_attention_interval (not layer_types); keep them consistent.
    tc["full_attention_interval"] = 3
    tc["dtype"] = "float32"
    for k in ("_attn_implementation", "_experts_implementation", "architectures"):
        tc.pop(k, None)
        d.pop(k, None)
    d["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
    d["transformers_version"] = transformers.__version__
    return d


def qwen3moe_config(vocab_size):
    cfg = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,  # dense MLP size, unused (every layer is MoE)
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        eos_token_id=SPECIALS.index("<|im_end|>"),
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


# ----------------------------------------------------------------------------- perturbation


@torch.no_grad()
def perturb(model, gen: torch.Generator, kind: str):
    """Make every parameter non-trivial (deterministic given gen)."""

    def n(shape, std):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    for name, p in sorted(model.named_parameters()):
        s = p.shape
        if name.endswith("linear_attn.norm.weight"):  # gated norm, plain w (init 1)
            p.copy_(1.0 + n(s, 0.3))
        elif name.endswith("norm.weight"):  # input/post/final/q/k norms
            if kind in ("qwen3_5_moe", "qwen3_next"):  # zero-centred, applied as (1+w)
                p.copy_(n(s, 0.3))
            else:  # qwen3_moe: plain w
                p.copy_(1.0 + n(s, 0.3))
        elif name.endswith("A_log"):
            p.copy_(torch.log(torch.rand(s, generator=gen) * 7.5 + 0.5))  # A in [0.5, 8]
        elif name.endswith("dt_bias"):
            p.copy_(1.0 + n(s, 0.5))
        elif name.endswith("conv1d.weight"):
            p.copy_(n(s, 0.4))
        elif name.endswith("mlp.gate.weight"):  # router: well separated experts
            p.copy_(n(s, 0.4))
        elif name.endswith("shared_expert_gate.weight"):
            p.copy_(n(s, 0.2))
        elif name.endswith("embed_tokens.weight"):
            p.copy_(n(s, 1.0))
        elif name == "lm_head.weight":
            p.copy_(n(s, 0.25))
        else:  # projections and experts
            fan_in = s[-1]
            p.copy_(n(s, 1.0 / math.sqrt(fan_in)))


def round_bf16_(model):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


# ----------------------------------------------------------------------------- reference run


@torch.no_grad()
def run_reference(model, prompt_ids, vocab, special_ids):
    model.eval()
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model.generate(
        ids,
        max_new_tokens=N_GEN,
        min_new_tokens=N_GEN,
        do_sample=False,
        use_cache=True,
        eos_token_id=None,
        pad_token_id=0,
        num_beams=1,
    )
    greedy = out[0, len(prompt_ids):].tolist()
    assert len(greedy) == N_GEN
    full = torch.tensor([prompt_ids + greedy], dtype=torch.long)
    fo = model(full, use_cache=False, output_router_logits=True)
    logits = fo.logits[0].float()
    assert logits.shape == (len(prompt_ids) + N_GEN, vocab)
    P = len(prompt_ids)
    # row i = logits after token i; greedy token t was predicted from row P-1+t
    steps = logits[P - 1: P - 1 + N_GEN]
    argmax = steps.argmax(-1).tolist()
    top2 = steps.topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1])
    maxabs = steps.abs().max().item()
    rel_margin_min = (margins / maxabs).min().item()
    # router: gap between k-th and (k+1)-th router logit, all layers, all positions
    k = model.config.num_experts_per_tok
    rmin = float("inf")
    for rl in fo.router_logits:
        srt = rl.float().sort(dim=-1, descending=True).values
        rmin = min(rmin, (srt[:, k - 1] - srt[:, k]).min().item())
    ok = (
        argmax == greedy
        and rel_margin_min > 2e-3
        and rmin > 1e-3
        and not any(t in special_ids for t in greedy)
        and len(set(greedy)) > 1
    )
    info = {
        "greedy": greedy,
        "argmax": argmax,
        "top2_margin_min": margins.min().item(),
        "top2_margin_rel_min": rel_margin_min,
        "max_abs_logit": maxabs,
        "router_topk_gap_min": rmin,
    }
    return ok, logits.numpy().astype(np.float32), info


def write_reference(out_dir, prompt_ids, logits, info, dtype_of_weights, extra=None):
    np.save(out_dir / "logits.npy", logits)
    ref = {
        "prompt_text": PROMPT_TEXT,
        "prompt_tokens": prompt_ids,
        "greedy_tokens": info["greedy"],
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "dtype_of_weights": dtype_of_weights,
        "compute_dtype": "float32",
        "logits_shape": list(logits.shape),
        "logits_rows": "row i = logits after token i of prompt_tokens + greedy_tokens",
        "top2_margin_min": info["top2_margin_min"],
        "top2_margin_rel_min": info["top2_margin_rel_min"],
        "max_abs_logit": info["max_abs_logit"],
        "router_topk_gap_min": info["router_topk_gap_min"],
    }
    if extra:
        ref.update(extra)
    with open(out_dir / "reference.json", "w") as f:
        json.dump(ref, f, indent=2)
        f.write("\n")


def fresh_dir(name):
    d = FIX / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def generation_config(eos_id):
    return {"do_sample": False, "eos_token_id": eos_id, "pad_token_id": 0,
            "transformers_version": transformers.__version__}


# ----------------------------------------------------------------------------- qwen3_5_moe


def build_qwen35(seed, vocab):
    torch.manual_seed(seed)
    cfg = qwen35_text_config(vocab)
    model = Qwen3_5MoeForCausalLM(cfg).float()
    gen = torch.Generator().manual_seed(seed)
    perturb(model, gen, "qwen3_5_moe")
    model.config._experts_implementation = "eager"
    model.config._attn_implementation = "eager"
    return model


def qwen35_checkpoint_state(model, fused=True):
    """HF checkpoint keys: model.language_model.* + top-level lm_head.weight."""
    sd = {}
    E = model.config.num_experts
    I = model.config.moe_intermediate_size
    for k, v in model.state_dict().items():
        v = v.detach().clone().contiguous()
        if k.startswith("model."):
            k2 = "model.language_model." + k[len("model."):]
        else:
            k2 = k
        if not fused and k2.endswith("mlp.experts.gate_up_proj"):
            base = k2[: -len("gate_up_proj")]
            assert v.shape[1] == 2 * I
            for e in range(E):
                sd[f"{base}{e}.gate_proj.weight"] = v[e, :I].clone()
                sd[f"{base}{e}.up_proj.weight"] = v[e, I:].clone()
            continue
        if not fused and k2.endswith("mlp.experts.down_proj"):
            base = k2[: -len("down_proj")]
            for e in range(E):
                sd[f"{base}{e}.down_proj.weight"] = v[e].clone()
            continue
        sd[k2] = v
    return sd


def save_sharded(sd, out_dir, n_shards, dtype):
    keys = sorted(sd.keys())
    sizes = [sd[k].numel() * sd[k].element_size() for k in keys]
    total = sum(sizes)
    target = total / n_shards
    shards, cur, acc = [], [], 0
    for k, s in zip(keys, sizes):
        if cur and acc + s > target and len(shards) < n_shards - 1:
            shards.append(cur)
            cur, acc = [], 0
        cur.append(k)
        acc += s
    shards.append(cur)
    weight_map = {}
    n = len(shards)
    for i, ks in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: sd[k].to(dtype).contiguous() for k in ks}, str(out_dir / fname), metadata={"format": "pt"})
        for k in ks:
            weight_map[k] = fname
    write_json(out_dir / "model.safetensors.index.json",
               {"metadata": {"total_size": sum(sd[k].numel() * torch.tensor([], dtype=dtype).element_size() for k in keys)},
                "weight_map": weight_map})
    return n


@torch.no_grad()
def check_reload(model_cls, out_dir, logits_ref, prompt_ids, greedy, exact=True):
    m2 = model_cls.from_pretrained(str(out_dir), dtype=torch.float32)
    m2.config._experts_implementation = "eager"
    m2.config._attn_implementation = "eager"
    m2.eval()
    full = torch.tensor([prompt_ids + greedy], dtype=torch.long)
    lg = m2(full, use_cache=False).logits[0].float().numpy()
    diff = np.abs(lg - logits_ref).max()
    print(f"    reload {out_dir.name}: max|dlogit| = {diff:.3g}")
    if exact:
        assert diff == 0.0, diff
    else:
        assert diff < 1e-5, diff
    return diff


def make_qwen35(name, seed0, vocab, prompt_ids, specials, tok_dir, fused, bf16, mlx_from=None):
    for seed in range(seed0, seed0 + 200):
        model = build_qwen35(seed, vocab)
        if bf16:
            round_bf16_(model)
        ok, logits, info = run_reference(model, prompt_ids, vocab, specials)
        print(f"  {name} seed {seed}: ok={ok} {info}")
        if ok:
            break
    else:
        raise SystemExit(f"no good seed for {name}")
    out = fresh_dir(name)
    cfg = qwen35_full_config_dict(model.config)
    cfg["text_config"]["dtype"] = cfg["dtype"] = "bfloat16" if bf16 else "float32"
    write_json(out / "config.json", cfg)
    write_json(out / "generation_config.json", generation_config(specials[2]))
    sd = qwen35_checkpoint_state(model, fused=fused)
    if bf16:
        n = save_sharded(sd, out, 2, torch.bfloat16)
        print(f"    wrote {n} shards")
    else:
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    copy_tok(tok_dir, out)
    write_reference(out, prompt_ids, logits, info, "bfloat16" if bf16 else "float32",
                    {"layout": "fused gate_up_proj [E,2I,H] + down_proj [E,H,I]" if fused
                     else "per-expert experts.{e}.{gate,up,down}_proj.weight",
                     "seed": seed})
    check_reload(Qwen3_5MoeForCausalLM, out, logits, prompt_ids, info["greedy"], exact=not bf16)
    return model, seed, out


def copy_tok(tok_dir, out):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, out / f)


# ----------------------------------------------------------------------------- qwen3_moe


def make_qwen3moe(name, seed0, vocab, prompt_ids, specials, tok_dir):
    for seed in range(seed0, seed0 + 200):
        torch.manual_seed(seed)
        cfg = qwen3moe_config(vocab)
        model = Qwen3MoeForCausalLM(cfg).float()
        perturb(model, torch.Generator().manual_seed(seed), "qwen3_moe")
        model.config._experts_implementation = "eager"
        ok, logits, info = run_reference(model, prompt_ids, vocab, specials)
        print(f"  {name} seed {seed}: ok={ok} {info}")
        if ok:
            break
    else:
        raise SystemExit(f"no good seed for {name}")
    out = fresh_dir(name)
    d = model.config.to_dict()
    for k in ("_attn_implementation", "_experts_implementation"):
        d.pop(k, None)
    d["architectures"] = ["Qwen3MoeForCausalLM"]
    # real Qwen3-30B-A3B config.json spells it num_experts (transformers maps it to num_local_experts)
    d = {("num_experts" if k == "num_local_experts" else k): v for k, v in d.items()}
    d["dtype"] = "float32"
    write_json(out / "config.json", d)
    write_json(out / "generation_config.json", generation_config(specials[2]))
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    sd = {}
    for k, v in model.state_dict().items():
        v = v.detach().clone().contiguous()
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            for e in range(E):
                sd[f"{base}{e}.gate_proj.weight"] = v[e, :I].clone()
                sd[f"{base}{e}.up_proj.weight"] = v[e, I:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(E):
                sd[f"{base}{e}.down_proj.weight"] = v[e].clone()
        else:
            sd[k] = v
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    copy_tok(tok_dir, out)
    write_reference(out, prompt_ids, logits, info, "float32", {"seed": seed})
    check_reload(Qwen3MoeForCausalLM, out, logits, prompt_ids, info["greedy"], exact=True)


# ----------------------------------------------------------------------------- qwen3_next


def qwen3next_config(vocab_size):
    """Qwen3-Next-80B-A3B's structure at toy size: full attention every 4th
    layer, 2 value heads per key head, gated shared expert."""
    cfg = Qwen3NextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,  # dense MLP size, unused (every layer is MoE)
        num_hidden_layers=4,
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        linear_num_key_heads=4,
        linear_key_head_dim=16,
        linear_num_value_heads=8,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        eos_token_id=SPECIALS.index("<|im_end|>"),
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def qwen3next_config_dict(cfg):
    """config.json in the style of Qwen/Qwen3-Next-80B-A3B-Instruct: flat,
    rope_theta / partial_rotary_factor / full_attention_interval at top
    level, no layer_types, no MTP key (the real one declares none)."""
    d = cfg.to_dict()
    for k in ("_attn_implementation", "_experts_implementation", "layer_types", "rope_parameters"):
        d.pop(k, None)
    d["full_attention_interval"] = 4
    d["rope_theta"] = cfg.rope_parameters["rope_theta"]
    d["partial_rotary_factor"] = cfg.rope_parameters["partial_rotary_factor"]
    d["architectures"] = ["Qwen3NextForCausalLM"]
    d["transformers_version"] = transformers.__version__
    return d


def build_qwen3next(seed, vocab):
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(qwen3next_config(vocab)).float()
    perturb(model, torch.Generator().manual_seed(seed), "qwen3_next")
    model.config._experts_implementation = "eager"
    model.config._attn_implementation = "eager"
    return model


def per_expert_state(model):
    """State dict with routed experts per expert (`mlp.experts.{e}.*_proj.weight`),
    as the official Qwen3-Next checkpoints store them."""
    I = model.config.moe_intermediate_size
    sd = {}
    for k, v in model.state_dict().items():
        v = v.detach().clone().contiguous()
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                sd[f"{base}{e}.gate_proj.weight"] = v[e, :I].clone()
                sd[f"{base}{e}.up_proj.weight"] = v[e, I:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                sd[f"{base}{e}.down_proj.weight"] = v[e].clone()
        else:
            sd[k] = v
    return sd


def mtp_state(model, gen):
    """A random MTP head under `mtp.*` (the official checkpoints carry one;
    transformers ignores it): fc [H, 2H], three norms, and one full-attention
    MoE layer `mtp.layers.0.*` shaped like the model's full-attention layers."""
    H = model.config.hidden_size
    full = model.config.layer_types.index("full_attention")
    pre = f"model.layers.{full}."
    sd = {}
    for k, v in per_expert_state(model).items():
        if k.startswith(pre):
            std = 0.3 if k.endswith("norm.weight") else 1.0 / math.sqrt(v.shape[-1])
            sd["mtp.layers.0." + k[len(pre):]] = torch.randn(v.shape, generator=gen) * std
    sd["mtp.fc.weight"] = torch.randn((H, 2 * H), generator=gen) / math.sqrt(2 * H)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        sd[f"mtp.{n}.weight"] = torch.randn((H,), generator=gen) * 0.3
    return sd


def make_qwen3next(name, seed0, vocab, prompt_ids, specials, tok_dir):
    for seed in range(seed0, seed0 + 200):
        model = build_qwen3next(seed, vocab)
        round_bf16_(model)
        ok, logits, info = run_reference(model, prompt_ids, vocab, specials)
        print(f"  {name} seed {seed}: ok={ok} {info}")
        if ok:
            break
    else:
        raise SystemExit(f"no good seed for {name}")
    out = fresh_dir(name)
    d = qwen3next_config_dict(model.config)
    d["dtype"] = "bfloat16"
    write_json(out / "config.json", d)
    write_json(out / "generation_config.json", generation_config(specials[2]))
    sd = per_expert_state(model)
    sd.update(mtp_state(model, torch.Generator().manual_seed(seed + 1)))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    copy_tok(tok_dir, out)
    write_reference(out, prompt_ids, logits, info, "bfloat16",
                    {"layout": "fused in_proj_qkvz / in_proj_ba, per-expert experts.{e}.{gate,up,down}_proj.weight, "
                               "random mtp.* head (ignored by transformers)",
                     "seed": seed})
    check_reload(Qwen3NextForCausalLM, out, logits, prompt_ids, info["greedy"], exact=True)


# ----------------------------------------------------------------------------- MLX 4-bit


def unpack_dequant(wq, scales, biases, bits, group):
    """float32 of scale*q + bias; wq uint32 [..., out, in*bits/32]."""
    w = wq.to(torch.int64) & 0xFFFFFFFF
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    q = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., out, words, per]
    q = q.reshape(*w.shape[:-1], w.shape[-1] * per).to(torch.float32)
    s = scales.to(torch.float32).repeat_interleave(group, dim=-1)
    b = biases.to(torch.float32).repeat_interleave(group, dim=-1)
    return s * q + b


def mlx_convert(src_dir, dst_dir):
    from mlx_lm.convert import convert

    convert(hf_path=str(src_dir), mlx_path=str(dst_dir), quantize=True,
            q_group_size=64, q_bits=4, dtype="bfloat16")


def mlx_to_hf_state(mlx_sd, qcfg, text_cfg, prefix="language_model."):
    """Dequantize an MLX qwen3_5_moe checkpoint back to HF Qwen3_5MoeForCausalLM keys (float32);
    with prefix "" a flat qwen3_next one (`model.*`, `lm_head.*`) to Qwen3NextForCausalLM keys."""
    default_bits, default_group = qcfg["bits"], qcfg["group_size"]
    out = {}
    bases = sorted({k[: -len(".scales")] for k in mlx_sd if k.endswith(".scales")})
    deq = {}
    for b in bases:
        path = b
        over = qcfg.get(path)
        bits = over["bits"] if isinstance(over, dict) else default_bits
        group = over["group_size"] if isinstance(over, dict) else default_group
        deq[b + ".weight"] = unpack_dequant(mlx_sd[b + ".weight"], mlx_sd[b + ".scales"], mlx_sd[b + ".biases"], bits, group)
    plain = {k: v.to(torch.float32) for k, v in mlx_sd.items()
             if not (k.endswith(".scales") or k.endswith(".biases")) and k not in deq}
    allw = {**plain, **deq}
    shifted = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight")
    for k, v in allw.items():
        if k.startswith(prefix + "model."):
            hk = "model." + k[len(prefix + "model."):]
        elif k.startswith(prefix + "lm_head."):
            hk = "lm_head." + k[len(prefix + "lm_head."):]
        else:
            raise KeyError(k)
        if hk.endswith(shifted) or hk == "model.norm.weight":
            v = v - 1.0  # MLX stores 1+w
        if hk.endswith("conv1d.weight"):
            v = v.permute(0, 2, 1).contiguous()  # [C,K,1] -> [C,1,K]
        if ".mlp.switch_mlp." in hk:
            continue
        out[hk] = v
    for l in range(text_cfg.num_hidden_layers):
        p = f"{prefix}model.layers.{l}.mlp.switch_mlp."
        g, u, d = allw[p + "gate_proj.weight"], allw[p + "up_proj.weight"], allw[p + "down_proj.weight"]
        out[f"model.layers.{l}.mlp.experts.gate_up_proj"] = torch.cat([g, u], dim=1)
        out[f"model.layers.{l}.mlp.experts.down_proj"] = d
    return out


def make_mlx4(name, src_dir, text_cfg, prompt_ids, specials, tok_dir, vocab, kind="qwen3_5_moe"):
    out = FIX / name
    if out.exists():
        shutil.rmtree(out)
    mlx_convert(src_dir, out)
    # tokenizer files: same as every other fixture
    for f in os.listdir(out):
        if f.startswith("tokenizer") or f in ("README.md", "chat_template.jinja", "special_tokens_map.json", "vocab.json", "merges.txt"):
            os.remove(out / f)
    copy_tok(tok_dir, out)
    with open(out / "config.json") as f:
        cfg = json.load(f)
    qcfg = cfg["quantization"]
    files = sorted(out.glob("*.safetensors"))
    mlx_sd = {}
    for fp in files:
        mlx_sd.update(load_file(str(fp)))
    # cross-check our unpacking against mx.dequantize
    import mlx.core as mx
    checked = 0
    for k in sorted(mlx_sd):
        if not k.endswith(".scales"):
            continue
        b = k[: -len(".scales")]
        over = qcfg.get(b)
        bits = over["bits"] if isinstance(over, dict) else qcfg["bits"]
        ours = unpack_dequant(mlx_sd[b + ".weight"], mlx_sd[b + ".scales"], mlx_sd[b + ".biases"], bits, 64)
        wq = mx.array(mlx_sd[b + ".weight"].numpy())
        sc = mx.array(mlx_sd[b + ".scales"].float().numpy()).astype(mx.bfloat16)
        bi = mx.array(mlx_sd[b + ".biases"].float().numpy()).astype(mx.bfloat16)
        theirs = mx.dequantize(wq, sc.astype(mx.float32), bi.astype(mx.float32), group_size=64, bits=bits)
        diff = np.abs(np.array(theirs) - ours.numpy()).max()
        assert diff <= 1e-6 * max(1.0, float(np.abs(ours.numpy()).max())), (k, diff)
        checked += 1
    print(f"    dequant matches mx.dequantize for {checked} tensors")
    next_ = kind == "qwen3_next"
    hf_sd = mlx_to_hf_state(mlx_sd, qcfg, text_cfg, prefix="" if next_ else "language_model.")
    model = (Qwen3NextForCausalLM if next_ else Qwen3_5MoeForCausalLM)(text_cfg).float()
    missing, unexpected = model.load_state_dict(hf_sd, strict=True), None
    model.config._experts_implementation = "eager"
    model.config._attn_implementation = "eager"
    ok, logits, info = run_reference(model, prompt_ids, vocab, specials)
    if next_ and not ok:
        # The source is the committed qwen3_next fixture, so there is no seed
        # to change: accept a top-1/top-2 margin down to 1e-3 x max|logit|
        # (the Rust parity error is ~1e-5 of it), the other checks unchanged.
        ok = (info["argmax"] == info["greedy"] and info["top2_margin_rel_min"] > 1e-3
              and info["router_topk_gap_min"] > 1e-3 and not any(t in specials for t in info["greedy"]))
        info["margin_rule"] = "top2_margin_rel_min > 1e-3 (source fixed: qwen3_next)"
    print(f"  {name}: ok={ok} {info}")
    neg = []
    for k in mlx_sd:
        if k.endswith(".scales"):
            neg.append((mlx_sd[k].float() < 0).float().mean().item())
    dtypes = {}
    for k, v in mlx_sd.items():
        dtypes.setdefault(str(v.dtype).replace("torch.", ""), 0)
        dtypes[str(v.dtype).replace("torch.", "")] += 1
    write_reference(out, prompt_ids, logits, info, "mlx affine 4-bit (router/shared_expert_gate 8-bit), group 64",
                    {"source": f"weights of {src_dir.name}, converted with mlx_lm.convert (mlx-lm 0.32.0, mlx 0.32.4) "
                               "quantize=True q_group_size=64 q_bits=4 dtype=bfloat16",
                     "reference_method": "dequantize every quantized tensor in float32 as scale*q+bias from the stored "
                                         "bf16 scale/bias, un-shift input/post/final/q/k norms by -1, conv1d [C,K,1]->[C,1,K], "
                                         f"load into {type(model).__name__} float32",
                     "fraction_negative_scales": float(np.mean(neg)),
                     "tensor_dtypes": dtypes})
    return ok


# ----------------------------------------------------------------------------- main


def main():
    print(f"torch {torch.__version__} transformers {transformers.__version__}")
    assert transformers.__version__ == "5.23.0"
    FIX.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(HERE / "tokenizer_corpus.txt", VOCAB)
    vocab = tok.get_vocab_size()
    assert vocab == VOCAB, vocab
    specials = [tok.token_to_id(s) for s in SPECIALS]
    assert specials == [0, 1, 2], specials
    tok_dir = Path(tempfile.mkdtemp())
    save_tokenizer(tok, tok_dir)
    prompt_ids = tok.encode(PROMPT_TEXT).ids
    assert tok.decode(prompt_ids) == PROMPT_TEXT
    print(f"tokenizer vocab {vocab}, prompt {len(prompt_ids)} tokens: {prompt_ids}")

    only = set(sys.argv[1:])

    def want(n):
        return not only or n in only

    if want("qwen3_5_moe_fused") or want("qwen3_5_moe_mlx4"):
        print("qwen3_5_moe_fused")
        seed = 1000
        while True:
            model, seed, fused_dir = make_qwen35("qwen3_5_moe_fused", seed, vocab, prompt_ids, specials, tok_dir,
                                                 fused=True, bf16=False)
            print("qwen3_5_moe_mlx4")
            if make_mlx4("qwen3_5_moe_mlx4", fused_dir, model.config, prompt_ids, specials, tok_dir, vocab):
                break
            print("  mlx4 fixture not well conditioned, reseeding both")
            seed += 1
    if want("qwen3_5_moe_split"):
        print("qwen3_5_moe_split")
        make_qwen35("qwen3_5_moe_split", 2000, vocab, prompt_ids, specials, tok_dir, fused=False, bf16=True)
    if want("qwen3_moe"):
        print("qwen3_moe")
        make_qwen3moe("qwen3_moe", 3000, vocab, prompt_ids, specials, tok_dir)
    if want("qwen3_next"):
        print("qwen3_next")
        make_qwen3next("qwen3_next", 4000, vocab, prompt_ids, specials, tok_dir)
    if want("qwen3_next_mlx4"):
        # mlx-lm keeps in_proj_qkvz / in_proj_ba fused and quantized, drops mtp.*
        print("qwen3_next_mlx4")
        ok = make_mlx4("qwen3_next_mlx4", FIX / "qwen3_next", qwen3next_config(vocab), prompt_ids, specials,
                       tok_dir, vocab, kind="qwen3_next")
        assert ok, "qwen3_next_mlx4 not well conditioned"
    shutil.rmtree(tok_dir)
    for d in sorted(FIX.iterdir()):
        size = sum(f.stat().st_size for f in d.iterdir())
        print(f"{d.name}: {size / 1e6:.2f} MB, files {sorted(f.name for f in d.iterdir())}")


if __name__ == "__main__":
    main()
