"""GroupedMLP steps in a loop, for a sampling profiler (host time only).

    python tools/host_steps.py --mode eager|compile --recipe bf16|fp8 [--per-expert] [--layer mlp|moe] [--steps 300]
    py-spy record --format raw -r 2000 -o stacks.txt -- python tools/host_steps.py ...

Each step synchronizes first, so the host time of forward and backward is
measured with an idle GPU, and the step time runs to the GPU's end of the
step (medians per block of steps; the best block is printed).  Under a
sampling profiler, samples inside torch.cuda.synchronize are GPU waits.  The default shape is
bench_compile.py's launch-bound one (4k tokens, 64 experts, H 2048, F 768),
device m_splits, stacked parameters.  ``--layer moe`` runs a whole
lpmoe.moe.MoELayer (router, routing map, permutation, experts, top-8) over
``--tokens`` tokens instead.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import lpmoe
from lpmoe.recipe import Float8BlockScaling
from profile_compile_host import add_shape_args, launch_bound_inputs  # (tools/ is this script's folder)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("eager", "compile"), default="eager")
    p.add_argument("--recipe", choices=("bf16", "fp8"), default="fp8")
    p.add_argument("--per-expert", action="store_true")
    p.add_argument("--layer", choices=("mlp", "moe"), default="mlp")
    p.add_argument("--top-k", type=int, default=8, help="--layer moe: experts per token")
    p.add_argument("--steps", type=int, default=100, help="steps per block")
    p.add_argument("--blocks", type=int, default=3)
    add_shape_args(p)
    a = p.parse_args()
    x, splits = launch_bound_inputs(a)
    if a.layer == "moe":
        mlp = lpmoe.moe.MoELayer(a.hidden, a.ffn, a.experts, a.top_k, params_dtype=torch.bfloat16,
                                 single_grouped_parameter=not a.per_expert)
    else:
        mlp = lpmoe.GroupedMLP(a.experts, a.hidden, a.ffn, params_dtype=torch.bfloat16, device="cuda",
                               single_grouped_parameter=not a.per_expert)
    m = torch.compile(mlp, fullgraph=True) if a.mode == "compile" else mlp
    recipe = Float8BlockScaling() if a.recipe == "fp8" else None

    def step():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
            y = m(x) if a.layer == "moe" else m(x, splits)
        t1 = time.perf_counter()
        y.backward(torch.ones_like(y))
        t2 = time.perf_counter()
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.synchronize()
        return t1 - t0, t2 - t1, time.perf_counter() - t0

    for _ in range(10):
        step()
    # blocks of steps; the block with the lowest median step time is reported
    # (host noise on the GPU machine comes in bursts longer than a step)
    blocks = []
    for _ in range(a.blocks):
        f, b, w = zip(*(step() for _ in range(a.steps)))
        blocks.append((statistics.median(w), statistics.median(f), statistics.median(b)))
    w, f, b = min(blocks)
    print(f"{a.layer} {a.mode} {a.recipe} {'per-expert' if a.per_expert else 'stacked'}: host fwd {f * 1e6:.0f} us, "
          f"bwd {b * 1e6:.0f} us, step (to the GPU's end) {w * 1e6:.0f} us (best of {a.blocks} blocks of "
          f"{a.steps}: {', '.join(f'{x[0] * 1e6:.0f}' for x in blocks)})")


if __name__ == "__main__":
    main()
