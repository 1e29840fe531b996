"""Functional API of the grouped expert layers.

* :func:`grouped_linear`  one grouped linear layer (the expert GEMMs)
* :class:`WeightCache`    FP8 weights kept across micro-batches

Modules: ``splits`` (routing), ``checks`` (argument validation),
``weights`` (weight operands and caching), ``saved`` (what backward keeps),
``linear_steps`` (the GEMM sequence); what each recipe quantizes and saves
is lpmoe.policy.
"""
from lpmoe.functional.linear import grouped_linear
from lpmoe.functional.weights import WeightCache

__all__ = ["grouped_linear", "WeightCache"]
