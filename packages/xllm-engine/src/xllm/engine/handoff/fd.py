"""The ``fd`` transport: prefill and decode instances on one host.

xTensor keeps every KV page in a memfd. The prefill instance passes that file descriptor once per
connection over a Unix socket (``SCM_RIGHTS``); the decode instance maps it. For each hand-off the
sender then names only its pages (:class:`KVFdHandoff`), and the decode instance copies them from the
mapping into its own reserved pages: no serialisation, no socket traffic for the KV, one memory copy
(gathered and scattered in one torch call pair). Using the sender's pages in place instead would save
that copy but tie a page's lifetime to another process (docs/architecture.md, "Transports").

The socket lives in the abstract namespace (no file) and accepts only processes of the same user. A
message is bounded before it is read: its length prefix is checked against the decode side's hand-off
bound (``HandoffSink.message_bytes``, the gRPC intake's ``TransferKV`` bound); a larger one is answered
with a failed ``KVTransferAck`` naming the bound, and the connection is closed unread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Sequence

import torch

from xllm.core.kv.page_store import PageAccess
from xllm.engine.handoff.base import (
    Destination,
    HandoffSink,
    KVReceiver,
    KVSender,
    Outgoing,
    TransferError,
    TransferResult,
    Transport,
)
from xllm.proto.engine.v1 import engine_pb2

log = logging.getLogger(__name__)

_HELLO = b"XKV1"  # first message of a connection, carrying the sender's memfd
_LENGTH = struct.Struct("!I")
MAX_MESSAGE = 64 << 20  # what the sender takes back (an ack): the receiver's bound is its sink's


class OversizedMessage(ConnectionError):
    """A message's length prefix is past the bound: it was not read."""


def _send_message(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts = []
    while n:
        part = sock.recv(n)
        if not part:
            raise ConnectionError("the peer closed the connection")
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def _recv_message(sock: socket.socket, limit: int = MAX_MESSAGE) -> bytes:
    """One length-prefixed message; :class:`OversizedMessage` (nothing read past the prefix) when it is
    longer than ``limit`` bytes."""
    (size,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    if size > limit:
        raise OversizedMessage(f"a {size}-byte hand-off message is past this instance's bound of {limit} bytes "
                               "(its configured context length and KV page sizes)")
    return _recv_exact(sock, size)


def _sockaddr(address: str) -> str:
    if not address.startswith("@"):
        raise TransferError(f"{address!r} is not an fd-transport address (@name)")
    return "\0" + address[1:]


class SenderPages:
    """The sender's memfd, mapped here once per connection (private and never written: reads see
    the sender's pages as they are), and a staging buffer reused across its hand-offs."""

    def __init__(self, fd: int) -> None:
        self._map = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.flat = torch.frombuffer(self._map, dtype=torch.uint8)
        self._staging = torch.empty(0, dtype=torch.int64)

    def staging(self, rows: int, words: int) -> torch.Tensor:
        if self._staging.numel() < rows * words:
            self._staging = torch.empty(rows * words, dtype=torch.int64)
        return self._staging[:rows * words].view(rows, words)

    def close(self) -> None:
        del self.flat, self._staging
        with contextlib.suppress(BufferError):  # a view still alive: unmapped when it goes
            self._map.close()


def _rows(flat: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """A memfd mapping as rows of one page (int64 words)."""
    return flat[:flat.numel() // page_bytes * page_bytes].view(torch.int64).view(-1, page_bytes // 8)


def copy_pages(src: SenderPages, src_offsets: Sequence[int], src_page_bytes: Sequence[int],
               source_pages: Sequence[int], dest: Destination, first_block: int) -> int:
    """Copy the sender's ``source_pages`` (blocks ``first_block ..``) into the reserved pages of
    ``dest``: one gather into a staging buffer and one scatter for all (layer, K|V) ranges of a page
    size, so the copy takes the GIL a few times however many pages it moves. (The decode engine's
    native steps hold the GIL: a copy of one ``copy_file_range`` per page and range waited behind
    them for up to seconds; measured with a 25 ms GIL-holding step running, 7680 pages of 6 KiB:
    0.8 s that way, 80 ms this way; 27 and 18 ms with nothing running.) Returns the bytes copied."""
    store = dest.store
    if store.memfd_map is None:
        raise TransferError("this instance's KV is not in a memfd (the fd transport needs xTensor and "
                            "--tensor-parallel-size 1)")
    if tuple(src_page_bytes) != store.page_bytes or len(src_offsets) != len(store.memfd_offsets):
        raise TransferError("the sender's KV pages are laid out differently")
    blocks = range(first_block, first_block + len(source_pages))
    if blocks.start < dest.first_block or blocks.stop > len(dest.pages):
        raise TransferError(f"blocks {blocks.start}..{blocks.stop - 1} are not the ones this reservation receives")
    if not source_pages:
        return 0
    dst_flat = torch.frombuffer(store.memfd_map, dtype=torch.uint8)
    dst_pages = [dest.pages[b] for b in blocks]
    by_size: dict[int, list[int]] = {}
    for r, pb in enumerate(store.page_bytes):
        by_size.setdefault(pb, []).append(r)
    try:
        for pb, ranges in by_size.items():
            offsets = [(src_offsets[r], store.memfd_offsets[r]) for r in ranges]
            if pb % 8 or any(s_off % pb or d_off % pb for s_off, d_off in offsets):
                raise TransferError(f"pages of {pb} bytes are not aligned in the memfds")
            src_rows = torch.tensor([s_off // pb + p for s_off, _ in offsets for p in source_pages])
            dst_rows = torch.tensor([d_off // pb + p for _, d_off in offsets for p in dst_pages])
            staged = src.staging(len(src_rows), pb // 8)
            torch.index_select(_rows(src.flat, pb), 0, src_rows, out=staged)
            _rows(dst_flat, pb).index_copy_(0, dst_rows, staged)
    except (IndexError, RuntimeError) as exc:  # pages beyond the sender's memfd
        raise TransferError(f"the sender named pages outside its KV memory: {exc}") from None
    return len(source_pages) * sum(store.page_bytes)


class FdReceiver(KVReceiver):
    """Decode side: a Unix socket served by a thread per connection."""

    name = "fd"

    def __init__(self, options: dict) -> None:
        super().__init__(options)
        self.address = f"@xllm-kv-{os.getpid()}-{secrets.token_hex(4)}"
        self._sock: socket.socket | None = None
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sink: HandoffSink | None = None

    async def start(self, sink: HandoffSink) -> None:
        self._loop, self._sink = asyncio.get_running_loop(), sink
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(_sockaddr(self.address))
        self._sock.listen(16)
        threading.Thread(target=self._accept, name="xllm-kv-fd", daemon=True).start()

    async def stop(self) -> None:
        self._stopping.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
            if uid != os.getuid():
                log.warning("fd transport: refused a connection from pid %d (uid %d)", pid, uid)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="xllm-kv-fd-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        src_fd, src = None, None
        try:
            hello, fds, _, _ = socket.recv_fds(conn, len(_HELLO), 1)
            if hello != _HELLO or len(fds) != 1:
                return
            src_fd = fds[0]
            src = SenderPages(src_fd)
            limit = self._sink.message_bytes
            while not self._stopping.is_set():
                handoff = engine_pb2.KVFdHandoff.FromString(_recv_message(conn, limit))
                _send_message(conn, self._receive(src, handoff).SerializeToString())
        except OversizedMessage as exc:  # the transfer fails cleanly; the unread rest makes the connection unusable
            log.warning("fd transport: %s; closing the connection", exc)
            with contextlib.suppress(OSError):
                _send_message(conn, engine_pb2.KVTransferAck(installed=False, error=str(exc)).SerializeToString())
        except (ConnectionError, OSError, ValueError):
            pass
        finally:
            if src is not None:
                src.close()
            if src_fd is not None:
                os.close(src_fd)
            conn.close()

    def _on_loop(self, fn, *args):
        async def call():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result()

    def _receive(self, src: SenderPages, h: engine_pb2.KVFdHandoff) -> engine_pb2.KVTransferAck:
        started = time.monotonic()
        commit = h.commit
        try:
            dest = self._on_loop(self._sink.begin_receive, commit.transfer_id, self.name)
        except TransferError as exc:
            return engine_pb2.KVTransferAck(installed=False, error=str(exc))
        error, copied = "", 0
        try:
            copied = copy_pages(src, h.memfd_offsets, h.page_bytes, h.source_pages, dest, commit.first_block)
        except (OSError, TransferError) as exc:
            error = str(exc)
        installed = asyncio.run_coroutine_threadsafe(
            self._sink.end_receive(commit, copied, error, started), self._loop).result()
        return engine_pb2.KVTransferAck(installed=installed, error=error)


class FdSender(KVSender):
    """Prefill side: connections to each decode instance, one per hand-off under way (each carries
    the memfd once when opened and is kept for later hand-offs), so that concurrent hand-offs (a
    burst of prefills, the migrations of a draining instance) are copied and installed together
    instead of one after another."""

    name = "fd"

    def __init__(self, options: dict) -> None:
        super().__init__(options)
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._closed = False  # connections in use when the sender closed are closed after their hand-off

    async def send(self, target: engine_pb2.KVTarget, store: PageAccess, out: Outgoing) -> TransferResult:
        if store.memfd is None:
            raise TransferError("the fd transport needs the xTensor KV backend (pages in a memfd) and "
                                "--tensor-parallel-size 1")
        commit = await out.commit()  # one message once the prefill is over: the copy takes milliseconds
        return await asyncio.to_thread(self._send, target.address, store, list(out.pages), commit)

    def _connect(self, address: str, memfd: int) -> socket.socket:
        with self._lock:
            idle = self._idle.get(address)
            if idle:
                return idle.pop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(float(self.options.get("timeout", 30.0)))
        try:
            sock.connect(_sockaddr(address))
            socket.send_fds(sock, [_HELLO], [memfd])
        except OSError as exc:
            sock.close()
            raise TransferError(f"cannot reach {address}: {exc}") from exc
        return sock

    def _send(self, address: str, store: PageAccess, pages: list[int], commit: engine_pb2.KVCommit) -> TransferResult:
        sock = self._connect(address, store.memfd)
        message = engine_pb2.KVFdHandoff(commit=commit, source_pages=pages, memfd_offsets=store.memfd_offsets,
                                         page_bytes=store.page_bytes)
        try:
            _send_message(sock, message.SerializeToString())
            ack = engine_pb2.KVTransferAck.FromString(_recv_message(sock))
        except OSError as exc:  # includes timeouts and a closed peer: drop the connection
            sock.close()
            raise TransferError(f"hand-off to {address} failed: {exc}") from exc
        with self._lock:
            if self._closed:
                sock.close()
            else:
                self._idle.setdefault(address, []).append(sock)
        return TransferResult(ack.installed, len(pages) * store.block_bytes if ack.installed else 0, ack.error)

    async def close(self) -> None:
        with self._lock:
            self._closed = True
            for socks in self._idle.values():
                for sock in socks:
                    sock.close()
            self._idle.clear()


TRANSPORT = Transport("fd", FdSender, FdReceiver)
