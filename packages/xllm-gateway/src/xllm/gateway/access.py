"""Who may call the OpenAI API, and who may ask for priority scheduling.

- **API keys** (``xllm serve --api-key KEY``, repeatable, or ``$XLLM_API_KEY``, comma-separated):
  when any is configured, every ``/v1/*`` route requires ``Authorization: Bearer <key>`` and
  answers 401 (type ``authentication_error``) otherwise. ``/health`` and ``/metrics`` stay open
  (probes and scrapers carry no key; bind them to a trusted network). Keys are compared in
  constant time (digests of equal length, :func:`hmac.compare_digest`), every key each time.
- **Priority** (a negative ``priority``, or ``service_tier`` ``priority``/``scale``: ahead of default
  requests): honoured only for the keys of ``--priority-api-key`` (which are valid API keys too), or
  for every client when no API key is configured and ``--allow-client-priority`` is given. Anyone
  else asking for it gets 403 (type ``permission_error``) naming the field, rather than being
  silently served at the default priority.
- **Offline** (``service_tier: "flex"``, or a ``priority`` at or above ``--offline-priority``, 1 by
  default): a downgrade, so anyone may ask for it, as for any positive ``priority`` (served after
  default requests). Offline requests are best-effort work in the capacity online requests leave
  (:mod:`xllm.sched.colocation`); :meth:`AccessPolicy.scheduling` says how a request is scheduled.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from xllm.gateway.openai.errors import forbidden, unauthorized
from xllm.gateway.openai.protocol import DEFAULT_OFFLINE_PRIORITY, OpenAIRequest, Scheduling

API_KEY_ENV = "XLLM_API_KEY"
API_PREFIX = "/v1/"
DASHBOARD_DATA_PREFIX = "/dashboard/api/"  # the live cluster page's data
# what the API keys guard (ApiGuard; the bearer scheme of /openapi.json): the OpenAI routes, the page's data,
# vLLM's tokenizer routes and the sleep / weight-update routes (xllm.gateway.openai.serving_weights)
KEYED_PREFIXES = (API_PREFIX, DASHBOARD_DATA_PREFIX, "/tokenize", "/detokenize", "/sleep", "/wake_up", "/is_sleeping",
                  "/update_weights")
SCHEME = "bearer"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class Caller:
    """The authenticated client of one request."""

    authenticated: bool  # presented a configured key
    may_set_priority: bool
    admin: bool = False  # presented an admin key (or no keys are configured): may load and unload adapters


@dataclass(frozen=True)
class AccessPolicy:
    """The API keys, the keys allowed to raise priorities, whether keyless clients may, and the
    priority from which a request is offline."""

    api_keys: frozenset[str] = frozenset()
    priority_keys: frozenset[str] = frozenset()
    admin_keys: frozenset[str] = frozenset()  # may change what is served (LoRA adapters); also API keys
    allow_client_priority: bool = False
    offline_priority: int = DEFAULT_OFFLINE_PRIORITY

    def __post_init__(self) -> None:
        for key in self.api_keys | self.priority_keys | self.admin_keys:
            if not key or key != key.strip():
                raise ValueError("an API key must be non-empty and have no surrounding whitespace")
        if self.allow_client_priority and self.api_keys:
            raise ValueError("--allow-client-priority applies only without --api-key; with API keys, list the "
                             "keys that may set priorities with --priority-api-key")

    @property
    def requires_key(self) -> bool:
        return bool(self.api_keys or self.admin_keys)

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller presenting the ``Authorization`` header value (None: no header); raises the
        401 :class:`APIError` when a key is required and this one is missing or wrong."""
        key = None
        if authorization is not None:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == SCHEME and value.strip():
                key = value.strip()
        if key is None:
            if self.requires_key:
                raise unauthorized("Missing bearer authentication in header: send 'Authorization: Bearer <API key>'.")
            return Caller(False, self.allow_client_priority, admin=True)
        given = _digest(key)
        is_api_key = is_priority_key = is_admin_key = False
        for k in self.api_keys:  # every key, no early exit
            is_api_key |= hmac.compare_digest(given, _digest(k))
        for k in self.priority_keys:
            is_priority_key |= hmac.compare_digest(given, _digest(k))
        for k in self.admin_keys:
            is_admin_key |= hmac.compare_digest(given, _digest(k))
        if self.requires_key and not (is_api_key or is_priority_key or is_admin_key):
            raise unauthorized("Incorrect API key provided.")
        return Caller(is_api_key or is_priority_key or is_admin_key, is_priority_key or self.allow_client_priority,
                      admin=is_admin_key or not self.requires_key)

    @staticmethod
    def check_admin(caller: Caller, what: str) -> None:
        """403 unless ``caller`` may change what the server serves (an admin key, or no keys configured)."""
        if not caller.admin:
            raise forbidden(f"{what} needs an admin API key (xllm serve --admin-api-key)")

    def scheduling(self, req: OpenAIRequest) -> Scheduling:
        """How the engine schedules ``req``: its priority, and whether it is offline."""
        return req.scheduling(self.offline_priority)

    @staticmethod
    def check_priority(caller: Caller, req: OpenAIRequest) -> None:
        """403 naming the field when ``req`` asks to be served ahead of default requests and
        ``caller`` may not (lower priorities and offline need no permission)."""
        asked = req.requested_priority()
        if asked is not None and not caller.may_set_priority:
            field, _ = asked
            raise forbidden(f"{field}: this client may not set the scheduling priority (the server honours it "
                            f"only for its priority API keys)", field)


def parse_keys(values: list[str] | None, env: str | None = None) -> frozenset[str]:
    """Keys from repeated flags (as given: :class:`AccessPolicy` refuses blank ones) plus a
    comma-separated environment value (entries stripped, blank ones dropped)."""
    keys = set(values or ())
    if env:
        keys.update(k.strip() for k in env.split(",") if k.strip())
    return frozenset(keys)
