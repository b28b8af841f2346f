"""Errors the engine raises to its callers (no torch: the gateway maps them without loading the engine)."""

from __future__ import annotations


class ConfigError(ValueError):
    """An engine setting is out of range or inconsistent."""


class EngineError(RuntimeError):
    """Base class of engine errors."""


class InvalidRequestError(EngineError, ValueError):
    """The request cannot be served as given (bad parameter, prompt too long).

    ``param`` names the offending field when there is one.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineOverloadedError(EngineError):
    """The waiting queue is full; retry later."""


class EngineDeadError(EngineError):
    """The engine loop has stopped (shut down or crashed)."""


class EngineCrashedError(EngineDeadError):
    """The engine loop crashed while the request was in flight. ``suspect``: the request was in the
    step that raised (it may be what crashed the engine); otherwise it was a bystander."""

    def __init__(self, message: str, suspect: bool) -> None:
        super().__init__(message)
        self.suspect = suspect
