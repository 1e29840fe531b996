"""Base class of lpmoe operations: recipe support is declared, not assumed."""
from __future__ import annotations

from typing import Optional

import torch

from lpmoe.autocast import get_autocast_recipe
from lpmoe.recipe import Float8BlockScaling, Recipe

__all__ = ["BasicOperation"]


class BasicOperation(torch.nn.Module):
    """An op of :class:`lpmoe.ops.Sequential`.

    Subclasses declare which recipes they handle.  An op that has not been
    written (and tested) for FP8 block scaling must not run silently under
    it, so :meth:`active_recipe` raises NotImplementedError unless the
    class sets ``supports_float8_block_scaling = True``.
    """

    #: the op runs correctly under lpmoe.recipe.Float8BlockScaling
    supports_float8_block_scaling = False
    #: forward takes (x, m_splits) rather than (x,)
    takes_m_splits = False
    #: forward takes optional per-row scales: (x, probs)
    takes_probs = False

    def __call__(self, *args, **kwargs):
        # Gate every call, whether or not a subclass's forward asks.
        self.active_recipe()
        return super().__call__(*args, **kwargs)

    def active_recipe(self) -> Optional[Recipe]:
        """The active autocast recipe, after checking this op supports it."""
        recipe = get_autocast_recipe()
        if isinstance(recipe, Float8BlockScaling) and not self.supports_float8_block_scaling:
            raise NotImplementedError(
                f"{type(self).__name__} does not support the Float8BlockScaling recipe "
                "(supports_float8_block_scaling = False); run it outside lpmoe.autocast or under "
                "lpmoe.autocast(enabled=False)")
        return recipe
