"""Timing helpers shared by the benchmarks: CUDA events, warm-up, median."""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Callable, List

import torch


def median_ms(fn: Callable[[], object], warmup: int = 5, iters: int = 15, reps: int = 10) -> float:
    """Median over ``iters`` samples of the mean time of fn() in ms.

    Each sample brackets ``reps`` back-to-back calls with CUDA events, so the
    host's launch latency overlaps the device work (as in a training step)
    instead of being counted once per call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times: List[float] = [events_ms(fn, reps) for _ in range(iters)]
    return statistics.median(times)


def events_ms(fn: Callable[[], object], reps: int) -> float:
    """Mean ms of ``reps`` back-to-back fn() calls between two CUDA events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def sustained_ms(fn: Callable[[], object], heat_s: float = 0.5, calls: int = 40) -> float:
    """Median ms per call once the GPU has settled at its power cap.

    A long FP8 GEMM run starts at the boost clock (1980 MHz on the H200) and
    drops within ~0.15 s to the clock the 700 W cap allows for that kernel
    (1400-1500 MHz; tools/probe_gemm_modes.py).  A few short bursts, as
    ``median_ms`` times them, mostly see the boost clock, where cycles alone
    decide; a training step runs GEMMs for seconds, where energy per call
    decides.  This runs fn back to back for ``heat_s`` seconds first, then
    times ``calls`` more calls one by one (an event between every two calls,
    which does not break the stream).  The heat clock starts after a first
    call (a JIT build or plan in it would leave the GPU idle and cool, and a
    cool GPU holds a higher clock under the same cap)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < heat_s:
        for _ in range(8):
            fn()
        torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
    ev[0].record()
    for i in range(calls):
        fn()
        ev[i + 1].record()
    ev[-1].synchronize()
    return statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(calls))


def add_sustained(p: argparse.ArgumentParser) -> None:
    """The ``--sustained SECONDS`` option of the GEMM benchmarks (:func:`sustained_ms`)."""
    p.add_argument("--sustained", type=float, default=0.0, metavar="SECONDS",
                   help="time each candidate after SECONDS of its own calls (power-capped clock) "
                        "instead of in short bursts (boost clock)")


def graph_median_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 15, reps: int = 10) -> float:
    """Median over ``iters`` replays of a CUDA graph of ``reps`` fn() calls,
    in ms per call: the device time of fn without the host gaps between
    launches, for kernels shorter than their Python call (eager timing of a
    0.15 ms kernel measures the host).  fn must be graph-safe."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times: List[float] = [events_ms(graph.replay, 1) / reps for _ in range(iters)]
    return statistics.median(times)


def host_us(fn: Callable[[], object], n: int = 50) -> float:
    """Host microseconds per fn() call, measured while the GPU sleeps so that
    no call waits on the device (launch-bound calls: the host cost alone)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))  # ~1.7 s of GPU cycles: longer than the n calls
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def time_and_peak(step: Callable[[], object], reset: Callable[[], object] = lambda: None, sustained: float = 0.0):
    """(median ms per step, peak GiB of one step above what was allocated
    before it).  One step runs first (workspaces, caches), then ``reset``
    (e.g. drop the gradients it made), then the measured step.  Timing: 7
    samples of 3 steps (mostly the boost clock), or with ``sustained`` > 0
    :func:`sustained_ms` after that many seconds of steps (the power-capped
    clock a training run sees)."""
    peak = peak_gib(step, reset)
    if sustained > 0:
        return sustained_ms(step, heat_s=sustained), peak
    return median_ms(step, warmup=2, iters=7, reps=3), peak


def peak_gib(step: Callable[[], object], reset: Callable[[], object] = lambda: None) -> float:
    """Peak GiB of one step above what was allocated before it (one step
    runs first for workspaces and caches, then ``reset``)."""
    step()
    reset()
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + bytes written per second).
    Timed eagerly: captured in a CUDA graph the copy becomes a memcpy node
    that ran at ~0.8 of this rate on the H100 (a lower, unfair baseline)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup=3, iters=20)
    return 2 * nbytes / ms / 1e6


def parser(desc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=desc)
    p.add_argument("--summary", default=None, help="write 'name|value' summary rows to this file")
    p.add_argument("--quick", action="store_true", help="fewer cases")
    return p


def mlp_cases(desc: str):
    """(args, cases) of the expert-MLP benchmarks (bench_grouped_mlp.py,
    bench_mixed_precision.py): --summary, --quick (the first case),
    --sustained, --uniform-only; cases are (experts, tokens, skewed) at
    8 x 64k and 32 x 16k, uniform and skewed.  Prints the header line."""
    p = parser(desc)
    add_sustained(p)
    p.add_argument("--uniform-only", action="store_true", help="skip the skewed routing cases")
    args = p.parse_args()
    torch.manual_seed(0)
    cases = [(8, 65536, False), (8, 65536, True), (32, 16384, False), (32, 16384, True)]
    if args.quick:
        cases = cases[:1]
    elif args.uniform_only:
        cases = [c for c in cases if not c[2]]
    print(f"device {torch.cuda.get_device_name()}  (ms per fwd+bwd step"
          f"{f', after {args.sustained} s of steps' if args.sustained else ''}; peak GiB above the step's start)")
    return args, cases


def write_summary(path, rows):
    if path:
        with open(path, "w") as f:
            for name, value in rows:
                f.write(f"{name}|{value}\n")


def splits_for(g: int, tokens: int, skewed: bool):
    """Expert splits, multiples of 128: uniform, or skewed (half of the tokens
    to expert 0, the rest spread evenly)."""
    if not skewed:
        return [tokens // g] * g
    big = tokens // 2 // 128 * 128
    rest = (tokens - big) // (g - 1) // 128 * 128
    s = [big] + [rest] * (g - 1)
    s[0] += tokens - sum(s)
    return s


def quantizer_splits(tokens: int, n: int, skewed: bool, align: int = 1):
    """Member sizes of the quantizer benchmarks: uniform, or one member with
    90 % of the tokens and the rest spread evenly; every size a multiple of
    ``align`` (NVFP4 skips members whose rows are not multiples of 16), the
    last member takes what is left (tokens must be a multiple of align)."""
    if not skewed:
        s = [tokens // n // align * align] * n
    else:
        big = int(tokens * 0.9) // align * align
        s = [big] + [(tokens - big) // (n - 1) // align * align] * (n - 1)
    s[-1] += tokens - sum(s)
    return s


def routed_splits(g: int, tokens: int, skewed: bool, seed: int = 0):
    """Expert splits as a router produces them (not multiples of anything):
    a multinomial draw, uniform over experts or with half of the probability
    on expert 0."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.full((g,), 1.0 / g) if not skewed else torch.cat([torch.tensor([0.5]),
                                                                   torch.full((g - 1,), 0.5 / (g - 1))])
    picks = torch.multinomial(probs, tokens, replacement=True, generator=gen)
    return torch.bincount(picks, minlength=g).tolist()
