"""One way to define an lpmoe custom op: ``lpmoe::<name>`` with its real
implementation (every device: it dispatches to the CUDA kernels or the CPU
reference itself) and its fake implementation (shapes only)."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["define"]


def define(name: str, fake: Callable, mutates_args: Sequence[str] = ()):
    def wrap(fn: Callable):
        op = torch.library.custom_op(f"lpmoe::{name}", fn, mutates_args=tuple(mutates_args))
        op.register_fake(fake)
        return op
    return wrap
