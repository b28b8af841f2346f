"""Failover: what becomes of a request whose instance broke its stream off.

An instance breaks a stream off (``InstanceUnavailableError``) when it died, hung, crashed or handed
the request back while shutting down. :class:`Failover` decides for the request's
:class:`~xllm.gateway.dispatch.RoutedStream`:

- the instance fails in the router (:meth:`Router.failed <xllm.gateway.router.Router.failed>`: its
  circuit breaker opens) unless the error names another instance (the other part of a PD pair, which
  accounted it), and the request is not placed on it again;
- a request that was a suspect in ``max_crash_strikes`` crashes (running when an engine crashed, in
  the failing step or on an instance that vanished) is failed (``RequestFailedError``: an internal
  error, not replayed on yet another instance);
- one already resumed ``max_resumes`` times gives up with the break;
- any other is resumed on another instance by recompute: the router places its continuation
  (:func:`xllm.gateway.progress.continuation`) away from the instances that failed it.

It counts ``xllm:router_failed_after_crashes`` and ``xllm:router_resumed_requests``
(:class:`~xllm.gateway.metrics.RouterMetrics`, the router's).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from xllm.engine_api.wire import InstanceUnavailableError, RequestFailedError

if TYPE_CHECKING:
    from xllm.gateway.metrics import RouterMetrics
    from xllm.gateway.progress import RequestProgress
    from xllm.gateway.router import Router, Ticket

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FailoverLimits:
    """``max_resumes``: continuations of a broken stream; ``max_crash_strikes``: instance failures a
    request may be a suspect in before it is failed rather than replayed."""

    max_resumes: int = 2
    max_crash_strikes: int = 2


class Failover:
    """Decides whether a broken stream is resumed or failed (see the module docstring); one per gateway."""

    def __init__(self, router: Router, limits: FailoverLimits | None = None,
                 metrics: RouterMetrics | None = None) -> None:
        self.router = router
        self.limits = limits or FailoverLimits()
        self.metrics = metrics

    def broke(self, model: str, ticket: Ticket, exc: InstanceUnavailableError, progress: RequestProgress) -> bool:
        """The request of ``progress`` running on ``ticket``'s instance broke off with ``exc``: account
        it (the failed instance into ``progress.failed``, ``exc.suspect`` into its crash strikes).
        Returns True when it is to be resumed elsewhere (the caller places it, then calls
        :meth:`resumed`), False when its resumes are spent (the caller re-raises ``exc``); raises
        :class:`RequestFailedError` from ``exc`` when it was a suspect in too many crashes."""
        if exc.instance_id and exc.instance_id != ticket.state.instance_id:
            progress.failed.add(exc.instance_id)  # another part of a PD pair (accounted there)
        else:
            self.router.failed(ticket.state)
            progress.failed.add(ticket.state.instance_id)
        progress.crash_strikes += exc.suspect
        rid = progress.request.request_id
        if progress.crash_strikes >= self.limits.max_crash_strikes:
            log.error("request %s failed: it was running when %d instances failed (%s); not replayed",
                      rid, progress.crash_strikes, ", ".join(sorted(progress.failed)))
            if self.metrics is not None:
                self.metrics.poisoned(model)
            raise RequestFailedError(f"the request was running on {progress.crash_strikes} instances that "
                                     "failed; it is not retried") from exc
        if progress.resumes >= self.limits.max_resumes:
            return False
        log.warning("request %s: %s; resuming after %d token(s) on another instance", rid, exc,
                    len(progress.generated))
        return True

    def resumed(self, model: str, ticket: Ticket, progress: RequestProgress) -> None:
        """The request that broke off ``ticket``'s instance was placed elsewhere (counted)."""
        progress.resumes += 1
        if self.metrics is not None:
            self.metrics.resumed(model, ticket.state.instance_id)
