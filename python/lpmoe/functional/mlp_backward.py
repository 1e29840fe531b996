"""The fused expert MLP's backward in stages (lpmoe.functional.mlp runs
them all for eager autograd; the compiled backward of a large layer,
lpmoe.library.mlp_backward_ops, runs each GEMM and the activation backward
as its own op, so every saved copy dies after its last reader in both).

Each stage takes the saved objects through ``take(name)`` (or as an
argument) and holds the only reference, so an FP8 copy dies with the GEMM
or kernel that last reads it (lpmoe.functional.saved.hold)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from lpmoe.activation import kernels
from lpmoe.functional.gathered_rows import GatheredRows
from lpmoe.functional.linear_steps import backward_steps, dgrad_step, one_gemm_step
from lpmoe.functional.splits import Splits
from lpmoe.grouped_tensor import GroupedTensor, shares_offsets
from lpmoe.policy import Grad, LinearPolicy, Needs
from lpmoe.policy.fp8_block import grad_views

if TYPE_CHECKING:
    from lpmoe.functional.mlp import MLPConfig

__all__ = ["Dh", "STAGE_ACT", "mlp_backward_fc2", "mlp_backward_fc2_part", "mlp_backward_activation",
           "mlp_backward_fc1", "mlp_backward_fc1_wgrad", "mlp_backward_fc1_dgrad", "mlp_backward_impl"]


@dataclass
class Dh:
    """fc1's output gradient as the activation backward wrote it: the FP8
    operands of fc1's GEMMs (both directions, with fc1's fused bias
    gradient) or the high-precision dh its policy prepares.  The compiled
    backward hands it from the activation op to fc1's ops."""
    quantized: Optional[GroupedTensor] = None
    hp: Optional[torch.Tensor] = None
    dbias: Optional[torch.Tensor] = None

    def grad(self, policy: LinearPolicy, splits: Splits, need: Needs) -> Grad:
        if self.quantized is not None:
            return grad_views(self.quantized, need, self.dbias)
        if need.dgrad or need.wgrad:
            return policy.grad(self.hp, splits, need)
        return Grad(hp=self.hp, dbias=self.dbias)  # (a bias gradient alone: the activation backward fused it)


#: the saved objects the activation stage reads (the compiled backward of
#: a large layer runs each GEMM and the activation as separate ops, so each
#: one's inputs die when it returns; fc2's wgrad reads "x2", its dgrad
#: "w2", fc1's "x1" and "w1"; lpmoe.library.mlp_backward_ops)
STAGE_ACT = ("probs", "h")


def _fc2_grad(grad_out, splits: Splits, cfg: MLPConfig, need: Needs) -> Grad:
    """fc2's output gradient in the form its policy's GEMMs read (for the
    GEMMs ``need`` asks for)."""
    pol2 = cfg.fc2.policy
    if isinstance(grad_out, GatheredRows):  # fc2's output gradient as rows of the tokens' gradient
        if not pol2.takes_gathered_grad(need) or not grad_out.can_quantize(pol2.grad_quantizer(need)):
            grad_out = grad_out.rows()  # this policy reads the rows themselves
    return pol2.grad(grad_out if isinstance(grad_out, GatheredRows) else grad_out.contiguous(), splits, need)


def mlp_backward_fc2(grad_out, take, splits: Splits, cfg: MLPConfig, dtype, main_grads=None):
    """fc2's backward: (da or None, fc2's weight grads, fc2's bias grads).
    ``take(name)`` hands the saved objects over one at a time (each can be
    dropped after its last reader)."""
    need2 = cfg.needs[1]
    grad2 = _fc2_grad(grad_out, splits, cfg, need2)
    del grad_out
    return backward_steps(cfg.fc2.policy, grad2, take("x2"), take("w2"), splits, need2, cfg.fc2.shape,
                          weights_cached=cfg.weights_cached(cfg.fc2), dtype=dtype, main_grads=main_grads)


def mlp_backward_fc2_part(grad_out, saved, splits: Splits, cfg: MLPConfig, dtype, part: str, with_dbias: bool,
                          main_grads=None):
    """One of fc2's GEMMs alone: ``part`` "wgrad" -> (weight grads, bias
    grads), "dgrad" -> (da, bias grads); ``saved`` is the operand that GEMM
    reads (x2 or w2).  The bias gradient comes with ``with_dbias``, fused
    into this GEMM's dy pass as eager fuses it into its first pass (the bits
    do not depend on the pass's direction; lpmoe.library.mlp_backward_ops
    says which op takes it)."""
    need2 = cfg.needs[1]
    need = Needs(dgrad=part == "dgrad" and need2.dgrad, wgrad=part == "wgrad" and need2.wgrad,
                 dbias=with_dbias and need2.dbias)
    grad2 = _fc2_grad(grad_out, splits, cfg, need)
    del grad_out
    return one_gemm_step(cfg.fc2.policy, grad2, saved, splits, need, cfg.fc2.shape, dtype=dtype,
                         main_grads=main_grads)


def mlp_backward_activation(da: Optional[torch.Tensor], take, splits: Splits, cfg: MLPConfig):
    """The activation backward from fc2's input gradient: (Dh or None,
    dprobs).  Call it with the only reference to ``da``: one pass over (da,
    h) writes fc1's output gradient in the form fc1's GEMMs read (with
    fc1's bias gradient when fused) and d probs, then both inputs die."""
    need1, need2, need_probs = cfg.needs
    probs, h = take("probs"), take("h")
    if not need2.dgrad:
        return None, None
    q1 = cfg.fc1.policy.grad_quantizer(need1)
    res = kernels.backward(da, h, cfg.spec, probs, splits.device, dh_hp=need1.any and q1 is None,
                           dh_quantizer=q1, dbias=need1.dbias and q1 is not None, dprobs=need_probs)
    del da, h
    dh = None
    if need1.any:
        dh = Dh(res.dh_quantized, None, res.dbias) if q1 is not None else Dh(None, res.dh, None)
    return dh, res.dprobs


def mlp_backward_fc1(dh: Optional[Dh], take, splits: Splits, cfg: MLPConfig, dtype, main_grads=None, dx_to=None):
    """fc1's backward from the activation stage's Dh: (dx, weight grads, bias grads)
    (``dx_to``: see backward_steps).  Call it with the only reference to
    ``dh`` (no decorator frame either: each FP8 copy of dh must die with the
    GEMM that reads it)."""
    need1 = cfg.needs[0]
    if dh is None:
        return None, None, None
    grad1 = dh.grad(cfg.fc1.policy, splits, need1)
    del dh
    return backward_steps(cfg.fc1.policy, grad1, take("x1"), take("w1"), splits, need1, cfg.fc1.shape,
                          dtype=dtype, main_grads=main_grads, dx_to=dx_to, weights_cached=cfg.weights_cached(cfg.fc1))


def mlp_backward_fc1_wgrad(dh: Dh, x1, splits: Splits, cfg: MLPConfig, dtype, main_grads=None):
    """fc1's weight and bias gradients alone (the compiled backward runs the
    dgrad in another op): the same steps as :func:`mlp_backward_fc1`."""
    need1 = cfg.needs[0]
    need = Needs(dgrad=False, wgrad=need1.wgrad, dbias=need1.dbias)
    grad1 = dh.grad(cfg.fc1.policy, splits, need)
    del dh
    return one_gemm_step(cfg.fc1.policy, grad1, x1, splits, need, cfg.fc1.shape, dtype=dtype, main_grads=main_grads)


def mlp_backward_fc1_dgrad(dh: Dh, w1, splits: Splits, cfg: MLPConfig) -> torch.Tensor:
    """fc1's input gradient alone (see :func:`mlp_backward_fc1_wgrad`)."""
    need = Needs(dgrad=True, wgrad=False, dbias=False)
    grad1 = dh.grad(cfg.fc1.policy, splits, need)
    del dh
    return dgrad_step(cfg.fc1.policy, grad1, w1, splits, cfg.fc1.shape)


@shares_offsets
def mlp_backward_impl(grad_out, take, splits: Splits, cfg: MLPConfig, dtype, main_grads=(None, None), source=None):
    """Gradients (dx, dprobs, w1, b1, w2, b2 lists or None): both stages;
    with ``source`` (routed tokens' backward view) dx is the tokens'."""
    fc2 = list(mlp_backward_fc2(grad_out, take, splits, cfg, dtype, main_grads[1]))
    w2_grads, b2_grads = fc2[1:]
    # pop: the next stage holds the only reference, so da dies with the
    # activation backward and each FP8 copy of dh with the GEMM that reads it
    act = list(mlp_backward_activation(fc2.pop(0), take, splits, cfg))
    dprobs = act[1]
    dx, w1_grads, b1_grads = mlp_backward_fc1(act.pop(0), take, splits, cfg, dtype, main_grads[0],
                                              source.rows_to_tokens if source is not None else None)
    return dx, dprobs, w1_grads, b1_grads, w2_grads, b2_grads
