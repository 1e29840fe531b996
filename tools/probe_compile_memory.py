"""Peak memory of one GroupedMLP fwd+bwd step, eager beside torch.compile.

    python tools/probe_compile_memory.py [--experts 8 --tokens 65536]

DeepSeek-V3 expert shapes (H 7168, F 2048, SwiGLU with probs), device
m_splits, fresh weight gradients, x held by the caller; bf16 and FP8 block
scaling; GiB above what was allocated before the step (as
benchmarks/bench_grouped_mlp.py counts it).  The eager backward drops h and
the FP8 copies after their last reader; a compiled backward op receives them
as inputs, which the compiled graph holds until the op returns.  Needs CUDA.
"""
from __future__ import annotations

import argparse
import sys
import os

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import lpmoe  # noqa: E402
from lpmoe.recipe import Float8BlockScaling  # noqa: E402

from _common import peak_gib  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    a = ap.parse_args()
    g, t = a.experts, a.tokens
    m = torch.full((g,), t // g, device="cuda", dtype=torch.int64)
    x = torch.randn(t, a.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    p = torch.rand(t, device="cuda", requires_grad=True)
    dy = torch.randn(t, a.hidden, device="cuda", dtype=torch.bfloat16)
    for name, recipe in (("bf16", None), ("fp8", Float8BlockScaling())):
        for mode in ("eager", "compile"):
            mlp = lpmoe.GroupedMLP(g, a.hidden, a.ffn, params_dtype=torch.bfloat16, device="cuda")
            run = torch.compile(mlp, fullgraph=True) if mode == "compile" else mlp

            def step():
                x.grad = p.grad = None
                mlp.zero_grad(set_to_none=True)
                with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
                    run(x, m, probs=p).backward(dy)

            def reset():
                x.grad = p.grad = None
                mlp.zero_grad(set_to_none=True)
            step()
            print(f"{name:5s} {mode:8s} peak {peak_gib(step, reset):5.2f} GiB above the step's start", flush=True)
            del mlp, run
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
