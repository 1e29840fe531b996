"""Argument checks of the grouped layers, all before any GPU work."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from lpmoe._device import cuda_major
from lpmoe.grouped_tensor import GroupedTensor
from lpmoe.recipe import Float8BlockScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling

__all__ = ["check_params", "check_recipe", "check_main_grads"]

_HP = (torch.bfloat16, torch.float16, torch.float32)


def check_params(inp, weights, biases, param_dtype: Optional[torch.dtype] = None) -> Tuple[int, int, int]:
    """(G, N, K) of valid parameters.  The weights and biases must have
    ``param_dtype`` (default: the input's dtype; under torch.autocast the
    parameters' own, lpmoe.functional.precision) and the input's device."""
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
    pd = inp.dtype if param_dtype is None else param_dtype
    if isinstance(weights, torch.Tensor):
        return _check_stacked(inp, weights, biases, pd)
    if not isinstance(weights, (list, tuple)) or len(weights) == 0:
        raise TypeError("weights must be a non-empty list of (out_features, in_features) tensors or one "
                        "(num_gemms, out_features, in_features) tensor")
    w0 = weights[0]
    for i, w in enumerate(weights):
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape != w0.shape:
            raise ValueError(f"weights[{i}] must be a 2-D tensor of shape {tuple(w0.shape)}")
        if w.dtype != pd or w.device != inp.device:
            raise TypeError(f"weights[{i}] is {w.dtype} on {w.device}; expected {_expected(inp, pd)}")
    n, k = w0.shape
    if inp.shape[-1] != k:
        raise ValueError(f"inp's last dim is {inp.shape[-1]} but the weights' in_features is {k}")
    if biases is not None:
        if not isinstance(biases, (list, tuple)) or len(biases) != len(weights):
            raise TypeError(f"biases must be None or a list of {len(weights)} (out_features,) tensors (per-expert "
                            "weights take per-expert biases)")
        for i, b in enumerate(biases):
            if not isinstance(b, torch.Tensor) or tuple(b.shape) != (n,):
                raise ValueError(f"biases[{i}] must have shape ({n},)")
            if b.dtype != pd or b.device != inp.device:
                raise TypeError(f"biases[{i}] is {b.dtype} on {b.device}; expected {_expected(inp, pd)}")
    return len(weights), n, k


def _expected(inp, pd: torch.dtype) -> str:
    if pd == inp.dtype:
        return (f"the input's {pd} on {inp.device} (or run under torch.autocast for parameters in another "
                "dtype)")
    return f"the weights' {pd} on {inp.device}"


def _check_stacked(inp, weight: torch.Tensor, bias, pd: torch.dtype) -> Tuple[int, int, int]:
    """One (G, N, K) weight and optionally one (G, N) bias."""
    if weight.dim() != 3 or weight.shape[0] == 0:
        raise ValueError(f"weights as one tensor must be (num_gemms, out_features, in_features), got shape "
                         f"{tuple(weight.shape)}")
    if weight.dtype != pd or weight.device != inp.device:
        raise TypeError(f"weights is {weight.dtype} on {weight.device}; expected {_expected(inp, pd)}")
    if not weight.is_contiguous():
        raise ValueError("weights as one (num_gemms, out_features, in_features) tensor must be contiguous")
    g, n, k = weight.shape
    if inp.shape[-1] != k:
        raise ValueError(f"inp's last dim is {inp.shape[-1]} but the weights' in_features is {k}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (g, n):
            got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"biases with a stacked weight must be one ({g}, {n}) tensor, got {got}")
        if bias.dtype != pd or bias.device != inp.device:
            raise TypeError(f"biases is {bias.dtype} on {bias.device}; expected {_expected(inp, pd)}")
    return g, n, k


def check_main_grads(weights) -> None:
    """fuse_wgrad_accumulation: when any weight trains, every weight (or the
    one stacked weight) needs an fp32 ``main_grad`` of its shape on its
    device (one grouped product adds into all of them; checked before any
    GPU work)."""
    stacked = isinstance(weights, torch.Tensor)
    weights = [weights] if stacked else list(weights)
    if not any(w.requires_grad for w in weights):
        return
    for i, w in enumerate(weights):
        name = "weights" if stacked else f"weights[{i}]"
        mg = getattr(w, "main_grad", None)
        if not isinstance(mg, torch.Tensor):
            raise AttributeError(f"fuse_wgrad_accumulation=True needs {name}.main_grad (an fp32 tensor of "
                                 f"shape {tuple(w.shape)} the weight gradient is added into)")
        if mg.dtype != torch.float32 or mg.shape != w.shape or mg.device != w.device:
            raise ValueError(f"{name}.main_grad must be fp32 {tuple(w.shape)} on {w.device}, got "
                             f"{mg.dtype} {tuple(mg.shape)} on {mg.device}")


def check_recipe(recipe, dtype, n: int, k: int, splits, cuda: bool,
                  device: Optional[torch.device] = None) -> None:
    graph_safe = splits.host is None
    # (the hardware check runs when the layer op itself runs, not while Dynamo traces)
    if cuda and isinstance(recipe, Float8BlockScaling) and not torch.compiler.is_compiling() and \
            cuda_major(device) != 9:
        raise RuntimeError(f"Float8BlockScaling needs Hopper (sm_90): its 1x128/128x128 FP8 GEMMs exist only "
                           f"there (this GPU is sm_{cuda_major(device)}x). On Blackwell the native FP8 "
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
            raise TypeError(f"Float8BlockScaling needs bf16 activations (the FP8 grouped GEMMs write bf16), got "
                            f"{dtype}; parameters of another dtype need torch.autocast(dtype=torch.bfloat16)")
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
