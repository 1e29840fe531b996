"""Optimizers that know lpmoe's layers.

* :class:`AdamW`  torch.optim.AdamW whose step also writes the expert layers'
  FP8 weights (one fused kernel per layer; the forward then quantizes none)
* :func:`stats`   how many layer steps took the fused path
"""
from lpmoe.optim.adamw import AdamW, stats

__all__ = ["AdamW", "stats"]
