"""Expert MLP forward+backward at DeepSeek-V3 expert shapes (7168 -> 2x2048
SwiGLU -> 7168, router probabilities applied), side by side in one run:

  fp8        lpmoe.GroupedMLP under lpmoe.autocast(Float8BlockScaling()), FP8
             weights quantized every step; "fp8 cachedW": is_first_microbatch=False
             (later micro-batches of a step reuse the cached FP8 weights); "fp8 keep":
             save_original_input=True (fc1 keeps the caller's x, not its FP8 copy)
  bf16       the same module without a recipe (bf16 grouped GEMMs, fused bf16 activation)
  torch      torch._grouped_mm fc1 -> F.silu(gate) * value * probs -> torch._grouped_mm fc2
             (PyTorch's own grouped GEMMs, autograd)

Graph-safe device m_splits for lpmoe, device offsets for torch.  Reports ms
per step (median of 7 samples of 3 steps, mostly at the boost clock; with
--sustained S the median of 40 steps after S seconds of back-to-back steps,
at the power-capped clock a training run sees), FP8's speedup over bf16 and
torch, and peak device memory of one step above what was allocated before it
(parameters, inputs, dy): "fresh" allocates the weight gradients during the
step (zero_grad(set_to_none=True)); "main_grad" accumulates them into
preallocated fp32 buffers (fuse_wgrad_accumulation, Megatron-style; torch:
.grad kept and accumulated), which isolates what the MLP itself needs
(activations, operands, workspaces).  "x made in the step" repeats the
peaks with the MLP's input made inside the step (x * 1, as the token
permutation of an MoE layer makes it): then a recipe whose backward keeps x
pays for it, while with a caller-held x the high-precision backward keeps it
by reference for free.
"""
from __future__ import annotations

import gc

import torch
import torch.nn.functional as F

import lpmoe
from lpmoe.recipe import Float8BlockScaling

from _common import mlp_cases, peak_gib, splits_for, time_and_peak, write_summary

HIDDEN, FFN = 7168, 2048


class TorchGroupedMLP(torch.nn.Module):
    """The same MLP on torch._grouped_mm (bf16)."""

    def __init__(self, experts):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(experts, 2 * FFN, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.01)
        self.w2 = torch.nn.Parameter(torch.randn(experts, HIDDEN, FFN, device="cuda", dtype=torch.bfloat16) * 0.01)

    def forward(self, x, offs, probs):
        h = torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs)
        g, v = h.chunk(2, dim=-1)
        a = F.silu(g) * v * probs[:, None].to(h.dtype)
        return torch._grouped_mm(a, self.w2.transpose(-2, -1), offs=offs)


def free_memory():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def run_case(g, tokens, skewed, sustained=0.0):
    splits = splits_for(g, tokens, skewed)
    m = torch.tensor(splits, device="cuda")
    offs = torch.cumsum(m, 0).to(torch.int32)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    p = torch.rand(tokens, device="cuda", requires_grad=True)
    dy = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    res = {}

    def leaf_grads_off():
        x.grad = p.grad = None

    for name, recipe, cached in (("fp8", Float8BlockScaling(), False), ("fp8 cachedW", Float8BlockScaling(), True),
                                 ("fp8 keep", Float8BlockScaling(), False), ("bf16", None, False)):
        keep = name == "fp8 keep"
        for grads in ("fresh", "main_grad"):
            main = grads == "main_grad"
            mlp = lpmoe.GroupedMLP(g, HIDDEN, FFN, params_dtype=torch.bfloat16, device="cuda",
                                   fuse_wgrad_accumulation=main, save_original_input=keep)
            if main:
                for lin in (mlp.linear_fc1, mlp.linear_fc2):
                    buf = torch.zeros((g,) + tuple(lin.weight0.shape), device="cuda")
                    for i, w in enumerate(lin.weights):
                        w.main_grad = buf[i]
            if cached:
                with lpmoe.autocast(recipe=recipe):
                    mlp(x, m, probs=p, is_first_microbatch=True)

            def step(x_in_step=False):
                leaf_grads_off()
                if not main:
                    mlp.zero_grad(set_to_none=True)
                with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
                    mlp(x * 1.0 if x_in_step else x, m, probs=p,
                        is_first_microbatch=False if cached else None).backward(dy)
            # the leaves' grads too: a dx left from the warm-up step would be freed and
            # re-made inside the measured step and so never show in its peak
            reset = leaf_grads_off if main else lambda: (leaf_grads_off(), mlp.zero_grad(set_to_none=True))
            res[(name, grads)] = time_and_peak(step, reset, sustained)
            if not cached and not keep:  # (keep assumes the caller holds x)
                res[(name, grads, "x in step")] = peak_gib(lambda: step(True), reset)
            del mlp
            free_memory()
    tm = TorchGroupedMLP(g)
    for grads in ("fresh", "main_grad"):
        def tstep():
            leaf_grads_off()
            if grads == "fresh":
                tm.zero_grad(set_to_none=True)
            tm(x, offs, p).backward(dy)
        try:
            res[("torch", grads)] = time_and_peak(tstep, leaf_grads_off if grads == "main_grad" else
                                                  lambda: (leaf_grads_off(), tm.zero_grad(set_to_none=True)),
                                                  sustained)
        except RuntimeError as exc:  # e.g. no grouped-mm backward in this torch
            print(f"  torch._grouped_mm MLP unavailable: {str(exc)[:100]}")
            break
    del tm
    leaf_grads_off()
    return res


def main():
    args, cases = mlp_cases(__doc__)
    rows = []
    for g, tokens, skewed in cases:
        r = run_case(g, tokens, skewed, args.sustained)
        free_memory()
        tag = f"g={g} tok={tokens} {'skew' if skewed else 'unif'}"
        cells = "  ".join(f"{k[0]}/{k[1]} {v[0]:7.2f} ms {v[1]:5.2f} GiB" for k, v in r.items() if len(k) == 2)
        cells += "  peak GiB, x made in the step: " + "  ".join(
            f"{k[0]}/{k[1]} {v:5.2f}" for k, v in r.items() if len(k) == 3)
        fp8, bf16 = r[("fp8", "fresh")], r[("bf16", "fresh")]
        line = (f"{tag:22s} | {cells} | fp8/bf16 {bf16[0] / fp8[0]:4.2f}x "
                f"(cachedW {bf16[0] / r[('fp8 cachedW', 'fresh')][0]:4.2f}x)")
        mem_fresh = fp8[1] / bf16[1]
        mem_kept = r[("fp8", "main_grad")][1] / r[("bf16", "main_grad")][1]
        in_fresh = r[("fp8", "fresh", "x in step")] / r[("bf16", "fresh", "x in step")]
        in_kept = r[("fp8", "main_grad", "x in step")] / r[("bf16", "main_grad", "x in step")]
        keep_fresh = r[("fp8 keep", "fresh")][1] / bf16[1]
        keep_kept = r[("fp8 keep", "main_grad")][1] / r[("bf16", "main_grad")][1]
        line += (f" | peak fp8/bf16 {mem_fresh:4.2f} (fresh grads) {mem_kept:4.2f} (main_grad); x made in the "
                 f"step {in_fresh:4.2f} {in_kept:4.2f}; fp8 keep/bf16 {keep_fresh:4.2f} {keep_kept:4.2f} "
                 f"at {bf16[0] / r[('fp8 keep', 'fresh')][0]:4.2f}x bf16's speed")
        if ("torch", "fresh") in r:
            line += f" | fp8/torch {r[('torch', 'fresh')][0] / fp8[0]:4.2f}x, bf16/torch " \
                    f"{r[('torch', 'fresh')][0] / bf16[0]:4.2f}x"
        print(line, flush=True)
        rows.append((f"mlp {tag} fp8/bf16 (cachedW) | peak fp8/bf16 fresh, main_grad (x made in step)",
                     f"{bf16[0] / fp8[0]:.2f}x ({bf16[0] / r[('fp8 cachedW', 'fresh')][0]:.2f}x) | "
                     f"{mem_fresh:.2f}, {mem_kept:.2f} ({in_fresh:.2f}, {in_kept:.2f})"))
        rows.append((f"mlp {tag} fp8 save_original_input: speed vs bf16 | peak vs bf16 fresh, main_grad",
                     f"{bf16[0] / r[('fp8 keep', 'fresh')][0]:.2f}x | {keep_fresh:.2f}, {keep_kept:.2f}"))
    write_summary(args.summary, rows)


if __name__ == "__main__":
    main()
