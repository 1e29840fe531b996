"""Which parameters an optimizer can step together with their FP8 copies:
one :class:`ExpertWeights` per lpmoe grouped linear layer (its G expert
weights, per-expert parameters or one stacked parameter, and its
:class:`~lpmoe.functional.WeightCache`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Union

import torch

from lpmoe.functional.weights import WeightCache
from lpmoe.module.grouped_linear import GroupedLinear

__all__ = ["ExpertWeights", "expert_weights_of"]


@dataclass(eq=False)
class ExpertWeights:
    """The weights of one grouped linear layer as the optimizer sees them."""
    name: str
    #: what the layer passes to lpmoe.functional (list of (N, K), or (G, N, K))
    weights: Union[List[torch.Tensor], torch.Tensor]
    cache: WeightCache
    #: (the cache's wanted quantizer, its two-direction copy): made once per format
    quantizer: Optional[tuple] = None
    #: the cache GroupedTensor last checked to fit (checked again when it changes)
    buffers_of: Optional[object] = None
    #: the experts' step counts (their states' ``step`` are 0-dim views of it)
    counts: Optional[torch.Tensor] = None

    @property
    def params(self) -> List[torch.Tensor]:
        """The parameters (optimizer state is kept per parameter)."""
        return [self.weights] if isinstance(self.weights, torch.Tensor) else list(self.weights)

    @property
    def shape(self):
        w = self.weights
        return tuple(w.shape) if isinstance(w, torch.Tensor) else (len(w),) + tuple(w[0].shape)


def expert_weights_of(modules: Union[torch.nn.Module, Iterable[torch.nn.Module]]) -> List[ExpertWeights]:
    """Every lpmoe GroupedLinear (also inside GroupedMLP, MoELayer and
    lpmoe.ops) found in ``modules``, once each."""
    roots = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
    found, seen = [], set()
    for root in roots:
        if not isinstance(root, torch.nn.Module):
            raise TypeError(f"fp8_weights_of takes torch.nn.Modules, got {type(root).__name__}")
        for name, m in root.named_modules():
            if isinstance(m, GroupedLinear) and id(m) not in seen:
                seen.add(id(m))
                found.append(ExpertWeights(name or type(m).__name__, m.functional_params()[0], m.weight_cache))
    return found
