"""A KV tier of one file per block: T2 (local SSD) over a directory, T1 (host DRAM shared by the
engine processes of a machine) over a tmpfs directory such as ``/dev/shm``.

Why files for the host tier too: a tmpfs file *is* host DRAM (page cache with no backing store),
shared by every process of the machine and outliving any of them without a daemon to start, keep
alive or restart; the kernel's directory is the shared index (a lookup is one ``stat``), a block is
published atomically (written to a temporary name, then ``rename``d), and a reader keeps reading a
block another process evicts meanwhile (an open file outlives its unlink: the reference count of
LRU-with-refcounts comes for free). A read is one ``readv`` straight into the engine's KV pages.
What this costs over a hand-made shared-memory segment: a few system calls per block (µs against
the ~0.5 ms of copying and checking a 0.7 MB block), and the LRU order kept in file times.

Layout: ``ROOT/<namespace hex>/<block hash hex>.kvb``, each a :class:`~xllm.kvstore.tier.BlockHeader`
and the payload; ``ROOT/<namespace hex>/.lock`` holds the bytes in use (8 bytes, little-endian)
and is ``flock``-ed by every process that changes the set of files, so capacity is shared by all
processes using the directory. A hit or a write sets the file's modification time: eviction
removes the files with the oldest times first (least recently used), down to ``low_water`` of
the capacity so a full tier is not rescanned on every write. No ``fsync``: after a crash a torn
file fails its checksum and is dropped (its block recomputed).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence

from xllm.kvstore.tier import HEADER_BYTES, BlockHeader, Buffers, CorruptBlockError, TierDownError, TierStats, checksum

log = logging.getLogger(__name__)

SUFFIX = ".kvb"
_STALE_TMP_SECONDS = 60.0


class FileTier:
    """One directory of block files within namespace ``ns`` (see the module docstring).

    ``capacity_bytes`` bounds the files' total size (all processes); ``low_water`` (0 < x <= 1) is
    the fraction of it an eviction frees down to. Raises :class:`TierDownError` when the directory
    cannot be created."""

    remote = False

    def __init__(self, name: str, root: str | os.PathLike, ns: bytes, capacity_bytes: int,
                 low_water: float = 15 / 16) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"tier {name}: capacity must be > 0 bytes, got {capacity_bytes}")
        if not 0 < low_water <= 1:
            raise ValueError(f"tier {name}: low_water must be in (0, 1], got {low_water}")
        self.name = name
        self.ns = ns
        self.directory = os.path.join(os.fspath(root), ns.hex())
        # the processes of this machine using this directory share it (its path includes the namespace)
        self.scope = f"file://{socket.gethostname()}{os.path.realpath(self.directory)}"
        self._capacity = capacity_bytes
        self._low_water = low_water
        self._mutex = threading.Lock()  # flock does not exclude threads sharing one open file
        self._stats = TierStats(capacity_bytes=capacity_bytes)
        self._dropped: list[int] = []  # blocks removed since drain_dropped (guarded by _mutex)
        self._lock_fd: int | None = None
        try:
            os.makedirs(self.directory, exist_ok=True)
            self._open_lock()
            fs = os.statvfs(self.directory)
        except OSError as exc:
            raise TierDownError(f"tier {name}: cannot use {self.directory}: {exc}") from exc
        if capacity_bytes > fs.f_blocks * fs.f_frsize:
            log.warning("tier %s: capacity %.2f GiB exceeds the %.2f GiB file system of %s: writes will fail "
                        "(and the tier be left out) when it fills", name, capacity_bytes / 2**30,
                        fs.f_blocks * fs.f_frsize / 2**30, self.directory)

    # ---- KVTier ------------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def path(self, block_hash: int) -> str:
        return os.path.join(self.directory, f"{block_hash:016x}{SUFFIX}")

    def contains(self, block_hash: int) -> bool:
        try:
            return os.path.exists(self.path(block_hash))
        except OSError:
            return False

    def contains_many(self, block_hashes: Sequence[int]) -> list[bool]:
        return [self.contains(h) for h in block_hashes]

    def put(self, block_hash: int, pieces: Buffers) -> bool:
        path = self.path(block_hash)
        if os.path.exists(path):
            return False
        payload = sum(len(p) for p in pieces)
        size = HEADER_BYTES + payload
        if size > self._capacity:
            return False
        header = BlockHeader(self.ns, block_hash, payload, checksum(pieces)).pack()
        tmp = os.path.join(self.directory, f".{block_hash:016x}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self._write(tmp, [header, *pieces])
            with self._locked():
                if os.path.exists(path):  # another process stored it meanwhile
                    os.unlink(tmp)
                    return False
                used = self._read_used()
                if used + size > self._capacity:
                    used = self._evict_lru(int(self._capacity * self._low_water) - size)
                os.rename(tmp, path)
                self._write_used(used + size)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._error()
            raise TierDownError(f"tier {self.name}: writing block {block_hash:016x}: {exc}") from exc
        with self._mutex:
            self._stats.wrote(payload)
        return True

    def put_many(self, blocks: Sequence[tuple[int, Sequence[bytes]]]) -> list[bool]:
        return [self.put(h, pieces) for h, pieces in blocks]

    def get_many_into(self, block_hashes: Sequence[int], dests: Sequence[Buffers]) -> list[bool]:
        out = []
        for h, dest in zip(block_hashes, dests, strict=True):
            try:
                out.append(self.get_into(h, dest))
            except CorruptBlockError:
                out.append(False)
        return out

    def get_into(self, block_hash: int, dest: Buffers) -> bool:
        path = self.path(block_hash)
        started = time.perf_counter()
        payload = sum(len(d) for d in dest)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._error()
            raise TierDownError(f"tier {self.name}: opening block {block_hash:016x}: {exc}") from exc
        try:
            head = bytearray(HEADER_BYTES)
            try:
                got = os.readv(fd, [head, *dest])
                size = os.fstat(fd).st_size
            except OSError as exc:
                self._error()
                raise TierDownError(f"tier {self.name}: reading block {block_hash:016x}: {exc}") from exc
            try:
                if got != HEADER_BYTES + payload or size != got:
                    raise CorruptBlockError(f"block file of {size} bytes, expected {HEADER_BYTES + payload}")
                BlockHeader.unpack(head).verify(self.ns, block_hash, payload, dest)
            except CorruptBlockError:
                with self._mutex:
                    self._stats.corrupt += 1
                self._drop(path)
                log.warning("tier %s: block %016x failed its check; dropped (it is recomputed)", self.name,
                            block_hash)
                raise
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.utime(path)  # most recently used
        with self._mutex:
            self._stats.loaded(payload, time.perf_counter() - started)
        return True

    def evict(self, block_hash: int) -> bool:
        try:
            return self._drop(self.path(block_hash))
        except OSError:
            self._error()
            return False

    def drain_dropped(self) -> list[int]:
        with self._mutex:
            out, self._dropped = self._dropped, []
        return out

    def listing(self) -> list[int]:
        try:
            with os.scandir(self.directory) as it:
                return [h for h in (_block_hash(e.name) for e in it) if h is not None]
        except OSError:
            return []

    def stats(self) -> TierStats:
        with self._mutex:
            out = TierStats(**vars(self._stats))
        with contextlib.suppress(OSError), self._locked():
            out.used_bytes = self._read_used()
        return out

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ---- internals ------------------------------------------------------------------------------
    def _open_lock(self) -> None:
        self._lock_fd = os.open(os.path.join(self.directory, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        with self._locked():
            if os.fstat(self._lock_fd).st_size < 8:  # a new directory (or an old one's counter lost)
                self._write_used(self._scan()[0])

    @contextlib.contextmanager
    def _locked(self):
        with self._mutex:
            if self._lock_fd is None:  # closed: reopen (e.g. a call racing close at shutdown)
                self._lock_fd = os.open(os.path.join(self.directory, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _read_used(self) -> int:
        raw = os.pread(self._lock_fd, 8, 0)
        return int.from_bytes(raw, "little") if len(raw) == 8 else self._scan()[0]

    def _write_used(self, used: int) -> None:
        os.pwrite(self._lock_fd, max(used, 0).to_bytes(8, "little"), 0)

    def _scan(self) -> tuple[int, list[tuple[int, int, str]]]:
        """Total bytes of the block files and (mtime, size, path) of each; removes stale temporaries."""
        total, files = 0, []
        now = time.time()
        with os.scandir(self.directory) as it:
            for entry in it:
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.name.endswith(SUFFIX):
                    total += st.st_size
                    files.append((st.st_mtime_ns, st.st_size, entry.path))
                elif entry.name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_SECONDS:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)  # a writer that died mid-write
        return total, files

    def _evict_lru(self, target: int) -> int:
        """Under the lock: remove the least recently used files until at most ``target`` bytes are
        used (exact, from a scan); returns the bytes in use after."""
        used, files = self._scan()
        files.sort()
        evicted = 0
        for _, size, path in files:
            if used <= target:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                used -= size
                evicted += 1
                h = _block_hash(os.path.basename(path))
                if h is not None:
                    self._dropped.append(h)  # (_mutex is held: called inside _locked)
        self._stats.evictions += evicted
        return used

    def _drop(self, path: str) -> bool:
        with self._locked():
            try:
                size = os.stat(path).st_size
                os.unlink(path)
            except FileNotFoundError:
                return False
            self._write_used(self._read_used() - size)
            h = _block_hash(os.path.basename(path))
            if h is not None:
                self._dropped.append(h)  # (_mutex is held inside _locked)
        return True

    def _write(self, tmp: str, pieces: list) -> None:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except FileNotFoundError:  # the directory went away (tmpfs cleaned): make it again
            os.makedirs(self.directory, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            total = sum(len(p) for p in pieces)
            written = os.writev(fd, pieces)
            if written != total:  # short write (disk full): finish piece by piece or fail
                view = memoryview(b"".join(bytes(p) for p in pieces))[written:]
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
        finally:
            os.close(fd)

    def _error(self) -> None:
        with self._mutex:
            self._stats.errors += 1


def _block_hash(name: str) -> int | None:
    """The block hash a block file's name holds, or None for any other file."""
    if not name.endswith(SUFFIX) or len(name) != 16 + len(SUFFIX):
        return None
    try:
        return int(name[:16], 16)
    except ValueError:
        return None
