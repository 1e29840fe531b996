"""What is alive at the peak of one expert-MLP training step: replays the CUDA
caching allocator's trace of one forward+backward step of lpmoe.GroupedMLP
(DeepSeek-V3 expert shapes, as benchmarks/bench_grouped_mlp.py) and prints,
at the moment device memory above the step's start is highest, every live
block grouped by where it was allocated (innermost lpmoe frames).

    PYTHONPATH=python:benchmarks python3 tools/memory_breakdown.py \
        [--experts 8] [--tokens 65536] [--recipe fp8|bf16|all] [--grads fresh|main_grad|all]
        [--x-in-step] [--compile] [--moe-layer --topk 8]

--moe-layer measures lpmoe.moe.MoELayer instead (--experts 64 --topk 8
--tokens 8192 for DeepSeek-V3's layer; the tokens are a leaf the caller
holds).

--x-in-step makes the MLP's input inside the step (as an MoE layer's token
permutation does), so a recipe that keeps x for its backward pays for it;
without it x is a leaf the caller holds, which the high-precision backward
keeps by reference for free.  --compile runs the step through
torch.compile(fullgraph=True) (the layer ops, lpmoe.library.mlp_ops).
"""
from __future__ import annotations

import argparse
import collections
import gc

import torch

import lpmoe
from bench_grouped_mlp import FFN, HIDDEN
from lpmoe.recipe import Float8BlockScaling

MB = 1e6


def where(frames) -> str:
    """The innermost three frames inside lpmoe (or this tool) as one label."""
    own = [f for f in frames if "/lpmoe/" in f["filename"] or "memory_breakdown" in f["filename"]]
    pick = own[:3] if own else frames[:2]
    return " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in pick)


def replay(trace):
    """(peak bytes above the start, live blocks at the peak, the frames of
    the allocation that reached it).
    Blocks allocated before recording began are not in the trace."""
    live, cur, peak, at_peak, cause = {}, 0, 0, {}, []
    for ev in trace:
        act = ev["action"]
        if act == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
            cur += ev["size"]
            if cur > peak:
                peak, at_peak, cause = cur, dict(live), ev.get("frames", [])
        elif act == "free_requested" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])[0]
    return peak, at_peak, cause


def timeline(trace, min_bytes=100 * MB):
    """Every allocation and free of at least ``min_bytes``, with the running total above the start."""
    live, cur = {}, 0
    for ev in trace:
        act = ev["action"]
        if act == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
            cur += ev["size"]
            if ev["size"] >= min_bytes:
                print(f"  +{ev['size'] / MB:8.1f} -> {cur / MB:8.1f} MB  {where(ev.get('frames', []))}")
        elif act == "free_requested" and ev["addr"] in live:
            size, frames = live.pop(ev["addr"])
            cur -= size
            if size >= min_bytes:
                print(f"  -{size / MB:8.1f} -> {cur / MB:8.1f} MB  {where(frames)}")


def run(g, tokens, recipe_name, grads, x_in_step, compiled=False, top_k=0, show_timeline=False):
    m = torch.tensor([tokens // g] * g, device="cuda")
    x0 = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    p = torch.rand(tokens, device="cuda", requires_grad=True)
    dy = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    recipe = Float8BlockScaling() if recipe_name == "fp8" else None
    main = grads == "main_grad"
    if top_k:  # the MoE layer (its experts are a GroupedMLP)
        layer = lpmoe.moe.MoELayer(HIDDEN, FFN, g, top_k, params_dtype=torch.bfloat16)
        mlp = layer.experts
        run_layer = torch.compile(layer, fullgraph=True) if compiled else layer
        run_mlp = lambda x, m, probs: run_layer(x)  # noqa: E731  (routing is the layer's)
    else:
        mlp = lpmoe.GroupedMLP(g, HIDDEN, FFN, params_dtype=torch.bfloat16, device="cuda",
                               fuse_wgrad_accumulation=main)
        run_mlp = torch.compile(mlp, fullgraph=True) if compiled else mlp
    if main:
        for lin in (mlp.linear_fc1, mlp.linear_fc2):
            buf = torch.zeros((g,) + tuple(lin.weight0.shape), device="cuda")
            for i, w in enumerate(lin.weights):
                w.main_grad = buf[i]

    def step():
        x0.grad = p.grad = None
        mlp.zero_grad(set_to_none=True)
        with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
            # x0 * 1: a fresh activation that only the MLP holds, as a token permutation makes
            run_mlp(x0 * 1.0 if x_in_step else x0, m, probs=p).backward(dy)

    step()
    x0.grad = p.grad = None
    mlp.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    measured = torch.cuda.max_memory_allocated() - base
    trace = snap["device_traces"][torch.cuda.current_device()]
    peak, at_peak, cause = replay(trace)
    if show_timeline:
        timeline(trace)
    groups = collections.defaultdict(list)
    for size, frames in at_peak.values():
        groups[where(frames)].append(size)
    print(f"== {recipe_name} {grads}{' x-in-step' if x_in_step else ''}{' compiled' if compiled else ''}"
          f"{f' MoE layer top-{top_k}' if top_k else ''}: {g} experts x {tokens} tokens: "
          f"peak above start {measured / 2**30:.3f} GiB (allocator), {peak / 2**30:.3f} GiB (trace replay); "
          f"reached by: {where(cause)}")
    for k, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        if sum(sizes) >= 1 * MB:
            each = " + ".join(f"{v / MB:.1f}" for v in sorted(sizes, reverse=True)[:6])
            print(f"  {sum(sizes) / MB:9.1f} MB = {each:40s} {k}")
    gc.collect()
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--recipe", default="all", choices=("fp8", "bf16", "all"))
    ap.add_argument("--grads", default="all", choices=("fresh", "main_grad", "all"))
    ap.add_argument("--x-in-step", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--moe-layer", action="store_true")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--timeline", action="store_true", help="also every allocation/free of 100 MB or more")
    a = ap.parse_args()
    for recipe in (("fp8", "bf16") if a.recipe == "all" else (a.recipe,)):
        for grads in (("fresh", "main_grad") if a.grads == "all" else (a.grads,)):
            run(a.experts, a.tokens, recipe, grads, a.x_in_step, a.compile, a.topk if a.moe_layer else 0, a.timeline)


if __name__ == "__main__":
    main()
