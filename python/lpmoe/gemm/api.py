"""lpmoe.grouped_gemm: the three grouped products of an MoE layer.

Backends
--------
``"grouped"``  lpmoe's sm_90 grouped kernels: its own FP8 block-scaled kernels
    for FP8 fprop/dgrad and wgrad (csrc/fp8_gemm), CUTLASS pointer-array
    kernels for 16-bit products and what lpmoe's kernels cannot run (discrete
    weights, more groups than their tables hold).  Group sizes are read on the GPU (the operands' device row
    prefix sums; the CUTLASS paths' argument launch writes per-group
    pointers, shapes and strides into a persistent setup buffer), so a call
    never syncs with the host and can be captured in a CUDA graph and
    replayed with different routing.  bf16/fp16 and FP8 block scaling (E4M3
    operands), any group sizes including 0.
``"cublas"``   one cuBLASLt matmul per non-empty group (VEC128_32F x
    BLK128x128_32F scaling for fprop/dgrad, VEC128 x VEC128 for wgrad).  It
    needs the split sizes on the host: pass ``m_splits`` (a list), otherwise
    they are read from the GPU (a host sync).  FP8 block scaling always runs
    with split accumulation (fp32 promotion): cuBLASLt has no fast-accumulation
    algorithm for block scaling, so no caller setting can change it.  cuBLASLt
    needs FP8 group sizes that are multiples of 4.
``"auto"``     GPU-resident splits: the grouped backend (or a clear error when
    it cannot run the call: never a silent host sync).  Host splits
    (``m_splits`` given): the faster one as measured on H100
    (benchmarks/bench_grouped_gemm.py, docs/perf-notes.md): cuBLASLt for FP8
    fprop/dgrad whose groups average >= 2048 tokens (0-10 % faster), the
    grouped kernels otherwise (1.5-7x faster for many small groups; FP8 wgrad
    at parity with the loop on large groups since 2026-11-25).

Both backends write only the first ``sum(m_splits)`` rows of a caller's
``out``; a fresh output has its rows past the sum zeroed.  Two grouped GEMMs
of the same workspace slot must not run concurrently on different streams
(see lpmoe.gemm.workspaces).  Not checked without a host sync (documented,
graph-safe): that the device splits of wgrad's two operands are equal, and
that per-member sizes fit the buffers (the offsets kernel truncates members
at capacity, so kernels never go out of bounds).
"""
from __future__ import annotations

import contextlib

from typing import Optional, Sequence

import torch

from lpmoe._async_inputs import ready
from lpmoe._device import cuda_major
from lpmoe.gemm.operands import GemmOperands, host_splits, parse_operands
from lpmoe.gemm.reference import reference_grouped_gemm
from lpmoe.gemm.weight_operands import fp8_weight_operand, ptr_table
from lpmoe.gemm.workspaces import gemm_workspace, setup_workspace, slot_for_kind
from lpmoe.library.routing import OPS, tracing

__all__ = ["grouped_gemm", "grouped_backend_support", "fp8_kernel_config", "fp8_wgrad_kernel_config", "fp8_kernel_key"]

_BACKENDS = ("auto", "grouped", "cublas")
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FMT = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 3}
_KIND = {"fprop": 0, "dgrad": 1, "wgrad": 2}

#: counts of backend launches, for tests that prove which path ran; FP8
#: grouped calls also count the kernel that ran: "fp8_n<width>_c<cluster>"
#: (lpmoe's block-scaled fprop/dgrad kernel, csrc/fp8_gemm),
#: "fp8_wgrad_n<width>_c<cluster>" (its wgrad kernel) or "fp8_cutlass"; 16-bit
#: grouped calls count their tile's rows: "16bit_rows128" or "16bit_rows64"
#: (fprop/dgrad of groups averaging <= 128 rows, csrc/gemm/heuristics16.h).
#: "row_epilogue" counts the separate bias / capacity-tail launch (the grouped
#: kernels zero a fresh output's tail themselves); "fp8_wgrad_bf16_tma_store"
#: the wgrad kernel's bf16 outputs written through TMA stores.
CALLS = {"grouped": 0, "cublas": 0, "reference": 0, "fp8_cutlass": 0, "16bit_rows128": 0, "16bit_rows64": 0,
         "row_epilogue": 0}

# FP8 kernels of the grouped backend, (tile width, cluster): zeros = the
# shape heuristic's choice (csrc/fp8_gemm/heuristics.h); width -1 = the
# CUTLASS kernel.  fprop/dgrad and wgrad are pinned separately, through
# fp8_kernel_config() and fp8_wgrad_kernel_config().
_fp8_config = (0, 0)
_fp8_wgrad_config = (0, 0)
#: tile widths of lpmoe's FP8 fprop/dgrad kernel in this build (csrc/fp8_gemm/block_scaled.h)
FP8_TILE_WIDTHS = (128, 160, 192)
#: tile widths of lpmoe's FP8 wgrad kernel in this build (csrc/fp8_gemm/wgrad.h)
FP8_WGRAD_TILE_WIDTHS = (128, 192)


def _checked_config(name: str, width, cluster, widths):
    for arg, v in (("width", width), ("cluster", cluster)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{arg} must be an int, got {type(v).__name__}")
    if width not in (0, -1) + widths or cluster not in (0, 1, 2):
        raise ValueError(f"{name}: width must be 0, -1 or one of {widths} and cluster 0, 1 or 2; "
                         f"got width={width}, cluster={cluster}")
    return width, cluster


@contextlib.contextmanager
def fp8_kernel_config(width: int = 0, cluster: int = 0):
    """Pin the grouped backend's FP8 fprop/dgrad kernel inside the block (tests,
    benchmarks, tuning): ``width`` 0 = automatic, -1 = the CUTLASS kernel, or a
    tile width lpmoe's kernel is built with (128, 160, 192); ``cluster`` 0 =
    automatic, 1 or 2 CTAs (2 multicasts the weight tile).  Not thread-local."""
    global _fp8_config
    old, _fp8_config = _fp8_config, _checked_config("fp8_kernel_config", width, cluster, FP8_TILE_WIDTHS)
    try:
        yield
    finally:
        _fp8_config = old


@contextlib.contextmanager
def fp8_wgrad_kernel_config(width: int = 0, cluster: int = 0):
    """Pin the grouped backend's FP8 wgrad kernel inside the block, as
    :func:`fp8_kernel_config` does for fprop/dgrad: ``width`` 0 = automatic,
    -1 = the CUTLASS kernel, or one of 128, 192; ``cluster`` 0, 1 or 2 (2
    multicasts the x^T tile).  Not thread-local."""
    global _fp8_wgrad_config
    old = _fp8_wgrad_config
    _fp8_wgrad_config = _checked_config("fp8_wgrad_kernel_config", width, cluster, FP8_WGRAD_TILE_WIDTHS)
    try:
        yield
    finally:
        _fp8_wgrad_config = old


def fp8_kernel_key(width: int, cluster: int, kind: str = "fprop") -> str:
    """CALLS key of a kernel configuration ("fp8_wgrad_n<w>_c<c>" for lpmoe's wgrad kernel)."""
    if width < 0:
        return "fp8_cutlass"
    return f"fp8_wgrad_n{width}_c{cluster}" if kind == "wgrad" else f"fp8_n{width}_c{cluster}"


def _out_cols(ops: GemmOperands) -> int:
    return ops.n if ops.kind == "fprop" else ops.k


def _check_out(ops: GemmOperands, out, out_dtype, accumulate: bool):
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    if accumulate and ops.kind != "wgrad":
        raise ValueError("accumulate=True is for kind='wgrad' (adds into an existing weight-gradient buffer)")
    if accumulate and out is None:
        raise ValueError("accumulate=True needs `out` (the buffer to add into)")
    shape = (ops.num_groups, ops.n, ops.k) if ops.kind == "wgrad" else (ops.rows, _out_cols(ops))
    if out is None:
        return None, out_dtype or ops.dtype, shape
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"`out` must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape:
        raise ValueError(f"`out` must have shape {shape} for kind={ops.kind!r}, got {tuple(out.shape)}")
    if out.dtype not in _OUT_DTYPES:
        raise TypeError(f"`out` must be bf16, fp16 or fp32, got {out.dtype}")
    if out_dtype is not None and out_dtype != out.dtype:
        raise ValueError(f"out_dtype={out_dtype} disagrees with out.dtype={out.dtype}")
    if out.device != ops.device:
        raise ValueError(f"`out` is on {out.device} but the operands are on {ops.device}")
    if not out.is_contiguous():
        raise ValueError("`out` must be contiguous")
    return out, out.dtype, shape


def _check_bias(ops: GemmOperands, bias, dtype):
    bias = ready(bias)
    if bias is None:
        return None
    if ops.kind != "fprop":
        raise ValueError("bias is only supported for kind='fprop'")
    if isinstance(bias, (list, tuple)):
        if len(bias) != ops.num_groups:
            raise ValueError(f"bias list has {len(bias)} entries, expected {ops.num_groups}")
        bias = torch.stack([b.reshape(-1) for b in bias])
    if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (ops.num_groups, ops.n):
        got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias must be (G, N) = {(ops.num_groups, ops.n)} or a list of (N,), got {got}")
    if bias.device != ops.device:
        raise ValueError(f"bias is on {bias.device} but the operands are on {ops.device}")
    return bias.to(dtype).contiguous()


def grouped_backend_support(ops: GemmOperands, out_dtype: torch.dtype) -> Optional[str]:
    """None if the grouped backend runs this call, else the reason it cannot."""
    if ops.device.type != "cuda":
        return "operands are not on a CUDA device"
    if cuda_major(ops.device) != 9:
        if ops.fp8:
            return ("FP8 block scaling GEMMs need Hopper (sm_90); on Blackwell use the MXFP8 recipe "
                    "(TransformerEngine) or bf16")
        return "the grouped kernels are built for sm_90 (Hopper); use backend='cublas' or torch._grouped_mm"
    if ops.n % 16 or ops.k % 16:
        return f"N and K must be multiples of 16 (got N={ops.n}, K={ops.k})"
    if ops.fp8:
        dts = {ops.a.rowwise_data.dtype if ops.kind != "wgrad" else ops.a.columnwise_data.dtype}
        b = ops.b_grouped
        dts.add(b.columnwise_data.dtype if (ops.kind != "fprop") else b.rowwise_data.dtype)
        if dts != {torch.float8_e4m3fn}:
            return "the grouped FP8 kernels take E4M3 operands (E5M2 gradients: use backend='cublas')"
        native = torch.bfloat16
    else:
        if ops.dtype not in (torch.bfloat16, torch.float16):
            return f"the grouped kernels take bf16/fp16 operands, got {ops.dtype}"
        native = ops.dtype
    if ops.kind != "wgrad" and out_dtype != native:
        return f"the grouped {ops.kind} writes {native} (asked for {out_dtype}); use backend='cublas'"
    return None


def grouped_gemm(a, b, *, kind: str, out: Optional[torch.Tensor] = None, accumulate: bool = False,
                 bias=None, out_dtype: Optional[torch.dtype] = None, backend: str = "auto",
                 m_splits: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Grouped products of an MoE layer (member t has M_t tokens):

    * ``"fprop"``: out_t (M_t x N) = a_t (M_t x K) . b_t (N x K)^T (+ bias_t);
      ``a`` tokens, ``b`` the weights.
    * ``"dgrad"``: out_t (M_t x K) = a_t (M_t x N) . b_t (N x K).
    * ``"wgrad"``: out_t (N x K) = a_t (M_t x N)^T . b_t (M_t x K), both grouped
      by tokens; ``accumulate=True`` adds into ``out`` (main_grad style).

    Args:
        a: token-grouped :class:`lpmoe.GroupedTensor` (same-shape or
            varying-first), bf16/fp16/fp32 or FP8 block scaling (1x128).
        b: weights as a same-shape GroupedTensor (FP8: 128x128), a (G, N, K)
            tensor or a list of G (N, K) tensors; for wgrad a token-grouped
            GroupedTensor with the same splits as ``a``.  FP8 roles: fprop
            reads rowwise a and W, dgrad rowwise dy and the columnwise
            (transposed) W, wgrad the columnwise copies of dy and x.
        out: optional output ((rows, cols), or (G, N, K) for wgrad).
        bias: fprop only, (G, N) or a list of (N,) tensors.
        out_dtype: output dtype when ``out`` is None (default: the operands'
            high-precision dtype).
        backend: "auto", "grouped" or "cublas" (see module docs).
        m_splits: optional host copy of the split sizes (saves the cuBLASLt
            backend a host sync; never read by the grouped backend).
    Returns the output tensor (``out`` itself when given).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if tracing():
        return OPS["grouped_gemm"](a, b, kind, out, accumulate, bias, out_dtype, backend, m_splits)
    return grouped_gemm_impl(a, b, kind, out, accumulate, bias, out_dtype, backend, m_splits)


def output_spec(a, b, kind: str, out_dtype, m_splits):
    """(dtype, shape, device) of a fresh output (metadata only: the fake of
    ``lpmoe::grouped_gemm``)."""
    ops = parse_operands(a, b, kind, m_splits)
    _, dtype, shape = _check_out(ops, None, out_dtype, False)
    return dtype, shape, ops.device


def grouped_gemm_impl(a, b, kind: str, out, accumulate: bool, bias, out_dtype, backend: str, m_splits):
    """The implementation behind :func:`grouped_gemm` (and its ops)."""
    ops = parse_operands(a, b, kind, m_splits)
    out, dtype, shape = _check_out(ops, out, out_dtype, accumulate)
    bias = _check_bias(ops, bias, dtype)

    if ops.device.type != "cuda":
        if backend != "auto":
            raise ValueError(f"backend={backend!r} needs CUDA operands; CPU operands run the reference")
        CALLS["reference"] += 1
        return reference_grouped_gemm(ops, out, accumulate, bias, dtype)

    reason = grouped_backend_support(ops, dtype)
    if backend == "auto":
        if reason is None:
            backend = "cublas" if _cublas_is_faster(ops) else "grouped"
        elif ops.m_splits is not None:
            backend = "cublas"
        else:
            raise ValueError(f"no sync-free grouped GEMM for this call ({reason}); pass m_splits=[...] "
                             "or backend='cublas' (which reads the splits on the host)")
    elif backend == "grouped" and reason is not None:
        raise ValueError(f"backend='grouped' cannot run this call: {reason}")

    fresh = out is None
    if fresh:
        out = torch.empty(shape, dtype=dtype, device=ops.device)
    # A fresh output's capacity tail (rows past sum(M_t)) is zeroed; a group
    # without device splits has none.  The grouped kernels' argument launch
    # zeroes it (no launch or host call of its own) unless a bias epilogue runs
    # anyway; the cuBLASLt loop leaves it to the row epilogue.
    tail = fresh and ops.a.first_dims is not None and ops.kind != "wgrad" and ops.rows > 0
    if backend == "grouped":
        CALLS["grouped"] += 1
        _run_grouped(ops, out, accumulate, zero_tail=tail and bias is None)
        tail = tail and bias is not None
    else:
        CALLS["cublas"] += 1
        _run_cublas(ops, out, accumulate)
    if ops.kind != "wgrad" and (bias is not None or tail) and ops.rows > 0:
        from lpmoe._ext import ext

        CALLS["row_epilogue"] += 1
        ext().grouped_row_epilogue(out, bias, ops.a.padded_row_offsets, ops.num_groups, tail)
    return out


def _cublas_is_faster(ops: GemmOperands) -> bool:
    """Host-split heuristic from the H100 benchmarks (see module docs): the
    cuBLASLt loop for FP8 fprop/dgrad of groups averaging >= 2048 tokens.
    FP8 wgrad stays on lpmoe's wgrad kernel, at parity with the loop there
    (0.98-1.06x, median 1.01, benchmarks/bench_fp8_wgrad_configs.py) without
    its launch per expert."""
    if ops.m_splits is None or not ops.fp8 or ops.kind == "wgrad":
        return False
    used = [m for m in ops.m_splits if m]
    if not used or sum(used) / len(used) < 2048:
        return False
    return all(m % 4 == 0 for m in used)


def _run_grouped(ops: GemmOperands, out: torch.Tensor, accumulate: bool, zero_tail: bool = False) -> None:
    from lpmoe._ext import ext

    g, n, k = ops.num_groups, ops.n, ops.k
    a, b = ops.a, ops.b_grouped
    a_scale = b_scale = b_ptrs = None
    b_member = b_scale_member = 0
    if ops.fp8:
        fmt = 2
        if ops.kind == "wgrad":
            a_data, a_scale = a.columnwise_data, a.columnwise_scale_inv
            b_data, b_scale = b.columnwise_data, b.columnwise_scale_inv
        else:
            # each GEMM reads the 128x128 scales that are MN-major for it
            a_data, a_scale = a.rowwise_data, a.scale_inv
            b_data, b_member, b_scale, b_scale_member = fp8_weight_operand(
                ops, "colwise" if ops.kind == "fprop" else "rowwise")
    else:
        fmt = _FMT[ops.dtype]
        a_data = a.rowwise_data
        if ops.kind == "wgrad":
            b_data = b.rowwise_data
        elif b is not None:
            b_data, b_member = b.rowwise_data, n * k
        elif ops.b_stacked is not None:
            b_data, b_member = ops.b_stacked, n * k
        else:
            b_data, b_ptrs = ops.b_list[0], ptr_table(ops)
    target = out
    # wgrad writes fp32, or bf16 directly for bf16/FP8 operands; other output
    # dtypes go through an fp32 buffer.
    direct = out.dtype == torch.float32 or (out.dtype == torch.bfloat16 and (ops.fp8 or ops.dtype == torch.bfloat16))
    if ops.kind == "wgrad" and not direct:
        target = out.float() if accumulate else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    ws = gemm_workspace(ops.device, slot_for_kind(ops.kind))
    setup = setup_workspace(ops.device, g)
    width, cluster, tma_store = ext().grouped_gemm_cutlass(
        _KIND[ops.kind], fmt, a_data, a_scale, b_data, b_ptrs, b_member, b_scale, b_scale_member, target,
        a.padded_row_offsets, g, n, k, 1.0 if accumulate else 0.0, setup, ws,
        *(_fp8_wgrad_config if ops.kind == "wgrad" else _fp8_config), zero_tail)
    key = fp8_kernel_key(width, cluster, ops.kind) if ops.fp8 else f"16bit_rows{width}"
    CALLS[key] = CALLS.get(key, 0) + 1
    if tma_store:  # lpmoe's wgrad kernel wrote bf16 through its TMA-store strips
        CALLS["fp8_wgrad_bf16_tma_store"] = CALLS.get("fp8_wgrad_bf16_tma_store", 0) + 1
    if target is not out:
        out.copy_(target)


def _run_cublas(ops: GemmOperands, out: torch.Tensor, accumulate: bool) -> None:
    from lpmoe._ext import ext

    splits = host_splits(ops)
    g, n, k = ops.num_groups, ops.n, ops.k
    a, b = ops.a, ops.b_grouped
    a_scale = b_tok = b_tok_scale = None
    b_addrs, b_scale_addrs = [], []
    if ops.fp8:
        fmt = 2
        if ops.kind != "wgrad" and any(m % 4 for m in splits):
            raise ValueError("cuBLASLt FP8 block scaling needs every group size to be a multiple of 4 "
                             f"(got {splits}); use backend='grouped'")
        if ops.kind == "wgrad":
            a_data, a_scale = a.columnwise_data, a.columnwise_scale_inv
            b_tok, b_tok_scale = b.columnwise_data, b.columnwise_scale_inv
        else:
            a_data, a_scale = a.rowwise_data, a.scale_inv
            # cuBLASLt's BLK128x128 layout is K-major: the other buffer of each pair
            data, member, scales, smember = fp8_weight_operand(ops, "rowwise" if ops.kind == "fprop" else "colwise")
            b_addrs = [data.data_ptr() + t * member for t in range(g)]
            b_scale_addrs = [scales.data_ptr() + 4 * t * smember for t in range(g)]
    else:
        fmt = _FMT[ops.dtype]
        a_data = a.rowwise_data
        if ops.kind == "wgrad":
            b_tok = b.rowwise_data
        elif b is not None or ops.b_stacked is not None:
            w = b.rowwise_data if b is not None else ops.b_stacked
            b_addrs = [w.data_ptr() + t * n * k * w.element_size() for t in range(g)]
        else:
            b_addrs = [w.data_ptr() for w in ops.b_list]
    ws = gemm_workspace(ops.device, slot_for_kind(ops.kind))
    w_e5m2 = False  # the binding only sees the weights' addresses
    if ops.fp8 and ops.kind != "wgrad":
        w_e5m2 = (b.rowwise_data if ops.kind == "fprop" else b.columnwise_data).dtype == torch.float8_e5m2
    ext().grouped_gemm_cublas(_KIND[ops.kind], fmt, a_data, a_scale, b_addrs, b_scale_addrs, b_tok, b_tok_scale,
                              out, splits, n, k, 1.0 if accumulate else 0.0, ws, w_e5m2)
