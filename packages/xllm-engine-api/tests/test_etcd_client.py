"""The etcd client's timeouts, failover and watch liveness, against scripted HTTP servers on
loopback: one that accepts and never answers (a frozen etcd), one that answers 503, one that
answers like etcd's JSON gateway (ranges, and watch streams that go silent or end)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from xllm.engine_api.registration.etcd_client import EtcdClient, EtcdError, EtcdUnavailable, EtcdWatchTimeout
from xllm.testing.processes import free_port

GUARD = 20.0  # a bound on every call, so a test that fails hangs no longer than this


@dataclass
class Reply:
    """What a scripted server answers: a status and JSON, or a stream of JSON lines."""

    status: int = 200
    body: dict | None = None
    lines: list[dict] = field(default_factory=list)
    then_silent: bool = False  # a stream: keep the connection open without another byte


@dataclass
class FakeServer:
    """A minimal HTTP/1.1 server: ``handler(path, body)`` returns the :class:`Reply`, or None to
    never answer."""

    handler: Callable[[str, dict], Reply | None]
    requests: list[tuple[str, dict]] = field(default_factory=list)
    connections: int = 0
    server: asyncio.Server | None = None
    _writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        for w in self._writers:
            w.close()
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                path = lines[0].split()[1]
                length = next(int(h.split(":")[1]) for h in lines[1:] if h.lower().startswith("content-length"))
                body = json.loads(await reader.readexactly(length))
                self.requests.append((path, body))
                reply = self.handler(path, body)
                if reply is None:
                    await asyncio.Event().wait()  # frozen: never answer
                if not reply.lines:
                    data = json.dumps(reply.body or {}).encode()
                    writer.write(f"HTTP/1.1 {reply.status} X\r\nContent-Type: application/json\r\n"
                                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
                    await writer.drain()
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
                for msg in reply.lines:
                    data = json.dumps(msg).encode() + b"\n"
                    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.01)
                if reply.then_silent:
                    await asyncio.Event().wait()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def header(revision: int) -> dict:
    return {"cluster_id": "1", "member_id": "2", "revision": str(revision), "raft_term": "2"}


def range_reply(revision: int, kvs: dict[str, bytes]) -> Reply:
    rows = [{"key": _b64(k), "value": _b64(v), "mod_revision": str(revision)} for k, v in kvs.items()]
    return Reply(body={"header": header(revision), "count": str(len(kvs)), "kvs": rows})


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), GUARD))


def test_a_call_to_an_etcd_that_never_answers_times_out():
    async def body():
        frozen = FakeServer(lambda path, b: None)
        client = EtcdClient(await frozen.start(), timeout=0.2, connect_timeout=0.2)
        try:
            with pytest.raises(EtcdUnavailable, match="ReadTimeout"):
                await client.get_prefix("/p/")
            with pytest.raises(EtcdUnavailable):  # a lease call as much as a range
                await client.keepalive(7)
        finally:
            await client.close()
            await frozen.stop()

    run(body)


def test_calls_fail_over_to_the_next_endpoint_and_stay_there():
    async def body():
        frozen = FakeServer(lambda path, b: None)
        no_leader = FakeServer(lambda path, b: Reply(503, {"error": "etcdserver: no leader", "code": 14}))
        good = FakeServer(lambda path, b: range_reply(9, {"/p/instances/e0": b"info"}))
        refused = f"127.0.0.1:{free_port()}"  # nothing listens there
        endpoints = [await frozen.start(), refused, await no_leader.start(), await good.start()]
        client = EtcdClient(",".join(endpoints), timeout=0.3, connect_timeout=0.3)
        try:
            revision, kvs = await client.get_prefix("/p/")
            assert revision == 9 and [(kv.key, kv.value) for kv in kvs] == [("/p/instances/e0", b"info")]
            assert client.endpoint == "http://" + endpoints[3]
            await client.get_prefix("/p/")  # the next call starts where the last one succeeded
            assert len(good.requests) == 2 and len(frozen.requests) == 1 and len(no_leader.requests) == 1
        finally:
            await client.close()
            for s in (frozen, no_leader, good):
                await s.stop()

    run(body)


def test_an_http_error_of_a_live_endpoint_is_not_failed_over():
    async def body():
        bad = FakeServer(lambda path, b: Reply(400, {"error": "bad key", "message": "bad key", "code": 3}))
        good = FakeServer(lambda path, b: range_reply(1, {}))
        client = EtcdClient(f"{await bad.start()},{await good.start()}", timeout=1.0)
        try:
            with pytest.raises(EtcdError, match="bad key") as info:
                await client.get_prefix("/p/")
            assert info.value.code == 3 and not good.requests
        finally:
            await client.close()
            await bad.stop()
            await good.stop()

    run(body)


def _watch_server(lines: list[dict], then_silent: bool) -> FakeServer:
    def handler(path: str, body: dict) -> Reply:
        assert path == "/v3/watch"
        return Reply(lines=lines, then_silent=then_silent)

    return FakeServer(handler)


def test_a_watch_asks_for_progress_notifications_and_a_silent_one_times_out():
    created = {"result": {"header": header(10), "created": True}}
    progress = [{"result": {"header": header(10 + i)}} for i in range(5)]
    event = {"result": {"header": header(16), "events": [
        {"type": "PUT", "kv": {"key": _b64("/p/heartbeats/e0"), "value": _b64(b"hb"), "mod_revision": "16"}},
        {"type": "DELETE", "kv": {"key": _b64("/p/instances/e1"), "mod_revision": "16"}}]}}

    async def body():
        server = _watch_server([created, *progress, event], then_silent=True)
        client = EtcdClient(await server.start(), timeout=1.0, watch_timeout=0.5)
        got = []
        try:
            with pytest.raises(EtcdWatchTimeout) as info:
                async for resp in client.watch_prefix("/p/", 11):
                    got.append(resp)
            assert info.value.idle_timeout == 0.5
            ((_, req),) = server.requests
            assert req["create_request"]["progress_notify"] is True
            assert req["create_request"]["start_revision"] == "11"
            assert got[0].created and not got[0].progress and got[0].revision == 10
            assert [r.revision for r in got[1:6]] == [10, 11, 12, 13, 14] and all(r.progress for r in got[1:6])
            assert [(e.type, e.key, e.value) for e in got[6].events] == [("PUT", "/p/heartbeats/e0", b"hb"),
                                                                          ("DELETE", "/p/instances/e1", b"")]
            assert len(got) == 7
        finally:
            await client.close()
            await server.stop()

    run(body)


def test_a_watch_that_ends_raises_and_the_idle_timeout_can_be_given_per_watch():
    async def body():
        ended = _watch_server([{"result": {"header": header(3), "created": True}}], then_silent=False)
        silent = FakeServer(lambda path, b: None)
        client = EtcdClient(await ended.start(), timeout=1.0)
        client2 = EtcdClient(await silent.start(), timeout=1.0, watch_timeout=60.0)
        try:
            with pytest.raises(EtcdError, match="ended"):
                async for _ in client.watch_prefix("/p/", 1):
                    pass
            with pytest.raises(EtcdWatchTimeout):  # silent from the start: not even the headers came
                async for _ in client2.watch_prefix("/p/", 1, idle_timeout=0.3):
                    pass
        finally:
            for c in (client, client2):
                await c.close()
            await ended.stop()
            await silent.stop()

    run(body)


def test_timeouts_must_be_positive():
    for kw in ({"timeout": 0}, {"connect_timeout": -1}, {"watch_timeout": 0}):
        with pytest.raises(ValueError):
            EtcdClient("h:1", **kw)
