"""Expert-MLP activations (SwiGLU, GeGLU, GELU, ReLU, clamped SwiGLU), with
an optional per-row scale (router probabilities).

* :class:`Activation` / :func:`parse_activation`: which activation.
* :func:`activation`: the standalone autograd op (high precision).
* :mod:`lpmoe.activation.kernels`: the fused kernels that also write FP8
  block operands, used by :class:`lpmoe.GroupedMLP`.
"""
from lpmoe.activation.function import activation
from lpmoe.activation.kernels import CALLS
from lpmoe.activation.spec import Activation, parse_activation

__all__ = ["Activation", "parse_activation", "activation", "CALLS"]
