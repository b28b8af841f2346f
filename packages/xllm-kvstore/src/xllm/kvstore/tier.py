"""KV tiers below an engine's own KV memory: the interface and the block record they store.

A tier keeps whole KV blocks (one block = ``block_size`` tokens of every layer's K and V, in the
engine's page layout) keyed by the block's chained hash (:mod:`xllm.kvstore.hashing`), inside a
*namespace* that names the model and the KV layout (:func:`namespace`): two engines share blocks
only when both agree, so a block written by another model or layout is never found.

Nothing read from a tier is trusted before it is checked: a stored block is a :class:`BlockHeader`
(magic, version, namespace digest, block hash, payload length, SHA-256 of the payload) followed by
the payload, and :meth:`BlockHeader.verify` compares every field with what the reader expects.

Tiers (T0 is the engine's own KV, in ``xllm.core.kv``):

- T1 ``host``: host DRAM shared by the engine processes of one machine (:mod:`xllm.kvstore.file_tier`
  over a tmpfs directory, ``/dev/shm``);
- T2 ``disk``: local SSD files (:mod:`xllm.kvstore.file_tier` over a directory);
- T3 ``store``: a cluster-wide store (:mod:`xllm.kvstore.mooncake_tier`), which also carries prefill/decode
  hand-offs: a prefill instance publishes a request's blocks there under their hashes and the decode
  instance reads them back (``xllm.engine.handoff.mooncake``), so they stay as ordinary T3 blocks.

Torch-free: payloads are bytes-like objects.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from xllm.proto.registry.v1 import instance_pb2

HOST, DISK, STORE = "host", "disk", "store"  # the lower tiers' names (T1, T2, T3)
TIER_ORDER = (HOST, DISK, STORE)  # fastest first

MAGIC = b"XKVB"
VERSION = 1
# magic, version, reserved, namespace digest (16), block hash (u64), payload bytes (u64), sha256[:16]
_HEADER = struct.Struct("<4sHH16sQQ16s")
HEADER_BYTES = _HEADER.size

Buffers = Sequence[memoryview]  # a block's payload as consecutive pieces (a page of every (layer, K|V) range)


class CorruptBlockError(Exception):
    """A stored block failed its check (header field or checksum): it must not be used."""


class TierDownError(Exception):
    """A tier cannot be reached (I/O error, store unreachable): the caller goes on without it."""


def namespace(model_identity: str, layout: str) -> bytes:
    """The 16-byte digest naming what a block's bytes depend on: the model (its identity string,
    e.g. a digest of its weights) and the KV layout (``KVCacheLayout.fingerprint``: layers, heads,
    widths, dtype, block size)."""
    if not model_identity:
        raise ValueError("a KV tier namespace needs the model's identity")
    return hashlib.blake2b(f"{model_identity}\0{layout}".encode(), digest_size=16).digest()


def model_identity(directory: str | os.PathLike, sample_bytes: int = 1 << 16) -> str:
    """A digest naming a model directory's weights: ``config.json`` and, for every weight file
    (``*.safetensors``, ``*.gguf``, ``*.bin``), its name, size and three samples (start, middle,
    end) of its bytes, so a fine-tune of the same architecture gets another identity. Reads a few
    hundred KiB whatever the model's size."""
    h = hashlib.blake2b(digest_size=16)
    names = sorted(os.listdir(directory))
    for name in names:
        path = os.path.join(directory, name)
        if name == "config.json":
            with open(path, "rb") as f:
                h.update(b"config\0" + f.read())
        elif name.endswith((".safetensors", ".gguf", ".bin")) and os.path.isfile(path):
            size = os.path.getsize(path)
            h.update(f"{name}\0{size}\0".encode())
            with open(path, "rb") as f:
                for at in (0, max(0, size // 2 - sample_bytes // 2), max(0, size - sample_bytes)):
                    f.seek(at)
                    h.update(f.read(sample_bytes))
    return h.hexdigest()


def checksum(pieces: Buffers | Sequence[bytes]) -> bytes:
    """SHA-256 (first 16 bytes) of the concatenated pieces (hashlib releases the GIL on large pieces)."""
    h = hashlib.sha256()
    for piece in pieces:
        h.update(piece)
    return h.digest()[:16]


@dataclass(frozen=True)
class BlockHeader:
    """What precedes a block's payload wherever it is stored."""

    ns: bytes
    block_hash: int
    payload_bytes: int
    digest: bytes

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, 0, self.ns, self.block_hash, self.payload_bytes, self.digest)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> BlockHeader:
        if len(raw) < HEADER_BYTES:
            raise CorruptBlockError(f"truncated header ({len(raw)} of {HEADER_BYTES} bytes)")
        magic, version, _, ns, block_hash, payload, digest = _HEADER.unpack(bytes(raw[:HEADER_BYTES]))
        if magic != MAGIC or version != VERSION:
            raise CorruptBlockError(f"not a KV block record (magic {magic!r}, version {version})")
        return cls(ns, block_hash, payload, digest)

    def verify(self, ns: bytes, block_hash: int, payload_bytes: int, pieces: Buffers | Sequence[bytes]) -> None:
        """Raise :class:`CorruptBlockError` unless this header names ``(ns, block_hash)``, the
        expected length, and the payload ``pieces`` hash to its digest."""
        if self.ns != ns:
            raise CorruptBlockError("block of another model or KV layout")
        if self.block_hash != block_hash:
            raise CorruptBlockError(f"block hash {self.block_hash:016x}, expected {block_hash:016x}")
        if self.payload_bytes != payload_bytes:
            raise CorruptBlockError(f"payload of {self.payload_bytes} bytes, expected {payload_bytes}")
        if checksum(pieces) != self.digest:
            raise CorruptBlockError(f"checksum mismatch for block {block_hash:016x}")


@dataclass
class TierStats:
    """Cumulative counts of one tier (what ``xllm:kv_tier_*`` metrics report).

    ``queries``/``hits``: blocks looked up / found and loaded intact; ``corrupt``: blocks found but
    failing their check (dropped, recomputed); ``bytes_read``/``bytes_written``: payload bytes;
    ``load_seconds``: time spent reading blocks; ``evictions``: blocks dropped for capacity;
    ``errors``: operations failed by an I/O or connection error; ``up``: reachable now."""

    queries: int = 0
    hits: int = 0
    corrupt: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    load_seconds: float = 0.0
    evictions: int = 0
    errors: int = 0
    up: bool = True
    used_bytes: int = 0
    capacity_bytes: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    def wrote(self, payload: int) -> None:
        """One block of ``payload`` bytes stored (caller holds the tier's lock)."""
        self.bytes_written += payload
        self.blocks_written += 1

    def loaded(self, payload: int, seconds: float) -> None:
        """One block of ``payload`` bytes found intact and read in ``seconds`` (caller holds the lock)."""
        self.hits += 1
        self.bytes_read += payload
        self.load_seconds += seconds

    def to_proto(self, tier: str) -> instance_pb2.KVTierStats:
        """The heartbeat form of these counts (``extra`` stays local)."""
        return instance_pb2.KVTierStats(tier=tier, **{f: getattr(self, f) for f in _PROTO_FIELDS})

    @classmethod
    def from_proto(cls, msg: instance_pb2.KVTierStats) -> TierStats:
        return cls(**{f: getattr(msg, f) for f in _PROTO_FIELDS})


_PROTO_FIELDS = ("queries", "hits", "corrupt", "bytes_read", "bytes_written", "blocks_written", "load_seconds",
                 "evictions", "errors", "up", "used_bytes", "capacity_bytes")


class KVTier(Protocol):
    """One tier of KV blocks within a namespace (fixed at construction), with a byte capacity and
    LRU eviction. Thread-safe: the engine's writer and loader threads call it concurrently.

    - ``put`` stores a block's payload (its pieces concatenated) unless it is already there; False
      when it was already present or does not fit. Evicts least recently used blocks for room.
    - ``get_into`` reads a block's payload into ``dest`` (pieces filled in order) and verifies it;
      False on a miss; raises :class:`CorruptBlockError` (the block is dropped from the tier) or
      :class:`TierDownError`. A hit makes the block the most recently used.
    - ``put_many`` / ``get_many_into``: the same for several blocks at once (one round trip for a remote
      tier). ``get_many_into`` answers per block whether it was loaded intact: a missing block and a
      corrupt one (dropped, counted) are both False; only an unreachable tier raises.
    - ``contains`` says whether the block is present (unverified: ``get_into`` checks);
      ``contains_many`` the same for several blocks at once (one round trip for a remote tier).
    - ``remote``: a lookup costs a network round trip (the engine thread asks such tiers only in
      batches, never per evicted block).
    - ``evict`` drops a block; False if it was absent.
    - ``drain_dropped`` lists the blocks this process removed (capacity eviction, a failed check,
      ``evict``) since the last call; ``listing`` the blocks present now where the tier can enumerate
      them cheaply (a local directory), else nothing. Together they let an instance publish which
      blocks it can load from the tier (``xllm.kvstore.events``); removals by other processes sharing
      the tier are not listed there, but a lookup or load that misses such a block says so
      (:class:`~xllm.kvstore.tiered.TieredStore` publishes the correction).
    - ``scope``: names the storage the tier is in (a host directory, a Mooncake master and namespace), so
      that the instances sharing it can be told apart from those that do not (``KVCacheEvents.tier_scopes``).
    Blocks being read are never freed under the reader (file tiers: an open file outlives its unlink).
    """

    name: str
    remote: bool
    scope: str

    def put(self, block_hash: int, pieces: Buffers | Sequence[bytes]) -> bool: ...

    def put_many(self, blocks: Sequence[tuple[int, Sequence[bytes]]]) -> list[bool]: ...

    def get_into(self, block_hash: int, dest: Buffers) -> bool: ...

    def get_many_into(self, block_hashes: Sequence[int], dests: Sequence[Buffers]) -> list[bool]: ...

    def contains(self, block_hash: int) -> bool: ...

    def contains_many(self, block_hashes: Sequence[int]) -> list[bool]: ...

    def evict(self, block_hash: int) -> bool: ...

    def drain_dropped(self) -> list[int]: ...

    def listing(self) -> list[int]: ...

    @property
    def capacity_bytes(self) -> int: ...

    def stats(self) -> TierStats: ...

    def close(self) -> None: ...
