#!/usr/bin/env python3
"""Train the multi-token-prediction (MTP) head of the demo model (models/demo/).

    tools/reference/.venv/bin/python tools/demo/train_mtp.py            # full run
    tools/reference/.venv/bin/python tools/demo/train_mtp.py --bench 5  # time a few steps only

The main model (trained by train_demo.py) is loaded frozen; only the `mtp.*`
weights are trained, on the same corpus, tokenizer and held-out split. The
head follows the runtime's math (crates/models/src/mtp.rs) and the float64
reference of tools/reference/make_mtp_fixture.py: for row t, with h_t the
main model's hidden state AFTER its final norm and x_{t+1} the next token,

    x      = fc( concat( pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t) ) )
    x      = decoder_layer(x)         # gated full attention (own KV cache, row t at RoPE
                                      # position t) + MoE (routed + shared), zero-centred norms
    logits = lm_head( mtp.norm(x) )   # the model's shared lm_head  -> token t+2

The decoder layer is transformers' Qwen3_5MoeDecoderLayer (the class of the
main model's full-attention layers, whose math the runtime's parity tests
pin), so the `mtp.*` names are the official checkpoints' own.

Loss per row: cross entropy to the true token t+2, plus KL_WEIGHT x the KL
divergence from the frozen main model's distribution at t+1 (what
speculative decoding verifies the draft against).

Writes: the `mtp.*` tensors (bfloat16) into models/demo/model.safetensors
(a temp file, then a rename; every existing tensor byte-identical, checked),
`mtp_num_hidden_layers: 1` into models/demo/config.json, the log
tools/demo/train_mtp_log.json, and the runtime parity fixture
tests/fixtures/demo_mtp/ (reference.json, mtp_logits.npy).

Deterministic: fixed seeds, fixed step count, single process, 1 thread.
See tools/demo/README.md.
"""

import argparse
import copy
import json
import math
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DEMO = REPO / "models" / "demo"
FIXTURE = REPO / "tests" / "fixtures" / "demo_mtp"
sys.path.insert(0, str(HERE.parent / "reference"))

import make_fixtures as mf  # noqa: E402  (write_json shared with the fixtures)
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import Qwen3_5MoeForCausalLM  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (  # noqa: E402
    Qwen3_5MoeDecoderLayer,
    Qwen3_5MoeRMSNorm,
)

SEQ = 256
BATCH = 8
STEPS = 400
LR = 2e-3
WARMUP = 20
SEED = 4321
KL_WEIGHT = 1.0
EVAL_WINDOWS = 40
PROMPT = "And it came to pass"  # crates/cli/src/demo.rs DEFAULT_PROMPT
GREEDY_NEW = 128  # greedy continuation scored for acceptance and kept as the fixture
FIXTURE_ROWS = [0, 1, 2, 3, 31, 63, 95, 127]  # MTP rows whose logits the fixture keeps


class MtpHead(nn.Module):
    """One MTP layer; its state_dict keys, under `mtp.`, are the checkpoints' names."""

    def __init__(self, text_cfg):
        super().__init__()
        h, eps = text_cfg.hidden_size, text_cfg.rms_norm_eps
        cfg = copy.deepcopy(text_cfg)
        # SDPA with no mask is causal attention over the rows (eager needs a
        # mask tensor); the main model keeps its own config.
        cfg._attn_implementation = "sdpa"
        cfg._experts_implementation = "eager"
        full = cfg.layer_types.index("full_attention")
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(h, eps=eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([Qwen3_5MoeDecoderLayer(cfg, full)])
        self.norm = Qwen3_5MoeRMSNorm(h, eps=eps)

    def forward(self, main, hidden, next_tokens):
        """hidden [B, T, H] (main model, after its final norm) and next_tokens
        [B, T] (token t+1 of row t) -> (logits [B, T, V] for token t+2, the
        head's normed output [B, T, H]). Row t sits at RoPE position t."""
        e = self.pre_fc_norm_embedding(main.model.embed_tokens(next_tokens))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        rope = main.model.rotary_emb(x, pos[None].expand(3, -1, -1))
        x = self.layers[0](x, position_embeddings=rope, attention_mask=None)
        out = self.norm(x)
        return main.lm_head(out), out


def load_main():
    """The frozen demo model in float32, from the bf16 checkpoint (mtp.* ignored)."""
    main = Qwen3_5MoeForCausalLM.from_pretrained(str(DEMO), dtype=torch.float32)
    main.config._experts_implementation = "eager"
    main.config._attn_implementation = "eager"
    main.eval()
    for p in main.parameters():
        p.requires_grad_(False)
    return main


@torch.no_grad()
def main_pass(main, tokens):
    """tokens [B, T] -> (hidden after the final norm [B, T, H], logits [B, T, V])."""
    hidden = main.model(input_ids=tokens, use_cache=False).last_hidden_state
    return hidden, main.lm_head(hidden)


def init_head(head, main):
    """The decoder layer starts as a copy of the main model's last full-attention
    layer, mtp.norm as the main final norm, fc as N(0, 0.02), the pre-fc norms at 1."""
    cfg = main.config
    last_full = max(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
    head.layers[0].load_state_dict(main.model.layers[last_full].state_dict())
    head.norm.load_state_dict(main.model.norm.state_dict())
    nn.init.normal_(head.fc.weight, std=cfg.initializer_range)
    nn.init.zeros_(head.pre_fc_norm_embedding.weight)
    nn.init.zeros_(head.pre_fc_norm_hidden.weight)


def mtp_rows(window):
    """window [B, T+1] -> main input [B, T], MTP next tokens [B, T-1], targets [B, T-1]."""
    return window[:, :-1], window[:, 1:-1], window[:, 2:]


def losses(head, main, window):
    inp, nxt, tgt = mtp_rows(window)
    hidden, main_logits = main_pass(main, inp)
    logits, _ = head(main, hidden[:, :-1], nxt)
    v = logits.shape[-1]
    ce = F.cross_entropy(logits.reshape(-1, v), tgt.reshape(-1))
    teacher = F.log_softmax(main_logits[:, 1:], dim=-1).reshape(-1, v)
    kl = F.kl_div(F.log_softmax(logits, dim=-1).reshape(-1, v), teacher, log_target=True, reduction="batchmean")
    return ce, kl, logits, main_logits


@torch.no_grad()
def evaluate(head, main, val_ids, windows=EVAL_WINDOWS):
    """Held-out metrics over `windows` windows of SEQ (teacher-forced on the corpus)."""
    ce_sum = kl_sum = 0.0
    n = hit_true = hit_main = main_true = 0
    for i in range(0, min(len(val_ids) - SEQ - 1, windows * SEQ), SEQ):
        w = val_ids[i: i + SEQ + 1][None]
        ce, kl, logits, main_logits = losses(head, main, w)
        _, _, tgt = mtp_rows(w)
        draft = logits.argmax(-1)
        greedy = main_logits[:, 1:].argmax(-1)
        ce_sum += ce.item()
        kl_sum += kl.item()
        hit_true += (draft == tgt).sum().item()
        hit_main += (draft == greedy).sum().item()
        main_true += (greedy == tgt).sum().item()
        n += tgt.numel()
    windows = n // (SEQ - 1)
    return {"ce": ce_sum / windows, "kl": kl_sum / windows, "top1_true": hit_true / n,
            "top1_main_greedy": hit_main / n, "main_top1_true": main_true / n, "rows": n}


@torch.no_grad()
def greedy_acceptance(head, main, tok):
    """Greedy continuation of PROMPT by the main model; the share of MTP rows
    t >= len(prompt) - 1 whose argmax is the main model's token t+2 (the k=1
    acceptance of greedy speculative decoding)."""
    ids = tok.encode(PROMPT).ids
    seq = torch.tensor([ids])
    for _ in range(GREEDY_NEW):
        _, lg = main_pass(main, seq)
        seq = torch.cat([seq, lg[:, -1].argmax(-1, keepdim=True)], dim=1)
    hidden, main_logits = main_pass(main, seq)
    logits, _ = head(main, hidden[:, :-1], seq[:, 1:])
    draft = logits[0, :-1].argmax(-1)  # row t -> token t+2, for t + 2 < len
    truth = seq[0, 2:]
    first = len(ids) - 1  # first row whose token t+2 the model generated
    acc = (draft[first:] == truth[first:]).float().mean().item()
    return acc, seq[0].tolist(), logits[0], main_logits[0]


def safetensors_entries(path):
    """name -> (dtype, shape, raw bytes) of a safetensors file, read directly."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8: 8 + n])
    base = 8 + n
    return {k: (v["dtype"], v["shape"], raw[base + v["data_offsets"][0]: base + v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def write_checkpoint(head):
    """Adds mtp.* (bf16) to model.safetensors, keeping every other tensor's bytes."""
    path = DEMO / "model.safetensors"
    before = {k: v for k, v in safetensors_entries(path).items() if not k.startswith("mtp.")}
    tensors = {k: v for k, v in load_file(str(path)).items() if not k.startswith("mtp.")}
    for k, v in head.state_dict().items():
        tensors["mtp." + k] = v.detach().to(torch.bfloat16).contiguous()
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    after = safetensors_entries(tmp)
    for k, v in before.items():
        assert after[k] == v, f"{k} changed"
    assert set(after) - set(before) == {"mtp." + k for k in head.state_dict()}
    tmp.chmod(0o644)
    os.replace(tmp, path)

    cfg_path = DEMO / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    tmp = cfg_path.with_name(cfg_path.name + ".tmp")
    mf.write_json(tmp, cfg)
    os.replace(tmp, cfg_path)
    return len(before), len(after), path.stat().st_size


def top2_margin(lg):
    s = torch.sort(lg, dim=-1).values
    return (s[..., -1] - s[..., -2]).tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", type=int, default=0, help="only time this many steps")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--eval-windows", type=int, default=EVAL_WINDOWS, help="held-out windows scored")
    args = ap.parse_args()

    torch.set_num_threads(1)  # 2 threads spin 8x slower while other jobs share the 2 cores
    torch.manual_seed(SEED)
    t_start = time.time()

    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    text = (HERE / "corpus.txt").read_text(encoding="utf-8")
    ids = torch.tensor(tok.encode(text).ids, dtype=torch.long)
    n_val = len(ids) // 50  # last 2% held out, as train_demo.py
    train_ids, val_ids = ids[:-n_val], ids[-n_val:]
    print(f"corpus: {len(ids)} tokens, {len(val_ids)} held out, {time.time() - t_start:.1f}s", flush=True)

    main_model = load_main()
    head = MtpHead(main_model.config)
    init_head(head, main_model)
    n_params = sum(p.numel() for p in head.parameters())
    print(f"MTP head: {n_params / 1e6:.3f}M params", flush=True)

    decay, no_decay = [], []
    for n, p in head.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    steps = args.bench or args.steps

    def lr_at(s):
        if s < WARMUP:
            return LR * (s + 1) / WARMUP
        frac = (s - WARMUP) / max(1, steps - WARMUP)
        return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    before = None
    if not args.bench:
        before = evaluate(head, main_model, val_ids, args.eval_windows)
        print(f"held-out before training: {before}", flush=True)

    gen = torch.Generator().manual_seed(SEED)
    head.train()
    t0 = time.time()
    log_ce, log_kl = [], []
    for step in range(steps):
        starts = torch.randint(0, len(train_ids) - SEQ - 1, (args.batch,), generator=gen)
        window = torch.stack([train_ids[s: s + SEQ + 1] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        ce, kl, _, _ = losses(head, main_model, window)
        total = ce + KL_WEIGHT * kl
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        log_ce.append(ce.item())
        log_kl.append(kl.item())
        if step % 10 == 0 or step == steps - 1:
            el = time.time() - t0
            print(f"step {step:4d} ce {ce.item():.3f} kl {kl.item():.3f} lr {lr_at(step):.2e} "
                  f"{el:.0f}s ({el / (step + 1):.2f}s/step)", flush=True)
    train_s = time.time() - t0
    if args.bench:
        return

    # Everything below uses the weights as saved (bf16), computed in float32.
    head.eval()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    after = evaluate(head, main_model, val_ids, args.eval_windows)
    print(f"held-out after training: {after}", flush=True)
    acc, seq, mtp_logits, _ = greedy_acceptance(head, main_model, tok)
    print(f"greedy continuation of {PROMPT!r}: k=1 acceptance {acc:.3f}", flush=True)

    n_before, n_after, size = write_checkpoint(head)
    print(f"model.safetensors: {n_before} tensors kept byte-identical, {n_after - n_before} mtp.* added, "
          f"{size} bytes", flush=True)

    # The runtime parity fixture: the MTP logits of a few rows of the greedy
    # sequence (rows run with the runtime's own hidden states), every row's argmax.
    FIXTURE.mkdir(parents=True, exist_ok=True)
    rows = mtp_logits[:-1]  # the last row's token t+2 is not in the sequence
    np.save(FIXTURE / "mtp_logits.npy", rows[FIXTURE_ROWS].numpy().astype(np.float32))
    margins = top2_margin(rows)
    mf.write_json(FIXTURE / "reference.json", {
        "source": "tools/demo/train_mtp.py (torch float32 on the bf16 weights of models/demo)",
        "prompt": PROMPT,
        "prompt_tokens": len(tok.encode(PROMPT).ids),
        "tokens": seq,
        "rows": FIXTURE_ROWS,
        "mtp_greedy": rows.argmax(-1).tolist(),
        "mtp_top2_margin": [round(m, 5) for m in margins],
        "greedy_acceptance": acc,
        "torch": torch.__version__,
    })

    log = {"steps": steps, "batch": args.batch, "seq": SEQ, "lr": LR, "warmup": WARMUP, "seed": SEED,
           "kl_weight": KL_WEIGHT, "mtp_params": n_params, "train_seconds": train_s,
           "total_seconds": time.time() - t_start, "held_out_before": before, "held_out_after": after,
           "prompt": PROMPT, "greedy_new_tokens": GREEDY_NEW, "greedy_acceptance_k1": acc,
           "model_safetensors_bytes": size,
           "ce_every_25": [round(x, 4) for x in log_ce[::25]] + [round(log_ce[-1], 4)],
           "kl_every_25": [round(x, 4) for x in log_kl[::25]] + [round(log_kl[-1], 4)]}
    mf.write_json(HERE / "train_mtp_log.json", log)
    print(json.dumps(log, indent=1))


if __name__ == "__main__":
    main()
