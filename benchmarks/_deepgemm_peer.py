"""DeepGEMM as a peer column of the grouped GEMM benchmark (our adapter code).

Finding, configuring and loading DeepGEMM (its pinned commit, how to recreate
the git-ignored .peers/DeepGEMM folder, the JIT set-up and the environment
variables) is in _deepgemm_jit.py; the names the benchmarks use from there
(available, reason, describe, disable, ...) are re-exported here.

Layout (grouped contiguous, "NT"): D[m, n] = A[m, :] . B[g(m)][n, :], A FP8
[m_pad, K] with 1x128 scales (fp32, column-major, TMA-aligned), B FP8
[G, N, K] with 128x128 scales [G, N/128, K/128], D bf16, and ``m_indices``
(int32 [m_pad]) giving each row's group.  Each group starts at a multiple of
128 rows (its M alignment); the rows that pad a group up to it carry
m_index -1 (the kernel skips 64-row slices that start with one).  Useful FLOPs
are 2 * sum(m_t) * N * K: the padding rows are never counted.

fprop: A = x [tokens, K], B = w [G, N, K].  dgrad: A = dy [tokens, N],
B = w^T [G, K, N] (the weights' transposed copy, quantized outside the timing
as lpmoe's columnwise copy is).  wgrad: DeepGEMM's k-grouped weight gradient
(:class:`KGroupedWgrad`, fp32 out; a loop of one launch per member at the
pinned commit).

    python3 benchmarks/_deepgemm_peer.py           # correctness check on the GPU
    python3 benchmarks/_deepgemm_peer.py --time    # + anchor-shape fprop/dgrad TFLOP/s
"""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from _deepgemm_jit import (  # noqa: F401 - re-exported: the benchmarks call them as dgp.*
    PEER_DIR, PINNED_COMMIT, _tls, available, commit, cutlass_include, describe, disable, load, reason)

ALIGN_M = 128          # DeepGEMM's M alignment of a group in the contiguous layout
FP8_MAX = 448.0        # largest float8_e4m3fn
CHECK_TOL = 1e-2       # relative L2 error against the dequantized reference
CHECK_CASE = ((200, 0, 77, 384), 512, 384)   # splits (uneven, one empty), K, N of check()
DEVICE = "cuda"


# ---------------------------------------------------------------------------
# operands
# ---------------------------------------------------------------------------
def _ceil(a: int, b: int) -> int:
    return (a + b - 1) // b


def padded_layout(splits: Sequence[int], device="cuda"):
    """(m_pad, dst, m_indices): dst[i] is the padded row of token row i;
    m_indices[r] is the group of padded row r, -1 on padding rows."""
    sizes = [int(s) for s in splits]
    padded = [_ceil(s, ALIGN_M) * ALIGN_M for s in sizes]
    m_pad = sum(padded)
    rows = sum(sizes)
    size_t = torch.tensor(sizes, device=device, dtype=torch.long)
    src_start = torch.cumsum(size_t, 0) - size_t
    pad_start = torch.tensor([sum(padded[:i]) for i in range(len(padded))], device=device, dtype=torch.long)
    shift = torch.repeat_interleave(pad_start - src_start, size_t, output_size=rows)
    dst = torch.arange(rows, device=device, dtype=torch.long) + shift
    m_indices = torch.full((m_pad,), -1, device=device, dtype=torch.int32)
    m_indices[dst] = torch.repeat_interleave(torch.arange(len(sizes), device=device, dtype=torch.int32), size_t,
                                             output_size=rows)
    return m_pad, dst, m_indices


def quant_1x128(a: torch.Tensor, chunk: int = 8192) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-row, per-128-column FP8 quantization: (fp8 [m, K], fp32 scales [m, K/128])."""
    m, k = a.shape
    if k % 128:
        raise ValueError(f"K={k} is not a multiple of 128")
    q = torch.empty(m, k, device=a.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(m, k // 128, device=a.device, dtype=torch.float32)
    for r in range(0, m, chunk):
        blk = a[r:r + chunk].float().view(-1, k // 128, 128)
        sc = blk.abs().amax(dim=2).clamp_min(1e-12) / FP8_MAX
        q[r:r + chunk] = (blk / sc.unsqueeze(2)).to(torch.float8_e4m3fn).view(-1, k)
        s[r:r + chunk] = sc
    return q, s


def quant_128x128(b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """128x128-block FP8 quantization of one [N, K] matrix: (fp8 [N, K], fp32 [N/128, K/128])."""
    n, k = b.shape
    if k % 128:
        raise ValueError(f"K={k} is not a multiple of 128")
    nb = _ceil(n, 128)
    full = torch.zeros(nb * 128, k, device=b.device, dtype=torch.float32)
    full[:n] = b.float()
    blk = full.view(nb, 128, k // 128, 128)
    sc = blk.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX
    q = (blk / sc[:, None, :, None]).to(torch.float8_e4m3fn).view(nb * 128, k)[:n].contiguous()
    return q, sc


class GroupedNT:
    """DeepGEMM operands of one grouped contiguous NT product, ready to run."""

    def __init__(self, splits: Sequence[int], a: Optional[torch.Tensor], b: Optional[torch.Tensor],
                 k: Optional[int] = None, n: Optional[int] = None):
        dg = load()
        if dg is None:
            raise RuntimeError(f"DeepGEMM unavailable: {reason()}")
        self.splits = [int(s) for s in splits]
        g = len(self.splits)
        dev = DEVICE
        self.m_pad, self.dst, self.m_indices = padded_layout(self.splits, dev)
        if a is None:  # compile-only operands: shapes and layouts, no data
            assert b is None and k is not None and n is not None
            self.k, self.n = k, n
            self.a = torch.empty(self.m_pad, k, device=dev, dtype=torch.float8_e4m3fn)
            a_s = torch.ones(self.m_pad, _ceil(k, 128), device=dev, dtype=torch.float32)
            self.b = torch.empty(g, n, k, device=dev, dtype=torch.float8_e4m3fn)
            self.b_s = torch.ones(g, _ceil(n, 128), _ceil(k, 128), device=dev, dtype=torch.float32)
        else:
            rows, self.k = a.shape
            gb, self.n, kb = b.shape
            if rows != sum(self.splits) or gb != g or kb != self.k:
                raise ValueError(f"shapes: a {tuple(a.shape)}, b {tuple(b.shape)}, splits sum {sum(self.splits)}")
            a_pad = torch.zeros(self.m_pad, self.k, device=dev, dtype=a.dtype)
            a_pad[self.dst] = a
            self.a, a_s = quant_1x128(a_pad)
            del a_pad
            self.b = torch.empty(g, self.n, self.k, device=dev, dtype=torch.float8_e4m3fn)
            self.b_s = torch.empty(g, _ceil(self.n, 128), _ceil(self.k, 128), device=dev, dtype=torch.float32)
            for t in range(g):
                self.b[t], self.b_s[t] = quant_128x128(b[t])
        # the LHS scales in the column-major, TMA-aligned layout the kernel reads (made once here)
        self.a_s = dg.get_col_major_tma_aligned_tensor(a_s)
        self.out = torch.empty(self.m_pad, self.n, device=dev, dtype=torch.bfloat16)
        self.flops = 2.0 * sum(self.splits) * self.n * self.k   # useful FLOPs only
        self._dg = dg

    def __call__(self) -> None:
        self._dg.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous((self.a, self.a_s), (self.b, self.b_s), self.out,
                                                          self.m_indices)

    def result(self) -> torch.Tensor:
        """D's useful rows, in token order [sum(m_t), N]."""
        return self.out[self.dst]

    def reference(self) -> torch.Tensor:
        """fp32 product of the dequantized operands, token rows only."""
        a = (self.a.float().view(self.m_pad, -1, 128) * self.a_s.unsqueeze(2)).view(self.m_pad, self.k)
        ref = torch.empty(sum(self.splits), self.n, device=a.device, dtype=torch.float32)
        r = 0
        for t, m in enumerate(self.splits):
            if m == 0:
                continue
            bs = self.b_s[t].repeat_interleave(128, 0)[:self.n].repeat_interleave(128, 1)[:, :self.k]
            rows = self.dst[r:r + m]
            ref[r:r + m] = a[rows] @ (self.b[t].float() * bs).t()
            r += m
        return ref


class KGroupedWgrad:
    """DeepGEMM's k-grouped weight gradient, fp32 out, accumulated into
    ``out``: dW[t] (N x K) += dy_t^T x_t.  At the pinned commit this is a host
    loop of one wgrad launch per member (``k_grouped_wgrad_gemm_fp8_fp8_fp32_nt``),
    so it needs host member sizes (multiples of 128 here).  LHS = dy_t^T [N, m_t],
    RHS = x_t^T [K, m_t], both scaled per 128 tokens (the 128x1 token blocks of
    lpmoe's columnwise copies), scales [m_t / 128, N] per member, stacked."""

    def __init__(self, splits: Sequence[int], dy: torch.Tensor, x: torch.Tensor):
        dg = load()
        if dg is None:
            raise RuntimeError(f"DeepGEMM unavailable: {reason()}")
        self.splits = [int(s) for s in splits]
        if any(s % 128 for s in self.splits):
            raise ValueError(f"k-grouped wgrad peer: member sizes must be multiples of 128, got {self.splits}")
        self.n, self.k = dy.shape[1], x.shape[1]
        parts: Dict[str, List[torch.Tensor]] = {"a": [], "sa": [], "b": [], "sb": []}
        r = 0
        for m in self.splits:
            if m:
                a, sa = quant_1x128(dy[r:r + m].t().contiguous())
                b, sb = quant_1x128(x[r:r + m].t().contiguous())
                parts["a"].append(a.view(-1))
                parts["b"].append(b.view(-1))
                parts["sa"].append(sa.t())
                parts["sb"].append(sb.t())
            r += m
        self.lhs = (torch.cat(parts["a"]), torch.cat(parts["sa"]).contiguous())
        self.rhs = (torch.cat(parts["b"]), torch.cat(parts["sb"]).contiguous())
        self.out = torch.zeros(len(self.splits), self.n, self.k, device=dy.device, dtype=torch.float32)
        self.flops = 2.0 * sum(self.splits) * self.n * self.k
        self._dg = dg

    def __call__(self) -> None:
        self._dg.k_grouped_wgrad_gemm_fp8_fp8_fp32_nt(self.lhs, self.rhs, self.out, self.splits)

    def reference(self) -> torch.Tensor:
        """fp32 products of the dequantized operands, [G, N, K]."""
        ref = torch.zeros_like(self.out)
        off = so = 0
        for t, m in enumerate(self.splits):
            if m == 0:
                continue
            nb = m // 128
            a = self.lhs[0][off * self.n:(off + m) * self.n].view(self.n, m).float()
            b = self.rhs[0][off * self.k:(off + m) * self.k].view(self.k, m).float()
            a = a * self.lhs[1][so:so + nb].t().repeat_interleave(128, 1)
            b = b * self.rhs[1][so:so + nb].t().repeat_interleave(128, 1)
            ref[t] = a @ b.t()
            off, so = off + m, so + nb
        return ref


def wgrad(splits, dy: torch.Tensor, x: torch.Tensor):
    """(callable adding dy_t^T x_t into a fp32 [G, N, K] buffer, useful FLOPs)."""
    op = KGroupedWgrad(splits, dy, x)
    return op, op.flops


def _graphed(op: "GroupedNT") -> Callable[[], None]:
    """A replay of one captured launch (the JIT build and the first run happen eagerly)."""
    op()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op()
    torch.cuda.synchronize()

    def replay() -> None:
        graph.replay()

    replay.op, replay.graph = op, graph  # type: ignore[attr-defined]  # operands live as long as the graph
    return replay


def grouped_nt(splits: Sequence[int], a: torch.Tensor, b: torch.Tensor, graph: bool = False):
    """(zero-argument callable running DeepGEMM's grouped contiguous GEMM, useful FLOPs).
    a: [sum(splits), K] high-precision tokens; b: [G, N, K] (any strides)."""
    op = GroupedNT(splits, a, b)
    return (_graphed(op) if graph else op), op.flops


def fprop(splits, x: torch.Tensor, w: torch.Tensor, graph: bool = False):
    """y = x w^T per group: x [tokens, K], w [G, N, K]."""
    return grouped_nt(splits, x, w, graph)


def dgrad(splits, dy: torch.Tensor, w: torch.Tensor, graph: bool = False):
    """dx = dy w per group: dy [tokens, N], w [G, N, K] (NT with w^T [G, K, N])."""
    return grouped_nt(splits, dy, w.transpose(1, 2), graph)


def precompile(jobs: Iterable[Tuple[Sequence[int], int, int]], workers: Optional[int] = None) -> Tuple[int, List[str], float]:
    """JIT-compile the kernels of the (splits, K, N) products ahead, in parallel
    threads (nvcc runs as a child process; nothing is launched).  Returns
    (kernels asked for, errors, seconds).  The main run then finds the cubins
    in DeepGEMM's cache."""
    if load() is None:
        return 0, [reason()], 0.0
    uniq = {}
    for splits, k, n in jobs:
        m_pad = sum(_ceil(int(s), ALIGN_M) * ALIGN_M for s in splits)
        uniq.setdefault((m_pad, len(splits), k, n), (list(splits), k, n))
    errors: List[str] = []

    def one(job):
        splits, k, n = job
        _tls.compile_only = True
        try:
            GroupedNT(splits, None, None, k=k, n=n)()
        except Exception as exc:  # noqa: BLE001 - reported, the timed call will fail again
            errors.append(f"G={len(splits)} K={k} N={n}: {type(exc).__name__}: {str(exc)[:160]}")
        finally:
            _tls.compile_only = False

    t0 = time.time()
    workers = workers or max(1, min(8, os.cpu_count() or 1, len(uniq)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, uniq.values()))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return len(uniq), errors, time.time() - t0


def check_jobs() -> List[Tuple[Sequence[int], int, int]]:
    """precompile() jobs of check() (fprop and dgrad)."""
    splits, k, n = CHECK_CASE
    return [(splits, k, n), (splits, n, k)]


def check(splits=CHECK_CASE[0], k: int = CHECK_CASE[1], n: int = CHECK_CASE[2], seed: int = 0) -> Dict[str, float]:
    """Relative L2 error of DeepGEMM's fprop and dgrad against fp32 products of
    the dequantized operands (uneven groups, one empty, padding rows skipped)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rows, g = sum(splits), len(splits)
    x = torch.randn(rows, k, device=DEVICE, generator=gen).bfloat16()
    dy = torch.randn(rows, n, device=DEVICE, generator=gen).bfloat16()
    w = (torch.randn(g, n, k, device=DEVICE, generator=gen) * 0.05).bfloat16()
    errs = {}
    for kind, a, b in (("fprop", x, w), ("dgrad", dy, w.transpose(1, 2))):
        op = GroupedNT(splits, a, b)
        op.out.fill_(float("nan"))   # rows it should write but does not would show
        op()
        torch.cuda.synchronize()
        got, ref = op.result().float(), op.reference()
        errs[kind] = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
    wsplits = [s // 128 * 128 + 128 if s else 0 for s in splits]  # multiples of 128, one member empty
    op = KGroupedWgrad(wsplits, torch.randn(sum(wsplits), n, device=DEVICE, generator=gen).bfloat16(),
                       torch.randn(sum(wsplits), k, device=DEVICE, generator=gen).bfloat16())
    op()  # out starts at zero: one call is the product
    torch.cuda.synchronize()
    ref = op.reference()
    errs["wgrad"] = float((op.out - ref).norm() / ref.norm().clamp_min(1e-30))
    return errs


def _main() -> int:
    import argparse
    p = argparse.ArgumentParser(description="DeepGEMM peer: correctness check (and a timing) on the GPU")
    p.add_argument("--time", action="store_true",
                   help="also time fprop/dgrad of the anchor shape (8 x 4096 tokens, K 7168, N 4096)")
    p.add_argument("--graph", action="store_true", help="--time through CUDA graph replays")
    args = p.parse_args()
    if load() is None:
        print(f"DeepGEMM unavailable: {reason()}")
        return 1
    print(describe())
    t0 = time.time()
    errs = check()
    bad = {k: v for k, v in errs.items() if not v <= CHECK_TOL}
    print("check (rel L2 err vs dequantized fp32 reference): "
          + ", ".join(f"{k} {v:.2e}" for k, v in errs.items())
          + f"  [{'FAIL' if bad else 'ok'}, tol {CHECK_TOL:g}; {time.time() - t0:.1f} s incl. JIT]")
    if args.time and not bad:
        from _common import median_ms
        splits, k, n = [4096] * 8, 7168, 4096
        x = torch.randn(sum(splits), k, device=DEVICE).bfloat16()
        dy = torch.randn(sum(splits), n, device=DEVICE).bfloat16()
        w = (torch.randn(len(splits), n, k, device=DEVICE) * 0.02).bfloat16()
        for kind, make, a in (("fprop", fprop, x), ("dgrad", dgrad, dy)):
            t0 = time.time()
            fn, flops = make(splits, a, w, graph=args.graph)
            fn()
            torch.cuda.synchronize()
            built = time.time() - t0
            ms = median_ms(fn, warmup=3, iters=7, reps=5)
            print(f"anchor {kind}: {flops / ms / 1e9:7.1f} TFLOP/s ({ms * 1e3:.0f} us; operands + JIT {built:.1f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(_main())
