"""Reporting for examples/train_moe_lm.py: the FP8/BF16 comparison of
finished runs (per seed, pooled over seeds), pooling runs that separate
processes wrote with --json, and the loss-curve plot."""
from __future__ import annotations

import json
import math
from typing import Dict, List

import torch

__all__ = ["summarize", "pool", "plot"]


def summarize(hists: Dict[str, Dict], seeds: List[int], recipes: List[str], seed_keys: bool = False) -> None:
    """Each recipe's final validation loss against BF16's, per seed, beside
    BF16's own spread across seeds (what "within 1 %" is resolved against);
    with several seeds also the mean gap and its standard error.  Runs are
    keyed "<recipe> s<seed>" when there are several seeds or ``seed_keys``."""
    seeded = seed_keys or len(seeds) > 1
    key = (lambda name, seed: f"{name} s{seed}") if seeded else (lambda name, seed: name)
    if "bf16" not in recipes:
        return
    for name in recipes:
        if name == "bf16":
            continue
        pairs = [(hists[key("bf16", s)], hists[key(name, s)]) for s in seeds
                 if key("bf16", s) in hists and key(name, s) in hists]
        if not pairs:
            print(f"{name}: no seed has both a bf16 and a {name} run; nothing to compare")
            continue
        gaps = [f["val"][-1] / b["val"][-1] - 1 for b, f in pairs]
        speed = [f["tokens_per_s"] / b["tokens_per_s"] for b, f in pairs]
        print(f"{name} vs bf16 final val loss: " + ", ".join(f"{100 * g:+.2f} %" for g in gaps)
              + f"   tokens/s {name}/bf16: " + ", ".join(f"{v:.2f}x" for v in speed))
        if len(gaps) > 1:
            g = torch.tensor(gaps, dtype=torch.float64)
            print(f"{name} vs bf16 over {len(gaps)} seeds: mean {100 * g.mean():+.2f} %, "
                  f"standard error {100 * g.std() / math.sqrt(len(gaps)):.2f} %, "
                  f"largest |gap| {100 * g.abs().max():.2f} %")
    b = [hists[key("bf16", s)]["val"][-1] for s in seeds if key("bf16", s) in hists]
    if len(b) > 1:
        print(f"bf16 across seeds: {min(b):.4f}..{max(b):.4f} ({100 * (max(b) / min(b) - 1):.2f} % spread)")


def pool(paths: List[str], plot_path: str) -> Dict[str, Dict]:
    """Summarize runs written by several processes (``--json``), e.g. one
    seed per process side by side on one GPU."""
    # Arguments that do not change a run's training: everything else must match.
    per_process = {"seeds", "recipes", "json", "plot", "pool", "device"}
    hists, seeds, recipes, setup, first = {}, [], [], None, None
    for path in paths:
        with open(path) as fh:
            saved = json.load(fh)
        this = {k: v for k, v in saved["args"].items() if k not in per_process}
        if setup is None:
            setup, first = this, path
        elif this != setup:
            diff = sorted(k for k in set(this) | set(setup) if this.get(k) != setup.get(k))
            raise ValueError(f"--pool: {path} was trained with other arguments than {first} ({', '.join(diff)}); "
                             "only runs of the same setup can be compared")
        twice = sorted(set(hists) & set(saved["runs"]))
        if twice:
            raise ValueError(f"--pool: {path} repeats run(s) {', '.join(twice)} of an earlier file "
                             "(give a repeated BF16 run the recipe name bf16-repeat)")
        hists.update(saved["runs"])
        seeds += [s for s in saved["seeds"] if s not in seeds]
        recipes += [r for r in saved["recipes"] if r not in recipes]
    seeds.sort()
    for name, h in hists.items():   # tokens/s of processes sharing one GPU: each other's load included
        print(f"{name}: final val loss {h['val'][-1]:.4f}, {h['tokens_per_s'] / 1e3:.1f} k tokens/s")
    summarize(hists, seeds, recipes, seed_keys=True)
    if plot_path:
        plot(hists, plot_path)
    return hists


def plot(hists: Dict[str, Dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:  # requirements.txt has it; a bare machine still trains
        print(f"matplotlib is not installed: no plot written to {path} (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    groups: Dict[str, List[Dict]] = {}
    for name, h in hists.items():   # "fp8 s3" -> "fp8": one curve (and band) per recipe
        groups.setdefault(name.rsplit(" s", 1)[0] if len(hists) > 2 else name, []).append(h)
    for name, hs in groups.items():
        k = max(1, len(hs[0]["train"]) // 100)
        train = torch.tensor([h["train"] for h in hs]).mean(0)
        smooth = train.unfold(0, k, k).mean(1) if len(train) >= k else train
        steps = hs[0]["step"]
        ax.plot([steps[min(len(steps) - 1, (i + 1) * k - 1)] for i in range(len(smooth))], smooth.tolist(),
                label=f"{name} train", alpha=0.6)
        val = torch.tensor([h["val"] for h in hs])
        final = f"{val[0, -1]:.4f}" if len(hs) == 1 else f"mean {val[:, -1].mean():.4f} over {len(hs)} runs"
        line, = ax.plot(hs[0]["val_step"], val.mean(0).tolist(), "o-", label=f"{name} val ({final})")
        if len(hs) > 1:
            ax.fill_between(hs[0]["val_step"], val.min(0).values.tolist(), val.max(0).values.tolist(),
                            color=line.get_color(), alpha=0.15)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title("MoE LM on the Python standard library: BF16 vs FP8 block scaling (lpmoe)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
