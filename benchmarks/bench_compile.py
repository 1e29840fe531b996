"""torch.compile vs eager: expert MLP and a small MoE block, fwd+bwd step.

Modes, measured side by side in one run (rounds interleaved):

  eager       lpmoe.GroupedMLP as is (autograd functions, no dispatcher)
  compile     torch.compile(fullgraph=True): one lpmoe::grouped_mlp node
              per direction, Inductor around it
  reduce-ovh  torch.compile(mode="reduce-overhead"): the same, replayed as
              CUDA graphs (device m_splits, so routing may change)

Each mode runs in both parameter layouts: per expert (G weights per layer,
TransformerEngine's default) and stacked (``single_grouped_parameter=True``:
one (G, N, K) weight per layer), interleaved in the same rounds.

Shapes: a launch-bound one (4k routed tokens, 64 experts, H=2048, F=768)
and a large one (64k tokens, 8 experts, DeepSeek-V3 H=7168, F=2048; not with
--quick), bf16
and FP8 block scaling; plus, at 4k tokens, a MoE block written with plain
PyTorch ops around GroupedMLP (router softmax/top-8, token sort, weighted
un-sort: examples/compile_moe_block.py) and lpmoe's own layer,
``lpmoe.moe.MoELayer`` (fused router, routing map, permutation kernels,
probabilities applied inside the experts, aux loss).  Step time: CUDA events around
forward+backward, median of --iters after warm-up.

``--routed``: only lpmoe's FP8 MoE layer, eager against compiled, and
compiled against the same layer compiled as before routed tokens crossed the
op boundary ("compile-rows": the experts get permuted bf16 rows, the
unpermute runs outside them), at DeepSeek-V3 shapes (8k tokens, 64 experts,
top-8, H 7168, F 2048) and the launch-bound one; with each step's peak
memory above its start.  Ratios: "eager/mode"
against eager of the same layout, "vs per-expert eager" against the
default layer in eager mode (>1 = faster).
"""
from __future__ import annotations

import statistics
import time

import torch

import lpmoe
from lpmoe.recipe import Float8BlockScaling

from _common import parser, write_summary


def _moe_block(hidden, ffn, experts, top_k, stacked):
    """examples/compile_moe_block.py's block (router, token sort, GroupedMLP)."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                        "compile_moe_block.py")
    spec = importlib.util.spec_from_file_location("compile_moe_block", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.MoEBlock(hidden, ffn, experts, top_k, device="cuda", single_grouped_parameter=stacked)


def _splits(tokens, experts):
    g = torch.Generator().manual_seed(0)
    w = torch.rand(experts, generator=g) + 0.2
    s = (w / w.sum() * tokens).floor().long()
    s[0] += tokens - int(s.sum())
    return s.cuda()


def _time(fn, iters, warmup=3):
    """(CUDA-event step times, host times to enqueue the step) in ms.  A
    host time near the step time means the step is launch-bound."""
    for _ in range(warmup):
        fn()
    times, host = [], []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        host.append((time.perf_counter() - t0) * 1e3)
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times, host


def run_case(name, make_module, x, splits, recipe, iters, rounds, profile=False):
    """``make_module(stacked)`` builds the layer in either parameter layout."""
    modes, owners = {}, {}
    for layout, stacked in (("per-expert", False), ("stacked", True)):
        module = make_module(stacked)
        for k, m in (("eager", module), ("compile", torch.compile(module, fullgraph=True)),
                     ("reduce-ovh", torch.compile(module, mode="reduce-overhead", fullgraph=True))):
            modes[(layout, k)] = m
            owners[(layout, k)] = module
    xs = x.detach().clone().requires_grad_(True)

    def step(key):
        m, owner = modes[key], owners[key]

        def f():
            with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
                y = m(xs, splits)
            y.backward(torch.ones_like(y))
            owner.zero_grad(set_to_none=True)
            xs.grad = None
        return f

    times = {k: [] for k in modes}
    host = {k: [] for k in modes}
    for _ in range(rounds):
        for k in modes:
            t, h = _time(step(k), iters)
            times[k] += t
            host[k] += h
    med = {k: statistics.median(v) for k, v in times.items()}
    hmed = {k: statistics.median(v) for k, v in host.items()}
    spread = {k: (min(v), max(v)) for k, v in times.items()}
    base = med[("per-expert", "eager")]
    rows = []
    for (layout, k) in modes:
        own = med[(layout, "eager")] / med[(layout, k)]
        print(f"{name:32s} {layout:10s} {k:10s} {med[(layout, k)]:8.3f} ms  [{spread[(layout, k)][0]:.3f}, "
              f"{spread[(layout, k)][1]:.3f}]  host {hmed[(layout, k)]:7.3f} ms  eager/mode {own:.3f}  "
              f"vs per-expert eager {base / med[(layout, k)]:.3f}", flush=True)
        rows.append((f"{name} {layout} {k}", f"{med[(layout, k)]:.3f} ms (host {hmed[(layout, k)]:.3f}), "
                     f"eager/mode {own:.3f}, vs per-expert eager {base / med[(layout, k)]:.3f}"))
    if profile:
        for key in (("per-expert", "eager"), ("per-expert", "compile"), ("stacked", "eager"), ("stacked", "compile")):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step(key)()
                torch.cuda.synchronize()
            print(f"--- {name} {key}: top host time (5 steps)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    return rows


class _RowsLayer(lpmoe.moe.MoELayer):
    """The MoE layer as torch.compile ran it before the MLP op took routed
    tokens: the experts get permuted rows (another type: its own graph)."""

    def _experts_gather(self) -> bool:
        return False


def routed_case(tokens, hidden, ffn, experts, top_k, iters, rounds):
    """FP8 MoE layer: eager, compile, compile-rows, eager-rows (ms, peak GiB)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = lpmoe.moe.MoELayer(hidden, ffn, experts, top_k, params_dtype=torch.bfloat16)
    rows_layer = _RowsLayer(hidden, ffn, experts, top_k, params_dtype=torch.bfloat16)
    rows_layer.load_state_dict(layer.state_dict())
    modes = {"eager": layer, "compile": torch.compile(layer, fullgraph=True),
             "eager-rows": rows_layer, "compile-rows": torch.compile(rows_layer, fullgraph=True)}
    owners = {"eager": layer, "compile": layer, "eager-rows": rows_layer, "compile-rows": rows_layer}
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)

    def step(k):
        def f():
            with lpmoe.autocast(recipe=Float8BlockScaling()):
                y = modes[k](x)
            y.backward(gy)
            owners[k].zero_grad(set_to_none=True)
            x.grad = None
        return f

    times = {k: [] for k in modes}
    for _ in range(rounds):
        for k in modes:
            times[k] += _time(step(k), iters)[0]
    peak = {}
    for k in modes:
        step(k)()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(k)()
        torch.cuda.synchronize()
        peak[k] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    med = {k: statistics.median(v) for k, v in times.items()}
    name = f"moe layer fp8 T={tokens} E={experts} k={top_k} H={hidden}"
    rows = []
    for k in modes:
        lo, hi = min(times[k]), max(times[k])
        print(f"{name:40s} {k:12s} {med[k]:8.3f} ms [{lo:.3f}, {hi:.3f}]  eager/mode {med['eager'] / med[k]:.3f}  "
              f"step peak {peak[k]:.2f} GiB", flush=True)
        rows.append((f"{name} {k}", f"{med[k]:.3f} ms, eager/mode {med['eager'] / med[k]:.3f}, peak {peak[k]:.2f} GiB"))
    print(f"{name:40s} compile / compile-rows: {med['compile-rows'] / med['compile']:.3f}x faster, "
          f"peak {peak['compile'] / peak['compile-rows']:.2f}x", flush=True)
    return rows


def main():
    p = parser(__doc__)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="host-time profile of the small FP8 MLP (eager, compile)")
    p.add_argument("--routed", action="store_true", help="only the FP8 MoE layer's routed-token cases")
    args = p.parse_args()
    torch.manual_seed(0)
    out = []
    if args.routed:
        out += routed_case(8192, 7168, 2048, 64, 8, args.iters, args.rounds)
        out += routed_case(4096, 2048, 768, 64, 8, args.iters, args.rounds)
        write_summary(args.summary, out)
        return
    fp8 = Float8BlockScaling()
    for recipe, rname in ((None, "bf16"), (fp8, "fp8")):
        shapes = ((4096, 64, 2048, 768),) if args.quick else ((4096, 64, 2048, 768), (65536, 8, 7168, 2048))
        for tokens, experts, hidden, ffn in shapes:
            torch._dynamo.reset()

            def mlp(stacked, e=experts, h=hidden, f=ffn):
                torch.manual_seed(0)
                return lpmoe.GroupedMLP(e, h, f, params_dtype=torch.bfloat16, device="cuda",
                                        single_grouped_parameter=stacked)
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            out += run_case(f"mlp {rname} T={tokens} E={experts} H={hidden}", mlp, x, _splits(tokens, experts),
                            recipe, args.iters, args.rounds,
                            profile=args.profile and recipe is not None and tokens == 4096)
        torch._dynamo.reset()
        x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
        out += run_case(f"moe block {rname} T=4096 E=64 k=8", lambda stacked: _moe_block(2048, 768, 64, 8, stacked),
                        x, None, recipe, args.iters, args.rounds)
        torch._dynamo.reset()

        def moe_layer(stacked):
            torch.manual_seed(0)
            return lpmoe.moe.MoELayer(2048, 768, 64, 8, params_dtype=torch.bfloat16, aux_loss_coeff=0.01,
                                      single_grouped_parameter=stacked)
        # (MoELayer.forward(x, is_first_microbatch): run_case's splits argument is None)
        out += run_case(f"moe layer {rname} T=4096 E=64 k=8", moe_layer, x, None, recipe, args.iters, args.rounds)
    write_summary(args.summary, out)


if __name__ == "__main__":
    main()
