"""What the ``lpmoe::grouped_mlp`` ops share: the static configuration
(a JSON string, constant per call site) decoded into the MLP's config, and
the names of the objects the forward saves for the backward."""
from __future__ import annotations

from typing import Tuple

from lpmoe.functional import mlp
from lpmoe.library import mlp_route, specs
from lpmoe.library.layer_common import needs_of_list, op_cache
from lpmoe.policy import Needs, policy_for

__all__ = ["SAVED", "mlp_config", "wgrad_out", "fc1_parts"]

#: the op's saved objects: the MLP's, then the routing's (lpmoe.library.mlp_route)
SAVED = mlp.SAVED + mlp_route.ROUTE


def _layer(c: dict, name: str, policy, fake: bool, weights=None) -> mlp._Layer:
    cache = op_cache(c[name]["cache"], c["first"], fake, weights)
    return mlp._Layer(policy, c["num"], c[name]["bias"], cache, False, tuple(c[name]["shape"]), c[name]["stacked"],
                      bool(c[name]["keep"]))


def mlp_config(c: dict, fake: bool, w1=None, w2=None) -> mlp.MLPConfig:
    """The MLPConfig of a parsed op configuration (``fake``: no weight
    caches; ``w1`` / ``w2``: the forward's weights, whose optimizer-written
    caches a default call reads)."""
    policy = policy_for(specs.decode(c["recipe"]))
    l1, l2 = _layer(c, "fc1", policy, fake, w1), _layer(c, "fc2", policy, fake, w2)
    first = None if (l1.weight_cache is None or l2.weight_cache is None) else c["first"]
    need1, need2, need_probs = c["needs"]
    return mlp.MLPConfig(specs.decode(c["act"]), l1, l2, c["probs"], first, c["grad"],
                         (needs_of_list(need1), needs_of_list(need2), need_probs))


def wgrad_out(c: dict, need: Needs, layer: str) -> bool:
    """Whether the backward returns ``layer``'s weight gradients (fused
    layers add them into main_grad instead)."""
    return need.wgrad and c[layer]["fuse"] is None


def fc1_parts(need1: Needs) -> Tuple[str, ...]:
    """The fc1 backward ops a staged backward runs, in order."""
    return (("wgrad",) if need1.wgrad or need1.dbias else ()) + (("dgrad",) if need1.dgrad else ())
