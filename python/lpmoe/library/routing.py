"""When lpmoe's entry points go through their PyTorch custom ops.

Every public entry point has a custom op (``torch.ops.lpmoe.*``, defined in
this package) so that ``torch.compile`` sees one opaque node per call, with
a fake implementation for shapes.  Plain eager calls skip the dispatcher and
run the same implementation function directly: a Python custom op costs
~20 us of host time per call (measured on the CI machine), which a
launch-bound MoE step would feel, and the result is the same either way.

:func:`tracing` decides: Dynamo is tracing, or a dispatch mode is active
(FakeTensorMode while shapes are propagated, functionalization and proxy
modes while AOTAutograd traces, or any mode a user installed).  Inside the
fake implementations of the layer ops the same rule sends every inner call
to its op's fake, which is how those layers get their output shapes from
the code that produces them.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["tracing", "OPS"]

#: adapters of the registered ops by name (filled by lpmoe.library.* at import)
OPS: Dict[str, object] = {}


def tracing() -> bool:
    """True when an lpmoe entry point must call its custom op rather than
    its implementation (see the module docstring)."""
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
