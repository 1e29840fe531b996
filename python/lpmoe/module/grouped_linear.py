"""``lpmoe.GroupedLinear``: the expert linear layer of an MoE block."""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Union

import torch

from lpmoe.autocast import get_autocast_recipe
from lpmoe.functional import WeightCache, grouped_linear

__all__ = ["GroupedLinear"]


def _prepare_workspaces(weights) -> None:
    """Make the persistent GEMM workspaces of the weights' device now, outside
    any capture: torch.compile's CUDA-graph trees run warm-up calls inside the
    graph memory pool, where a workspace made on first use would be a live
    allocation the pool does not track."""
    weight = weights[0]
    if weight.is_cuda and torch.cuda.get_device_capability(weight.device)[0] == 9:
        from lpmoe.gemm.api import prepare_weight_list
        from lpmoe.gemm.workspaces import gemm_workspace, setup_workspace
        for slot in (0, 1):
            gemm_workspace(weight.device, slot)
        setup_workspace(weight.device, len(weights))
        prepare_weight_list(weights)


class GroupedLinear(torch.nn.Module):
    """G independent linear layers applied to G consecutive row blocks.

    ``y_t = x_t . weight{t}^T + bias{t}`` for the ``m_splits[t]`` rows of
    expert t.  Parameters are ``weight0 .. weight{G-1}`` (out x in) and, with
    ``bias=True``, ``bias0 .. bias{G-1}`` (zero-initialised): the state-dict
    keys of TransformerEngine's ``GroupedLinear``, so checkpoints move between
    the two (TE's ``_extra_state`` entry is accepted and ignored on load).

    The precision follows the active :func:`lpmoe.autocast` recipe at call
    time (input dtype without one).  The layer owns a
    :class:`~lpmoe.functional.WeightCache` for its FP8 weights
    (``is_first_microbatch``).

    Args:
        num_gemms: number of experts G.
        in_features, out_features: per-expert sizes.
        bias: learn per-expert biases.
        params_dtype: parameter dtype (default ``torch.get_default_dtype()``);
            FP8 block scaling needs bf16.
        device: where the parameters live; ``"cpu"`` runs lpmoe's reference
            GEMMs with the GPU path's numerics.
        init_method: ``init_method(weight)`` initialises each weight in
            place; default kaiming-uniform as ``torch.nn.Linear``.
        fuse_wgrad_accumulation: add weight gradients into each weight's
            fp32 ``main_grad`` (set by the training framework, e.g. Megatron)
            instead of ``.grad``; TransformerEngine's argument of that name
            (see :func:`lpmoe.functional.grouped_linear`).
    """

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True,
                 params_dtype: Optional[torch.dtype] = None, device: Union[str, torch.device] = "cuda",
                 init_method: Optional[Callable[[torch.Tensor], None]] = None,
                 fuse_wgrad_accumulation: bool = False):
        super().__init__()
        if not isinstance(fuse_wgrad_accumulation, bool):
            raise TypeError(f"fuse_wgrad_accumulation must be a bool, got {fuse_wgrad_accumulation!r}")
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
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
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(flat[i]))
            if self.use_bias:
                b = torch.empty(out_features, dtype=self.params_dtype, device=device)
                self.register_parameter(f"bias{i}", torch.nn.Parameter(b))
        # Not a buffer: derived from the weights, never saved in checkpoints.
        self.weight_cache = WeightCache()
        self.reset_parameters()
        _prepare_workspaces(self.weights)

    def _apply(self, fn, *args, **kwargs):
        self.weight_cache.clear()  # .to() / .cuda() / .bfloat16() replace the parameters
        out = super()._apply(fn, *args, **kwargs)
        _prepare_workspaces(self.weights)
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
    def weights(self) -> List[torch.nn.Parameter]:
        # straight from the parameter dict: Module.__getattr__ per expert
        # costs ~1.3 us each, 85 us for 64 experts per call (CI CPU)
        params = self._parameters
        return [params[f"weight{i}"] for i in range(self.num_gemms)]

    @property
    def biases(self) -> Optional[List[torch.nn.Parameter]]:
        if not self.use_bias:
            return None
        params = self._parameters
        return [params[f"bias{i}"] for i in range(self.num_gemms)]

    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """``inp`` (..., in_features) grouped by expert; ``m_splits`` tokens
        per expert (CUDA int tensor: graph-safe; list / CPU tensor: host
        path; see :mod:`lpmoe.functional`).  Returns (..., out_features)."""
        return grouped_linear(inp, m_splits, self.weights, self.biases, get_autocast_recipe(),
                              weight_cache=self.weight_cache, is_first_microbatch=is_first_microbatch,
                              fuse_wgrad_accumulation=self.fuse_wgrad_accumulation)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # TE checkpoints carry an `_extra_state` (its FP8 metadata); lpmoe
        # derives everything from the weights, so accept and drop it.
        state_dict.pop(prefix + "_extra_state", None)
        self.weight_cache.clear()  # new weights: the cached FP8 copy is stale
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}, params_dtype={self.params_dtype}"
                + (", fuse_wgrad_accumulation=True" if self.fuse_wgrad_accumulation else ""))
