"""Value semantics from a ``_fields()`` dict: equality, hashing and repr of
small configuration objects (quantizers, recipes)."""
from __future__ import annotations


class ValueFields:
    def _fields(self) -> dict:
        raise NotImplementedError

    def __eq__(self, other):
        return type(self) is type(other) and self._fields() == other._fields()

    def __hash__(self):
        return hash((type(self).__name__, tuple(sorted((k, str(v)) for k, v in self._fields().items()))))

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self._fields().items())
        return f"{type(self).__name__}({args})"
