"""``lpmoe.autocast``: choose the recipe lpmoe layers run under.

    with lpmoe.autocast(recipe=lpmoe.recipe.Float8BlockScaling()):
        y = layer(x, m_splits)

The state is a per-thread stack: nested contexts override the outer one and
restore it on exit; ``autocast(enabled=False)`` inside an enabled context
turns quantization off for its body.  Outside any context (or when disabled)
layers compute in their input dtype (bf16 / fp16 / fp32).  The recipe is read
at forward time; the backward pass uses the recipe its forward ran with.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

from lpmoe.recipe import Float8BlockScaling, Recipe

__all__ = ["autocast", "get_autocast_recipe", "is_autocast_enabled"]

class _State(threading.local):
    # Every thread starts with its own empty stack (threading.local runs
    # __init__ per thread), so reading it never creates it: an attribute
    # created on first use inside a compiled region would be a guard that
    # fails once and recompiles the caller.
    def __init__(self):
        self.stack = []


_state = _State()


def _stack() -> list:
    return _state.stack


@contextlib.contextmanager
def autocast(enabled: bool = True, recipe: Optional[Recipe] = None) -> Iterator[None]:
    """Run lpmoe layers inside the block with ``recipe``.

    Args:
        enabled: False turns low precision off inside the block (layers run
            in their input dtype), also when an outer block enabled it.
        recipe: the recipe; None with ``enabled=True`` means the default
            recipe, :class:`lpmoe.recipe.Float8BlockScaling` ``()`` (the one
            lpmoe runs natively on Hopper).
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be an lpmoe.recipe.Recipe or None, got {type(recipe).__name__}")
    if enabled and recipe is None:
        recipe = Float8BlockScaling()
    stack = _stack()
    stack.append(recipe if enabled else None)
    depth = len(stack)
    try:
        yield
    finally:
        # Pop exactly our own entry, so an exception in a nested block that
        # skipped its own exit cannot leave the stack shifted.
        del stack[depth - 1:]


def get_autocast_recipe() -> Optional[Recipe]:
    """The recipe of the innermost enabled autocast block, or None."""
    stack = _stack()
    return stack[-1] if stack else None


def is_autocast_enabled() -> bool:
    return get_autocast_recipe() is not None
