"""Parameter dtype and compute dtype of the expert layers (torch.autocast).

A layer computes in its input's dtype, and its parameters must have that
dtype, as ``torch.nn.Linear`` asks, unless ``torch.autocast`` is active for
the input's device.  Then, as in TransformerEngine's modules, the compute
dtype is the autocast dtype and the parameters may be of any float dtype
(the usual mixed precision: fp32 parameters, bf16 compute):

* the input is cast to the compute dtype (an autograd op: its gradient
  comes back in the input's dtype);
* a recipe quantizes the weights straight from the parameters (an fp32
  weight goes to FP8 in one rounding, without a bf16 copy in between); a
  high-precision GEMM reads them cast to the compute dtype (one cast of all
  experts per call; fprop's cast is kept for dgrad, as a quantized copy is,
  and the fused MLP drops it right after dgrad);
* biases are cast to the compute dtype for the forward's epilogue (as
  lpmoe.grouped_gemm does with any bias);
* weight gradients are written by the wgrad GEMM in the parameters' dtype
  from its fp32 accumulator (no rounding to the compute dtype first); bias
  gradients are fp32 sums, rounded to the compute dtype where a
  quantization or activation pass fuses them (as TransformerEngine), then
  widened to the parameters' dtype.

Inside the layers autocast is switched off (:func:`autocast_off`): their
own torch calls (the CPU reference GEMMs, sums) must run in the dtypes the
layer chose, not the ones autocast would pick.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch

from lpmoe.functional.weights import stack_weights

__all__ = ["autocast_dtype", "compute_input", "params_dtype", "as_compute", "autocast_off"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """torch.autocast's dtype for ``device``'s type, or None when it is off."""
    kind = device.type
    if kind not in ("cuda", "cpu") or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def params_dtype(weights) -> Optional[torch.dtype]:
    """The dtype of the first weight (None if ``weights`` holds no tensor:
    the argument checks then say what was expected)."""
    w = weights if isinstance(weights, torch.Tensor) else (
        weights[0] if isinstance(weights, (list, tuple)) and weights else None)
    return w.dtype if isinstance(w, torch.Tensor) else None


def compute_input(inp, weights) -> Tuple[object, Optional[torch.dtype]]:
    """(the input in the compute dtype, the dtype the parameters must have).

    Without autocast the parameters must have the input's dtype (None is
    returned for it: the checks compare with the input).  Under autocast a
    float input is cast to the autocast dtype and the parameters may keep
    theirs."""
    if not isinstance(inp, torch.Tensor) or inp.dtype not in _FLOATS:
        return inp, None
    cd = autocast_dtype(inp.device)
    if cd is None:
        return inp, None
    if inp.dtype != cd:
        inp = inp.to(cd)
    pd = params_dtype(weights)
    return inp, (pd if pd in _FLOATS else None)


def as_compute(params, dtype: torch.dtype):
    """Weights or biases as a GEMM reads them in ``dtype``: unchanged when
    they have it, else cast, the G per-expert tensors as one stacked tensor
    (one cast kernel for all experts; the grouped GEMMs take either form).
    None and quantized operands pass through."""
    if params is None or not isinstance(params, (torch.Tensor, list, tuple)):
        return params
    if isinstance(params, torch.Tensor):
        return params if params.dtype == dtype else params.detach().to(dtype)
    if params[0].dtype == dtype:
        return params
    if params[0].dim() == 2:  # a view when the weights sit back to back (GroupedLinear's do)
        g, (n, k) = len(params), params[0].shape
        return stack_weights(params).view(g, n, k).to(dtype)  # (a tensor of its own, not a view)
    return torch.stack([p.detach() for p in params]).to(dtype)


@contextlib.contextmanager
def autocast_off():
    """Autocast switched off (CUDA and CPU) while a layer runs; no context
    is entered where it is off already (the usual case: no cost)."""
    on = [kind for kind in ("cuda", "cpu") if torch.is_autocast_enabled(kind)]
    if not on:
        yield
        return
    with contextlib.ExitStack() as stack:
        for kind in on:
            stack.enter_context(torch.autocast(kind, enabled=False))
        yield
