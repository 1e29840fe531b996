"""``lpmoe.GroupedLinear``: the expert linear layer of an MoE block."""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Union

import torch

from lpmoe._device import cuda_major
from lpmoe.autocast import get_autocast_recipe
from lpmoe.functional import WeightCache, grouped_linear

__all__ = ["GroupedLinear"]


def _prepare_workspaces(weights) -> None:
    """Make the persistent GEMM workspaces of the weights' device now, outside
    any capture: torch.compile's CUDA-graph trees run warm-up calls inside the
    graph memory pool, where a workspace made on first use would be a live
    allocation the pool does not track.  (A stacked weight needs no address
    table: the GEMMs address its experts from its base.)"""
    stacked = isinstance(weights, torch.Tensor)
    weight = weights if stacked else weights[0]
    if weight.is_cuda and cuda_major(weight.device) == 9:
        from lpmoe.gemm.weight_operands import prepare_weight_list
        from lpmoe.gemm.workspaces import gemm_workspace, setup_workspace
        for slot in (0, 1):
            gemm_workspace(weight.device, slot)
        setup_workspace(weight.device, len(weights))
        if not stacked:
            prepare_weight_list(weights)


class GroupedLinear(torch.nn.Module):
    """G independent linear layers applied to G consecutive row blocks.

    ``y_t = x_t . weight{t}^T + bias{t}`` for the ``m_splits[t]`` rows of
    expert t.  Parameters are ``weight0 .. weight{G-1}`` (out x in) and, with
    ``bias=True``, ``bias0 .. bias{G-1}`` (zero-initialised): the state-dict
    keys of TransformerEngine's ``GroupedLinear``, so checkpoints move between
    the two (TE's ``_extra_state`` entry is accepted and ignored on load).

    With ``single_grouped_parameter=True`` the layer has one parameter
    ``weight`` (G, out, in) and, with bias, ``bias`` (G, out) instead: one
    autograd leaf, one gradient accumulation, one optimizer tensor and one
    torch.compile guard instead of G of each, and the wgrad GEMM's (G, N, K)
    output is the gradient as is.  This is what makes the layer's host work
    independent of G (see docs/compile-notes.md).  Its state dict still has
    the per-expert keys, so checkpoints load across both layouts and TE.

    The precision follows the active :func:`lpmoe.autocast` recipe at call
    time (input dtype without one).  The layer owns a
    :class:`~lpmoe.functional.WeightCache` for its FP8 weights
    (``is_first_microbatch``).

    Args:
        num_gemms: number of experts G.
        in_features, out_features: per-expert sizes.
        bias: learn per-expert biases.
        params_dtype: parameter dtype (default ``torch.get_default_dtype()``).
            The layer computes in its input's dtype, which the parameters
            must have, or under ``torch.autocast`` in autocast's dtype from
            parameters of any float dtype (fp32 parameters, bf16 compute;
            FP8 block scaling computes in bf16:
            lpmoe.functional.precision).
        device: where the parameters live; ``"cpu"`` runs lpmoe's reference
            GEMMs with the GPU path's numerics.
        init_method: ``init_method(weight)`` initialises each weight in
            place; default kaiming-uniform as ``torch.nn.Linear``.
        fuse_wgrad_accumulation: add weight gradients into each weight's
            fp32 ``main_grad`` (set by the training framework, e.g. Megatron)
            instead of ``.grad``; TransformerEngine's argument of that name
            (see :func:`lpmoe.functional.grouped_linear`).
        single_grouped_parameter: one (G, out, in) weight parameter (and one
            (G, out) bias) instead of G (TransformerEngine's argument of
            that name).
        save_original_input: keep the input itself for the backward, not
            the recipe's copy of it (TransformerEngine's argument of that
            name; see :func:`lpmoe.functional.grouped_linear`).
    """

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True,
                 params_dtype: Optional[torch.dtype] = None, device: Union[str, torch.device] = "cuda",
                 init_method: Optional[Callable[[torch.Tensor], None]] = None,
                 fuse_wgrad_accumulation: bool = False, single_grouped_parameter: bool = False,
                 save_original_input: bool = False):
        super().__init__()
        for name, v in (("fuse_wgrad_accumulation", fuse_wgrad_accumulation),
                        ("single_grouped_parameter", single_grouped_parameter),
                        ("save_original_input", save_original_input)):
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be a bool, got {v!r}")
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.save_original_input = save_original_input
        self.single_grouped_parameter = single_grouped_parameter
        for name, v in (("num_gemms", num_gemms), ("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bool(bias)
        self.params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.init_method = init_method
        # The G weights are views of one (G, out, in) buffer, so the FP8 path
        # quantizes them as one same-shape group without stacking (a copy of
        # every weight per step).  Anything that replaces the parameters
        # (.to(), FSDP, ...) just falls back to stacking.
        flat = torch.empty(num_gemms, out_features, in_features, dtype=self.params_dtype, device=device)
        if single_grouped_parameter:
            self.weight = torch.nn.Parameter(flat)
            self.register_parameter("bias", torch.nn.Parameter(torch.empty(
                num_gemms, out_features, dtype=self.params_dtype, device=device)) if self.use_bias else None)
            self._register_state_dict_hook(_per_expert_keys)
        else:
            for i in range(num_gemms):
                self.register_parameter(f"weight{i}", torch.nn.Parameter(flat[i]))
                if self.use_bias:
                    b = torch.empty(out_features, dtype=self.params_dtype, device=device)
                    self.register_parameter(f"bias{i}", torch.nn.Parameter(b))
        # Not a buffer: derived from the weights, never saved in checkpoints.
        self.weight_cache = WeightCache()
        self.reset_parameters()
        _prepare_workspaces(self.functional_params()[0])

    def _apply(self, fn, *args, **kwargs):
        self.weight_cache.clear()  # .to() / .cuda() / .bfloat16() replace the parameters
        out = super()._apply(fn, *args, **kwargs)
        _prepare_workspaces(self.functional_params()[0])
        return out

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for w in self.weights:
                if self.init_method is not None:
                    self.init_method(w)
                else:
                    torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))  # torch.nn.Linear's default
            for b in self.biases or []:
                b.zero_()
        self.weight_cache.clear()

    @property
    def weights(self) -> List[torch.Tensor]:
        """The G per-expert weights (views of the stacked parameter with
        ``single_grouped_parameter``)."""
        if self.single_grouped_parameter:
            return list(self.weight.unbind(0))
        # straight from the parameter dict: Module.__getattr__ per expert
        # costs ~1.3 us each, 85 us for 64 experts per call (CI CPU)
        params = self._parameters
        return [params[f"weight{i}"] for i in range(self.num_gemms)]

    @property
    def biases(self) -> Optional[List[torch.Tensor]]:
        if not self.use_bias:
            return None
        if self.single_grouped_parameter:
            return list(self.bias.unbind(0))
        params = self._parameters
        return [params[f"bias{i}"] for i in range(self.num_gemms)]

    def functional_params(self):
        """(weights, biases) as lpmoe.functional takes them: the parameter
        lists, or the stacked parameters themselves."""
        if self.single_grouped_parameter:
            params = self._parameters
            return params["weight"], params["bias"]
        return self.weights, self.biases

    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """``inp`` (..., in_features) grouped by expert; ``m_splits`` tokens
        per expert (CUDA int tensor: graph-safe; list / CPU tensor: host
        path; see :mod:`lpmoe.functional`).  Returns (..., out_features)."""
        weights, biases = self.functional_params()
        return grouped_linear(inp, m_splits, weights, biases, get_autocast_recipe(),
                              weight_cache=self.weight_cache, is_first_microbatch=is_first_microbatch,
                              fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
                              save_original_input=self.save_original_input)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # TE checkpoints carry an `_extra_state` (its FP8 metadata); lpmoe
        # derives everything from the weights, so accept and drop it.
        state_dict.pop(prefix + "_extra_state", None)
        if self.single_grouped_parameter:
            _stack_expert_keys(state_dict, prefix, self.num_gemms, self.use_bias, error_msgs)
        self.weight_cache.clear()  # new weights: the cached FP8 copy is stale
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}, params_dtype={self.params_dtype}"
                + (", fuse_wgrad_accumulation=True" if self.fuse_wgrad_accumulation else "")
                + (", single_grouped_parameter=True" if self.single_grouped_parameter else ""))


# A stacked layer's checkpoint keeps the per-expert keys (TE's layout, and what
# lpmoe.moe's expert-parallel renumbering works on): saved as G views, loaded
# by stacking them back.  A state dict with the stacked key loads as well.
def _per_expert_keys(module, state_dict, prefix, local_metadata):
    for name in ("weight", "bias"):
        t = state_dict.pop(prefix + name, None)
        if t is not None:
            for i, part in enumerate(t.unbind(0)):
                state_dict[f"{prefix}{name}{i}"] = part
    return state_dict


def _stack_expert_keys(state_dict, prefix: str, num: int, bias: bool, error_msgs) -> None:
    for name in ("weight",) + (("bias",) if bias else ()):
        keys = [f"{prefix}{name}{i}" for i in range(num)]
        present = [k in state_dict for k in keys]
        if prefix + name in state_dict or not any(present):
            continue
        if not all(present):
            missing = ", ".join(k[len(prefix):] for k, p in zip(keys, present) if not p)
            error_msgs.append(f"the stacked parameter {prefix}{name} needs all of {name}0..{name}{num - 1}: "
                              f"missing {missing}")
            continue
        state_dict[prefix + name] = torch.stack([state_dict.pop(k) for k in keys])
