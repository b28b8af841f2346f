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

Endpoints are ``host:port`` (or ``http://host:port``), several separated by commas; a request
that cannot reach one endpoint is retried on the next.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)

NOT_FOUND = 5  # gRPC code etcd uses for an unknown lease


class EtcdError(RuntimeError):
    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class EtcdLeaseNotFound(EtcdError):
    """The lease expired or was revoked."""


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
    """The etcd calls the registry needs, async, over the JSON gateway."""

    def __init__(self, endpoints: str | Sequence[str], timeout: float = 5.0) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.timeout = timeout
        self._current = 0
        self._http = httpx.AsyncClient(timeout=timeout, trust_env=False)

    async def close(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: dict) -> dict:
        last: Exception | None = None
        for k in range(len(self.endpoints)):
            idx = (self._current + k) % len(self.endpoints)
            try:
                resp = await self._http.post(self.endpoints[idx] + path, json=body)
            except httpx.TransportError as exc:
                last = exc
                continue
            self._current = idx
            data = resp.json() if resp.content else {}
            if resp.status_code != 200:
                code = data.get("code")
                message = data.get("message") or data.get("error") or resp.text
                if code == NOT_FOUND and "lease" in str(message):
                    raise EtcdLeaseNotFound(message, code)
                raise EtcdError(f"etcd {path}: HTTP {resp.status_code}: {message}", code)
            return data
        raise EtcdError(f"no etcd endpoint reachable ({', '.join(self.endpoints)}): {last}")

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
    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[list[WatchEvent]]:
        """Batches of changes under ``prefix`` from ``start_revision`` on, in revision order.

        Raises :class:`EtcdCompacted` when that revision is gone, :class:`EtcdError` (or an
        httpx error) when the stream breaks; the caller re-reads the range and watches again.
        """
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_range_end(prefix)),
                                   "start_revision": str(start_revision)}}
        url = self.endpoints[self._current] + "/v3/watch"
        timeout = httpx.Timeout(self.timeout, read=None)
        async with self._http.stream("POST", url, json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                raise EtcdError(f"etcd watch: HTTP {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                msg = json.loads(line)
                if "error" in msg:
                    raise EtcdError(f"etcd watch: {msg['error']}")
                result = msg.get("result", {})
                if result.get("compact_revision") and result.get("canceled"):
                    raise EtcdCompacted(int(result["compact_revision"]))
                if result.get("canceled"):
                    raise EtcdError(f"etcd watch canceled: {result.get('cancel_reason', '')}")
                events = [WatchEvent(ev.get("type", "PUT"), _unb64(ev["kv"]["key"]).decode(),
                                     _unb64(ev["kv"].get("value")), int(ev["kv"].get("mod_revision", 0)))
                          for ev in result.get("events") or []]
                if events:
                    yield events
        raise EtcdError("etcd watch stream ended")


def _kv(raw: dict) -> KeyValue:
    return KeyValue(_unb64(raw["key"]).decode(), _unb64(raw.get("value")), int(raw.get("mod_revision", 0)),
                    int(raw.get("lease", 0)))
