"""Functional API of the grouped expert layers.

* :func:`grouped_linear`  one grouped linear layer (the expert GEMMs)
* :func:`grouped_mlp`     fc1 -> fused activation -> fc2
* :class:`WeightCache`    FP8 weights kept across micro-batches
* :class:`LayerParams`    one layer's parameters for grouped_mlp

Modules: ``splits`` (routing), ``checks`` (argument validation),
``weights`` (weight operands and caching), ``saved`` (what backward keeps),
``linear_steps`` (the GEMM sequence shared by both layers); what each recipe
quantizes and saves is lpmoe.policy.
"""
from lpmoe.functional.linear import grouped_linear
from lpmoe.functional.mlp import LayerParams, grouped_mlp
from lpmoe.functional.weights import WeightCache

__all__ = ["grouped_linear", "grouped_mlp", "LayerParams", "WeightCache"]
