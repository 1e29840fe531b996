"""Expert parameters in the two layouts the layers take.

* **per expert** (TransformerEngine's ``GroupedLinear`` layout): G weights
  (N, K) and optionally G biases (N,), one autograd leaf each.
* **stacked** (``single_grouped_parameter=True``): one (G, N, K) weight and
  optionally one (G, N) bias.  The GEMMs read the same bytes either way
  (GroupedLinear's per-expert weights are views of one buffer too); what
  changes is the host work per call: one autograd input, one gradient
  accumulation, one guard under torch.compile instead of G of each, and the
  (G, N, K) weight gradient the wgrad GEMM writes is the parameter's
  gradient as is (no split into G tensors).

Everything that differs between the two is here, so the autograd functions
and the compiled ops only ask these helpers.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

__all__ = ["is_stacked", "shape_of", "as_inputs", "from_inputs", "input_count", "any_requires_grad", "grads_for"]

Params = Union[torch.Tensor, Sequence[torch.Tensor]]


def is_stacked(weights: Params) -> bool:
    return isinstance(weights, torch.Tensor)


def shape_of(weights: Params):
    """(G, N, K) of validated weights."""
    if isinstance(weights, torch.Tensor):
        g, n, k = weights.shape
        return g, n, k
    n, k = weights[0].shape
    return len(weights), n, k


def as_inputs(ts: Optional[Params]) -> List[torch.Tensor]:
    """The autograd inputs of one parameter set (weights or biases)."""
    if ts is None:
        return []
    return [ts] if isinstance(ts, torch.Tensor) else list(ts)


def input_count(num: int, stacked: bool) -> int:
    return 1 if stacked else num


def from_inputs(inputs: Sequence[torch.Tensor], stacked: bool) -> Params:
    """Inverse of :func:`as_inputs` for a non-empty set."""
    return inputs[0] if stacked else list(inputs)


def any_requires_grad(ts: Optional[Params]) -> bool:
    if ts is None:
        return False
    if isinstance(ts, torch.Tensor):
        return ts.requires_grad
    return any(t.requires_grad for t in ts)


def grads_for(grads, num: int, stacked: bool) -> List[Optional[torch.Tensor]]:
    """Autograd's gradients of one parameter set from a (G, ...) gradient
    (or an already per-expert list, or None)."""
    if stacked:
        return [grads]
    if grads is None:
        return [None] * num
    return list(grads) if isinstance(grads, list) else list(grads.unbind(0))
