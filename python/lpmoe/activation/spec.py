"""Which activation an expert MLP uses: a small value object."""
from __future__ import annotations

import math
from typing import Union

from lpmoe._value_fields import ValueFields
from lpmoe.reference.activation import GLU_KINDS, KINDS

__all__ = ["Activation", "parse_activation"]

# Kernel enum (csrc/activation/activation.h, activation::Kind).
_KERNEL_KIND = {"swiglu": 0, "geglu": 1, "gelu": 2, "relu": 3, "clamped_swiglu": 4}


class Activation(ValueFields):
    """An activation of lpmoe's fused expert MLP.

    * ``"swiglu"``          silu(gate) * value; h = [gate | value] (gate first)
    * ``"geglu"``           gelu_tanh(gate) * value
    * ``"gelu"``            gelu with the tanh approximation
    * ``"relu"``            max(x, 0)
    * ``"clamped_swiglu"``  gpt-oss's SwiGLU: gate clamped above at ``limit``,
      value clamped to [-limit, limit], ``(gate * sigmoid(alpha * gate)) *
      (value + 1)`` (gate first, not interleaved)

    The exact fp32 math of each is lpmoe.reference.activation.
    """

    def __init__(self, kind: str, alpha: float = 1.702, limit: float = 7.0):
        if kind not in KINDS:
            raise ValueError(f"activation must be one of {KINDS}, got {kind!r}")
        alpha, limit = float(alpha), float(limit)
        if not (math.isfinite(alpha) and math.isfinite(limit) and limit > 0):
            raise ValueError(f"clamped_swiglu needs a finite alpha and a positive finite limit, got alpha={alpha}, "
                             f"limit={limit}")
        self.kind = kind
        self.alpha = alpha
        self.limit = limit

    @property
    def is_glu(self) -> bool:
        """The input holds two halves (gate, value): 2F columns for F outputs."""
        return self.kind in GLU_KINDS

    @property
    def kernel_kind(self) -> int:
        return _KERNEL_KIND[self.kind]

    def input_width(self, ffn: int) -> int:
        return 2 * ffn if self.is_glu else ffn

    def _fields(self):
        f = {"kind": self.kind}
        if self.kind == "clamped_swiglu":
            f.update(alpha=self.alpha, limit=self.limit)
        return f


#: one Activation per name with default parameters, made at import (traced
#: code looks them up instead of constructing one)
_BY_NAME = {k: Activation(k) for k in KINDS}


def parse_activation(activation: Union[str, Activation]) -> Activation:
    if isinstance(activation, Activation):
        return activation
    if isinstance(activation, str):
        if activation.lower() in _BY_NAME:
            return _BY_NAME[activation.lower()]
        return Activation(activation.lower())  # raises the error naming the valid kinds
    raise TypeError(f"activation must be a name ({', '.join(KINDS)}) or an lpmoe.activation.Activation, "
                    f"got {type(activation).__name__}")
