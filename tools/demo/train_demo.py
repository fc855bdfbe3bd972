#!/usr/bin/env python3
"""Train the small demo qwen3_5_moe model that `slipstream run` uses when no model is given.

    tools/reference/.venv/bin/python tools/demo/train_demo.py            # full run -> models/demo/
    tools/reference/.venv/bin/python tools/demo/train_demo.py --bench 5  # time a few steps only

Deterministic: fixed seeds, fixed step count, single process, 2 threads.
See tools/demo/README.md.
"""

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE.parent / "reference"))

import make_fixtures as mf  # noqa: E402  (tokenizer + config helpers shared with the fixtures)
from safetensors.torch import save_file  # noqa: E402
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402

VOCAB = 4096
SEQ = 256
BATCH = 8
STEPS = 350
LR = 3e-3
WARMUP = 40
SEED = 1234
PROMPT = "And it came to pass"


def demo_config(vocab):
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=vocab,
        hidden_size=192,
        num_hidden_layers=6,
        layer_types=["linear_attention", "linear_attention", "full_attention",
                     "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [4, 2, 2], "mrope_interleaved": True},
        linear_num_key_heads=4,
        linear_key_head_dim=32,
        linear_num_value_heads=8,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        # Declared, not trained (sequences are SEQ long): room for coding
        # agents' long prompts in the server's client tests (tests/clients).
        max_position_embeddings=262144,
        eos_token_id=mf.SPECIALS.index("<|im_end|>"),
        initializer_range=0.02,
    )
    cfg._attn_implementation = "eager"
    return cfg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", type=int, default=0, help="only time this many steps")
    ap.add_argument("--experts-impl", default="eager")
    ap.add_argument("--steps", type=int, default=STEPS)
    args = ap.parse_args()

    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    t_start = time.time()

    tok = mf.train_tokenizer(HERE / "corpus.txt", VOCAB)
    assert tok.get_vocab_size() == VOCAB
    text = (HERE / "corpus.txt").read_text(encoding="utf-8")
    ids = torch.tensor(tok.encode(text).ids, dtype=torch.long)
    print(f"tokenizer: vocab {VOCAB}; corpus {len(text)} chars -> {len(ids)} tokens "
          f"({len(text) / len(ids):.2f} chars/token), {time.time() - t_start:.1f}s", flush=True)

    cfg = demo_config(VOCAB)
    model = Qwen3_5MoeForCausalLM(cfg).float()
    model.config._experts_implementation = args.experts_impl
    model.config._attn_implementation = "eager"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M params ({2 * n_params / 1e6:.1f} MB in bf16)", flush=True)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in n or n.endswith(("A_log", "dt_bias")) else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    steps = args.bench or args.steps

    def lr_at(s):
        if s < WARMUP:
            return LR * (s + 1) / WARMUP
        frac = (s - WARMUP) / max(1, steps - WARMUP)
        return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    gen = torch.Generator().manual_seed(SEED)
    n_val = len(ids) // 50  # last 2% held out
    train_ids, val_ids = ids[:-n_val], ids[-n_val:]
    model.train()
    t0 = time.time()
    ema = None
    loss_log = []
    for step in range(steps):
        starts = torch.randint(0, len(train_ids) - SEQ - 1, (BATCH,), generator=gen)
        batch = torch.stack([train_ids[s: s + SEQ + 1] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        out = model(input_ids=batch[:, :-1], use_cache=False, output_router_logits=True)
        logits = out.logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), batch[:, 1:].reshape(-1))
        total = loss + cfg.router_aux_loss_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        loss_log.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            el = time.time() - t0
            print(f"step {step:4d} loss {loss.item():.3f} ema {ema:.3f} aux {out.aux_loss.item():.3f} "
                  f"lr {lr_at(step):.2e} {el:.0f}s ({el / (step + 1):.2f}s/step)", flush=True)
    train_s = time.time() - t0
    if args.bench:
        return

    model.eval()
    with torch.no_grad():
        vl = []
        for i in range(0, min(len(val_ids) - SEQ - 1, 40 * SEQ), SEQ):
            b = val_ids[i: i + SEQ + 1][None]
            lg = model(input_ids=b[:, :-1], use_cache=False).logits
            vl.append(torch.nn.functional.cross_entropy(lg[0].float(), b[0, 1:]).item())
    val_loss = sum(vl) / len(vl)
    print(f"val loss {val_loss:.3f} (held-out last 2% of the corpus)")

    out_dir = REPO / "models" / "demo"
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    full = mf.qwen35_full_config_dict(model.config)
    full["text_config"]["dtype"] = full["dtype"] = "bfloat16"
    mf.write_json(out_dir / "config.json", full)
    mf.write_json(out_dir / "generation_config.json",
                  {"do_sample": False, "eos_token_id": [mf.SPECIALS.index("<|im_end|>"),
                                                        mf.SPECIALS.index("<|endoftext|>")],
                   "pad_token_id": mf.SPECIALS.index("<|endoftext|>"), "max_new_tokens": 256,
                   "transformers_version": mf.transformers.__version__})
    sd = mf.qwen35_checkpoint_state(model, fused=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)
    mf.save_tokenizer(tok, out_dir)

    # sample from the saved bf16 checkpoint (computed in float32)
    m2 = Qwen3_5MoeForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    m2.config._experts_implementation = "eager"
    m2.eval()
    p = torch.tensor([tok.encode(PROMPT).ids])
    with torch.no_grad():
        g = m2.generate(p, max_new_tokens=80, do_sample=False, eos_token_id=None, pad_token_id=0)
    sample = tok.decode(g[0].tolist())
    print("greedy sample:", repr(sample))
    size = (out_dir / "model.safetensors").stat().st_size
    log = {"steps": steps, "batch": BATCH, "seq": SEQ, "lr": LR, "seed": SEED,
           "final_train_loss_ema": ema, "final_train_loss": loss_log[-1], "val_loss": val_loss,
           "train_seconds": train_s, "total_seconds": time.time() - t_start, "params": n_params,
           "model_safetensors_bytes": size, "prompt": PROMPT, "greedy_sample": sample,
           "greedy_tokens": g[0].tolist(),
           "loss_every_50": [round(x, 4) for x in loss_log[::50]]}
    mf.write_json(HERE / "train_log.json", log)
    print(json.dumps({k: v for k, v in log.items() if k != "greedy_tokens"}, indent=1))


if __name__ == "__main__":
    main()
