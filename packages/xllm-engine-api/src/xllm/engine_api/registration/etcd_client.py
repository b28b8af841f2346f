"""A small asyncio etcd v3 client over etcd's JSON gRPC gateway (``/v3/...``), on httpx.

Why this and not a client library (the reasoning is also in docs/architecture.md):

- PyPI ``etcd3`` 0.12 fails to import with protobuf 7 (its generated code predates it);
  ``aetcd`` 1.0 works today but ships its own generated etcd protobuf code, which is exactly
  what broke ``etcd3`` and pins us to its maintainers' regeneration schedule; ``etcd3gw`` is
  synchronous (requests + futurist threads) where the gateway and the engine server are asyncio.
- The registry needs eight calls (put, range, delete, lease grant/keepalive/revoke, watch).
  etcd serves all of them as JSON on its client port (etcd >= 3.4: ``/v3/``), so the client is a
  few dozen lines on httpx, already a dependency, with no generated code and no protobuf
  version coupling; watches are a streamed HTTP response of JSON lines.
- Values are our own protobuf messages, base64 in the JSON like every etcd key and value.

Endpoints are ``host:port`` (or ``http://host:port``), several separated by commas. Every call has
timeouts (``connect_timeout`` to connect, ``timeout`` for the rest): a call that cannot connect, times
out or meets an unavailable member (HTTP 503, gRPC ``UNAVAILABLE``) is retried on the next endpoint,
and :class:`EtcdUnavailable` is raised when none answered. A watch asks etcd for progress
notifications (empty responses on an idle stream; how often is etcd's
``--experimental-watch-progress-notify-interval``, 10 min by default) and raises
:class:`EtcdWatchTimeout` when nothing at all arrived for its idle timeout: a frozen etcd or a
silently dead connection cannot leave a watcher waiting forever.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)

NOT_FOUND = 5  # gRPC code etcd uses for an unknown lease
UNAVAILABLE = 14  # gRPC code of a member that cannot serve (no leader, stopping): try another
DEFAULT_TIMEOUT = 3.0  # seconds a call may take once connected (the registry's calls are small)
DEFAULT_CONNECT_TIMEOUT = 1.0
DEFAULT_WATCH_TIMEOUT = 10.0  # seconds a watch may stay silent before it counts as dead


# An endpoint that could not be talked to. httpx maps most of these to TransportError, but a TLS
# alert that arrives with the first read (a client certificate refused under TLS 1.3) surfaces as the
# raw ssl.SSLError.
TRANSPORT_ERRORS = (httpx.TransportError, ssl.SSLError)


class EtcdError(RuntimeError):
    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class EtcdLeaseNotFound(EtcdError):
    """The lease expired or was revoked."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered (refused, timed out, or unavailable)."""


class EtcdWatchTimeout(EtcdError):
    """A watch stream stayed silent (no event, no progress notification) for its idle timeout."""

    def __init__(self, idle_timeout: float) -> None:
        super().__init__(f"etcd watch silent for {idle_timeout:g} s")
        self.idle_timeout = idle_timeout


class EtcdCompacted(EtcdError):
    """A watch asked for revisions etcd has compacted away: re-read the range."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted (oldest available {compact_revision})")
        self.compact_revision = compact_revision


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True)
class WatchEvent:
    type: str  # "PUT" or "DELETE"
    key: str
    value: bytes
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True)
class WatchResponse:
    """One response of a watch stream: its creation, a batch of changes, or a progress notification
    (no events: nothing changed up to ``revision``; every later event has a higher revision)."""

    revision: int  # the store revision in the response header
    events: tuple[WatchEvent, ...] = ()
    created: bool = False

    @property
    def progress(self) -> bool:
        return not self.events and not self.created


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_range_end(prefix: str) -> bytes:
    """The etcd ``range_end`` that covers every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    for i in range(len(raw) - 1, -1, -1):
        if raw[i] < 0xFF:
            raw[i] += 1
            return bytes(raw[: i + 1])
    return b"\0"


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = []
    for item in (e.strip() for e in items):
        if not item:
            continue
        out.append(item.rstrip("/") if "://" in item else f"http://{item}")
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


class EtcdClient:
    """The etcd calls the registry needs, async, over the JSON gateway.

    ``timeout`` bounds every call once connected (reading the answer included), ``connect_timeout``
    each connection attempt; a failed attempt moves on to the next endpoint (see the module doc).
    ``watch_timeout`` is the default idle timeout of :meth:`watch_prefix`.
    """

    def __init__(self, endpoints: str | Sequence[str], timeout: float = DEFAULT_TIMEOUT, *,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 watch_timeout: float = DEFAULT_WATCH_TIMEOUT, ssl_context: ssl.SSLContext | None = None) -> None:
        for name, value in (("timeout", timeout), ("connect_timeout", connect_timeout),
                            ("watch_timeout", watch_timeout)):
            if value <= 0:
                raise ValueError(f"etcd {name} must be > 0, got {value}")
        self.endpoints = parse_endpoints(endpoints)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.watch_timeout = watch_timeout
        self._current = 0
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=connect_timeout), trust_env=False,
                                       verify=ssl_context or True)  # ssl_context: https:// endpoints' CA, client cert

    @property
    def endpoint(self) -> str:
        """The endpoint the last successful call used (tried first by the next one)."""
        return self.endpoints[self._current]

    async def close(self) -> None:
        await self._http.aclose()

    def _order(self) -> list[int]:
        """Endpoint indexes to try: the last one that answered, then the others in turn."""
        return [(self._current + k) % len(self.endpoints) for k in range(len(self.endpoints))]

    async def _post(self, path: str, body: dict) -> dict:
        failures: list[str] = []
        for idx in self._order():
            endpoint = self.endpoints[idx]
            try:
                resp = await self._http.post(endpoint + path, json=body)
                data = resp.json() if resp.content else {}
            except TRANSPORT_ERRORS as exc:
                failures.append(f"{endpoint}: {type(exc).__name__} {exc}".rstrip())
                continue
            except ValueError:  # not JSON: not an etcd (a proxy's error page?)
                failures.append(f"{endpoint}: HTTP {resp.status_code}, not JSON")
                continue
            code = data.get("code") if isinstance(data, dict) else None
            if resp.status_code == 503 or code == UNAVAILABLE:
                failures.append(f"{endpoint}: unavailable: {data.get('message') or resp.text}")
                continue
            self._current = idx
            if resp.status_code != 200:
                message = data.get("message") or data.get("error") or resp.text
                if code == NOT_FOUND and "lease" in str(message):
                    raise EtcdLeaseNotFound(message, code)
                raise EtcdError(f"etcd {path}: HTTP {resp.status_code}: {message}", code)
            return data
        raise EtcdUnavailable(f"no etcd endpoint answered {path} ({'; '.join(failures)})")

    # ---- keys -----------------------------------------------------------------------------
    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        data = await self._post("/v3/kv/put", body)
        return int(data.get("header", {}).get("revision", 0))

    async def get(self, key: str) -> KeyValue | None:
        data = await self._post("/v3/kv/range", {"key": _b64(key)})
        kvs = data.get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    async def get_prefix(self, prefix: str) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` and the store revision they were read at."""
        data = await self._post("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_range_end(prefix))})
        return int(data.get("header", {}).get("revision", 0)), [_kv(kv) for kv in data.get("kvs") or []]

    async def delete_prefix(self, prefix: str) -> int:
        data = await self._post("/v3/kv/deleterange",
                                {"key": _b64(prefix), "range_end": _b64(prefix_range_end(prefix))})
        return int(data.get("deleted", 0))

    # ---- leases ---------------------------------------------------------------------------
    async def grant(self, ttl: float) -> tuple[int, int]:
        """A new lease; returns ``(lease_id, granted ttl seconds)``."""
        data = await self._post("/v3/lease/grant", {"TTL": str(max(1, round(ttl)))})
        if data.get("error"):
            raise EtcdError(f"lease grant failed: {data['error']}")
        return int(data["ID"]), int(data.get("TTL", 0))

    async def keepalive(self, lease: int) -> int:
        """Renew ``lease``; returns its TTL, 0 when it no longer exists."""
        data = await self._post("/v3/lease/keepalive", {"ID": str(lease)})
        return int(data.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        with contextlib.suppress(EtcdLeaseNotFound):
            await self._post("/v3/lease/revoke", {"ID": str(lease)})

    # ---- watch ----------------------------------------------------------------------------
    async def watch_prefix(self, prefix: str, start_revision: int,
                           idle_timeout: float | None = None) -> AsyncIterator[WatchResponse]:
        """Every response of a watch of ``prefix`` from ``start_revision`` on, in revision order:
        first its creation, then batches of changes and progress notifications.

        Raises :class:`EtcdCompacted` when that revision is gone, :class:`EtcdWatchTimeout` when
        nothing arrived for ``idle_timeout`` s (default: the client's ``watch_timeout``), and
        :class:`EtcdError` (or an httpx error) when the stream breaks or ends; the caller re-reads
        the range and watches again. Opening the stream fails over across the endpoints.
        """
        idle = self.watch_timeout if idle_timeout is None else idle_timeout
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_range_end(prefix)),
                                   "start_revision": str(start_revision), "progress_notify": True}}
        resp = await self._open_stream("/v3/watch", body, httpx.Timeout(self.timeout, connect=self.connect_timeout,
                                                                        read=idle))
        try:
            if resp.status_code != 200:
                raise EtcdError(f"etcd watch: HTTP {resp.status_code}")
            lines = resp.aiter_lines()
            while True:
                try:
                    line = await anext(lines)
                except StopAsyncIteration:
                    break
                except httpx.ReadTimeout as exc:
                    raise EtcdWatchTimeout(idle) from exc
                if line.strip():
                    yield _watch_response(json.loads(line))
        finally:
            await resp.aclose()
        raise EtcdError("etcd watch stream ended")

    async def _open_stream(self, path: str, body: dict, timeout: httpx.Timeout) -> httpx.Response:
        """POST ``body`` and return the response once its headers arrived (the caller reads and
        closes it), trying the endpoints in turn like :meth:`_post`."""
        failures: list[str] = []
        timed_out = False
        for idx in self._order():
            endpoint = self.endpoints[idx]
            request = self._http.build_request("POST", endpoint + path, json=body, timeout=timeout)
            try:
                resp = await self._http.send(request, stream=True)
            except TRANSPORT_ERRORS as exc:
                timed_out = isinstance(exc, httpx.ReadTimeout)
                failures.append(f"{endpoint}: {type(exc).__name__} {exc}".rstrip())
                continue
            self._current = idx
            return resp
        if timed_out and timeout.read is not None:
            raise EtcdWatchTimeout(timeout.read)
        raise EtcdUnavailable(f"no etcd endpoint answered {path} ({'; '.join(failures)})")


def _watch_response(msg: dict) -> WatchResponse:
    if "error" in msg:
        raise EtcdError(f"etcd watch: {msg['error']}")
    result = msg.get("result", {})
    if result.get("compact_revision") and result.get("canceled"):
        raise EtcdCompacted(int(result["compact_revision"]))
    if result.get("canceled"):
        raise EtcdError(f"etcd watch canceled: {result.get('cancel_reason', '')}")
    events = tuple(WatchEvent(ev.get("type", "PUT"), _unb64(ev["kv"]["key"]).decode(), _unb64(ev["kv"].get("value")),
                              int(ev["kv"].get("mod_revision", 0)), int(ev["kv"].get("lease", 0)))
                   for ev in result.get("events") or [])
    return WatchResponse(int(result.get("header", {}).get("revision", 0)), events, bool(result.get("created")))


def _kv(raw: dict) -> KeyValue:
    return KeyValue(_unb64(raw["key"]).decode(), _unb64(raw.get("value")), int(raw.get("mod_revision", 0)),
                    int(raw.get("lease", 0)))
