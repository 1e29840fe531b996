"""FP8 block-scaled fprop/dgrad: every kernel configuration of the grouped
backend side by side with the cuBLASLt per-expert loop, interleaved and
repeated (the H100 runs FP8 GEMMs at its power limit: read ratios, medians
and the spread).  These measurements set csrc/fp8_gemm/heuristics.h.

Columns: lpmoe's kernel at each tile width and cluster (n192c2: 192 output
columns per tile, clusters of 2 CTAs sharing the weight tile by multicast),
the CUTLASS kernel, "auto" (what the heuristic picks), the cuBLASLt loop and,
when .peers/DeepGEMM is present (benchmarks/_deepgemm_peer.py), DeepGEMM's
grouped-contiguous kernel on the same shapes (its groups padded to 128 rows;
only useful FLOPs counted).
TFLOP/s count useful FLOPs only (2 * tokens * N * K).
"""
from __future__ import annotations

import statistics

import torch

import lpmoe
from lpmoe import Float8BlockQuantizer
from lpmoe.gemm import fp8_kernel_config

import _deepgemm_peer as dgp
from _common import add_sustained, median_ms, parser, splits_for, sustained_ms, write_summary

SHAPES = {"dsv3-up": (7168, 4096), "dsv3-down": (2048, 7168), "mixtral-up": (4096, 14336),
          "qwen3-up": (2048, 1536), "qwen3-down": (768, 2048)}
CASES = [("dsv3-up", 8, 32768, False), ("dsv3-up", 8, 32768, True), ("dsv3-down", 8, 32768, False),
         ("mixtral-up", 8, 16384, False), ("dsv3-up", 32, 65536, False), ("qwen3-up", 32, 16384, False),
         ("qwen3-down", 64, 65536, True), ("qwen3-up", 64, 4096, False)]
CONFIGS = {f"n{w}c{c}": (w, c) for w in (128, 160, 192) for c in (1, 2)}
CONFIGS.update({"cutlass": (-1, 0), "auto": (0, 0)})


def operands(k, n, g, splits):
    q1, q2 = Float8BlockQuantizer(block_dim=1), Float8BlockQuantizer(block_dim=2)
    rows = sum(splits)
    first = torch.tensor(splits, dtype=torch.int64, device="cuda")
    x = torch.randn(rows, k, device="cuda").bfloat16()
    dy = torch.randn(rows, n, device="cuda").bfloat16()
    w = (torch.randn(g * n, k, device="cuda") * 0.05).bfloat16()
    wq = lpmoe.group_quantize(w, q2, num_tensors=g)
    return {"fprop": (lpmoe.group_quantize(x, q1, num_tensors=g, first_dims=first), wq, x),
            "dgrad": (lpmoe.group_quantize(dy, q1, num_tensors=g, first_dims=first), wq, dy),
            "w": w.view(g, n, k)}


def candidates(a, b, kind, splits, hp=None, w=None):
    def grouped(config):
        def run():
            with fp8_kernel_config(*config):
                lpmoe.grouped_gemm(a, b, kind=kind, backend="grouped")
        return run
    fns = {name: grouped(cfg) for name, cfg in CONFIGS.items()}
    fns["cublas"] = lambda: lpmoe.grouped_gemm(a, b, kind=kind, backend="cublas", m_splits=splits)
    if hp is not None and dgp.available():
        try:
            fns["deepgemm"], _ = (dgp.fprop if kind == "fprop" else dgp.dgrad)(splits, hp, w)
        except Exception as exc:  # the column stays empty
            print(f"    (DeepGEMM skipped: {type(exc).__name__}: {str(exc)[:100]})")
    return fns


def measure(fns, rounds, sustained=0.0):
    """name -> list of ms, one per round; names interleaved inside a round.
    sustained > 0: each timing follows that many seconds of the same calls
    (the power-capped clock, _common.sustained_ms); 0: short bursts, which
    mostly run at the boost clock."""
    got = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            got[name].append(sustained_ms(fn, sustained) if sustained > 0
                             else median_ms(fn, warmup=2, iters=5, reps=4))
    return got


def main():
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    add_sustained(p)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return
    cases = CASES[:3] if args.quick else CASES
    summary = []
    names = list(CONFIGS) + ["cublas"]
    if dgp.available():
        names.append("deepgemm")
    else:
        print(f"DeepGEMM column skipped: {dgp.reason()}")
    print("TFLOP/s median over rounds [min-max]; ratio = auto / cublas loop")
    print(f"{'case':28s} {'kind':5s} | " + " | ".join(f"{n:>16s}" for n in names) + " | auto/cublas")
    for shape, g, tokens, skewed in cases:
        k, n = SHAPES[shape]
        splits = splits_for(g, tokens, skewed)
        ops = operands(k, n, g, splits)
        for kind in ("fprop", "dgrad"):
            flops = 2.0 * tokens * n * k
            a, b, hp = ops[kind]
            got = measure(candidates(a, b, kind, splits, hp, ops["w"]), args.rounds, args.sustained)
            tf = {name: [flops / ms / 1e9 for ms in v] for name, v in got.items()}
            med = {name: statistics.median(v) for name, v in tf.items()}
            cells = " | ".join(f"{med[x]:4.0f} [{min(tf[x]):4.0f}-{max(tf[x]):4.0f}]".rjust(16) if x in med
                               else "-".rjust(16) for x in names)
            label = f"{shape} g{g} {tokens} {'skew' if skewed else 'unif'}"
            ratio = med["auto"] / med["cublas"]
            print(f"{label:28s} {kind:5s} | {cells} | {ratio:5.2f}", flush=True)
            summary.append((f"{label} {kind} auto/cublas", f"{ratio:.2f}"))
            best = max((x for x in CONFIGS if x.startswith("n")), key=lambda x: med[x])
            summary.append((f"{label} {kind} best lpmoe config", f"{best} ({med[best] / med['cutlass']:.2f}x cutlass)"))
            if "deepgemm" in med:
                summary.append((f"{label} {kind} auto/DeepGEMM", f"{med['auto'] / med['deepgemm']:.2f}"))
        del ops
        torch.cuda.empty_cache()
    write_summary(args.summary, summary)


if __name__ == "__main__":
    main()
