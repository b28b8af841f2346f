"""The HTTP front against slow and numerous clients (:mod:`xllm.gateway.http_guard`): a real uvicorn
on a loopback port over the fake engine, with 1 s read deadlines and a per-client cap of 8.

- slowloris: request heads and a body trickled at 1 byte per 0.2 s, a connection that sends
  nothing and a body that stops are closed at their deadline (408, OpenAI-style where a response
  is written), an idle kept-alive one at the keep-alive timeout (quietly), while plain requests on
  other connections are served throughout;
- the (cap+1)-th connection of one client address gets 429 with Retry-After, other addresses are
  unaffected, and the refusals are counted in /metrics;
- an SSE stream that outlasts every deadline is not cut.

The slow clients and those of the cap test connect from loopback addresses of their own (127.0.0.2-4),
so the cap counts them apart from each other and from the plain requests.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from xllm.gateway.app import GatewayState, create_app
from xllm.gateway.http_guard import ConnectionTally, HttpGuardOptions, build_server
from xllm.gateway.metrics import EngineMetrics
from xllm.gateway.registry import EmbeddedRegistry
from xllm.testing.fakes import FAKE_MAX_LEN, FAKE_MODEL, FakeEngineClient
from xllm.testing.processes import serving_in_thread, wait_for
from xllm.testing.sse import sse_events

WAIT = 30.0  # failure guard of the waits on sockets and state, never a timing assertion
DEADLINE = 1.0
CAP = 8
TRICKLE = 0.2  # seconds between the bytes a slow client sends
OPTIONS = HttpGuardOptions(header_timeout_s=DEADLINE, body_timeout_s=DEADLINE, keep_alive_s=DEADLINE,
                           max_connections_per_client=CAP, max_connections=1000)
HEAD = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n")
BODY = json.dumps({"prompt": "x", "max_tokens": 1}).encode()


@dataclass
class Served:
    url: str
    port: int
    tally: ConnectionTally
    engine: FakeEngineClient


@pytest.fixture(scope="module")
def served(smollm2_tokenizer, fake_tokens) -> Iterator[Served]:
    engine = FakeEngineClient(smollm2_tokenizer, fake_tokens)
    engine.chunk_delay = 0.03
    registry = EmbeddedRegistry()
    registry.register(engine)
    metrics = EngineMetrics()
    app = create_app(GatewayState(registry=registry, tokenizer=smollm2_tokenizer, metrics=metrics,
                                  default_model=FAKE_MODEL, max_model_len=FAKE_MAX_LEN))
    server = build_server(app, "127.0.0.1", 0, OPTIONS, metrics.registry, log_level="warning")
    with serving_in_thread(server, WAIT) as port:
        yield Served(f"http://127.0.0.1:{port}", port, server.config.http_protocol_class.tally, engine)


def refused(url: str) -> dict[str, float]:
    """``xllm:http_refused_total`` by reason, from /metrics."""
    text = httpx.get(f"{url}/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("xllm:http_refused_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


@dataclass
class SlowClient:
    """A connection that sends ``data`` one byte per :data:`TRICKLE` s (after ``burst`` at once)."""

    port: int
    data: bytes
    burst: int = 0
    stall: bool = False  # send the burst, then nothing
    sock: socket.socket = field(init=False)
    sent: int = 0
    received: bytes = b""
    opened: float = 0.0
    lived: float | None = None  # seconds from connect to the server closing the connection

    def __post_init__(self) -> None:
        self.sock = connect_from("127.0.0.4", self.port)
        self.opened = time.monotonic()
        self.sock.sendall(self.data[:self.burst])
        self.sent = self.burst

    def send_next(self) -> None:
        if self.stall or self.sent >= len(self.data):
            return
        try:
            self.sock.send(self.data[self.sent:self.sent + 1])
            self.sent += 1
        except OSError:  # reset by the server: closed
            self.closed()

    def read(self) -> None:
        try:
            chunk = self.sock.recv(65536)
        except OSError:
            chunk = b""
        self.received += chunk
        if not chunk:
            self.closed()

    def closed(self) -> None:
        if self.lived is None:
            self.lived = time.monotonic() - self.opened
            self.sock.close()


def trickle(clients: list[SlowClient]) -> None:
    """Feed the slow clients until the server has closed every one (WAIT: failure guard)."""
    guard = time.monotonic() + WAIT
    while any(c.lived is None for c in clients):
        assert time.monotonic() < guard, "the server never closed the slow connections"
        live = [c for c in clients if c.lived is None]
        readable, _, _ = select.select([c.sock for c in live], [], [], TRICKLE)
        for c in live:
            if c.sock in readable:
                c.read()
        for c in live:
            if c.lived is None and c.sock not in readable:
                c.send_next()


def status_and_error(raw: bytes) -> tuple[int, dict | None]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"] if body else None


def test_slow_clients_are_cut_at_the_deadline_while_others_are_served(served):
    before = refused(served.url)
    body = json.dumps({"prompt": "x", "max_tokens": 1, "pad": "y" * 40}).encode()
    heads = [SlowClient(served.port, HEAD % len(BODY) + BODY) for _ in range(2)]
    idle = SlowClient(served.port, b"")  # connects and sends nothing
    request = HEAD % len(BODY) + BODY
    kept = SlowClient(served.port, request, burst=len(request))  # one request, then idle on keep-alive
    bodies = [SlowClient(served.port, HEAD % len(body) + body, burst=len(HEAD % len(body)) + 2),
              SlowClient(served.port, HEAD % len(body) + body, burst=len(HEAD % len(body)) + 2, stall=True)]
    served_meanwhile: list[int] = []
    done = threading.Event()

    def plain_requests() -> None:  # other connections, while the slow ones are held
        with httpx.Client(base_url=served.url, timeout=WAIT) as http:
            while not done.is_set():
                served_meanwhile.append(http.post("/v1/completions", content=BODY,
                                                  headers={"content-type": "application/json"}).status_code)

    thread = threading.Thread(target=plain_requests)
    thread.start()
    try:
        trickle([*heads, idle, kept, *bodies])
    finally:
        done.set()
        thread.join(WAIT)
    assert served_meanwhile and set(served_meanwhile) == {200}
    for c in heads + bodies:
        assert c.sent < len(c.data)  # cut before it finished sending
        if c.received:  # the 408 arrived (a reset may beat it while bytes are still coming)
            assert status_and_error(c.received)[0] == 408, c.received
    assert kept.received.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" not in kept.received  # closed quietly
    for c in idle, bodies[1]:  # silent or stalled, nothing in flight: the answer arrives before the close
        status, err = status_and_error(c.received)
        assert status == 408 and err["code"] == "request_timeout" and err["type"] == "invalid_request_error"
    after = refused(served.url)
    assert after["header_timeout"] - before["header_timeout"] == len(heads) + 1
    assert after["body_timeout"] - before["body_timeout"] == len(bodies)
    print(f"slow connections lived {', '.join(f'{c.lived:.2f}' for c in [*heads, idle, kept, *bodies])} s "
          f"(deadline {DEADLINE} s); {len(served_meanwhile)} plain requests served meanwhile")


def connect_from(address: str, port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT, source_address=(address, 0))


def exchange(s: socket.socket, request: bytes) -> bytes:
    """Send ``request`` and read until the server closes the connection."""
    s.sendall(request)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_per_client_cap_refuses_one_more_with_429(served):
    before = refused(served.url)
    stream = json.dumps({"prompt": "x", "max_tokens": 100, "stream": True}).encode()
    held = [connect_from("127.0.0.2", served.port) for _ in range(CAP)]
    try:
        for s in held:  # each holds a stream: the connections stay busy past every deadline
            s.sendall(HEAD % len(stream) + stream)  # ~3 s of stream
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
        with connect_from("127.0.0.2", served.port) as extra:
            raw = exchange(extra, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        head = raw.partition(b"\r\n\r\n")[0].lower()
        status, err = status_and_error(raw)
        assert status == 429 and b"retry-after: 1" in head and err["code"] == "too_many_connections"
        with connect_from("127.0.0.3", served.port) as other:  # another client is not affected
            assert exchange(other, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").startswith(
                b"HTTP/1.1 200")
    finally:
        for s in held:
            s.close()
    assert refused(served.url)["client_cap"] - before["client_cap"] == 1
    wait_for(lambda: "127.0.0.2" not in served.tally.per_client, WAIT, "the held connections to be released",
             interval=0.01)
    with connect_from("127.0.0.2", served.port) as again:  # below the cap again
        assert exchange(again, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").startswith(
            b"HTTP/1.1 200")


def test_sse_stream_outlasting_every_deadline_is_not_cut(served):
    n = 60  # x chunk_delay 0.03 s: about 2 s, past the 1 s header, body and keep-alive deadlines
    started = time.monotonic()
    with httpx.Client(base_url=served.url, timeout=WAIT) as http:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": n, "stream": True})
    lasted = time.monotonic() - started
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert sum(1 for e in events[:-1] if e["choices"] and e["choices"][0]["text"]) == n
    print(f"stream of {n} chunks lasted {lasted:.2f} s, deadlines {DEADLINE} s")


def test_flags_build_the_options():
    from xllm.gateway.api_flags import http_guard_options
    from xllm.gateway.cli import build_parser

    args = build_parser().parse_args(["serve", "--http-header-timeout-s", "2", "--http-body-timeout-s", "3",
                                      "--http-keep-alive-s", "4", "--max-connections-per-client", "0",
                                      "--max-connections", "9"])
    assert http_guard_options(args) == HttpGuardOptions(2.0, 3.0, 4.0, None, 9)
    assert http_guard_options(build_parser().parse_args(["serve"])) == HttpGuardOptions()
    with pytest.raises(ValueError, match="header_timeout_s"):
        HttpGuardOptions(header_timeout_s=0)
