"""What the gateway's parts tell the cluster page as it happens: role flips (:mod:`xllm.gateway.roles`) and
moves (:mod:`xllm.gateway.moves`) publish to one :class:`EventSink` their owner gives them (the page's
:class:`~xllm.gateway.dashboard.hub.EventHub`; None: nobody listens)."""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger(__name__)


class EventSink(Protocol):
    """Takes an event of ``kind`` with its JSON-able ``data``; must not block."""

    def publish(self, kind: str, data: dict) -> object: ...


def publish_safely(sink: EventSink | None, kind: str, data: dict) -> None:
    """Offer an event to ``sink`` (None: nothing); a sink that fails is logged: the page's feed never stops
    the work it reports."""
    if sink is None:
        return
    try:
        sink.publish(kind, data)
    except Exception:
        log.exception("publishing %s failed", kind)
