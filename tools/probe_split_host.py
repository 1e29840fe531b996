"""Host time of a compiled GroupedMLP step with the backward in one op or
in three (lpmoe.library.mlp_ops.SPLIT_BACKWARD_BYTES forced), at one shape.

    python tools/probe_split_host.py [--experts 8 --tokens 65536 --hidden 7168 --ffn 2048] [--fp8]

Host microseconds per step (8 steps queued behind a sleeping GPU, so no
call waits on the device), then a cProfile of 10 steps of each form (top
functions by own time).  Compiled-graph caches are off: the two forms
trace the same graph.  Needs CUDA.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import lpmoe  # noqa: E402
from lpmoe.library import mlp_ops  # noqa: E402
from lpmoe.recipe import Float8BlockScaling  # noqa: E402

from _common import host_us  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--fp8", action="store_true")
    a = ap.parse_args()
    recipe = Float8BlockScaling() if a.fp8 else None
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    m = torch.full((a.experts,), a.tokens // a.experts, device="cuda")
    x = torch.randn(a.tokens, a.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    p = torch.rand(a.tokens, device="cuda", requires_grad=True)
    dy = torch.randn(a.tokens, a.hidden, device="cuda", dtype=torch.bfloat16)
    for name, threshold in (("one op", 1 << 62), ("three ops", 0)):
        mlp_ops.SPLIT_BACKWARD_BYTES = threshold
        torch._dynamo.reset()
        mlp = lpmoe.GroupedMLP(a.experts, a.hidden, a.ffn, params_dtype=torch.bfloat16, device="cuda")
        run = torch.compile(mlp, fullgraph=True)

        def step():
            x.grad = p.grad = None
            mlp.zero_grad(set_to_none=True)
            with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
                run(x, m, probs=p).backward(dy)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        print(f"{name:10s} host {host_us(step, n=8):8.0f} us per step", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(10):
            step()
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
        print("\n".join(line[:150] for line in out.getvalue().splitlines() if line.strip()[:1].isdigit()))



if __name__ == "__main__":
    main()
