"""T3: the Mooncake store as the cluster-wide KV tier (xLLM §3.4; PyPI ``mooncake-transfer-engine-non-cuda``
over TCP: ``pip install 'xllm-kvstore[mooncake]'``, and Debian ``libibverbs1``). The client lives in a
worker process of its own (:mod:`xllm.kvstore.mooncake_worker`: in the engine's process it held the
GIL for as long as its transfers took), spawned when the tier opens and again after it died.

A block is one object, key ``xllm/kv/<namespace hex>/<block hash hex>``, value the
:class:`~xllm.kvstore.tier.BlockHeader` and the payload, checked on every read like a file tier's.
Batches (``put_many``, ``get_many_into``, ``contains_many``) are one round trip each: a prefill/decode
hand-off through the store moves a request's blocks with one of each.
Capacity and eviction are the store's: every client mounts a segment of its memory into the
cluster's pool (``segment_bytes``) and the master evicts objects when the pool fills; a put the
pool cannot take is dropped. An unreachable master (Mooncake's own error codes), a worker that
died or one that does not answer within ``timeout`` is a :class:`~xllm.kvstore.tier.TierDownError`,
and the store skips the tier until its retry.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from xllm.kvstore.mooncake_worker import (
    OP_CLOSE,
    OP_EXISTS,
    OP_GET,
    OP_GET_MANY,
    OP_PUT,
    OP_PUT_MANY,
    OP_REMOVE,
    REQUEST,
    RESPONSE,
    pack_items,
    unpack_items,
)
from xllm.kvstore.tier import (
    HEADER_BYTES,
    STORE,
    BlockHeader,
    Buffers,
    CorruptBlockError,
    TierDownError,
    TierStats,
    checksum,
)

log = logging.getLogger(__name__)

# Mooncake ErrorCode values meaning "cannot reach the store" (not "no room" or "exists")
_TRANSFER_FAIL, _RPC_FAIL, _ETCD_ERRORS = -800, -900, -1000
SCHEME = "mooncake://"


def parse_url(url: str) -> str:
    """The master's ``HOST:PORT`` of a ``mooncake://HOST:PORT`` store URL (``ValueError`` otherwise)."""
    if not url.startswith(SCHEME) or ":" not in url[len(SCHEME):]:
        raise ValueError(f"a Mooncake store is named mooncake://HOST:PORT (its master), got {url!r}")
    return url[len(SCHEME):].rstrip("/")


def _unreachable(code: int) -> bool:
    return code in (_TRANSFER_FAIL, _RPC_FAIL) or code <= _ETCD_ERRORS


class MooncakeTier:
    """The ``store`` tier over a Mooncake master (``HOST:PORT``) and its metadata server (URL), through
    a worker process. Raises :class:`TierDownError` when the store cannot be joined."""

    remote = True

    def __init__(self, master: str, metadata: str, ns: bytes, segment_bytes: int, name: str = STORE,
                 local_host: str = "127.0.0.1", timeout: float = 10.0) -> None:
        self.name = name
        self.ns = ns
        self.timeout = timeout
        self._prefix = f"xllm/kv/{ns.hex()}/"
        self.scope = f"{SCHEME}{master}/{ns.hex()}"  # every client of this master, in this namespace
        self._capacity = segment_bytes
        self._argv = [sys.executable, "-m", "xllm.kvstore.mooncake_worker", master, metadata, str(segment_bytes),
                      local_host]
        self._mutex = threading.Lock()   # the stats
        self._channel = threading.Lock()  # one request at a time on the worker's pipes
        self._proc: subprocess.Popen | None = None
        self._stats = TierStats(capacity_bytes=segment_bytes)
        self._dropped: list[int] = []  # blocks this process removed since drain_dropped (guarded by _mutex)
        with self._channel:
            self._spawn()

    # ---- the worker -----------------------------------------------------------------------------
    def _spawn(self) -> None:
        proc = subprocess.Popen(self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        try:
            line = self._read_line(proc, 60.0)
        except (OSError, EOFError, TimeoutError) as exc:
            self._kill(proc)
            raise TierDownError(f"tier {self.name}: the Mooncake worker did not start: {exc}") from exc
        if not line.startswith(b"READY 0"):
            self._kill(proc)
            raise TierDownError(f"tier {self.name}: cannot join the Mooncake store ({line.decode().strip()})")
        self._proc = proc

    def _read_line(self, proc: subprocess.Popen, timeout: float) -> bytes:
        line = b""
        while not line.endswith(b"\n"):
            line += self._read(proc, 1, time.monotonic() + timeout)
        return line

    @staticmethod
    def _read(proc: subprocess.Popen, n: int, deadline: float) -> bytes:
        fd, out = proc.stdout.fileno(), bytearray()
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("no answer in time")
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise EOFError("the worker exited")
            out += chunk
        return bytes(out)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5.0)

    def _call(self, op: int, key: str = "", payload: bytes = b"") -> tuple[int, bytes]:
        with self._channel:
            if self._proc is None or self._proc.poll() is not None:
                self._spawn()  # (after the store's retry window: it skipped this tier meanwhile)
            proc = self._proc
            try:
                raw = key.encode()
                proc.stdin.write(REQUEST.pack(op, len(raw), len(payload)) + raw)
                if payload:
                    proc.stdin.write(payload)
                deadline = time.monotonic() + self.timeout
                code, size = RESPONSE.unpack(self._read(proc, RESPONSE.size, deadline))
                return code, self._read(proc, size, deadline) if size else b""
            except (OSError, EOFError, TimeoutError, ValueError) as exc:
                self._kill(proc)
                self._proc = None
                self._failed()
                raise TierDownError(f"tier {self.name}: the Mooncake worker failed: {exc}") from exc

    # ---- KVTier -----------------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def key(self, block_hash: int) -> str:
        return f"{self._prefix}{block_hash:016x}"

    def contains(self, block_hash: int) -> bool:
        return self.contains_many([block_hash])[0]

    def contains_many(self, block_hashes: Sequence[int]) -> list[bool]:
        if not block_hashes:
            return []
        _, raw = self._call(OP_EXISTS, payload="\n".join(self.key(h) for h in block_hashes).encode())
        codes = struct.unpack(f"<{len(raw) // 4}i", raw)
        if len(codes) != len(block_hashes) or any(c < 0 for c in codes):
            self._failed()
            raise TierDownError(f"tier {self.name}: lookup failed ({min(codes, default=-1)})")
        return [c == 1 for c in codes]

    def _record(self, block_hash: int, pieces: Buffers | Sequence[bytes]) -> tuple[bytes, int]:
        """A block's stored value (header and payload) and its payload size."""
        payload = sum(len(p) for p in pieces)
        header = BlockHeader(self.ns, block_hash, payload, checksum(pieces)).pack()
        return b"".join([header, *(bytes(p) for p in pieces)]), payload

    def put(self, block_hash: int, pieces: Buffers) -> bool:
        value, payload = self._record(block_hash, pieces)
        code, _ = self._call(OP_PUT, self.key(block_hash), value)
        if code != 0:
            if _unreachable(code):
                self._failed()
                raise TierDownError(f"tier {self.name}: put failed ({code})")
            return False  # no room in the pool, or another instance stored it meanwhile
        with self._mutex:
            self._stats.wrote(payload)
        return True

    def put_many(self, blocks: Sequence[tuple[int, Sequence[bytes]]]) -> list[bool]:
        """One round trip for all of ``blocks``; the store takes the batch whole or not at all."""
        if not blocks:
            return []
        records = [self._record(h, pieces) for h, pieces in blocks]
        code, _ = self._call(OP_PUT_MANY, payload=pack_items([(self.key(h), value)
                                                              for (h, _), (value, _) in zip(blocks, records)]))
        if code != 0:
            if _unreachable(code):
                self._failed()
                raise TierDownError(f"tier {self.name}: batch put failed ({code})")
            return [False] * len(blocks)
        with self._mutex:
            for _, payload in records:
                self._stats.wrote(payload)
        return [True] * len(blocks)

    def get_into(self, block_hash: int, dest: Buffers) -> bool:
        started = time.perf_counter()
        _, value = self._call(OP_GET, self.key(block_hash))
        return self._fill(block_hash, value, dest, started)

    def get_many_into(self, block_hashes: Sequence[int], dests: Sequence[Buffers]) -> list[bool]:
        if not block_hashes:
            return []
        started = time.perf_counter()
        keys = [self.key(h) for h in block_hashes]
        _, raw = self._call(OP_GET_MANY, payload="\n".join(keys).encode())
        try:
            items = unpack_items(raw)
        except ValueError as exc:
            self._failed()
            raise TierDownError(f"tier {self.name}: a malformed batch answer ({exc})") from exc
        if [k for k, _ in items] != keys:
            self._failed()
            raise TierDownError(f"tier {self.name}: the batch answer names other keys")
        out = []
        for h, (_, value), dest in zip(block_hashes, items, dests, strict=True):
            try:
                out.append(self._fill(h, value, dest, started))
            except CorruptBlockError:
                out.append(False)
            started = time.perf_counter()  # the round trip is charged to the first block
        return out

    def _fill(self, block_hash: int, value: bytes | memoryview, dest: Buffers, started: float) -> bool:
        """Check a stored value and copy its payload into ``dest``: False when it is missing (evicted since
        the lookup, or unreachable), :class:`CorruptBlockError` (the object is removed) when it fails."""
        if not value:
            return False
        payload = sum(len(d) for d in dest)
        view = memoryview(value)
        try:
            if len(view) != HEADER_BYTES + payload:
                raise CorruptBlockError(f"object of {len(view)} bytes, expected {HEADER_BYTES + payload}")
            body = view[HEADER_BYTES:]
            BlockHeader.unpack(view[:HEADER_BYTES]).verify(self.ns, block_hash, payload, [body])
        except CorruptBlockError:
            with self._mutex:
                self._stats.corrupt += 1
            with contextlib.suppress(TierDownError):
                self.evict(block_hash)
            log.warning("tier %s: block %016x failed its check; dropped (it is recomputed)", self.name, block_hash)
            raise
        at = 0
        for d in dest:
            d[:] = body[at:at + len(d)]
            at += len(d)
        with self._mutex:
            self._stats.loaded(payload, time.perf_counter() - started)
        return True

    def evict(self, block_hash: int) -> bool:
        # forced: a read leaves a lease on the object, which a plain remove respects (-706)
        removed = self._call(OP_REMOVE, self.key(block_hash))[0] == 0
        if removed:
            with self._mutex:
                self._dropped.append(block_hash)
        return removed

    def drain_dropped(self) -> list[int]:
        """Blocks this process removed. The master's own evictions are not observable from here."""
        with self._mutex:
            out, self._dropped = self._dropped, []
        return out

    def listing(self) -> list[int]:
        return []  # the cluster-wide store is not enumerated (its content is every instance's)

    def raw_put(self, key: str, value: bytes) -> int:
        """Store ``value`` under ``key`` as is (tests: a damaged object)."""
        return self._call(OP_PUT, key, value)[0]

    def raw_get(self, key: str) -> bytes:
        return self._call(OP_GET, key)[1]

    def stats(self) -> TierStats:
        with self._mutex:
            return TierStats(**vars(self._stats))

    def close(self, timeout: float = 10.0) -> None:
        """Ask the worker to leave the store and exit, without waiting: a thread reaps it, killing it
        after ``timeout`` seconds (a client's goodbye takes ~2 s, and retries for long when the
        master is gone)."""
        with self._channel:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        with self._mutex:
            if self._stats.errors:  # the store has failed: its goodbye would only retry
                timeout = min(timeout, 1.0)
        with contextlib.suppress(OSError):
            proc.stdin.write(REQUEST.pack(OP_CLOSE, 0, 0))
            proc.stdin.close()

        def reap() -> None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill(proc)
            with contextlib.suppress(OSError):
                proc.stdout.close()

        threading.Thread(target=reap, name="mooncake-worker-reaper", daemon=True).start()

    def _failed(self) -> None:
        with self._mutex:
            self._stats.errors += 1
