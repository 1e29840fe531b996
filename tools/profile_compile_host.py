"""Where the host time of a compiled GroupedMLP step goes, beside eager.

    python tools/profile_compile_host.py [--tokens 4096 --experts 64 --hidden 2048 --ffn 768]

For each parameter layout (stacked, per expert) and recipe (bf16, FP8 block),
eager and ``torch.compile(fullgraph=True)`` steps run interleaved (device
m_splits); each step is timed on the host (enqueue time, GPU idle at the
start), split into forward and backward, and the time spent inside lpmoe's
own functions is summed per step:

  mlp_forward_impl / mlp_backward_impl   the layer's work (both modes)
  _mlp_forward / fc2_run, act_run,       the layer ops' implementations
  fc1_run                                (compile: impl + saved-layout work)
  flatten / rebuild                      saved tensors across the op boundary
  check_recipe                           the op's run-time checks

What is left of fwd/bwd outside those is the caller's side: eager = module,
checks and autograd; compile = Dynamo's guards, AOTAutograd's wrappers and
the custom-op dispatch.  Medians over 60 steps.  Needs CUDA.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

import lpmoe
from lpmoe.functional import mlp as fmlp
from lpmoe.functional import mlp_backward
from lpmoe.library import mlp_backward_ops, mlp_ops, saved_layout
from lpmoe.recipe import Float8BlockScaling

ACC: dict = collections.defaultdict(float)


def _wrap(module, name):
    fn = getattr(module, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            ACC[name] += time.perf_counter() - t
    setattr(module, name, timed)


def _cprofile(modes, step, n, label):
    import cProfile
    import io
    import pstats
    for k, m in modes.items():
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        # the backward in the calling thread, where cProfile sees it
        with torch.autograd.set_multithreading_enabled(False):
            prof.enable()
            for _ in range(n):
                step(m)
            prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(f"--- cProfile {label} {k}: {n} steps\n" + out.getvalue().split("\n", 4)[-1][:5000])


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The step's shape (bench_compile.py's launch-bound case by default)."""
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)


def launch_bound_inputs(a, device="cuda"):
    """(x, device m_splits): seeded bf16 tokens that need a gradient, and
    uneven expert splits (random weights, the rounding rest on expert 0)."""
    torch.manual_seed(0)
    x = torch.randn(a.tokens, a.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(a.experts, generator=torch.Generator().manual_seed(0)) + 0.2
    s = (w / w.sum() * a.tokens).floor().long()
    s[0] += a.tokens - int(s.sum())
    return x, s.to(device)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also run N steps of each mode under cProfile and print the top functions by own time")
    a = p.parse_args()
    for module, name in ((fmlp, "mlp_forward_impl"), (mlp_backward, "mlp_backward_impl"), (mlp_ops, "_mlp_forward"),
                         (mlp_backward_ops, "fc2_run"), (mlp_backward_ops, "act_run"),
                         (mlp_backward_ops, "fc1_run"),
                         (saved_layout, "flatten"), (saved_layout, "rebuild"), (mlp_ops, "check_recipe")):
        _wrap(module, name)
    x, splits = launch_bound_inputs(a)
    for stacked in (True, False):
        for rname, recipe in (("bf16", None), ("fp8", Float8BlockScaling())):
            torch._dynamo.reset()
            mlp = lpmoe.GroupedMLP(a.experts, a.hidden, a.ffn, params_dtype=torch.bfloat16, device="cuda",
                                   single_grouped_parameter=stacked)
            modes = {"eager": mlp, "compile": torch.compile(mlp, fullgraph=True)}

            def step(m):
                with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
                    t0 = time.perf_counter()
                    y = m(x, splits)
                    t1 = time.perf_counter()
                y.backward(torch.ones_like(y))
                t2 = time.perf_counter()
                mlp.zero_grad(set_to_none=True)
                x.grad = None
                return t1 - t0, t2 - t1

            for m in modes.values():
                for _ in range(5):
                    step(m)
            res = {k: ([], [], collections.defaultdict(list)) for k in modes}
            for _ in range(a.rounds):
                for k, m in modes.items():
                    for _ in range(10):
                        torch.cuda.synchronize()
                        ACC.clear()
                        f, b = step(m)
                        res[k][0].append(f * 1e6)
                        res[k][1].append(b * 1e6)
                        for name, v in ACC.items():
                            res[k][2][name].append(v * 1e6)
            if a.cprofile:
                _cprofile(modes, step, a.cprofile, f"{'stacked' if stacked else 'per-expert'} {rname}")
            for k in modes:
                fw, bw, acc = res[k]
                parts = "  ".join(f"{n} {statistics.median(v):.0f}" for n, v in acc.items())
                print(f"{'stacked' if stacked else 'per-expert':10s} {rname} {k:8s} fwd {statistics.median(fw):5.0f} us"
                      f"  bwd {statistics.median(bw):5.0f} us | {parts}", flush=True)


if __name__ == "__main__":
    main()
