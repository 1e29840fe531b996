"""Access to the compiled extension ``lpmoe._C``.

The pure-PyTorch reference and every CPU path work without it; GPU paths
import it lazily so that a missing build gives one clear error.
"""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def ext():
    try:
        from lpmoe import _C  # type: ignore[attr-defined]
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "lpmoe's CUDA extension (lpmoe._C) is not built. Install with "
            "`pip install --no-build-isolation .` (see README)."
        ) from exc
    return _C


def has_extension() -> bool:
    try:
        ext()
    except RuntimeError:
        return False
    return True
