"""Name tables of pluggable parts, with implementations imported on first use.

Every kind of pluggable part (KV backends, batch and routing policies, model architectures,
dtypes, ...) has one :class:`NameRegistry` in the module that owns the concept. An entry maps a
name to a ``"module:attribute"`` target that is imported only when the entry is first used, so
listing the names — for ``--help``, CLI ``choices`` or an error message — costs nothing and pulls
in no heavy dependency (a torch-free process can list torch-backed parts).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(ValueError):
    """A name that is not in the registry; the message lists the known ones."""


class NameRegistry(Generic[T]):
    """``name -> T`` for one kind of part (``kind`` names it in error messages).

    ``entries`` maps canonical names to ``"module:attribute"`` targets; ``aliases`` maps other
    accepted spellings to canonical names. Names are matched case-sensitively, except that
    ``normalize`` (default: identity) is applied to every lookup first.
    """

    def __init__(self, kind: str, entries: Mapping[str, str] | None = None,
                 aliases: Mapping[str, str] | None = None, normalize=None) -> None:
        self.kind = kind
        self._targets: dict[str, str] = {}
        self._aliases: dict[str, str] = {}
        self._loaded: dict[str, T] = {}
        self._normalize = normalize or (lambda name: name)
        for name, target in (entries or {}).items():
            self.register(name, target)
        for alias, name in (aliases or {}).items():
            self.alias(alias, name)

    # ---- building ---------------------------------------------------------------------------
    def register(self, name: str, target: str) -> None:
        """Add ``name`` -> ``"module:attribute"`` (imported on first :meth:`get`)."""
        module, sep, attr = target.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"{self.kind} {name!r}: target {target!r} is not 'module:attribute'")
        if name in self._targets or name in self._aliases:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._targets[name] = target

    def alias(self, alias: str, name: str) -> None:
        """Accept ``alias`` as another spelling of the registered ``name``."""
        if name not in self._targets:
            raise ValueError(f"{self.kind} alias {alias!r} points to unknown {name!r}")
        if alias in self._targets or alias in self._aliases:
            raise ValueError(f"{self.kind} {alias!r} is already registered")
        self._aliases[alias] = name

    # ---- looking up -------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Canonical names, in registration order."""
        return list(self._targets)

    def choices(self) -> list[str]:
        """Every accepted spelling (canonical names first, then aliases), for CLI ``choices``."""
        return [*self._targets, *self._aliases]

    def canonical(self, name: str) -> str:
        """The canonical name ``name`` stands for; :class:`UnknownNameError` lists the known ones."""
        key = self._normalize(name)
        key = self._aliases.get(key, key)
        if key not in self._targets:
            raise UnknownNameError(f"unknown {self.kind} {name!r}; known: {', '.join(self.choices())}")
        return key

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        key = self._normalize(name)
        return key in self._targets or key in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self._targets)

    def __len__(self) -> int:
        return len(self._targets)

    def get(self, name: str) -> T:
        """The implementation registered as ``name`` (imported now if it was not yet)."""
        key = self.canonical(name)
        if key not in self._loaded:
            module, _, attr = self._targets[key].partition(":")
            self._loaded[key] = getattr(importlib.import_module(module), attr)
        return self._loaded[key]

    def create(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call the implementation registered as ``name`` (a class or factory) with the arguments."""
        return self.get(name)(*args, **kwargs)  # type: ignore[operator]

    def __repr__(self) -> str:
        return f"NameRegistry({self.kind!r}, {self.choices()})"
