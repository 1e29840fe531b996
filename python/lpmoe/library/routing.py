"""When lpmoe's entry points go through their PyTorch custom ops.

Every public entry point has a custom op (``torch.ops.lpmoe.*``, defined in
this package) so that ``torch.compile`` sees one opaque node per call, with
a fake implementation for shapes.  Plain eager calls skip the dispatcher and
run the same implementation function directly: a Python custom op costs
~20 us of host time per call (measured on the CI machine), which a
launch-bound MoE step would feel, and the result is the same either way.

:func:`tracing` decides: Dynamo is tracing, or one of PyTorch's tracing
modes is active (FakeTensorMode while shapes are propagated,
functionalization and proxy modes while AOTAutograd traces).  Inside the
fake implementations of the layer ops the same rule sends every inner call
to its op's fake, which is how those layers get their output shapes from
the code that produces them.
"""
from __future__ import annotations

from typing import Dict

import torch

__all__ = ["tracing", "OPS"]

#: adapters of the registered ops by name (filled by lpmoe.library.* at import)
OPS: Dict[str, object] = {}


_TRACING_MODES = (torch._C._TorchDispatchModeKey.FAKE, torch._C._TorchDispatchModeKey.PROXY,
                  torch._C._TorchDispatchModeKey.FUNCTIONAL)
# bound once: a layer step asks ~80 times (0.48 -> 0.18 us per call on the
# CI machine); Dynamo knows is_compiling by identity, so the alias traces alike
_FAKE, _PROXY, _FUNCTIONAL = _TRACING_MODES
_is_compiling = torch.compiler.is_compiling
_mode = torch._C._get_dispatch_mode


def tracing() -> bool:
    """True when an lpmoe entry point must call its custom op rather than
    its implementation (see the module docstring): Dynamo is tracing, or one
    of PyTorch's tracing modes (fake tensors, proxy tracing,
    functionalization) is active.  User dispatch modes (FlopCounterMode,
    debugging modes, selective checkpointing) keep the eager path."""
    if _is_compiling():
        return True
    return _mode(_FAKE) is not None or _mode(_PROXY) is not None or _mode(_FUNCTIONAL) is not None
