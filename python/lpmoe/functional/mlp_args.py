"""The arguments of lpmoe.functional.grouped_mlp that belong to the MLP:
its per-layer parameters (:class:`LayerParams`) and their checks (the
checks shared with grouped_linear are lpmoe.functional.checks)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lpmoe.functional.checks import check_main_grads, check_params
from lpmoe.functional.params import Params
from lpmoe.functional.weights import WeightCache

__all__ = ["LayerParams", "check_probs", "check_layer", "check_fc2", "check_options"]


@dataclass
class LayerParams:
    """One grouped linear layer of the MLP: G weights (out, in) and optional
    G biases, or one stacked (G, out, in) weight and optional (G, out) bias
    (lpmoe.functional.params), and the options of
    :func:`lpmoe.functional.grouped_linear` (``save_original_input`` is
    taken by fc1 only: fc2's input is made inside the MLP)."""
    weights: Params
    biases: Optional[Params] = None
    weight_cache: Optional[WeightCache] = None
    fuse_wgrad_accumulation: bool = False
    save_original_input: bool = False


def check_probs(probs, inp: torch.Tensor, lead: tuple) -> Optional[torch.Tensor]:
    if probs is None:
        return None
    if not isinstance(probs, torch.Tensor) or tuple(probs.shape) not in (lead, lead + (1,)):
        got = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise ValueError(f"probs must have one value per token row, shape {lead}, got {got}")
    if probs.dtype not in (torch.float32, torch.bfloat16, torch.float16) or probs.device != inp.device:
        raise TypeError(f"probs must be fp32/bf16/fp16 on {inp.device}, got {probs.dtype} on {probs.device}")
    return probs.reshape(-1)


def check_layer(params: LayerParams, name: str):
    if not isinstance(params, LayerParams):
        raise TypeError(f"{name} must be an lpmoe.functional.LayerParams, got {type(params).__name__}")
    if params.weight_cache is not None and not isinstance(params.weight_cache, WeightCache):
        raise TypeError(f"{name}.weight_cache must be an lpmoe.functional.WeightCache, got "
                        f"{type(params.weight_cache).__name__}")
    for opt in ("fuse_wgrad_accumulation", "save_original_input"):
        if not isinstance(getattr(params, opt), bool):
            raise TypeError(f"{name}.{opt} must be a bool, got {getattr(params, opt)!r}")
    return params


def check_fc2(inp, fc2: LayerParams, g: int, hidden: int, ffn: int, param_dtype=None) -> None:
    """fc2's parameters against fc1's sizes; their dtype is fc1's
    (``param_dtype``, lpmoe.functional.checks.check_params)."""
    ws = fc2.weights
    if isinstance(ws, torch.Tensor):
        if tuple(ws.shape) != (g, hidden, ffn):
            raise ValueError(f"fc2.weights as one tensor must be (G={g}, hidden={hidden}, ffn={ffn}), got "
                             f"{tuple(ws.shape)}")
    else:
        if not isinstance(ws, (list, tuple)) or len(ws) != g:
            raise ValueError(f"fc2.weights must be a list of {g} tensors (one per expert), got "
                             f"{len(ws) if isinstance(ws, (list, tuple)) else type(ws).__name__}")
        if not isinstance(ws[0], torch.Tensor) or tuple(ws[0].shape) != (hidden, ffn):
            raise ValueError(f"fc2.weights must be (hidden={hidden}, ffn={ffn}) per expert, got "
                             f"{tuple(ws[0].shape) if isinstance(ws[0], torch.Tensor) else type(ws[0]).__name__}")
    check_params(inp.new_empty((0, ffn)), ws, fc2.biases, param_dtype)


def check_options(fc1: LayerParams, fc2: LayerParams, is_first_microbatch) -> None:
    """The layers' options against each other and the call's."""
    if fc2.save_original_input:
        raise ValueError("fc2.save_original_input: fc2's input is made inside the MLP (the fused activation's "
                         "output), so only fc1 can keep its input")
    if is_first_microbatch not in (None, True, False):
        raise TypeError(f"is_first_microbatch must be None, True or False, got {is_first_microbatch!r}")
    if is_first_microbatch is not None and (fc1.weight_cache is None or fc2.weight_cache is None):
        raise ValueError("is_first_microbatch needs both layers' weight caches to keep the quantized weights in")
    if torch.is_grad_enabled():
        for lp in (fc1, fc2):
            if lp.fuse_wgrad_accumulation:
                check_main_grads(lp.weights)
