"""The FP8 wgrad kernel by member size and tile width (H100 probes behind
docs/fp8-wgrad-kernel-notes.md and docs/grouped-mlp-notes.md, stop 55).

    PYTHONPATH=python:benchmarks python3 tools/probe_wgrad_shapes.py members
        DeepSeek-V3 fc1/fc2, bf16 output (what the MLP's wgrad writes), widths
        192 and 128 (cluster 1): 128 to 1024 tokens per member over 32
        members, the benchmark's skewed routing (half of the tokens to one
        member) and 8 x 8192; how per-tile costs grow as tiles get fewer
        K-blocks.
    PYTHONPATH=python:benchmarks python3 tools/probe_wgrad_shapes.py qwen3
        Small N x K per member (Qwen3-down: 64 tiles per member at width
        192, 96 at 128): fresh fp32, bf16 and accumulating, uniform and
        skewed routing, both widths.
    PYTHONPATH=python:benchmarks python3 tools/probe_wgrad_shapes.py acc
        The main_grad (fp32 accumulate) kernels alone, widths 192 and 128
        (cluster 1, each with the tile order run_wgrad picks for the call):
        DeepSeek-V3 fc1/fc2 and Qwen3 at 512 to 8192 tokens per member,
        uniform and skewed; behind the accumulate width rule (heuristics.h).

TFLOP/s (2 x tokens x N x K), medians of 3 interleaved burst rounds.
"""
import statistics
import sys

import torch

import lpmoe
from _common import splits_for
from bench_fp8_kernel_configs import SHAPES, measure
from bench_fp8_wgrad_configs import operands
from lpmoe.gemm import fp8_wgrad_kernel_config


def time_widths(dyg, xg, outs, tokens, n, k):
    """{label: TFLOP/s} for every (width, output) pair; outs: name -> (tensor, accumulate)."""
    fns = {}
    for w in (192, 128):
        for name, (out, acc) in outs.items():
            def run(w=w, out=out, acc=acc):
                with fp8_wgrad_kernel_config(w, 1):
                    lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out=out, accumulate=acc, backend="grouped")
            fns[f"n{w} {name}"] = run
    got = measure(fns, 3)
    return {key: 2.0 * tokens * n * k / statistics.median(v) / 1e9 for key, v in got.items()}


def members():
    for label, (k, n) in (("fc1", SHAPES["dsv3-up"]), ("fc2", SHAPES["dsv3-down"])):
        for g, tokens, skewed in ((32, 4096, False), (32, 8192, False), (32, 16384, False), (32, 32768, False),
                                  (32, 16384, True), (8, 65536, False)):
            dyg, xg = operands(k, n, g, splits_for(g, tokens, skewed))
            out = torch.empty(g, n, k, device="cuda", dtype=torch.bfloat16)
            got = time_widths(dyg, xg, {"bf16": (out, False)}, tokens, n, k)
            tag = "skewed" if skewed else "uniform"
            print(f"{label} {g} x {tokens // g} {tag}: " + "  ".join(f"{key} {v:5.0f}" for key, v in got.items()),
                  flush=True)
            del dyg, xg, out
            torch.cuda.empty_cache()


def qwen3():
    for shape, g, tokens, skewed in (("qwen3-down", 64, 65536, False), ("qwen3-down", 64, 65536, True),
                                     ("qwen3-down", 64, 16384, False), ("qwen3-down", 128, 65536, False),
                                     ("qwen3-up", 64, 65536, True)):
        k, n = SHAPES[shape]
        dyg, xg = operands(k, n, g, splits_for(g, tokens, skewed))
        outs = {"f32": (torch.empty(g, n, k, device="cuda"), False),
                "bf16": (torch.empty(g, n, k, device="cuda", dtype=torch.bfloat16), False),
                "acc": (torch.zeros(g, n, k, device="cuda"), True)}
        got = time_widths(dyg, xg, outs, tokens, n, k)
        print(f"{shape} {g} x {tokens // g} {'skewed' if skewed else 'uniform'}: " +
              "  ".join(f"{key} {v:5.0f}" for key, v in got.items()), flush=True)
        del dyg, xg, outs
        torch.cuda.empty_cache()


def acc():
    cases = [(label, SHAPES[name], g, tokens, skewed)
             for label, name in (("fc1", "dsv3-up"), ("fc2", "dsv3-down"))
             for g, tokens, skewed in ((32, 16384, False), (32, 16384, True), (32, 32768, False),
                                       (64, 65536, True), (8, 65536, False))]
    cases += [(name, SHAPES[name], g, tokens, skewed)
              for name, g, tokens, skewed in (("qwen3-down", 64, 65536, False), ("qwen3-down", 64, 65536, True),
                                              ("qwen3-down", 64, 16384, False), ("qwen3-up", 64, 65536, True))]
    for label, (k, n), g, tokens, skewed in cases:
        dyg, xg = operands(k, n, g, splits_for(g, tokens, skewed))
        got = time_widths(dyg, xg, {"acc": (torch.zeros(g, n, k, device="cuda"), True)}, tokens, n, k)
        print(f"{label} {g} x {tokens // g} {'skewed' if skewed else 'uniform'}: " +
              "  ".join(f"{key} {v:5.0f}" for key, v in got.items()), flush=True)
        del dyg, xg
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    {"members": members, "qwen3": qwen3, "acc": acc}[sys.argv[1] if len(sys.argv) > 1 else "members"]()
