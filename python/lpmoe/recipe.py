"""Recipes: which low-precision format each GEMM operand of a layer uses.

A recipe holds no state; it says how to quantize the three roles of a linear
layer and makes the matching :mod:`lpmoe.quantizers`:

* ``"input"``   activations x (fprop, and wgrad's token operand)
* ``"weight"``  the expert weights W (fprop, and dgrad's transposed copy)
* ``"grad"``    the output gradient dy (dgrad, and wgrad's token operand)

``backward_override`` changes what the backward pass sees:

* ``None``              quantized backward (dy quantized, quantized x / W reused)
* ``"high_precision"``  save the original x and W; backward GEMMs in high precision
* ``"dequantized"``     save the quantized x and W of the forward, dequantize
                        them for the backward; backward GEMMs in high precision

Recipes:

* :class:`Float8BlockScaling`  native on Hopper: FP8 block scaling
  (x 1x128, W 128x128, dy 1x128) through lpmoe's grouped FP8 GEMMs.
* :class:`MXFP8BlockScaling`, :class:`NVFP4BlockScaling`  Hopper has no
  MXFP8/NVFP4 tensor cores: lpmoe *emulates* their numerics (quantize,
  dequantize, high-precision GEMM).  Useful to study accuracy, not speed.
"""
from __future__ import annotations

import enum
from typing import Optional

import torch

from lpmoe._value_fields import ValueFields
from lpmoe.quantizers import Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer

__all__ = ["Format", "Recipe", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling", "ROLES",
           "BACKWARD_OVERRIDES"]

ROLES = ("input", "weight", "grad")
BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


class Format(enum.Enum):
    """FP8 element formats of a recipe.

    ``E4M3``: every operand E4M3.  ``HYBRID``: forward operands (x, W) E4M3,
    gradients E5M2 (more range, less precision).
    """

    E4M3 = "E4M3"
    HYBRID = "HYBRID"

    def dtype_for(self, role: str) -> torch.dtype:
        if self is Format.HYBRID and role == "grad":
            return torch.float8_e5m2
        return torch.float8_e4m3fn


def _check_format(fp8_format) -> Format:
    if not isinstance(fp8_format, Format):
        raise TypeError(f"fp8_format must be lpmoe.recipe.Format.E4M3 or Format.HYBRID, got {fp8_format!r}")
    return fp8_format


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")


class Recipe(ValueFields):
    """Base class of lpmoe recipes (see the module docstring)."""

    #: True when lpmoe runs the recipe's GEMMs natively on Hopper, False when
    #: its numerics are emulated (quantize -> dequantize -> high-precision GEMM)
    native_on_hopper = False

    def __init__(self, backward_override: Optional[str] = None):
        if backward_override not in BACKWARD_OVERRIDES:
            raise ValueError(f"backward_override must be one of {BACKWARD_OVERRIDES}, got {backward_override!r}")
        self.backward_override = backward_override

    def quantizer(self, role: str, *, rowwise: bool = True, columnwise: bool = True) -> Quantizer:
        """The quantizer of ``role`` ("input", "weight" or "grad") producing
        the requested directions."""
        raise NotImplementedError

    def _fields(self) -> dict:
        return {"backward_override": self.backward_override}



class Float8BlockScaling(Recipe):
    """FP8 block scaling (DeepSeek-V3 style), run natively on Hopper.

    Args:
        fp8_format: ``Format.E4M3`` (default) or ``Format.HYBRID`` (E5M2 grads).
        x_block_dim, w_block_dim, grad_block_dim: 1 = 1x128 blocks, 2 = 128x128
            tiles, for activations, weights and gradients.  A GEMM cannot
            take two 128x128 operands, so no two operands that meet in a GEMM
            (x/W in fprop, dy/W in dgrad, dy/x in wgrad) may both be 2.
            lpmoe's grouped GEMMs run the default x=1, W=2, grad=1.
        power_2_scale: round scales to powers of two.
        amax_epsilon: lower bound on each block's amax (0 = none).
        backward_override: None, "high_precision" or "dequantized".
    """

    native_on_hopper = True

    def __init__(self, fp8_format: Format = Format.E4M3, x_block_dim: int = 1, w_block_dim: int = 2,
                 grad_block_dim: int = 1, power_2_scale: bool = True, amax_epsilon: float = 0.0,
                 backward_override: Optional[str] = None):
        super().__init__(backward_override)
        self.fp8_format = _check_format(fp8_format)
        for name, v in (("x_block_dim", x_block_dim), ("w_block_dim", w_block_dim),
                        ("grad_block_dim", grad_block_dim)):
            if v not in (1, 2) or isinstance(v, bool):
                raise ValueError(f"{name} must be 1 (1x128 blocks) or 2 (128x128 tiles), got {v!r}")
        pairs = (("x", x_block_dim, "w", w_block_dim, "fprop"), ("grad", grad_block_dim, "w", w_block_dim, "dgrad"),
                 ("grad", grad_block_dim, "x", x_block_dim, "wgrad"))
        for a, da, b, db, gemm in pairs:
            if da == 2 and db == 2:
                raise ValueError(f"{a}_block_dim=2 with {b}_block_dim=2: the {gemm} GEMM would multiply two "
                                 "128x128-scaled operands, which block-scaled GEMMs do not support")
        self.x_block_dim = int(x_block_dim)
        self.w_block_dim = int(w_block_dim)
        self.grad_block_dim = int(grad_block_dim)
        self.power_2_scale = bool(power_2_scale)
        amax_epsilon = float(amax_epsilon)
        if not amax_epsilon >= 0.0:  # also rejects NaN
            raise ValueError(f"amax_epsilon must be >= 0, got {amax_epsilon!r}")
        self.amax_epsilon = amax_epsilon

    @property
    def is_default_layout(self) -> bool:
        """True for x 1x128, W 128x128, dy 1x128: the layout the grouped GEMMs take."""
        return (self.x_block_dim, self.w_block_dim, self.grad_block_dim) == (1, 2, 1)

    def quantizer(self, role, *, rowwise=True, columnwise=True) -> Float8BlockQuantizer:
        _check_role(role)
        dim = {"input": self.x_block_dim, "weight": self.w_block_dim, "grad": self.grad_block_dim}[role]
        return Float8BlockQuantizer(fp8_dtype=self.fp8_format.dtype_for(role), block_dim=dim, rowwise=rowwise,
                                    columnwise=columnwise, pow2_scales=self.power_2_scale,
                                    amax_epsilon=self.amax_epsilon)

    def _fields(self):
        return {"fp8_format": self.fp8_format, "x_block_dim": self.x_block_dim, "w_block_dim": self.w_block_dim,
                "grad_block_dim": self.grad_block_dim, "power_2_scale": self.power_2_scale,
                "amax_epsilon": self.amax_epsilon, **super()._fields()}


class MXFP8BlockScaling(Recipe):
    """MXFP8 (E8M0 scale per 32 elements).  **Emulated on Hopper**: each
    operand is quantized along its GEMM's contraction dim, dequantized, and
    multiplied in high precision."""

    def __init__(self, fp8_format: Format = Format.E4M3, backward_override: Optional[str] = None):
        super().__init__(backward_override)
        self.fp8_format = _check_format(fp8_format)

    def quantizer(self, role, *, rowwise=True, columnwise=True) -> MXFP8Quantizer:
        _check_role(role)
        return MXFP8Quantizer(fp8_dtype=self.fp8_format.dtype_for(role), rowwise=rowwise, columnwise=columnwise)

    def _fields(self):
        return {"fp8_format": self.fp8_format, **super()._fields()}


class NVFP4BlockScaling(Recipe):
    """NVFP4 (E2M1 data, E4M3 scale per 16 elements, fp32 amax per expert).
    **Emulated on Hopper** like :class:`MXFP8BlockScaling`.  Plain 1x16
    quantization of every operand (no random Hadamard transform, no
    stochastic rounding).  Every expert's token count must be a multiple of
    16 (checked when the splits are on the host)."""

    def quantizer(self, role, *, rowwise=True, columnwise=True) -> NVFP4Quantizer:
        _check_role(role)
        return NVFP4Quantizer(rowwise=rowwise, columnwise=columnwise)
