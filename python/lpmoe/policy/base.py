"""What a recipe does to the operands of one grouped linear layer.

A layer runs three grouped GEMMs (lpmoe.grouped_gemm):

    fprop   y  = x . W^T        (token operand x, weight operand W)
    dgrad   dx = dy . W         (token operand dy, the saved weight operand)
    wgrad   dW = dy^T . x       (token operands dy and the saved x)

A :class:`LinearPolicy` decides, for one recipe, what each GEMM reads and
what the forward keeps for the backward.  The autograd functions
(lpmoe.functional) only sequence GEMMs; every recipe-specific decision lives
in one policy object per recipe (lpmoe.policy.*).  The fused expert MLP asks
the same objects what its activation kernel should write.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from lpmoe._value_fields import shared
from lpmoe.grouped_tensor import GroupedTensor
from lpmoe.quantize import group_dequantize
from lpmoe.quantizers import Quantizer

__all__ = ["Needs", "Tokens", "Forward", "Grad", "LinearPolicy", "grouped_rows", "dequantized_rows",
           "recipe_quantizer"]


def recipe_quantizer(recipe, role: str, rowwise: bool, columnwise: bool) -> Quantizer:
    """``recipe.quantizer(role, ...)`` as one shared, frozen object per recipe
    class, configuration and arguments (lpmoe._value_fields.shared): the
    policies ask for the same few at every step."""
    return shared(recipe, (role, rowwise, columnwise),
                  lambda: recipe.quantizer(role, rowwise=rowwise, columnwise=columnwise))


@dataclass
class Needs:
    """Which gradients the backward of one layer must produce."""
    dgrad: bool   # input gradient
    wgrad: bool   # weight gradients
    dbias: bool   # bias gradients

    @property
    def any(self) -> bool:
        return self.dgrad or self.wgrad or self.dbias


@dataclass
class Tokens:
    """A layer's token operand (activations or output gradient), as high
    precision (rows, C) and/or already quantized by a fused kernel, or as
    rows still to be gathered from a token matrix (``gathered``, an
    lpmoe.functional.gathered_rows.GatheredRows; only for a policy whose
    :meth:`LinearPolicy.input_quantizer` takes it).  ``save_original``: the
    caller keeps ``hp`` / ``gathered`` alive anyway (TE's
    save_original_input), so a policy may save that reference for its
    backward instead of a copy it made, and re-derive what wgrad reads."""
    hp: Optional[torch.Tensor] = None
    quantized: Optional[GroupedTensor] = None
    gathered: object = None
    save_original: bool = False


@dataclass
class Forward:
    x: object                 # fprop token operand
    w: object                 # fprop weight operand
    saved_x: object = None    # what wgrad will read (None: nothing to keep)
    saved_w: object = None    # what dgrad will read


@dataclass
class Grad:
    """The output gradient in the form the backward GEMMs read.

    An operand is either given (``dgrad`` / ``wgrad``) or made when its GEMM
    first asks for it (``make(which)``, which may also set ``dbias``): a
    policy that quantizes each direction in its own pass then never holds
    both quantized copies of dy at once."""
    dgrad: object = None                    # dgrad's token operand
    wgrad: object = None                    # wgrad's token operand
    dbias: Optional[torch.Tensor] = None    # (G, N) when fused into the quantization
    hp: Optional[torch.Tensor] = None       # high-precision dy, for a bias gradient computed separately
    make: Optional[Callable[["Grad", str], object]] = None

    def take(self, which: str):
        """The operand of the ``which`` GEMM ("dgrad" or "wgrad"), made now
        if it was not given; the Grad drops its reference, so the operand
        dies with the GEMM that reads it."""
        op = getattr(self, which)
        if op is None and self.make is not None:
            op = self.make(self, which)
        setattr(self, which, None)
        return op


def dequantized_rows(qg: GroupedTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """(rows, K) high-precision values of a quantized group (its rowwise
    copy), in ``dtype`` (default: the dtype it was quantized from)."""
    return group_dequantize(qg, qg.dtype if dtype is None else dtype).rowwise_data.view(qg.logical_shape)


def saved_weight_view(qw: GroupedTensor, view: str) -> GroupedTensor:
    """What a policy keeps of its quantized weights for dgrad (its
    ``saved_weight``): ``"transposed"``, the transposed copy with the rowwise
    scales beside it (the FP8 dgrad GEMM reads both); ``"rowwise"``, the
    rowwise copy (dequantized for a high-precision dgrad).
    One function, so a backward that takes the weights from the layer's
    cache instead (lpmoe.library.cached_weights) reads the same view."""
    if view == "transposed":
        return qw.direction_view(columnwise=True, keep_other_scales=True)
    if view == "rowwise":
        return qw.direction_view(columnwise=False)
    raise ValueError(f"unknown saved weight view {view!r}")


def grouped_rows(x2d: torch.Tensor, splits: torch.Tensor) -> GroupedTensor:
    """Wrap (rows, C) token rows as an expert-grouped tensor (no copy)."""
    return GroupedTensor(num_tensors=splits.numel(), logical_shape=tuple(x2d.shape), dtype=x2d.dtype,
                         rowwise_data=x2d.view(-1), first_dims=splits)


class LinearPolicy:
    """Operand handling of one recipe (see the module docstring).

    ``splits`` arguments are :class:`lpmoe.functional.splits.Splits`;
    ``weights`` a :class:`lpmoe.functional.weights.WeightSource`.
    """

    def forward(self, x: Tokens, weights, splits, need: Needs) -> Forward:
        raise NotImplementedError

    def grad(self, dy: torch.Tensor, splits, need: Needs) -> Grad:
        raise NotImplementedError

    def dgrad_weights(self, saved_w, num: int, n: int, k: int, dtype: Optional[torch.dtype] = None):
        """dgrad's weight operand from what :meth:`forward` saved; ``dtype``:
        the compute dtype of a high-precision dgrad (None: FP8 operands).
        By default what was saved, cast to that dtype where it has another
        (the parameters under torch.autocast, lpmoe.functional.precision)."""
        if dtype is None:
            return saved_w
        from lpmoe.functional.precision import as_compute  # (lpmoe.functional imports the policies)
        return as_compute(saved_w, dtype)

    def wgrad_tokens(self, saved_x, splits):
        """wgrad's token operand from what :meth:`forward` saved."""
        return grouped_rows(saved_x, splits.device) if isinstance(saved_x, torch.Tensor) else saved_x

    def input_quantizer(self, need: Needs) -> Optional[Quantizer]:
        """The quantizer :meth:`forward` applies to the layer's input when
        the input may arrive as rows to gather (``Tokens.gathered``), or
        None: this policy needs the high-precision rows themselves (the
        caller then materialises them)."""
        return None

    def gathers_input(self, need: Needs) -> bool:
        """Whether :meth:`input_quantizer` gives a quantizer, answered without
        making one (traced code asks this: a quantizer's construction is
        not traceable)."""
        return False

    def takes_gathered_grad(self, need: Needs) -> bool:
        """Whether :meth:`grad` takes the output gradient as rows to gather
        (a lpmoe.functional.gathered_rows.GatheredRows) instead of a tensor."""
        return False

    # --- what a fused activation in front of this layer writes (lpmoe.GroupedMLP)
    def activation_output(self, need: Needs):
        """(write the high-precision activation?, quantizer of the fused FP8
        output or None) for the activation feeding this layer."""
        return True, None

    def grad_quantizer(self, need: Needs) -> Optional[Quantizer]:
        """Quantizer a fused activation backward uses to write this layer's
        output gradient directly (None: it writes high precision and
        :meth:`grad` handles it)."""
        return None
