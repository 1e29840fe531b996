"""Access to the compiled extension ``lpmoe._C``.

The pure-PyTorch reference and every CPU path work without it; GPU paths
import it lazily so that a missing build gives one clear error.
"""
from __future__ import annotations

import functools

#: the binding interface this package calls (csrc/binding/module.cpp sets
#: the extension's own; they change together)
BINDING_VERSION = 10


@functools.lru_cache(maxsize=None)
def ext():
    try:
        from lpmoe import _C  # type: ignore[attr-defined]
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "lpmoe's CUDA extension (lpmoe._C) is not built. Install with "
            "`pip install --no-build-isolation .` (see README)."
        ) from exc
    built = getattr(_C, "BINDING_VERSION", 1)
    if built != BINDING_VERSION:
        raise RuntimeError(
            f"lpmoe's CUDA extension (lpmoe._C at {getattr(_C, '__file__', '?')}) was built from other sources: "
            f"binding version {built}, this package calls version {BINDING_VERSION}. Rebuild it "
            "(`pip install --no-build-isolation .`, or `python setup.py build_ext --inplace` in a checkout)."
        )
    return _C


def has_extension() -> bool:
    try:
        ext()
    except RuntimeError:
        return False
    return True
