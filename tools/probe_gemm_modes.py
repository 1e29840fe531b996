"""Why the large FP8 GEMMs' times are bimodal: per-call times of long
back-to-back runs beside the GPU's clock and power.

    PYTHONPATH=python:benchmarks python3 tools/probe_gemm_modes.py [--calls 300 --rounds 2 --out DIR]
    PYTHONPATH=python:benchmarks python3 tools/probe_gemm_modes.py --mlp [--calls 60]

For each configuration (lpmoe's kernel at pinned widths/clusters, DeepGEMM
when .peers/DeepGEMM is present) the anchor fprop (8 x 4096 tokens, K 7168,
N 4096) runs --calls times back to back after an idle second, with a CUDA
event between every two calls (events do not break the stream), so each
call's own device time is known.  nvidia-smi samples SM clock, power and
throttle reasons every 20 ms meanwhile.  Printed per block: the per-call
times in tenths of the block (median of each tenth) and the clock and power
over the same tenths (matched by wall time), so a time that changes with the
clock shows as power, and one that jumps at a steady clock does not.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

import torch

import lpmoe
from lpmoe import Float8BlockQuantizer
from lpmoe.gemm import fp8_kernel_config

import _deepgemm_peer as dgp

SMI_FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def _smi_start(path):
    fields = SMI_FIELDS
    probe = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True)
    if probe.returncode != 0:  # older drivers call the reasons "throttle reasons"
        fields = fields.replace("clocks_event_reasons", "clocks_throttle_reasons")
    f = open(path, "w")
    cmd = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-lms", "20"]
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.DEVNULL), f


def _smi_read(path):
    """[(unix time, MHz, W, reasons)] of the samples."""
    import datetime
    rows = []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        try:
            ts = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((ts, float(parts[1]), float(parts[2]), parts[4]))
        except ValueError:
            continue
    return rows


def run_block(fn, calls):
    """(per-call ms, wall start, wall end) of calls back-to-back calls."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
    torch.cuda.synchronize()
    t0 = time.time()
    ev[0].record()
    for i in range(calls):
        fn()
        ev[i + 1].record()
    ev[-1].synchronize()
    t1 = time.time()
    return [ev[i].elapsed_time(ev[i + 1]) for i in range(calls)], t0, t1


def mlp_candidates():
    """name -> step of a GroupedMLP fwd+bwd (bench_grouped_mlp.py's setup)."""
    from lpmoe.recipe import Float8BlockScaling
    g, tokens, hidden, ffn = 8, 65536, 7168, 2048
    m = torch.full((g,), tokens // g, device="cuda")
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    p = torch.rand(tokens, device="cuda", requires_grad=True)
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    mlp = lpmoe.GroupedMLP(g, hidden, ffn, params_dtype=torch.bfloat16, device="cuda")
    fns = {}
    for name, recipe in (("mlp fp8", Float8BlockScaling()), ("mlp bf16", None)):
        def step(recipe=recipe):
            x.grad = p.grad = None
            mlp.zero_grad(set_to_none=True)
            with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
                mlp(x, m, probs=p).backward(dy)
        fns[name] = step
    # fwd + bwd FLOPs: 3 GEMMs per layer, 2 * tokens * N * K each
    return fns, 3 * 2.0 * tokens * (hidden * 2 * ffn + ffn * hidden)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--configs", default="192,2 160,2 192,1")
    p.add_argument("--shape", default="8,4096,7168,4096", help="groups,tokens per group,K,N")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--mlp", action="store_true", help="time GroupedMLP steps (FP8, BF16) instead of one GEMM")
    a = p.parse_args()
    if a.mlp:
        fns, flops = mlp_candidates()
        return report(fns, flops, a, "GroupedMLP 8 x 8192 tokens, H 7168, F 2048, fwd+bwd steps")
    g, m, k, n = (int(v) for v in a.shape.split(","))
    splits = [m] * g
    first = torch.tensor(splits, dtype=torch.int64, device="cuda")
    torch.manual_seed(0)
    x = torch.randn(g * m, k, device="cuda").bfloat16()
    w = (torch.randn(g * n, k, device="cuda") * 0.05).bfloat16()
    xq = lpmoe.group_quantize(x, Float8BlockQuantizer(block_dim=1), num_tensors=g, first_dims=first)
    wq = lpmoe.group_quantize(w, Float8BlockQuantizer(block_dim=2), num_tensors=g)
    fns = {}
    for c in a.configs.split():
        bn, cl = (int(v) for v in c.split(","))

        def run(bn=bn, cl=cl):
            with fp8_kernel_config(bn, cl):
                lpmoe.grouped_gemm(xq, wq, kind="fprop", backend="grouped")
        fns[f"n{bn}c{cl}"] = run
    if dgp.available():
        fns["deepgemm"], _ = dgp.fprop(splits, x, w.view(g, n, k))
    else:
        print("DeepGEMM skipped:", dgp.reason())
    fns["cublas"] = lambda: lpmoe.grouped_gemm(xq, wq, kind="fprop", backend="cublas", m_splits=splits)
    offs = torch.cumsum(first, 0).to(torch.int32)
    w3 = w.view(g, n, k)
    fns["torch bf16"] = lambda: torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)  # is BF16 capped too?
    flops = 2.0 * g * m * n * k
    report(fns, flops, a, f"shape g{g} x {m}, K {k}, N {n}")


def report(fns, flops, a, label):
    for fn in fns.values():  # JIT, plans, autotuning out of the way
        fn()
    torch.cuda.synchronize()
    smi_path = os.path.join(a.out, "smi.csv")
    proc, fh = _smi_start(smi_path)
    time.sleep(1.0)
    blocks = []
    for r in range(a.rounds):
        for name, fn in fns.items():
            time.sleep(1.0)
            ms, t0, t1 = run_block(fn, a.calls)
            blocks.append((r, name, ms, t0, t1))
    time.sleep(0.2)
    proc.terminate()
    proc.wait()
    fh.close()
    smi = _smi_read(smi_path)
    print(f"{label}; {a.calls} calls per block; TFLOP/s per tenth of the block "
          f"(median), then SM MHz and W over the same tenths")
    raw = open(os.path.join(a.out, "per_call_ms.txt"), "w")
    for r, name, ms, t0, t1 in blocks:
        raw.write(f"{r} {name} " + " ".join(f"{v:.4f}" for v in ms) + "\n")
        tenth = max(1, len(ms) // 10)
        parts = [ms[i:i + tenth] for i in range(0, len(ms), tenth)][:10]
        tf = [flops / statistics.median(pp) / 1e9 for pp in parts]
        span = (t1 - t0) / len(parts)
        clk, pw, why = [], [], set()
        for i in range(len(parts)):
            s = [row for row in smi if t0 + i * span <= row[0] < t0 + (i + 1) * span]
            clk.append(statistics.median([row[1] for row in s]) if s else float("nan"))
            pw.append(statistics.median([row[2] for row in s]) if s else float("nan"))
            why.update(row[3] for row in s)
        allmed = flops / statistics.median(ms) / 1e9
        q = sorted(ms)
        print(f"r{r} {name:9s} med {allmed:5.0f} TF/s  p10 {flops / q[len(q) * 9 // 10] / 1e9:5.0f} "
              f"p90 {flops / q[len(q) // 10] / 1e9:5.0f} | " + " ".join(f"{v:4.0f}" for v in tf))
        print(f"{'':14s} MHz " + " ".join(f"{v:4.0f}" for v in clk) + "   W " + " ".join(f"{v:3.0f}" for v in pw)
              + f"   reasons {sorted(why)}")
    raw.close()


if __name__ == "__main__":
    main()
