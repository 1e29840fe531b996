"""Train a small MoE transformer language model on real text, in BF16 and in
FP8 block scaling, and compare their loss curves.

The text is the source code of Python's own standard library (every machine
with Python has it; nothing is downloaded): byte-level tokens, the last 5% of
the files (sorted by path) held out for validation.  The model: pre-norm
transformer blocks (causal attention with rotary positions, then a
mixture-of-experts MLP); the router (softmax, top-k, renormalised
probabilities, Switch load-balancing loss) and the token permutation are
plain PyTorch; the experts are one
lpmoe.GroupedMLP per block (SwiGLU, router probabilities fused into the
activation), fed with device-side expert counts (the graph-safe path).

Both runs of a seed start from the same weights and see the same batches
(non-overlapping windows, each at most once per pass); only the experts'
GEMMs differ (lpmoe.autocast(Float8BlockScaling()) for FP8).  Parameters are
bf16 with fp32 master weights in the optimizer, or with ``--params fp32``
fp32 trained in place under torch.autocast(bfloat16) (PyTorch's usual mixed
precision; lpmoe then quantizes the experts' weights straight from fp32 and
writes fp32 weight gradients).  ``--optimizer lpmoe`` steps either with
lpmoe.optim.AdamW (``master_weights=True`` for bf16 parameters), which also
writes the experts' FP8 weights.  Prints the loss and
tokens/s, the FP8/BF16 gap of the final validation loss (the whole held-out
text) per seed beside BF16's spread across seeds, and writes a PNG of the
loss curves.

    python examples/train_moe_lm.py --seeds 0,1     # GPU: 2400 steps each, < 1 pass
    python examples/train_moe_lm.py --steps 20 ...  # a short smoke run (CPU too)
    # seeds as processes side by side on one GPU, then pooled:
    for s in 0 1 2 3; do python examples/train_moe_lm.py --seeds $s --plot '' --json s$s.json & done; wait
    python examples/train_moe_lm.py --pool s*.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import lpmoe
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import lpmoe
from lpmoe.recipe import Float8BlockScaling

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling report module
from moe_lm_runs import plot, pool, summarize  # noqa: E402


# ------------------------------------------------------------------- data
def stdlib_bytes(limit_mb: float) -> tuple:
    """(train, val) uint8 tensors of the standard library's .py sources."""
    root = os.path.dirname(os.__file__)
    files = []
    for d, subdirs, names in os.walk(root):
        subdirs[:] = sorted(s for s in subdirs if s not in ("site-packages", "dist-packages", "__pycache__"))
        files += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
    files.sort()
    budget = int(limit_mb * 2**20)
    chunks, total = [], 0
    for path in files:
        with open(path, "rb") as fh:
            data = fh.read()
        chunks.append(data)
        total += len(data)
        if total >= budget:
            break
    n_val = max(1, len(chunks) // 20)
    train = b"".join(chunks[:-n_val])
    val = b"".join(chunks[-n_val:])
    as_t = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return as_t(train), as_t(val)


class Windows:
    """Non-overlapping (seq + 1)-byte windows of ``data`` in a shuffled order,
    ``batch_size`` per call: a run shorter than one pass sees every byte at
    most once, so its validation loss measures learning, not memorisation
    (the first version drew random offsets and ran ~2.5 passes; both recipes
    then overfit and their validation losses split by up to 11 %)."""

    def __init__(self, data: torch.Tensor, batch_size: int, seq: int, gen: Optional[torch.Generator], device):
        n = (data.numel() - 1) // seq
        if n < batch_size:
            raise ValueError(f"the text holds {n} windows of {seq + 1} bytes, fewer than batch={batch_size}")
        self.data, self.batch_size, self.seq, self.gen, self.device = data, batch_size, seq, gen, device
        self.starts = torch.arange(n) * seq
        self.order = self._order()
        self.pos, self.passes = 0, 0

    def _order(self):
        if self.gen is None:
            return self.starts
        return self.starts[torch.randperm(len(self.starts), generator=self.gen)]

    def __len__(self):  # whole batches in one pass
        return len(self.starts) // self.batch_size

    def next(self):
        if self.pos + self.batch_size > len(self.order):   # a new pass, in a new order
            self.order, self.pos, self.passes = self._order(), 0, self.passes + 1
        starts = self.order[self.pos:self.pos + self.batch_size]
        self.pos += self.batch_size
        b = self.data[starts[:, None] + torch.arange(self.seq + 1)[None, :]].long().to(self.device)
        return b[:, :-1], b[:, 1:]


# ------------------------------------------------------------------ model
class MoE(nn.Module):
    """Top-k router in plain PyTorch around lpmoe.GroupedMLP experts."""

    def __init__(self, d: int, ffn: int, experts: int, top_k: int, device, params_dtype=torch.bfloat16):
        super().__init__()
        self.experts_n, self.top_k = experts, top_k
        self.router = nn.Linear(d, experts, bias=False, device=device)
        self.experts = lpmoe.GroupedMLP(experts, d, ffn, activation="swiglu", device=device,
                                        params_dtype=params_dtype)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.router(x).float().softmax(-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        flat = top_i.reshape(-1)
        counts = torch.bincount(flat, minlength=self.experts_n)  # tokens per expert, on the device
        # Switch load balancing: E * sum_e (fraction routed to e) * (mean router prob of e)
        aux = self.experts_n * (counts.float() / flat.numel() * probs.mean(0)).sum()
        order = torch.argsort(flat, stable=True)               # group the k copies by expert
        y = self.experts(x[order // self.top_k], counts, probs=top_p.reshape(-1)[order])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y = y[inverse].view(-1, self.top_k, shape[-1]).sum(1)  # deterministic un-permute
        return y.view(shape), aux


def rotary(q: torch.Tensor, k: torch.Tensor) -> tuple:
    """Rotary position embedding of (batch, heads, seq, head_dim) queries and
    keys (rotate-half form, base 10000), in fp32."""
    half = q.shape[-1] // 2
    inv_freq = 10000.0 ** (-torch.arange(half, device=q.device, dtype=torch.float32) / half)
    angle = torch.arange(q.shape[-2], device=q.device, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = angle.cos(), angle.sin()

    def rotate(x):
        x1, x2 = x.float().split(half, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)
    return rotate(q), rotate(k)


class Block(nn.Module):
    def __init__(self, d, heads, ffn, experts, top_k, device, rope=False, params_dtype=torch.bfloat16):
        super().__init__()
        self.heads, self.rope = heads, rope
        self.norm1 = nn.RMSNorm(d, device=device)
        self.qkv = nn.Linear(d, 3 * d, bias=False, device=device)
        self.proj = nn.Linear(d, d, bias=False, device=device)
        self.norm2 = nn.RMSNorm(d, device=device)
        self.moe = MoE(d, ffn, experts, top_k, device, params_dtype)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2))
        if self.rope:
            q, k = rotary(q, k)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        y, aux = self.moe(self.norm2(x))
        return x + y, aux


class MoELM(nn.Module):
    def __init__(self, args, device):
        super().__init__()
        # Token embeddings start at std 0.02 (GPT-2's), not nn.Embedding's 1:
        # beside std-1 tokens, learned positions (--pos learned) were 2 % of
        # the residual stream and every run sat on a bigram plateau (loss
        # ~2.4) for ~1000 steps; when it left decided the final loss more than
        # the recipe did.  Rotary positions (the default) shorten the plateau
        # further.
        self.embed = nn.Embedding(256, args.d_model, device=device)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.pos = (nn.Parameter(torch.randn(args.seq, args.d_model, device=device) * 0.02)
                    if args.pos == "learned" else None)
        pdtype = torch.float32 if args.params == "fp32" else torch.bfloat16
        self.blocks = nn.ModuleList(Block(args.d_model, args.heads, args.ffn, args.experts, args.top_k, device,
                                          rope=args.pos == "rope", params_dtype=pdtype) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.d_model, device=device)
        self.head = nn.Linear(args.d_model, 256, bias=False, device=device)

    def forward(self, tokens):
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos[: tokens.shape[1]]
        aux = 0.0
        for blk in self.blocks:
            x, a = blk(x)
            aux = aux + a
        return self.head(self.norm(x)).float(), aux / len(self.blocks)


class MasterAdamW:
    """AdamW on fp32 master copies of bf16 parameters."""

    def __init__(self, params, lr, weight_decay=0.1):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)

    def step(self, lr):
        for g in self.opt.param_groups:
            g["lr"] = lr
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float()
        torch.nn.utils.clip_grad_norm_(self.master, 1.0)
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)
                p.grad = None


class AmpAdamW:
    """AdamW on fp32 parameters themselves (--params fp32, torch.autocast):
    PyTorch's usual mixed precision, no master copies.  ``--optimizer
    lpmoe``: lpmoe.optim.AdamW, which also writes the experts' FP8 weights
    in its step (the FP8 forward then quantizes none); for bf16 parameters
    with its fp32 master weights (``master_weights=True``)."""

    def __init__(self, model, lr, weight_decay=0.1, kind="torch"):
        self.params = [p for p in model.parameters() if p.requires_grad]
        fused = self.params[0].is_cuda
        kw = dict(lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, fused=fused)
        master = self.params[0].dtype != torch.float32
        self.opt = (lpmoe.optim.AdamW(self.params, fp8_weights_of=model, master_weights=master, **kw)
                    if kind == "lpmoe" else torch.optim.AdamW(self.params, **kw))

    def step(self, lr):
        for g in self.opt.param_groups:
            g["lr"] = lr
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


# ---------------------------------------------------------------- training
def train(args, label, recipe, seed, train_data, val_data, device) -> Dict[str, List]:
    torch.manual_seed(seed)
    amp = args.params == "fp32"  # fp32 parameters, bf16 compute under torch.autocast
    model = MoELM(args, device)
    if amp:
        opt = AmpAdamW(model, args.lr, kind=args.optimizer)
    else:
        model = model.to(torch.bfloat16)
        opt = (AmpAdamW(model, args.lr, kind="lpmoe") if args.optimizer == "lpmoe"
               else MasterAdamW(model.parameters(), args.lr))
    mixed = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp)  # noqa: E731
    batches = Windows(train_data, args.batch, args.seq, torch.Generator().manual_seed(seed + 1), device)
    val = Windows(val_data, args.batch, args.seq, None, device)   # every validation window, in file order
    val_batches = [val.next() for _ in range(len(val) if args.eval_batches <= 0 else min(args.eval_batches, len(val)))]
    hist = {"step": [], "train": [], "val_step": [], "val": []}
    tokens, train_time = 0, 0.0
    name = f"{label} seed {seed}"
    for step in range(1, args.steps + 1):
        lr = args.lr * min(1.0, step / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps)))
        x, y = batches.next()
        t0 = time.perf_counter()
        with mixed(), lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
            logits, aux = model(x)
            loss = F.cross_entropy(logits.view(-1, 256), y.reshape(-1))
            (loss + args.aux_coeff * aux).backward()
        opt.step(lr)
        if device.type == "cuda":
            torch.cuda.synchronize()
        train_time += time.perf_counter() - t0
        tokens += x.numel()
        hist["step"].append(step)
        hist["train"].append(float(loss.detach()))
        if step % args.eval_every == 0 or step == args.steps:
            with torch.no_grad(), mixed(), lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
                vl = sum(float(F.cross_entropy(model(vx)[0].view(-1, 256), vy.reshape(-1)))
                         for vx, vy in val_batches) / len(val_batches)
            hist["val_step"].append(step)
            hist["val"].append(vl)
            print(f"[{name}] step {step:5d}  train {float(loss.detach()):.4f}  val {vl:.4f}  "
                  f"{tokens / train_time / 1e3:8.1f} k tokens/s", flush=True)
    hist["tokens_per_s"] = tokens / train_time
    hist["passes"] = tokens / (len(batches) * args.batch * args.seq)
    return hist


def parse_args(argv: Optional[List[str]] = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2400)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=512, help="expert hidden size (SwiGLU: fc1 has 2x)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--pos", choices=("rope", "learned"), default="rope",
                   help="position encoding: rotary (default), or learned absolute embeddings, with which the runs "
                        "sit on a bigram plateau (loss ~2.4) for hundreds of steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--aux-coeff", type=float, default=0.01)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-batches", type=int, default=0, help="0: the whole validation text")
    p.add_argument("--data-mb", type=float, default=32.0, help="read at most this much source text")
    p.add_argument("--seeds", default="0", help="comma-separated; each seed trains every recipe")
    p.add_argument("--recipes", default="bf16,fp8", help="comma-separated: bf16, fp8, fp8-hp-backward, bf16-repeat")
    p.add_argument("--params", choices=("bf16", "fp32"), default="bf16",
                   help="bf16 parameters with fp32 master copies in the optimizer, or fp32 parameters "
                        "trained under torch.autocast(bfloat16) with a plain AdamW")
    p.add_argument("--optimizer", choices=("torch", "lpmoe"), default="torch",
                   help="torch.optim.AdamW (on fp32 masters of bf16 parameters), or lpmoe.optim.AdamW (writes "
                        "the experts' FP8 weights in its step; master_weights=True for bf16 parameters)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--plot", default="moe_lm_loss.png", help="PNG path ('' to skip)")
    p.add_argument("--json", default="", help="also write every run's history here (to pool seeds run as processes)")
    p.add_argument("--pool", nargs="+", default=None, metavar="JSON",
                   help="train nothing: summarize (and plot) the runs in these --json files")
    args = p.parse_args(argv)
    if args.pos == "rope" and (args.d_model % args.heads or (args.d_model // args.heads) % 2):
        p.error(f"--pos rope needs an even head size: --d-model {args.d_model} / --heads {args.heads}")
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Dict]:
    args = parse_args(argv)
    if args.pool:
        return pool(args.pool, args.plot)
    device = torch.device(args.device)
    train_data, val_data = stdlib_bytes(args.data_mb)
    print(f"data: {train_data.numel() / 2**20:.1f} MiB train, {val_data.numel() / 2**20:.1f} MiB val "
          f"(Python {sys.version.split()[0]} standard library); device {device}")
    recipes = {"bf16": None, "fp8": Float8BlockScaling(),
               # FP8 forward, high-precision backward GEMMs: which half of FP8 moves the curve
               "fp8-hp-backward": Float8BlockScaling(backward_override="high_precision"),
               # BF16 again (another process or run): how far two runs of the same
               # seed and recipe end apart, the noise floor of the FP8/BF16 gap
               "bf16-repeat": None}
    hists = {}
    seeds = [int(v) for v in args.seeds.split(",")]
    for seed in seeds:
        for name in args.recipes.split(","):
            key = name if len(seeds) == 1 else f"{name} s{seed}"
            hists[key] = train(args, name, recipes[name], seed, train_data, val_data, device)
    for name, h in hists.items():
        print(f"{name}: final val loss {h['val'][-1]:.4f}, {h['tokens_per_s'] / 1e3:.1f} k tokens/s, "
              f"{h['passes']:.2f} passes over the training text")
    summarize(hists, seeds, args.recipes.split(","))
    if args.json:
        seeded = hists if len(seeds) > 1 else {f"{k} s{seeds[0]}": h for k, h in hists.items()}
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "seeds": seeds, "recipes": args.recipes.split(","), "runs": seeded}, fh)
    if args.plot:
        plot(hists, args.plot)
    return hists


if __name__ == "__main__":
    main()
