"""Expert MLP forward+backward (DeepSeek-V3-like: 7168 -> 2x2048 SwiGLU ->
7168), side by side in one run:

  fp8      lpmoe.GroupedLinear x2 under lpmoe.autocast(Float8BlockScaling())
           (weights quantized every step; "cachedW": is_first_microbatch=False,
           the later micro-batches of a step, FP8 weights from the cache;
           "host": m_splits as a list, where grouped_gemm may use cuBLASLt)
  bf16     the same module without a recipe (bf16 grouped GEMMs)
  loop     a Python loop of nn.Linear per expert (host splits)

each eager and as a CUDA graph replay (torch.cuda.make_graphed_callables;
not for the loop, whose shapes change with routing).  Reports ms per step,
tokens/s ratios and the peak memory of one step above the parameters.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import lpmoe
from lpmoe.recipe import Float8BlockScaling

from _common import parser, splits_for, time_and_peak, write_summary

HIDDEN, FFN = 7168, 2048


class ExpertMLP(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        kw = dict(bias=False, params_dtype=torch.bfloat16, device="cuda")
        self.fc1 = lpmoe.GroupedLinear(experts, HIDDEN, 2 * FFN, **kw)
        self.fc2 = lpmoe.GroupedLinear(experts, FFN, HIDDEN, **kw)

    def forward(self, x, m_splits, is_first_microbatch=None):
        h = self.fc1(x, m_splits, is_first_microbatch=is_first_microbatch)
        a, b = h.chunk(2, dim=-1)
        return self.fc2(F.silu(a) * b, m_splits, is_first_microbatch=is_first_microbatch)


class LoopMLP(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        mk = lambda i, o: torch.nn.Linear(i, o, bias=False, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        self.fc1 = torch.nn.ModuleList(mk(HIDDEN, 2 * FFN) for _ in range(experts))
        self.fc2 = torch.nn.ModuleList(mk(FFN, HIDDEN) for _ in range(experts))

    def forward(self, x, splits):
        outs = []
        for i, xi in enumerate(x.split(splits)):
            a, b = self.fc1[i](xi).chunk(2, dim=-1)
            outs.append(self.fc2[i](F.silu(a) * b))
        return torch.cat(outs)


def time_step(step):
    return time_and_peak(step)


def run_case(g, tokens, skewed):
    splits = splits_for(g, tokens, skewed)
    m = torch.tensor(splits, device="cuda")
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    res = {}
    recipes = {"fp8": Float8BlockScaling(), "bf16": None}
    for name, recipe in recipes.items():
        # a fresh module per recipe: make_graphed_callables rebinds forward
        mlp = ExpertMLP(g)
        def eager():
            mlp.zero_grad(set_to_none=True)  # as a training step: fresh gradients
            with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
                mlp(x, m).backward(dy)
        res[f"{name} eager"] = time_step(eager)
        if recipe is not None:
            # later micro-batches of a step: FP8 weights from the cache
            with lpmoe.autocast(recipe=recipe):
                mlp(x, m, is_first_microbatch=True).backward(dy)

            def cached():
                mlp.zero_grad(set_to_none=True)
                with lpmoe.autocast(recipe=recipe):
                    mlp(x, m, is_first_microbatch=False).backward(dy)
            res[f"{name} cachedW"] = time_step(cached)

            def host_path():
                # m_splits as a list: grouped_gemm may pick cuBLASLt per
                # product (faster FP8 wgrad for large groups); not graph-safe
                mlp.zero_grad(set_to_none=True)
                with lpmoe.autocast(recipe=recipe):
                    mlp(x, splits).backward(dy)
            res[f"{name} host"] = time_step(host_path)
        with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
            graphed = torch.cuda.make_graphed_callables(mlp, (x, m), num_warmup_iters=3)

        def replay():
            mlp.zero_grad(set_to_none=True)
            with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
                graphed(x, m).backward(dy)
        res[f"{name} graph"] = time_step(replay)
        del graphed, mlp
    loop = LoopMLP(g)

    def loop_step():
        loop.zero_grad(set_to_none=True)
        loop(x, splits).backward(dy)
    res["loop eager"] = time_step(loop_step)
    del loop
    x.grad = None
    return res


def free_memory():
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def main():
    args = parser(__doc__).parse_args()
    torch.manual_seed(0)
    cases = [(8, 16384, False), (8, 65536, False), (8, 65536, True), (32, 16384, False), (32, 65536, True)]
    if args.quick:
        cases = cases[:1]
    print(f"device {torch.cuda.get_device_name()}  (ms per fwd+bwd step, median; peak GiB above parameters)")
    rows = []
    for g, tokens, skewed in cases:
        r = run_case(g, tokens, skewed)
        free_memory()  # graph pools of the finished case
        cells = "  ".join(f"{k} {v[0]:7.2f} ms/{v[1]:5.2f} GiB" for k, v in r.items())
        fp8_vs_bf16 = r["bf16 eager"][0] / r["fp8 eager"][0]
        cached_vs_bf16 = r["bf16 eager"][0] / r["fp8 cachedW"][0]
        host_vs_bf16 = r["bf16 eager"][0] / r["fp8 host"][0]
        graph_gain = r["fp8 eager"][0] / r["fp8 graph"][0]
        vs_loop = r["loop eager"][0] / r["fp8 eager"][0]
        tag = f"g={g} tok={tokens} {'skew' if skewed else 'unif'}"
        print(f"{tag:22s} | {cells} | fp8/bf16 {fp8_vs_bf16:4.2f}x (cached W {cached_vs_bf16:4.2f}x, "
              f"host splits {host_vs_bf16:4.2f}x) "
              f"graph/eager {graph_gain:4.2f}x fp8/loop {vs_loop:4.2f}x", flush=True)
        rows.append((f"mlp {tag} fp8/bf16 (cachedW) | graph",
                     f"{fp8_vs_bf16:.2f}x ({cached_vs_bf16:.2f}x) | {graph_gain:.2f}x; vs loop {vs_loop:.2f}x"))
    write_summary(args.summary, rows)


if __name__ == "__main__":
    main()
