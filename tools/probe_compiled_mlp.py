"""A compiled GroupedMLP step beside eager, and the compiled backward in
one op beside the staged ops (lpmoe.library.mlp_ops.SPLIT_BACKWARD_BYTES forced).

    python tools/probe_compiled_mlp.py memory [--experts 8 --tokens 65536 --hidden 7168 --ffn 2048]
    python tools/probe_compiled_mlp.py host [--fp8] [same shape options]

memory: peak GiB of one fwd+bwd step above its start, eager and
torch.compile(fullgraph=True), bf16 and FP8 block scaling (fresh weight
gradients, x held by the caller, as benchmarks/bench_grouped_mlp.py counts
it).  The eager backward drops h and the FP8 copies after their last
reader; a compiled backward op holds its inputs until it returns.

host: host microseconds per step (8 steps queued behind a sleeping GPU,
so no call waits on the device), eager and compiled with the backward in
one op and in three, then a cProfile of 10 steps of each (top functions by own
time).  Compiled-graph caches are off: both forms trace the same graph.

DeepSeek-V3 expert shapes by default, SwiGLU with probs, device m_splits.
Needs CUDA.
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

from _common import host_us, peak_gib  # noqa: E402


class Case:
    """Inputs of one shape and a fwd+bwd step of a fresh GroupedMLP."""

    def __init__(self, a):
        self.a = a
        self.m = torch.full((a.experts,), a.tokens // a.experts, device="cuda")
        self.x = torch.randn(a.tokens, a.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        self.p = torch.rand(a.tokens, device="cuda", requires_grad=True)
        self.dy = torch.randn(a.tokens, a.hidden, device="cuda", dtype=torch.bfloat16)

    def step_fn(self, recipe, compiled: bool):
        """(step, reset) of a new module; reset drops the step's gradients."""
        mlp = lpmoe.GroupedMLP(self.a.experts, self.a.hidden, self.a.ffn, params_dtype=torch.bfloat16, device="cuda")
        run = torch.compile(mlp, fullgraph=True) if compiled else mlp

        def reset():
            self.x.grad = self.p.grad = None
            mlp.zero_grad(set_to_none=True)

        def step():
            reset()
            with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
                run(self.x, self.m, probs=self.p).backward(self.dy)
        return step, reset


def memory(case: Case):
    for name, recipe in (("bf16", None), ("fp8", Float8BlockScaling())):
        for mode in ("eager", "compile"):
            step, reset = case.step_fn(recipe, mode == "compile")
            step()
            print(f"{name:5s} {mode:8s} peak {peak_gib(step, reset):5.2f} GiB above the step's start", flush=True)
            del step, reset
            torch.cuda.empty_cache()


def _host_line(name, step, repeats):
    """Median [min-max] over `repeats` samples of host_us (8 steps each)."""
    v = sorted(host_us(step, n=8) for _ in range(repeats))
    print(f"{name:10s} host {v[len(v) // 2]:8.0f} us per step [{v[0]:.0f}-{v[-1]:.0f}]", flush=True)


def _lpmoe_own_time(step, steps: int = 20):
    """cProfile of eager steps (backward in the calling thread, where
    cProfile sees it): lpmoe's functions by own time per step."""
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
        torch.cuda.synchronize()
    rows = [(v[2] / steps * 1e6, v[0] / steps, f"{k[0].split('python/')[-1]}:{k[2]}")
            for k, v in pstats.Stats(prof).stats.items() if "lpmoe" in k[0] or k[0] == "~"]
    for t, n, name in sorted(rows, reverse=True)[:30]:
        print(f"{t:7.1f} us/step own {n:6.1f} calls  {name}")


def host(case: Case, fp8: bool, repeats: int = 5, profile: bool = True, eager_only: bool = False):
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    recipe = Float8BlockScaling() if fp8 else None
    step, _ = case.step_fn(recipe, False)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    _host_line("eager", step, repeats)
    if eager_only:
        if profile:
            _lpmoe_own_time(step)
        return
    for name, threshold in (("one op", 1 << 62), ("staged ops", 0)):
        mlp_ops.SPLIT_BACKWARD_BYTES = threshold
        torch._dynamo.reset()
        step, _ = case.step_fn(recipe, True)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        _host_line(name, step, repeats)
        if not profile:
            continue
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(10):
            step()
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(14)
        stats.print_callees("backend_impl")  # the custom op's own wrapper: what runs under it
        print("\n".join(line[:150] for line in out.getvalue().splitlines() if line.strip()[:1].isdigit()
                        or "->" in line or "backend_impl" in line))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("memory", "host"))
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--fp8", action="store_true", help="host: FP8 block scaling (default bf16)")
    ap.add_argument("--repeats", type=int, default=5, help="host: samples of 8 steps per form (median, range)")
    ap.add_argument("--no-cprofile", action="store_true", help="host: skip the cProfile of each compiled form")
    ap.add_argument("--eager-only", action="store_true", help="host: eager steps only (no compile)")
    a = ap.parse_args()
    case = Case(a)
    if a.what == "memory":
        memory(case)
    else:
        host(case, a.fp8, a.repeats, not a.no_cprofile, a.eager_only)


if __name__ == "__main__":
    main()
