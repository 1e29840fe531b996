"""Value semantics from a ``_fields()`` dict: equality, hashing and repr of
small configuration objects (quantizers, recipes)."""
from __future__ import annotations


class ValueFields:
    """Each instance carries its JSON description (``_spec``,
    lpmoe.library.specs), written when the outermost ``__init__`` returns and
    rewritten when a field is assigned later, so traced code (torch.compile)
    reads a string instead of running json."""

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        def __init__(self, *args, **kwargs):
            depth = self.__dict__.get("_init_depth", 0)
            self.__dict__["_init_depth"] = depth + 1
            try:
                init(self, *args, **kwargs)
            finally:
                self.__dict__["_init_depth"] = depth
            if depth == 0:
                from lpmoe.library.specs import describe
                self.__dict__["_spec"] = describe(self)

        __init__.__doc__, __init__.__wrapped__ = init.__doc__, init
        cls.__init__ = __init__

    def __setattr__(self, name, value):
        if not name.startswith("_") and self.__dict__.get("_frozen"):
            raise AttributeError(f"cannot set {name!r}: this {type(self).__name__} is shared (lpmoe hands one "
                                 f"object per configuration to every GEMM operand); change a copy instead: "
                                 f"q.copy({name}=...)")
        object.__setattr__(self, name, value)
        if not name.startswith("_") and "_spec" in self.__dict__:  # changed after construction: rewrite
            from lpmoe.library.specs import describe
            self.__dict__["_spec"] = describe(self)

    def _freeze(self):
        """Refuse later field assignments (objects shared through :func:`shared`)."""
        self.__dict__["_frozen"] = True
        return self

    def _fields(self) -> dict:
        raise NotImplementedError

    def __eq__(self, other):
        return type(self) is type(other) and self._fields() == other._fields()

    def __hash__(self):
        return hash((type(self).__name__, tuple(sorted((k, str(v)) for k, v in self._fields().items()))))

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self._fields().items())
        return f"{type(self).__name__}({args})"


_SHARED: dict = {}


def shared(obj: ValueFields, extra: tuple, make):
    """One frozen object per (class and configuration of ``obj``, ``extra``):
    ``make()`` builds it on a miss.  For configuration objects the layers
    derive at every step (a quantizer from a recipe, a one-direction copy of
    a quantizer): building one writes its JSON description (~10-30 us of
    host time), a lookup reads the description the source already holds.
    ``make`` runs on the object itself, so subclasses unknown to the spec
    decoder work.  Bounded: configurations are few in practice."""
    from lpmoe.library.specs import encode
    key = (type(obj), encode(obj)) + extra
    got = _SHARED.get(key)
    if got is None:
        if len(_SHARED) >= 1024:
            _SHARED.clear()
        got = _SHARED[key] = make()._freeze()
    return got
