"""Host time of one grouped GEMM call, layer by layer (GPU machine).

Eager grouped GEMMs of small groups are host-bound: the kernel is shorter
than the call.  This splits the host microseconds of ``lpmoe.grouped_gemm``
into its layers, beside ``torch._grouped_mm`` doing the same product:

* the whole call, the binding call alone (arguments captured from a real
  call), the row-epilogue binding alone, a trivial binding call (pybind11's
  floor) and ``parse_operands`` alone;
* cProfile of the Python layer (top functions by own time);
* the CUDA runtime calls made inside one call (torch.profiler CPU events).

Host time is measured while the GPU sleeps, so no call waits on the device.

    PYTHONPATH=python:benchmarks python3 tools/profile_gemm_host.py
"""
import cProfile
import pstats
import sys

import torch

sys.path.insert(0, "benchmarks")
from lpmoe._ext import ext  # noqa: E402
from lpmoe.gemm.operands import parse_operands  # noqa: E402
from bench_grouped_gemm import bf16_fprop_pair  # noqa: E402
from _common import host_us  # noqa: E402


def captured(name, fn):
    """Arguments of the binding function `name` during one fn() call."""
    mod = ext()
    real = getattr(mod, name)
    seen = []

    def spy(*args):
        seen.append(args)
        return real(*args)

    setattr(mod, name, spy)
    try:
        fn()
    finally:
        setattr(mod, name, real)
    return real, seen


def runtime_calls(fn, n=20):
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = [(e.self_cpu_time_total / n, e.count / n, e.key) for e in prof.key_averages()
            if e.self_cpu_time_total > 0 and e.key.startswith(("cuda", "cu"))]
    return sorted(rows, reverse=True)[:12]


def main():
    g, tokens, k, n = 64, 4096, 2048, 1536  # qwen3-up, 64-token groups: the host-bound case
    ours, theirs, xg, w = bf16_fprop_pair(g, tokens, k, n)
    gemm, gemm_args = captured("grouped_gemm_cutlass", ours)
    epi, epi_args = captured("grouped_row_epilogue", ours)
    cases = {
        "lpmoe.grouped_gemm": ours,
        "torch._grouped_mm": theirs,
        "binding grouped_gemm_cutlass": lambda: gemm(*gemm_args[0]),
        "binding grouped_row_epilogue": (lambda: epi(*epi_args[0])) if epi_args else None,
        "binding floor (grouped_gemm_setup_bytes)": lambda: ext().grouped_gemm_setup_bytes(g),
        "parse_operands": lambda: parse_operands(xg, w, "fprop", None),
        "torch.empty (out)": lambda: torch.empty(tokens, n, dtype=torch.bfloat16, device="cuda"),
    }
    for rnd in range(3):
        line = []
        for name, fn in cases.items():
            if fn is not None:
                line.append(f"{name} {host_us(fn, n=200):.1f}")
        print(f"round {rnd}: host us per call: " + " | ".join(line), flush=True)

    prof = cProfile.Profile()
    ours()
    torch.cuda._sleep(int(3e9))
    prof.enable()
    for _ in range(200):
        ours()
    prof.disable()
    torch.cuda.synchronize()
    print("cProfile of 200 lpmoe.grouped_gemm calls (tottime per call, us):")
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:18]
    for (file, line, func), (cc, nc, tt, ct, _) in rows:
        print(f"  {tt / 200 * 1e6:7.1f} own {ct / 200 * 1e6:7.1f} cum  x{nc / 200:.0f}  {func} "
              f"({file.split('/')[-1]}:{line})")
    for tag, fn in (("lpmoe", ours), ("torch", theirs)):
        print(f"CUDA API calls per {tag} call (self us, count):")
        for us, cnt, key in runtime_calls(fn):
            print(f"  {us:7.1f} x{cnt:.1f} {key}")


if __name__ == "__main__":
    main()
