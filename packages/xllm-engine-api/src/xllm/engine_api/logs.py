"""Log lines that name their request: the request id (and trace id) of the task that logged, as text or JSON.

Every process of the service (gateway, engine, TP worker rank) sets its logging up with
:func:`setup_logging`. A request's handler sets :data:`REQUEST_ID` (the gateway's HTTP request id; an
engine's call, its engine request id) and, when the request is traced, :data:`TRACE_ID`; every line
logged in that task (and the threads it hands work to with a copied context) carries them: ``[req=…]``
in text, ``request_id`` / ``trace_id`` fields in JSON (``--log-format json``: one object per line for log
collectors: ``time``, ``level``, ``logger``, ``message``, ``request_id``, ``trace_id``, ``exception``).

The two context variables are this module's only module-level objects besides constants: a
``ContextVar`` holds one value per asyncio task / copied context, never state shared between requests.
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar

REQUEST_ID: ContextVar[str | None] = ContextVar("xllm_request_id", default=None)
TRACE_ID: ContextVar[str | None] = ContextVar("xllm_trace_id", default=None)
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(request_tag)s: %(message)s"


class RequestContext(logging.Filter):
    """Adds ``request_id``, ``trace_id`` and ``request_tag`` (`` [req=ID]`` or empty) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = REQUEST_ID.get()
        record.request_id = rid
        record.trace_id = TRACE_ID.get()
        record.request_tag = f" [req={rid}]" if rid else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see the module docstring); ``static`` fields are added to each (e.g. the rank)."""

    def __init__(self, static: dict[str, object] | None = None) -> None:
        super().__init__()
        self.static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "message": record.getMessage(), **self.static}
        for key in ("request_id", "trace_id"):
            value = getattr(record, key, None)
            if value:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def setup_logging(level: str | int, fmt: str = "text", static: dict[str, object] | None = None,
                  text_format: str = TEXT_FORMAT) -> None:
    """The root logger at ``level`` in ``fmt`` (``text``/``json``) on stderr, every record tagged with its
    request (:class:`RequestContext`); ``static``: JSON fields of every line. As ``logging.basicConfig``: a
    root logger that already has handlers (an embedding application's, a test runner's) keeps them and only
    gets the level."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"--log-format: {fmt!r} is not one of {', '.join(LOG_FORMATS)}")
    root = logging.getLogger()
    root.setLevel(level if isinstance(level, int) else getattr(logging, level.upper()))
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.addFilter(RequestContext())
    handler.setFormatter(JsonFormatter(static) if fmt == "json" else logging.Formatter(text_format))
    root.addHandler(handler)


def current_format() -> str:
    """The format :func:`setup_logging` gave this process (``text`` when it was not set up): a child process
    (a tensor-parallel rank) logs the way its parent does."""
    json_handlers = [h for h in logging.getLogger().handlers if isinstance(h.formatter, JsonFormatter)]
    return "json" if json_handlers else "text"
