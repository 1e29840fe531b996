"""Sizes that may be symbolic.

Under torch.compile with dynamic shapes the token count of a layer call is a
``torch.SymInt`` inside the layer ops' fake implementations.  Converting it
with ``int()`` would pin the compiled graph to one token count (a guard on
the exact value, so every new count recompiles); lpmoe's shape code keeps
such sizes symbolic instead and converts only concrete values."""
from __future__ import annotations

import torch


def size(d):
    """``d`` as a size: a SymInt stays symbolic, anything else becomes int."""
    return d if isinstance(d, torch.SymInt) else int(d)


def key(d):
    """A hashable stand-in for a size (SymInts are unhashable): the int, or
    the symbolic expression's text, which names the same size within one
    trace."""
    return ("sym", str(d)) if isinstance(d, torch.SymInt) else d
