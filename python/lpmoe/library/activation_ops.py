"""Custom ops of the fused activation kernels (lpmoe.activation.kernels).

``lpmoe::activation_forward``   act(h) [* probs]: high precision and/or the
                                FP8 block operands of the next GEMM
``lpmoe::activation_backward``  dh (high precision and/or FP8 block), fc1's
                                bias gradient, d probs

A quantized result's metadata (dims and offsets of the splits) is rebuilt
outside the op from the same splits, so the op returns only buffers it
allocated.  Which results exist follows from the arguments, so every list
has a fixed layout.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from lpmoe.activation import kernels
from lpmoe.grouped_tensor import GroupedTensor
from lpmoe.library import specs
from lpmoe.library._define import define
from lpmoe.library.quantize_ops import produced_buffers, with_buffers
from lpmoe.library.routing import OPS

Tensor = torch.Tensor


def _metadata(q, splits: Tensor, rows: int, cols: int, dtype) -> GroupedTensor:
    """Dims and offsets of a quantized activation grouped by ``splits``
    (its buffers are placeholders; the op writes the real ones)."""
    return GroupedTensor.empty(q, splits.numel(), (rows, cols), dtype=dtype, first_dims=splits, device=splits.device)


def _quantized_bufs(res_q, q) -> List[Tensor]:
    return [] if q is None else [getattr(res_q, n) for n in produced_buffers(q)]


# ------------------------------------------------------------------ forward
def _forward_fake(h, spec, probs, splits, write_hp, quantizer):
    act, q = specs.decode(spec), specs.decode(quantizer)
    rows, f = h.shape[0], h.shape[1] // 2 if act.is_glu else h.shape[1]
    out = [torch.empty((rows, f), dtype=h.dtype, device=h.device)] if write_hp else []
    return out + ([] if q is None else _quantized_bufs(_metadata(q, splits, rows, f, h.dtype), q))


@define("activation_forward", _forward_fake)
def _forward(h: Tensor, spec: str, probs: Optional[Tensor], splits: Optional[Tensor], write_hp: bool,
             quantizer: str) -> List[Tensor]:
    q = specs.decode(quantizer)
    res = kernels.forward_impl(h, specs.decode(spec), probs, splits, write_hp=write_hp, quantizer=q)
    return ([res.hp] if write_hp else []) + _quantized_bufs(res.quantized, q)


def forward(h, spec, probs, splits, write_hp: bool, quantizer) -> kernels.ForwardResult:
    write_hp = write_hp or quantizer is None
    res = _forward(h, specs.encode(spec), probs, splits, write_hp, specs.encode(quantizer))
    hp = res[0] if write_hp else None
    qa = None
    if quantizer is not None:
        f = h.shape[1] // 2 if spec.is_glu else h.shape[1]
        qa = with_buffers(_metadata(quantizer, splits, h.shape[0], f, h.dtype), quantizer, res[int(write_hp):])
    return kernels.ForwardResult(hp, qa)


OPS["activation_forward"] = forward


# ----------------------------------------------------------------- backward
def _backward_fake(da, h, spec, probs, splits, dh_hp, dh_quantizer, dbias, dprobs):
    q = specs.decode(dh_quantizer)
    rows, w = h.shape
    out = [torch.empty((rows, w), dtype=h.dtype, device=h.device)] if dh_hp else []
    if q is not None:
        out += _quantized_bufs(_metadata(q, splits, rows, w, h.dtype), q)
    if dbias:
        out.append(torch.empty((splits.numel(), w), dtype=h.dtype, device=h.device))
    if dprobs and probs is not None:
        out.append(torch.empty(probs.shape, dtype=probs.dtype, device=probs.device))
    return out


@define("activation_backward", _backward_fake)
def _backward(da: Tensor, h: Tensor, spec: str, probs: Optional[Tensor], splits: Optional[Tensor], dh_hp: bool,
              dh_quantizer: str, dbias: bool, dprobs: bool) -> List[Tensor]:
    q = specs.decode(dh_quantizer)
    res = kernels.backward_impl(da, h, specs.decode(spec), probs, splits, dh_hp=dh_hp, dh_quantizer=q, dbias=dbias,
                                dprobs=dprobs)
    out = ([res.dh] if dh_hp else []) + _quantized_bufs(res.dh_quantized, q)
    if dbias:
        out.append(res.dbias)
    if dprobs and probs is not None:
        out.append(res.dprobs)
    return out


def backward(da, h, spec, probs, splits, dh_hp: bool, dh_quantizer, dbias: bool, dprobs: bool
             ) -> kernels.BackwardResult:
    res = list(_backward(da, h, specs.encode(spec), probs, splits, dh_hp, specs.encode(dh_quantizer), dbias, dprobs))
    out = kernels.BackwardResult(dh=res.pop(0) if dh_hp else None)
    if dh_quantizer is not None:
        k = len(produced_buffers(dh_quantizer))
        out.dh_quantized = with_buffers(_metadata(dh_quantizer, splits, h.shape[0], h.shape[1], h.dtype),
                                        dh_quantizer, res[:k])
        res = res[k:]
    if dbias:
        out.dbias = res.pop(0)
    if dprobs and probs is not None:
        out.dprobs = res.pop(0)
    return out


OPS["activation_backward"] = backward
