"""Specs are registered by metadata type and looked up through the MRO, so a subclass
inherits its base's declarations unless it registers its own. A missing spec is an error at
``bind``, never a silent skip (the ``hasattr`` class of bug)."""
from __future__ import annotations

from graphctl.errors import BindError, DeclarationError
from graphctl.state.plan import compile_spec
from graphctl.state.spec import StateSpec

__all__ = ["Registry", "default_registry", "register"]


class Registry:
    def __init__(self) -> None:
        self._specs: dict[type, StateSpec] = {}

    def register(self, cls: type, spec: StateSpec) -> StateSpec:
        """Register ``spec`` for ``cls``: compiles it (refusing contradictions) and freezes it."""
        if not isinstance(cls, type):
            raise DeclarationError("register() keys by type", expected="a class", found=type(cls).__name__,
                                   fix="pass the metadata class, e.g. register(DSAMetadata, spec)")
        if not isinstance(spec, StateSpec):
            raise DeclarationError("register() takes a StateSpec", expected="StateSpec", found=type(spec).__name__,
                                   fix="build the declarations with StateSpec(...)")
        if cls in self._specs:
            raise DeclarationError(f"type {cls.__qualname__} is already registered", expected="one spec per type",
                                   found=f"spec '{self._specs[cls].name}' already registered",
                                   fix="extend the existing spec in a new StateSpec and register a subclass")
        compile_spec(spec)
        self._specs[cls] = spec
        return spec

    def lookup(self, cls: type) -> StateSpec:
        for klass in cls.__mro__:
            spec = self._specs.get(klass)
            if spec is not None:
                return spec
        raise BindError(f"no spec registered for type {cls.__qualname__} or its bases",
                        expected="a registered StateSpec", found="none",
                        fix=f"graphctl.register({cls.__qualname__}, spec) before binding")

    def __contains__(self, cls: type) -> bool:
        return any(k in self._specs for k in cls.__mro__)


default_registry = Registry()
register = default_registry.register
