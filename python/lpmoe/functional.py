"""``lpmoe.functional.grouped_linear``: the expert GEMMs of an MoE layer.

    y_t = x_t . W_t^T (+ b_t)        for expert t = 0 .. G-1

``inp`` holds the tokens of all experts as consecutive row blocks
(``m_splits[t]`` rows for expert t, in expert order).

Two ways to give the splits
---------------------------
* **graph-safe path**: ``m_splits`` is an int tensor on the input's CUDA
  device.  Nothing in forward or backward reads it on the host: no sync, so
  the layer can be captured in a CUDA graph and replayed with new routing.
  Checks that need the values (no negatives, sum <= rows) cannot run; bad
  splits are clamped by the kernels (see :func:`lpmoe.grouped_gemm`).
* **host path**: ``m_splits`` is a list of ints or a CPU tensor.  It is
  validated on the host, copied to the device once, and handed to
  :func:`lpmoe.grouped_gemm` (which lets it fall back to cuBLASLt where the
  sync-free kernels do not cover a case, e.g. fp32 or E5M2 gradients).

On the CPU both run lpmoe's fp64 reference GEMMs on the same quantized
operands as the GPU, so CPU results predict GPU numerics.

Capacity tail: rows past ``sum(m_splits)`` belong to no expert.  Their
output rows are 0 and their input-gradient rows are 0.

Recipes (see :mod:`lpmoe.recipe`)
---------------------------------
* none: GEMMs in the input dtype (bf16 / fp16 / fp32; fp32 on CUDA needs
  the host path).
* :class:`~lpmoe.recipe.Float8BlockScaling`: x 1x128, W 128x128, dy 1x128
  FP8 through the grouped FP8 GEMMs; bf16 activations and parameters only
  (the FP8 grouped GEMMs write bf16).  ``Format.HYBRID`` (E5M2 gradients)
  needs the host path on CUDA: the sync-free kernels take E4M3 only, and
  silently changing the gradient format would change the recipe's numerics,
  so the graph-safe path raises instead.
* :class:`~lpmoe.recipe.MXFP8BlockScaling`,
  :class:`~lpmoe.recipe.NVFP4BlockScaling`: **emulated** (Hopper has no
  such tensor cores).  The forward quantizes x and W along K and
  dequantizes them; the backward quantizes dy along N and reuses the saved
  dequantized x and W; every GEMM runs in high precision.  The wgrad
  operands are therefore not re-quantized along the token dim, unlike a
  hardware recipe.  NVFP4 needs every split to be a multiple of 16.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from lpmoe.autocast import get_autocast_recipe
from lpmoe.gemm import grouped_gemm
from lpmoe.grouped_tensor import GroupedTensor
from lpmoe.quantize import group_dequantize, group_quantize, group_quantize_dbias
from lpmoe.recipe import (Float8BlockScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling, Recipe)

__all__ = ["grouped_linear", "WeightCache"]

_HP = (torch.bfloat16, torch.float16, torch.float32)
# Width of the ones operand of the bias-gradient GEMM: the narrowest the
# grouped kernels take (N and K multiples of 16).
_BIAS_ONES_COLS = 16


# --------------------------------------------------------------- weight cache
class WeightCache:
    """FP8 weights of one layer, quantized once and reused across micro-batches.

    ``is_first_microbatch`` (see :func:`grouped_linear`) decides when the
    cache is refreshed.  Inside CUDA graph capture the refresh is recorded as
    an in-place quantization into the cached buffers, gated by
    :attr:`skip_flag`: set it with :meth:`set_skip_update` between replays
    to reuse the cached weights (e.g. later micro-batches of a step).
    """

    def __init__(self):
        self.quantized: Optional[GroupedTensor] = None
        #: float32 device tensor read by the quantize kernel (1.0 = skip writing)
        self.skip_flag: Optional[torch.Tensor] = None

    def clear(self) -> None:
        self.quantized = None
        self.skip_flag = None

    def set_skip_update(self, skip: bool) -> None:
        """Make captured graphs keep (True) or refresh (False) the cached
        weights on their next replays.  Call outside capture."""
        if self.skip_flag is None:
            raise RuntimeError("the weight cache has no skip flag yet: run one eager forward first")
        self.skip_flag.fill_(1.0 if skip else 0.0)

    def usable_for(self, quantizer, num: int, shape: Tuple[int, int], dtype, device) -> bool:
        """The cached tensor holds this format, shape and (at least) these directions."""
        q = self.quantized
        if q is None:
            return False
        cq = q.quantizer
        same_format = cq.copy(rowwise=True, columnwise=True) == quantizer.copy(rowwise=True, columnwise=True)
        directions = (cq.rowwise or not quantizer.rowwise) and (cq.columnwise or not quantizer.columnwise)
        return (same_format and directions and q.num_tensors == num and q.logical_shape == shape
                and q.dtype == dtype and q.device == device)

    def _flag(self, device: torch.device) -> Optional[torch.Tensor]:
        # Made eagerly (never inside capture, where the zero fill would be
        # recorded and undo set_skip_update on every replay).
        if self.skip_flag is None or self.skip_flag.device != device:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            self.skip_flag = torch.zeros(1, dtype=torch.float32, device=device)
        return self.skip_flag


def _stack_weights(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """(G*N, K) weights: the same-shape group layout quantizers take.  A view
    when the weights already sit back to back in one buffer (GroupedLinear's
    parameters do), else a copy."""
    w0 = weights[0]
    n, k = w0.shape
    step = n * k * w0.element_size()
    if all(w.is_contiguous() and w.untyped_storage().data_ptr() == w0.untyped_storage().data_ptr()
           and w.data_ptr() == w0.data_ptr() + i * step for i, w in enumerate(weights)):
        return w0.detach().as_strided((len(weights) * n, k), (k, 1))
    return torch.stack(list(weights)).view(len(weights) * n, k)


def _quantized_weights(weights, quantizer, cache: Optional[WeightCache], is_first_microbatch,
                       capturing: bool) -> GroupedTensor:
    """Quantize the weights per ``is_first_microbatch`` semantics:
    None = quantize now, no caching; True = quantize into the cache;
    False = reuse the cache (quantizing into it if it is missing or unfit)."""
    g = len(weights)
    n, k = weights[0].shape
    if cache is None:
        return group_quantize(_stack_weights(weights), quantizer, num_tensors=g)
    fit = cache.usable_for(quantizer, g, (g * n, k), weights[0].dtype, weights[0].device)
    if capturing:
        if is_first_microbatch is False and fit:
            return cache.quantized  # the graph reads whatever the cache holds at replay
        if fit:  # refresh in place (fixed pointers), skippable at replay time
            group_quantize(_stack_weights(weights), cache.quantized.quantizer, num_tensors=g,
                           output=cache.quantized, noop_flag=cache._flag(weights[0].device))
            return cache.quantized
        cache.quantized = group_quantize(_stack_weights(weights), quantizer, num_tensors=g)
        return cache.quantized
    cache._flag(weights[0].device)  # exists before any capture
    if is_first_microbatch is None:
        return group_quantize(_stack_weights(weights), quantizer, num_tensors=g)
    if is_first_microbatch is False and fit:
        return cache.quantized
    if fit:  # in place: pointers stay stable for graphs captured later
        return group_quantize(_stack_weights(weights), cache.quantized.quantizer, num_tensors=g,
                              output=cache.quantized)
    cache.quantized = group_quantize(_stack_weights(weights), quantizer, num_tensors=g)
    return cache.quantized


# ------------------------------------------------------------------- helpers
def _tokens(x2d: torch.Tensor, splits: torch.Tensor) -> GroupedTensor:
    """Wrap (rows, C) token rows as an expert-grouped tensor (no copy)."""
    return GroupedTensor(num_tensors=splits.numel(), logical_shape=tuple(x2d.shape), dtype=x2d.dtype,
                         rowwise_data=x2d.view(-1), first_dims=splits)


def _dequantized(qg: GroupedTensor, dtype: torch.dtype) -> torch.Tensor:
    """(rows, K) high-precision values of a quantized group (rowwise copy)."""
    return group_dequantize(qg, dtype).rowwise_data.view(qg.logical_shape)


def _fake_quantize(x2d: torch.Tensor, quantizer, splits: Optional[torch.Tensor], num: int) -> torch.Tensor:
    """Quantize then dequantize (emulated formats).  Rows past the splits
    are left uninitialised: no GEMM reads them."""
    qg = group_quantize(x2d, quantizer, num_tensors=num, first_dims=splits)
    return _dequantized(qg, x2d.dtype)


def _bias_grad(dy: torch.Tensor, splits: torch.Tensor, host: Optional[List[int]]) -> torch.Tensor:
    """(G, N) per-expert column sums of dy, deterministic and sync-free: a
    wgrad GEMM against a ones operand (fixed-order fp32 accumulation; no
    atomics, no host read of the splits)."""
    ones = torch.ones((dy.shape[0], _BIAS_ONES_COLS), dtype=dy.dtype, device=dy.device)
    sums = grouped_gemm(_tokens(dy, splits), _tokens(ones, splits), kind="wgrad", out_dtype=torch.float32,
                        m_splits=host)
    return sums[:, :, 0]


# ---------------------------------------------------------------- validation
@dataclass
class _Splits:
    device: torch.Tensor          # int64, on the input's device
    host: Optional[List[int]]     # None on the graph-safe path


def _parse_splits(m_splits, num: int, rows: int, device: torch.device) -> _Splits:
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"m_splits must hold int32/int64 values, got {m_splits.dtype}")
        if m_splits.dim() != 1 or m_splits.numel() != num:
            raise ValueError(f"m_splits must have one entry per expert ({num}), got shape {tuple(m_splits.shape)}")
        if m_splits.device.type != "cpu":
            if m_splits.device != device:
                raise ValueError(f"m_splits is on {m_splits.device} but the input is on {device}")
            return _Splits(m_splits.to(torch.int64), None)  # graph-safe: never read on the host
        host = [int(v) for v in m_splits.tolist()]  # CPU memory: no device sync
    elif isinstance(m_splits, (list, tuple)):
        bad = [v for v in m_splits if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
        if bad:
            raise TypeError(f"m_splits must be ints, got {type(bad[0]).__name__} {bad[0]!r}")
        if len(m_splits) != num:
            raise ValueError(f"m_splits has {len(m_splits)} entries, expected one per expert ({num})")
        host = [int(v) for v in m_splits]
    else:
        raise TypeError(f"m_splits must be a list of ints or an int tensor, got {type(m_splits).__name__}")
    if any(v < 0 for v in host):
        raise ValueError(f"m_splits must be non-negative, got {host}")
    if sum(host) > rows:
        raise ValueError(f"sum(m_splits) = {sum(host)} exceeds the input's {rows} token rows")
    dev = torch.tensor(host, dtype=torch.int64)
    return _Splits(dev if device.type == "cpu" else dev.to(device), host)


def _check_params(inp, weights, biases) -> Tuple[int, int, int]:
    if isinstance(inp, GroupedTensor):
        raise TypeError("inp must be a high-precision torch.Tensor, not a GroupedTensor; grouped_linear groups "
                        "and quantizes it itself")
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"inp must be a torch.Tensor, got {type(inp).__name__} (quantized inputs are not "
                        "supported: pass the high-precision tensor)")
    if inp.dtype not in _HP:
        raise TypeError(f"inp must be bf16, fp16 or fp32 (quantized inputs are not supported), got {inp.dtype}")
    if inp.dim() < 2:
        raise ValueError(f"inp must be (tokens, in_features) or (..., in_features), got shape {tuple(inp.shape)}")
    if not isinstance(weights, (list, tuple)) or len(weights) == 0:
        raise TypeError("weights must be a non-empty list of (out_features, in_features) tensors")
    w0 = weights[0]
    for i, w in enumerate(weights):
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape != w0.shape:
            raise ValueError(f"weights[{i}] must be a 2-D tensor of shape {tuple(w0.shape)}")
        if w.dtype != inp.dtype or w.device != inp.device:
            raise TypeError(f"weights[{i}] is {w.dtype} on {w.device}; expected the input's {inp.dtype} on "
                            f"{inp.device}")
    n, k = w0.shape
    if inp.shape[-1] != k:
        raise ValueError(f"inp's last dim is {inp.shape[-1]} but the weights' in_features is {k}")
    if biases is not None:
        if not isinstance(biases, (list, tuple)) or len(biases) != len(weights):
            raise TypeError(f"biases must be None or a list of {len(weights)} (out_features,) tensors")
        for i, b in enumerate(biases):
            if not isinstance(b, torch.Tensor) or tuple(b.shape) != (n,):
                raise ValueError(f"biases[{i}] must have shape ({n},)")
            if b.dtype != inp.dtype or b.device != inp.device:
                raise TypeError(f"biases[{i}] is {b.dtype} on {b.device}; expected {inp.dtype} on {inp.device}")
    return len(weights), n, k


def _check_main_grads(weights) -> None:
    """fuse_wgrad_accumulation: when any weight trains, every weight needs an
    fp32 ``main_grad`` of its shape on its device (one grouped product adds
    into all of them; checked before any GPU work)."""
    if not any(w.requires_grad for w in weights):
        return
    for i, w in enumerate(weights):
        mg = getattr(w, "main_grad", None)
        if not isinstance(mg, torch.Tensor):
            raise AttributeError(f"fuse_wgrad_accumulation=True needs weights[{i}].main_grad (an fp32 tensor of "
                                 f"shape {tuple(w.shape)} the weight gradient is added into)")
        if mg.dtype != torch.float32 or mg.shape != w.shape or mg.device != w.device:
            raise ValueError(f"weights[{i}].main_grad must be fp32 {tuple(w.shape)} on {w.device}, got "
                             f"{mg.dtype} {tuple(mg.shape)} on {mg.device}")


def _stacked_main_grads(weights) -> Optional[torch.Tensor]:
    """The G main_grads as one (G, N, K) view when they are consecutive,
    contiguous pieces of one buffer (as a training framework's flat gradient
    buffer lays them out), else None."""
    mgs = [w.main_grad for w in weights]
    m0 = mgs[0]
    step = m0.numel()
    for i, m in enumerate(mgs):
        if (not m.is_contiguous() or m.untyped_storage().data_ptr() != m0.untyped_storage().data_ptr()
                or m.storage_offset() != m0.storage_offset() + i * step):
            return None
    n, k = m0.shape
    return m0.as_strided((len(mgs), n, k), (step, k, 1))


def _accumulate_main_grads(weights, wgrad_into) -> None:
    """Adds the weight gradients into the weights' main_grads (fp32): in the
    wgrad GEMM's epilogue when the main_grads form one buffer, else through
    one fp32 product and G adds.  On the GPU both add the same fp32 product
    with one rounding (bitwise equal); the CPU reference rounds its fp64
    product only once in the fused case."""
    stacked = _stacked_main_grads(weights)
    if stacked is not None:
        wgrad_into(stacked, True)
        return
    tmp = wgrad_into(None, False)
    for w, t in zip(weights, tmp.unbind(0)):
        w.main_grad.add_(t)


def _fused_wgrad_results(weights) -> List[Optional[torch.Tensor]]:
    """What autograd gets for the weights once their gradient went into
    main_grad (TransformerEngine's convention, which Megatron relies on): a
    placeholder tensor with ``grad_added_to_main_grad`` set, where the weight
    has that attribute (so its gradient hooks still fire), else None."""
    out: List[Optional[torch.Tensor]] = []
    for w in weights:
        if hasattr(w, "grad_added_to_main_grad"):
            w.grad_added_to_main_grad = True
            make = torch.zeros if getattr(w, "zero_out_wgrad", False) else torch.empty
            out.append(make(w.shape, dtype=w.dtype, device=w.device))
        else:
            out.append(None)
    return out


def _cuda_major(device: torch.device) -> int:
    """Compute-capability major of a CUDA device (host query, no sync)."""
    return torch.cuda.get_device_capability(device)[0]


def _check_recipe(recipe, dtype, n: int, k: int, splits: _Splits, cuda: bool,
                  device: Optional[torch.device] = None) -> None:
    graph_safe = splits.host is None
    if cuda and isinstance(recipe, Float8BlockScaling) and _cuda_major(device) != 9:
        raise RuntimeError(f"Float8BlockScaling needs Hopper (sm_90): its 1x128/128x128 FP8 GEMMs exist only "
                           f"there (this GPU is sm_{_cuda_major(device)}x). On Blackwell the native FP8 "
                           "recipe is MXFP8 (TransformerEngine); in lpmoe use MXFP8BlockScaling (numerics "
                           "emulation) with host m_splits, or no recipe.")
    if recipe is not None and not isinstance(recipe, (Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling)):
        raise TypeError(f"unsupported recipe {type(recipe).__name__}; use Float8BlockScaling, MXFP8BlockScaling "
                        "or NVFP4BlockScaling from lpmoe.recipe")
    if recipe is not None and (n % 16 or k % 16):
        raise ValueError(f"{type(recipe).__name__} needs in_features and out_features to be multiples of 16, "
                         f"got in={k}, out={n}")
    if isinstance(recipe, Float8BlockScaling):
        if not recipe.is_default_layout:
            raise NotImplementedError("lpmoe's grouped FP8 GEMMs take x 1x128, W 128x128, grad 1x128 "
                                      "(x_block_dim=1, w_block_dim=2, grad_block_dim=1); got "
                                      f"{recipe.x_block_dim}/{recipe.w_block_dim}/{recipe.grad_block_dim}")
        if dtype != torch.bfloat16:
            raise TypeError(f"Float8BlockScaling needs bf16 activations and parameters (the FP8 grouped GEMMs "
                            f"write bf16), got {dtype}")
        if cuda and graph_safe and recipe.fp8_format is Format.HYBRID and recipe.backward_override is None:
            raise ValueError("Float8BlockScaling(Format.HYBRID) has E5M2 gradients, which the sync-free grouped "
                             "GEMMs do not take; pass m_splits as a list (host path, cuBLASLt) or use Format.E4M3")
    if isinstance(recipe, NVFP4BlockScaling) and splits.host is not None and any(v % 16 for v in splits.host):
        raise ValueError(f"NVFP4BlockScaling needs every m_splits entry to be a multiple of 16, got {splits.host}")
    if cuda and graph_safe:
        if dtype == torch.float32:
            raise TypeError("fp32 on the graph-safe path (device m_splits) is not supported: the sync-free "
                            "grouped GEMMs take bf16/fp16; pass m_splits as a list (host path) or use bf16")
        if n % 16 or k % 16:
            raise ValueError(f"the graph-safe path needs in_features and out_features to be multiples of 16 "
                             f"(sync-free grouped GEMMs), got in={k}, out={n}")


# ------------------------------------------------------------ autograd core
@dataclass
class _Config:
    recipe: Optional[Recipe]
    splits: _Splits
    num: int
    has_bias: bool
    weight_cache: Optional[WeightCache]
    is_first_microbatch: Optional[bool]
    grad_enabled: bool  # read at call time: Function.forward always runs with grad disabled
    fuse_wgrad_accumulation: bool = False


def _mode(recipe) -> str:
    if recipe is None:
        return "hp"
    return "fp8" if isinstance(recipe, Float8BlockScaling) else "emulated"


def _save(ctx, x_bwd, w_bwd) -> None:
    """Save wgrad's token operand and dgrad's weight operand, each a tensor,
    a list of tensors, a quantized GroupedTensor or None.  Tensors go through
    save_for_backward, so autograd catches in-place changes (e.g. an
    optimizer step) before the backward; GroupedTensors are internal to this
    call and are kept as ctx attributes."""
    tensors, layout = [], []
    for obj in (x_bwd, w_bwd):
        if isinstance(obj, torch.Tensor):
            layout.append(("tensor", 1))
            tensors.append(obj)
        elif isinstance(obj, list):
            layout.append(("list", len(obj)))
            tensors += obj
        else:
            layout.append(("object", obj))
    ctx.save_for_backward(*tensors)
    ctx.saved_objects = layout


def _saved(ctx):
    """(x_bwd, w_bwd) as given to :func:`_save`."""
    tensors, out, i = ctx.saved_tensors, [], 0
    for kind, v in ctx.saved_objects:
        if kind == "object":
            out.append(v)
        elif kind == "tensor":
            out.append(tensors[i])
            i += 1
        else:
            out.append(list(tensors[i:i + v]))
            i += v
    return out


def _wgrad(ctx, run) -> Optional[torch.Tensor]:
    """``run(out, accumulate)`` is the layer's wgrad GEMM.  Plain: returns
    the (G, N, K) gradients.  fuse_wgrad_accumulation: adds them into the
    weights' main_grads and returns None."""
    if ctx.weights is None:
        return run(None, False)
    _accumulate_main_grads(ctx.weights, run)
    return None


class _GroupedLinear(torch.autograd.Function):
    """Forward saves wgrad's token operand and dgrad's weight operand in the
    form the backward GEMMs take (per recipe mode and backward_override)."""

    @staticmethod
    def forward(ctx, x2d, cfg: _Config, *params):
        num, splits, recipe = cfg.num, cfg.splits, cfg.recipe
        weights = list(params[:num])
        biases = list(params[num:]) if cfg.has_bias else None
        # needs_input_grad reflects requires_grad only, not torch.no_grad().
        need = [cfg.grad_enabled and r for r in ctx.needs_input_grad]
        need_dgrad = need[0]
        need_wgrad = any(need[2:2 + num])
        need_dbias = cfg.has_bias and any(need[2 + num:])
        mode = _mode(recipe)
        override = None if recipe is None else recipe.backward_override
        quantized_bwd = mode != "hp" and override is None
        host = splits.host
        n, k = weights[0].shape

        if mode == "hp":
            out = grouped_gemm(_tokens(x2d, splits.device), weights, kind="fprop", bias=biases, m_splits=host)
            x_bwd, w_bwd = x2d, weights
        elif mode == "fp8":
            q_x = recipe.quantizer("input", rowwise=True, columnwise=need_wgrad and quantized_bwd)
            # The cache keeps the transposed copy whenever grads may be asked
            # for, so micro-batches with and without dgrad share one cache.
            q_w = recipe.quantizer("weight", rowwise=True, columnwise=quantized_bwd and cfg.grad_enabled)
            capturing = x2d.is_cuda and torch.cuda.is_current_stream_capturing()
            qx = group_quantize(x2d, q_x, num_tensors=num, first_dims=splits.device)
            qw = _quantized_weights(weights, q_w, cfg.weight_cache, cfg.is_first_microbatch, capturing)
            out = grouped_gemm(qx, qw, kind="fprop", bias=biases, m_splits=host)
            if override == "high_precision":
                x_bwd, w_bwd = x2d, weights
            elif override == "dequantized":
                x_bwd, w_bwd = qx, qw  # dequantized in backward, only if needed
            else:
                x_bwd = qx.direction_view(columnwise=True) if need_wgrad else None  # wgrad reads only this
                w_bwd = qw
        else:
            x_hat = _fake_quantize(x2d, recipe.quantizer("input", rowwise=True, columnwise=False),
                                   splits.device, num)
            w_hat = _fake_quantize(_stack_weights(weights), recipe.quantizer("weight", rowwise=True,
                                                                               columnwise=False), None, num)
            w_hat = w_hat.view(num, n, k)
            out = grouped_gemm(_tokens(x_hat, splits.device), w_hat, kind="fprop", bias=biases, m_splits=host)
            x_bwd, w_bwd = (x2d, weights) if override == "high_precision" else (x_hat, w_hat)

        ctx.cfg = cfg
        ctx.weights = weights if cfg.fuse_wgrad_accumulation else None  # their main_grads, in backward
        ctx.mode, ctx.quantized_bwd = mode, quantized_bwd
        _save(ctx, x_bwd if need_wgrad else None, w_bwd if need_dgrad else None)
        ctx.flags = (need_dgrad, need_wgrad, need_dbias)
        ctx.shape = (x2d.shape[0], n, k)
        ctx.dtype = x2d.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        cfg = ctx.cfg
        need_dgrad, need_wgrad, need_dbias = ctx.flags
        num, splits, host = cfg.num, cfg.splits, cfg.splits.host
        dy = grad_out.contiguous()  # e.g. an expanded (stride-0) grad of .sum()
        dgrad = wgrad = dbias = None
        x_b, w_b = _saved(ctx)

        if ctx.mode == "fp8" and ctx.quantized_bwd:
            q_dy = cfg.recipe.quantizer("grad", rowwise=need_dgrad, columnwise=need_wgrad)
            qdy = None
            if need_dgrad and need_dbias:
                qdy, dbias = group_quantize_dbias(dy, q_dy, num_tensors=num, first_dims=splits.device)
            elif need_dgrad or need_wgrad:
                qdy = group_quantize(dy, q_dy, num_tensors=num, first_dims=splits.device)
            if need_dgrad:
                dgrad = grouped_gemm(qdy, w_b, kind="dgrad", m_splits=host)
            if need_wgrad:
                wgrad = _wgrad(ctx, lambda out, acc: grouped_gemm(
                    qdy, x_b, kind="wgrad", out=out, accumulate=acc,
                    out_dtype=None if out is not None else (torch.float32 if ctx.weights else ctx.dtype),
                    m_splits=host))
        else:
            if isinstance(x_b, GroupedTensor):  # "dequantized" FP8: back to high precision
                x_b = _dequantized(x_b, ctx.dtype)
            if isinstance(w_b, GroupedTensor):
                _, n, k = ctx.shape
                w_b = _dequantized(w_b, ctx.dtype).view(num, n, k)
            dy_q = dy
            if ctx.mode == "emulated" and ctx.quantized_bwd and (need_dgrad or need_wgrad):
                q_dy = cfg.recipe.quantizer("grad", rowwise=True, columnwise=False)
                dy_q = _fake_quantize(dy, q_dy, splits.device, num)
            dyg = _tokens(dy_q, splits.device)
            if need_dgrad:
                dgrad = grouped_gemm(dyg, w_b, kind="dgrad", m_splits=host)
            if need_wgrad:
                xg = _tokens(x_b, splits.device)
                wgrad = _wgrad(ctx, lambda out, acc: grouped_gemm(
                    dyg, xg, kind="wgrad", out=out, accumulate=acc,
                    out_dtype=None if out is not None else (torch.float32 if ctx.weights else ctx.dtype),
                    m_splits=host))
        if need_dbias and dbias is None:
            dbias = _bias_grad(dy, splits.device, host)

        if ctx.weights is not None and need_wgrad:
            w_grads = _fused_wgrad_results(ctx.weights)
        else:
            w_grads = [None] * num if wgrad is None else list(wgrad.to(ctx.dtype).unbind(0))
        grads = [dgrad, None] + w_grads
        if cfg.has_bias:
            grads += [None] * num if dbias is None else list(dbias.to(ctx.dtype).unbind(0))
        ctx.saved_objects = ctx.weights = None  # free the saved operands early
        return tuple(grads)


# ------------------------------------------------------------------ public
def grouped_linear(inp: torch.Tensor, m_splits, weights: Sequence[torch.Tensor],
                   biases: Optional[Sequence[torch.Tensor]] = None, recipe: Optional[Recipe] = None, *,
                   weight_cache: Optional[WeightCache] = None,
                   is_first_microbatch: Optional[bool] = None,
                   fuse_wgrad_accumulation: bool = False) -> torch.Tensor:
    """Grouped linear layer: rows of expert t (in order) times ``W_t^T`` (+ ``b_t``).

    Args:
        inp: (tokens, in_features) or (..., in_features), bf16/fp16/fp32,
            grouped by expert; rows past ``sum(m_splits)`` are a capacity
            tail (output and input-gradient rows there are 0).
        m_splits: tokens per expert: an int tensor on the input's CUDA device
            (graph-safe, never read on the host), or a list of ints / a CPU
            int tensor (host path; validated).  See the module docstring.
        weights: G tensors (out_features, in_features), the input's dtype.
        biases: None or G tensors (out_features,).
        recipe: an :mod:`lpmoe.recipe` recipe; None = the active
            :func:`lpmoe.autocast` recipe (or none: input-dtype GEMMs).  To
            force high precision inside an autocast block, nest
            ``lpmoe.autocast(enabled=False)``.
        weight_cache: a :class:`WeightCache` (layers own one) reused for FP8
            block weights across calls (emulated recipes quantize the
            weights on every call).
        is_first_microbatch: FP8 weight caching.  None: quantize the weights
            on every call, no caching.  True: quantize into ``weight_cache``.
            False: reuse ``weight_cache`` (weights unchanged since the last
            True call, e.g. later micro-batches of a step).
        fuse_wgrad_accumulation: add the weight gradients into each
            weight's fp32 ``main_grad`` (Megatron-style) instead of returning
            them: in the wgrad GEMM's epilogue when the main_grads are
            consecutive pieces of one buffer, else through one fp32 product
            and an add per expert.  As in TransformerEngine, autograd then
            gets a placeholder gradient (and ``grad_added_to_main_grad`` is
            set) for weights that have that attribute, None for the others.
    Returns (..., out_features) in the input's dtype.

    Errors are raised before any GPU work.  Quantized inputs (GroupedTensor,
    FP8 tensors) raise TypeError: pass the high-precision activations.
    """
    g, n, k = _check_params(inp, weights, biases)
    if recipe is None:
        recipe = get_autocast_recipe()
    x2d = inp.reshape(-1, k)
    splits = _parse_splits(m_splits, g, x2d.shape[0], inp.device)
    _check_recipe(recipe, inp.dtype, n, k, splits, inp.is_cuda, inp.device)
    if is_first_microbatch not in (None, True, False):
        raise TypeError(f"is_first_microbatch must be None, True or False, got {is_first_microbatch!r}")
    if is_first_microbatch is not None and weight_cache is None:
        raise ValueError("is_first_microbatch needs a weight_cache to keep the quantized weights in")
    if weight_cache is not None and not isinstance(weight_cache, WeightCache):
        raise TypeError(f"weight_cache must be an lpmoe.functional.WeightCache, got {type(weight_cache).__name__}")
    if not isinstance(fuse_wgrad_accumulation, bool):
        raise TypeError(f"fuse_wgrad_accumulation must be a bool, got {fuse_wgrad_accumulation!r}")
    if fuse_wgrad_accumulation and torch.is_grad_enabled():
        _check_main_grads(weights)
    cfg = _Config(recipe, splits, g, biases is not None, weight_cache, is_first_microbatch,
                  torch.is_grad_enabled(), fuse_wgrad_accumulation)
    params = list(weights) + (list(biases) if biases is not None else [])
    out = _GroupedLinear.apply(x2d.contiguous(), cfg, *params)
    return out.view(*inp.shape[:-1], n)
