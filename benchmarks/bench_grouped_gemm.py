"""Grouped GEMM throughput (TFLOP/s) on MoE expert shapes, side by side:

  fp8 grp    lpmoe grouped backend, FP8 block scaling (1x128 x 128x128; wgrad 1x128 x 1x128)
  fp8 cublas lpmoe cuBLASLt per-expert loop, same FP8 block operands (host splits)
  torch fp8  torch._scaled_grouped_mm, FP8 rowwise scales (fprop only: its closest analogue)
  bf16 grp   lpmoe grouped backend, bf16
  torch bf16 torch._grouped_mm, bf16
  DeepGEMM   peer: DeepGEMM's Hopper FP8 grouped-contiguous GEMM (1x128 x 128x128
             scales; fprop, and dgrad through the weights' transposed copy), from
             the git-ignored .peers/DeepGEMM (benchmarks/_deepgemm_peer.py); "-"
             when that folder is absent or its JIT fails

FLOPs = 2 * sum(M_t) * N * K per product (DeepGEMM pads each group to 128
rows; the padding is not counted).  Quantization is not timed (the
operands are quantized once).  Eager timing by default (back-to-back calls,
host launch cost overlapped where the kernel is longer); --graph times the
lpmoe and torch columns as CUDA graph replays (device time).  Routing:
uniform, or skewed (half of the tokens to one expert, the rest spread
evenly), all splits multiples of 128 (torch's grouped kernels need
16-aligned groups).
"""
from __future__ import annotations

import torch

import lpmoe
from lpmoe import Float8BlockQuantizer, GroupedTensor

import _deepgemm_peer as dgp
from _common import add_sustained, graph_median_ms, median_ms, parser, splits_for, sustained_ms, write_summary

DG = "DeepGEMM"
DG_GRAPH = False  # --deepgemm-graph: time DeepGEMM as a CUDA graph replay
GRAPH = False  # --graph: time every lpmoe/torch column as CUDA graph replays (device time, no host launch cost)
SUSTAINED = 0.0  # --sustained: seconds of each candidate's own calls before timing it (power-capped clock)

Q1 = Float8BlockQuantizer(block_dim=1)
Q2 = Float8BlockQuantizer(block_dim=2)

# (name, K = in_features, N = out_features)
SHAPES = [
    ("dsv3-up", 7168, 4096),
    ("dsv3-down", 2048, 7168),
    ("qwen3-up", 2048, 1536),
    ("qwen3-down", 768, 2048),
    ("mixtral-up", 4096, 14336),
]


def grouped(t, splits):
    m = torch.tensor(splits, device="cuda")
    return GroupedTensor(num_tensors=len(splits), logical_shape=tuple(t.shape), dtype=t.dtype,
                         rowwise_data=t.view(-1), first_dims=m)


def bf16_fprop_pair(g, tokens, k, n):
    """(lpmoe, torch, x, w): closures of one bf16 grouped fprop on uniform
    groups, lpmoe.grouped_gemm and torch._grouped_mm over the same operands
    (x as a GroupedTensor, the (g, n, k) weights)."""
    splits = splits_for(g, tokens, False)
    offs = torch.cumsum(torch.tensor(splits, device="cuda"), 0).to(torch.int32)
    x = torch.randn(tokens, k, device="cuda").bfloat16()
    w = (torch.randn(g, n, k, device="cuda") * 0.02).bfloat16()
    xg = grouped(x, splits)
    return (lambda: lpmoe.grouped_gemm(xg, w, kind="fprop", backend="grouped"),
            lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), xg, w)


def make_operands(k, n, g, splits):
    """(a, b) of each kind, FP8 block and bf16, plus the bf16 tensors."""
    rows = sum(splits)
    first = torch.tensor(splits, device="cuda")
    x = torch.randn(rows, k, device="cuda").bfloat16()
    dy = torch.randn(rows, n, device="cuda").bfloat16()
    w = (torch.randn(g, n, k, device="cuda") * 0.02).bfloat16()
    xq = lpmoe.group_quantize(x, Q1, num_tensors=g, first_dims=first)
    dyq = lpmoe.group_quantize(dy, Q1, num_tensors=g, first_dims=first)
    wq = lpmoe.group_quantize(w.view(g * n, k), Q2, num_tensors=g)
    xg, dyg = grouped(x, splits), grouped(dy, splits)
    return {"hp": (x, dy, w),
            "fp8": {"fprop": (xq, wq), "dgrad": (dyq, wq), "wgrad": (dyq, xq)},
            "bf16": {"fprop": (xg, w), "dgrad": (dyg, w), "wgrad": (dyg, xg)}}


def tflops(flops, ms):
    return flops / ms / 1e9 if ms == ms else float("nan")


def safe(fn):
    try:
        fn()
        if SUSTAINED > 0:
            return sustained_ms(fn, SUSTAINED)
        if GRAPH:
            return graph_median_ms(fn, iters=7, reps=5)
        return median_ms(fn, warmup=3, iters=7, reps=5)
    except Exception as exc:  # a baseline that does not support a case
        print(f"    (baseline skipped: {type(exc).__name__}: {str(exc)[:100]})")
        return float("nan")


def time_deepgemm(kind, splits, a, w):
    """(ms, useful FLOPs) of DeepGEMM's fprop (a = x, w = weights), dgrad (a =
    dy) or k-grouped wgrad (a = dy, w = x; fp32 accumulated, eager: a host loop
    of launches); ms is nan when the column is off.  Its operands are built
    (padded, quantized) untimed."""
    if not dgp.available():
        return float("nan"), 0.0
    try:
        if kind == "wgrad":
            fn, flops = dgp.wgrad(splits, a, w)
        else:
            fn, flops = (dgp.fprop if kind == "fprop" else dgp.dgrad)(splits, a, w, graph=DG_GRAPH)
    except Exception as exc:
        print(f"    (DeepGEMM skipped: {type(exc).__name__}: {str(exc)[:100]})")
        return float("nan"), 0.0
    ms = safe(fn)
    del fn
    return ms, flops


def cell(key, v):
    return f"{key} {v:7.1f}" if v == v or key != DG else f"{key} {'-':>7s}"


def run_case(name, k, n, g, tokens, skewed, kinds):
    splits = splits_for(g, tokens, skewed)
    rows = sum(splits)
    offs = torch.cumsum(torch.tensor(splits, device="cuda"), 0).to(torch.int32)
    ops = make_operands(k, n, g, splits)
    x, dy, w = ops["hp"]
    flops = 2.0 * rows * n * k
    out = {}
    for kind in kinds:
        (fa, fb), (ba, bb) = ops["fp8"][kind], ops["bf16"][kind]
        res = {
            "fp8 grp": safe(lambda: lpmoe.grouped_gemm(fa, fb, kind=kind, backend="grouped")),
            "fp8 cublas": safe(lambda: lpmoe.grouped_gemm(fa, fb, kind=kind, backend="cublas", m_splits=splits)),
            "bf16 grp": safe(lambda: lpmoe.grouped_gemm(ba, bb, kind=kind, backend="grouped")),
        }
        if kind == "fprop":
            x8 = x.to(torch.float8_e4m3fn)
            w8 = w.to(torch.float8_e4m3fn)
            sa = torch.ones(rows, device="cuda")
            sb = torch.ones(g, n, device="cuda")
            res["torch fp8"] = safe(lambda: torch._scaled_grouped_mm(x8, w8.transpose(-2, -1), sa, sb, offs=offs,
                                                                     out_dtype=torch.bfloat16))
            res["torch bf16"] = safe(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
        elif kind == "dgrad":
            res["torch bf16"] = safe(lambda: torch._grouped_mm(dy, w, offs=offs))
        else:
            res["torch bf16"] = safe(lambda: torch._grouped_mm(dy.t(), x, offs=offs))
            # what DeepGEMM's k-grouped wgrad does: add into a fp32 [G, N, K] buffer (main_grad)
            acc = torch.zeros(g, n, k, device="cuda")
            res["fp8 grp acc32"] = safe(lambda: lpmoe.grouped_gemm(fa, fb, kind=kind, backend="grouped", out=acc,
                                                                   accumulate=True))
        tf = {key: tflops(flops, ms) for key, ms in res.items()}
        # DeepGEMM: useful FLOPs only (fprop/dgrad pad each group to 128 rows)
        dg_ms, dg_flops = time_deepgemm(kind, splits, x if kind == "fprop" else dy, x if kind == "wgrad" else w)
        tf[DG] = tflops(dg_flops, dg_ms) if dg_flops else float("nan")
        out[kind] = tf
        route = "skew" if skewed else "unif"
        cells = "  ".join(cell(key, v) for key, v in tf.items())
        ratio_fp8 = tf["fp8 grp"] / tf["fp8 cublas"]
        ratio_bf16 = tf["bf16 grp"] / tf["torch bf16"]
        dg_tf = tf.get(DG, float("nan"))
        mine = tf.get("fp8 grp acc32", tf["fp8 grp"])  # wgrad: the like-for-like accumulating call
        ratio_dg = f" fp8 grp/DeepGEMM {mine / dg_tf:5.2f}" if dg_tf == dg_tf else ""
        print(f"{name:11s} g={g:2d} tok={tokens:6d} {route} {kind:5s} | {cells} | fp8 grp/cublas {ratio_fp8:5.2f} "
              f"bf16 grp/torch {ratio_bf16:5.2f}{ratio_dg}", flush=True)
    return out


def sweep(variants, kinds=("fprop", "dgrad", "wgrad"), out_dtype=None):
    """Tuning builds (-DLPMOE_GEMM_EXPERIMENTS): time the grouped FP8 kernels
    of each compiled configuration (LPMOE_GEMM_VARIANT) on a few shapes,
    beside the cuBLASLt per-expert loop of the same run."""
    import os

    cases = [("dsv3-up", 8, 32768), ("dsv3-down", 8, 32768), ("mixtral-up", 8, 16384), ("qwen3-up", 32, 16384),
             ("qwen3-up", 64, 4096)]
    for name, g, tokens in cases:
        k, n = next((k, n) for s, k, n in SHAPES if s == name)
        splits = splits_for(g, tokens, False)
        ops = make_operands(k, n, g, splits)
        flops = 2.0 * tokens * n * k
        for kind in kinds:
            fa, fb = ops["fp8"][kind]
            kw = {"out_dtype": out_dtype} if out_dtype is not None else {}
            ref = tflops(flops, safe(lambda: lpmoe.grouped_gemm(fa, fb, kind=kind, backend="cublas", m_splits=splits,
                                                                **kw)))
            cells = [f"cublas {ref:6.1f}"]
            for v in variants:
                # "name+sw4+rN": configuration name, tile swizzle 4, raster along N
                name_v, *knobs = v.split("+")
                os.environ["LPMOE_GEMM_VARIANT"] = name_v
                for kn in knobs:
                    key = "LPMOE_GEMM_SWIZZLE" if kn.startswith("sw") else "LPMOE_GEMM_RASTER"
                    os.environ[key] = kn[2:] if kn.startswith("sw") else kn[1:]
                f8 = tflops(flops, safe(lambda: lpmoe.grouped_gemm(fa, fb, kind=kind, backend="grouped", **kw)))
                cells.append(f"{v or 'default'} {f8:6.1f} ({f8 / ref:4.2f})")
                for key in ("LPMOE_GEMM_VARIANT", "LPMOE_GEMM_SWIZZLE", "LPMOE_GEMM_RASTER"):
                    os.environ.pop(key, None)
            print(f"sweep {name:10s} g={g:2d} tok={tokens:6d} {kind:5s} | " + " | ".join(cells), flush=True)


def setup_deepgemm(args, cases):
    """Load the DeepGEMM peer, JIT-build its kernels for this run's products ahead
    (parallel nvcc), and check one small case against a dequantized reference.
    Any failure turns the column off with a one-line note."""
    global DG_GRAPH
    DG_GRAPH = args.deepgemm_graph
    if args.no_deepgemm:
        dgp.disable("--no-deepgemm")
    if not dgp.available():
        print(f"DeepGEMM column skipped: {dgp.reason()}")
        return
    jobs = [(splits_for(8, 8 * 4096, False), 7168, 4096)]
    for name, g, tokens, skewed in cases:
        k, n = next((k, n) for s, k, n in SHAPES if s == name)
        splits = splits_for(g, tokens, skewed)
        jobs += [(splits, k, n), (splits, n, k)]  # fprop (K, N); dgrad (N, K)
    try:
        count, errors, secs = dgp.precompile(jobs + dgp.check_jobs())
        for e in errors:
            print(f"    (DeepGEMM JIT failed: {e})")
        errs = dgp.check()
    except Exception as exc:
        dgp.disable(f"{type(exc).__name__}: {str(exc)[:200]}")
        print(f"DeepGEMM column skipped: {dgp.reason()}")
        return
    bad = [k for k, v in errs.items() if not v <= dgp.CHECK_TOL]
    status = "ok" if not bad else "FAILED"
    print(f"{dgp.describe()}: {count} kernels JIT-built in {secs:.0f} s; check vs dequantized reference {status} "
          f"(rel err {', '.join(f'{k} {v:.1e}' for k, v in errs.items())})"
          + ("; timed as CUDA graph replays" if DG_GRAPH else ""))
    if bad:
        dgp.disable(f"its output failed the check ({', '.join(bad)})")
        print(f"DeepGEMM column skipped: {dgp.reason()}")


def main():
    p = parser(__doc__)
    p.add_argument("--sweep", default=None, help="comma-separated LPMOE_GEMM_VARIANT names ('' = default)")
    p.add_argument("--kinds", default="fprop,dgrad,wgrad", help="GEMM kinds of --sweep")
    p.add_argument("--fp32-out", action="store_true", help="--sweep with fp32 outputs (wgrad)")
    p.add_argument("--no-deepgemm", action="store_true", help="leave the DeepGEMM peer column empty")
    p.add_argument("--graph", action="store_true",
                   help="time the lpmoe and torch columns as CUDA graphs of 5 calls (device time; the default eager "
                        "timing includes each call's host cost where it exceeds the kernel)")
    p.add_argument("--deepgemm-graph", action="store_true",
                   help="time DeepGEMM as a CUDA graph replay (no per-call Python launch cost)")
    add_sustained(p)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_grouped_gemm: no CUDA device, nothing to time")
    global GRAPH, SUSTAINED
    GRAPH, SUSTAINED = args.graph, args.sustained
    if args.sweep is not None:
        sweep(args.sweep.split(","), args.kinds.split(","), torch.float32 if args.fp32_out else None)
        return
    torch.manual_seed(0)
    timing = "median of 7 samples x 5 calls; " + ("CUDA graphs of 5 calls, device time" if GRAPH else
                                                   "eager, host launch cost overlapped")
    if SUSTAINED > 0:
        timing = f"median of 40 single calls after {SUSTAINED} s of the same calls (power-capped clock)"
    print(f"device {torch.cuda.get_device_name()}  (TFLOP/s; {timing})")
    rows = []
    cases = [("dsv3-up", 8, 32768, False), ("dsv3-up", 8, 32768, True), ("dsv3-down", 8, 32768, False),
             ("qwen3-up", 32, 16384, False), ("qwen3-down", 64, 65536, True), ("mixtral-up", 8, 16384, False),
             ("dsv3-up", 32, 65536, False), ("qwen3-up", 64, 4096, False)]
    if args.quick:
        cases = cases[:2]
    setup_deepgemm(args, cases)
    # the anchor case of the issue: 8 groups x 4096 tokens, K 7168, N 4096 (fprop)
    anchor = run_case("dsv3-up", 7168, 4096, 8, 8 * 4096, False, ["fprop"])
    rows.append(("gemm anchor 8x4096 K7168 N4096 fprop fp8 grp TF",
                 f"{anchor['fprop']['fp8 grp']:.0f} (cublas loop {anchor['fprop']['fp8 cublas']:.0f})"))
    if anchor["fprop"][DG] == anchor["fprop"][DG]:
        rows.append(("gemm anchor fprop DeepGEMM TF", f"{anchor['fprop'][DG]:.0f}"))
    worst_fp8, worst_bf16, vs_dg = [], [], []
    for name, g, tokens, skewed in cases:
        k, n = next((k, n) for s, k, n in SHAPES if s == name)
        res = run_case(name, k, n, g, tokens, skewed, ["fprop", "dgrad", "wgrad"])
        for kind, tf in res.items():
            worst_fp8.append((tf["fp8 grp"] / tf["fp8 cublas"], f"{name} g{g} {kind}"))
            worst_bf16.append((tf["bf16 grp"] / tf["torch bf16"], f"{name} g{g} {kind}"))
            if DG in tf:
                vs_dg.append((tf["fp8 grp"] / tf[DG], f"{name} g{g} {kind}"))
    worst_fp8 = [w for w in worst_fp8 if w[0] == w[0]]
    worst_bf16 = [w for w in worst_bf16 if w[0] == w[0]]
    if worst_fp8:
        lo = min(worst_fp8)
        rows.append(("gemm fp8 grp/cublas min (median)",
                     f"{lo[0]:.2f} at {lo[1]} ({sorted(r for r, _ in worst_fp8)[len(worst_fp8) // 2]:.2f})"))
    if worst_bf16:
        lo = min(worst_bf16)
        rows.append(("gemm bf16 grp/torch min (median)",
                     f"{lo[0]:.2f} at {lo[1]} ({sorted(r for r, _ in worst_bf16)[len(worst_bf16) // 2]:.2f})"))
    vs_dg = [w for w in vs_dg if w[0] == w[0]]
    if vs_dg:
        lo = min(vs_dg)
        rows.append(("gemm fp8 grp/DeepGEMM min (median)",
                     f"{lo[0]:.2f} at {lo[1]} ({sorted(r for r, _ in vs_dg)[len(vs_dg) // 2]:.2f})"))
    if GRAPH:
        rows = [(name + " [graph]", value) for name, value in rows]
    write_summary(args.summary, rows)


if __name__ == "__main__":
    main()
