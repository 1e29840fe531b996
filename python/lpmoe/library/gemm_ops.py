"""Custom ops of lpmoe.grouped_gemm.

``lpmoe::grouped_gemm``      fresh output (every kind, backend and format)
``lpmoe::grouped_gemm_out``  into the caller's ``out`` (declared mutated),
                             ``accumulate=True`` adds into it (wgrad)

Operands cross the boundary as packed GroupedTensors; the weight operand
may also be a list of (N, K) tensors or one (G, N, K) tensor ("list" /
"stacked" in ``b_meta``).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from lpmoe.gemm import api
from lpmoe.grouped_tensor import GroupedTensor
from lpmoe.library._define import define
from lpmoe.library.grouped_codec import pack, unpack
from lpmoe.library.routing import OPS

Tensor = torch.Tensor
_NO_FIELDS: List[Optional[Tensor]] = []


def _pack_b(b) -> Tuple[List[Optional[Tensor]], str, List[Tensor]]:
    if isinstance(b, GroupedTensor):
        fields, meta = pack(b)
        return fields, meta, []
    if isinstance(b, torch.Tensor):
        return _NO_FIELDS, "stacked", [b]
    return _NO_FIELDS, "list", list(b)


def _unpack_b(fields, meta: str, tensors: List[Tensor]):
    if meta == "stacked":
        return tensors[0]
    if meta == "list":
        return tensors
    return unpack(fields, meta)


def _fresh_fake(a_fields, a_meta, b_fields, b_meta, b_tensors, kind, bias, out_dtype, backend, m_splits):
    dtype, shape, dev = api.output_spec(unpack(a_fields, a_meta), _unpack_b(b_fields, b_meta, b_tensors), kind,
                                        out_dtype, m_splits)
    return torch.empty(shape, dtype=dtype, device=dev)


@define("grouped_gemm", _fresh_fake)
def _grouped_gemm(a_fields: List[Optional[Tensor]], a_meta: str, b_fields: List[Optional[Tensor]], b_meta: str,
                  b_tensors: List[Tensor], kind: str, bias: Optional[Tensor], out_dtype: Optional[torch.dtype],
                  backend: str, m_splits: Optional[List[int]]) -> Tensor:
    return api.grouped_gemm_impl(unpack(a_fields, a_meta), _unpack_b(b_fields, b_meta, b_tensors), kind, None, False,
                                 bias, out_dtype, backend, m_splits)


def _out_fake(a_fields, a_meta, b_fields, b_meta, b_tensors, kind, out, accumulate, bias, backend, m_splits):
    return None


@define("grouped_gemm_out", _out_fake, mutates_args=("out",))
def _grouped_gemm_out(a_fields: List[Optional[Tensor]], a_meta: str, b_fields: List[Optional[Tensor]], b_meta: str,
                      b_tensors: List[Tensor], kind: str, out: Tensor, accumulate: bool, bias: Optional[Tensor],
                      backend: str, m_splits: Optional[List[int]]) -> None:
    api.grouped_gemm_impl(unpack(a_fields, a_meta), _unpack_b(b_fields, b_meta, b_tensors), kind, out, accumulate,
                          bias, None, backend, m_splits)


def grouped_gemm(a, b, kind, out, accumulate, bias, out_dtype, backend, m_splits):
    """Adapter of :func:`lpmoe.gemm.api.grouped_gemm_impl` through the ops."""
    if isinstance(bias, (list, tuple)):
        bias = torch.stack([t.reshape(-1) for t in bias])
    a_fields, a_meta = pack(a)
    b_fields, b_meta, b_tensors = _pack_b(b)
    splits = None if m_splits is None else [int(v) for v in m_splits]
    if out is None:
        return _grouped_gemm(a_fields, a_meta, b_fields, b_meta, b_tensors, kind, bias, out_dtype, backend, splits)
    if out_dtype is not None and out_dtype != out.dtype:
        raise ValueError(f"out_dtype={out_dtype} disagrees with out.dtype={out.dtype}")
    _grouped_gemm_out(a_fields, a_meta, b_fields, b_meta, b_tensors, kind, out, accumulate, bias, backend, splits)
    return out


OPS["grouped_gemm"] = grouped_gemm
