"""Static arguments of the custom ops as strings.

Custom-op schemas take tensors and scalars; lpmoe's configuration objects
(quantizers, recipes, activations) are small value objects
(lpmoe._value_fields).  Each is written as JSON of its class name and
fields, and read back into an equal object.  Strings are hashable constants
for Dynamo (no recompilation while the configuration stays the same) and
survive a compiled artifact being loaded in another process.
"""
from __future__ import annotations

import enum
import functools
import json
from typing import Any, Optional

import torch

__all__ = ["encode", "decode", "dtype_name", "dtype_from_name", "json_constant", "parse"]

_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8,
    torch.int32, torch.int64)}


def dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[name]


def _classes() -> dict:
    from lpmoe.activation.spec import Activation
    from lpmoe.quantizers import Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer
    from lpmoe.recipe import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling
    return {c.__name__: c for c in (Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer, Float8BlockScaling,
                                    MXFP8BlockScaling, NVFP4BlockScaling, Activation)}


def _value(v: Any) -> Any:
    if isinstance(v, torch.dtype):
        return {"dtype": dtype_name(v)}
    if isinstance(v, enum.Enum):
        return {"enum": type(v).__name__, "value": v.value}
    return v


def _read(v: Any) -> Any:
    if isinstance(v, dict) and "dtype" in v:
        return dtype_from_name(v["dtype"])
    if isinstance(v, dict) and "enum" in v:
        from lpmoe.recipe import Format
        return Format(v["value"])
    return v


def encode(obj: Optional[Any]) -> str:
    """JSON of a quantizer / recipe / activation (``"null"`` for None): the
    string each object wrote when it was made (lpmoe._value_fields), so
    traced code only reads an attribute."""
    if obj is None:
        return "null"
    spec = obj.__dict__.get("_spec")
    return spec if spec is not None else describe(obj)


def describe(obj: Any) -> str:
    fields = {k: _value(v) for k, v in obj._fields().items()}
    return json.dumps({"type": type(obj).__name__, "fields": fields}, sort_keys=True)


@functools.lru_cache(maxsize=1024)
def decode(spec: str) -> Optional[Any]:
    """The object :func:`encode` wrote (configuration objects are immutable,
    so one decoded object per string is shared)."""
    d = json.loads(spec)
    if d is None:
        return None
    cls = _classes()[d["type"]]
    return cls(**{k: _read(v) for k, v in d["fields"].items()})


@torch.compiler.assume_constant_result
def json_constant(obj: Any) -> str:
    """``json.dumps(obj, sort_keys=True)`` of static values, kept as a
    constant by Dynamo (see :func:`encode`)."""
    return json.dumps(obj, sort_keys=True)


@functools.lru_cache(maxsize=4096)
def parse(text: str) -> Any:
    """``json.loads`` of a static argument, parsed once per distinct string
    (the result is shared: callers must not modify it)."""
    return json.loads(text)
