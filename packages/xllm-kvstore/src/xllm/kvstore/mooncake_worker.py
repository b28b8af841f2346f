"""The process that holds an engine's Mooncake store client (``python -m xllm.kvstore.mooncake_worker``).

Why a process of its own: the Mooncake client holds the GIL while a call waits for its transfer
threads, and an engine's OpenMP team keeps the cores busy, so in the engine's process one ``put``
stalled the engine thread for up to seconds (TTFT p50 13x worse in ``benchmarks/kv_tiers``). Here
the engine's writer and loader threads only wait on a pipe.

Protocol over stdin/stdout, one request at a time: a request is ``<BIQ>`` (op, key bytes, payload
bytes), the key, the payload; a response is ``<iQ>`` (code, payload bytes) and the payload. The
worker writes ``READY <code>`` (a line) once its client joined the store (code 0) or failed.
Batches (one round trip to the store each): ``OP_EXISTS`` and ``OP_GET_MANY`` take the keys joined
by newlines as the payload; ``OP_PUT_MANY`` takes :func:`pack_items` of the (key, value) pairs;
``OP_GET_MANY`` answers :func:`pack_items` of (key, value) with an empty value for a missing key.
"""

from __future__ import annotations

import struct
import sys

REQUEST = struct.Struct("<BIQ")
RESPONSE = struct.Struct("<iQ")
OP_CLOSE, OP_PUT, OP_GET, OP_EXISTS, OP_REMOVE, OP_PUT_MANY, OP_GET_MANY = 0, 1, 2, 3, 4, 5, 6
_ITEM = struct.Struct("<IQ")  # key bytes, value bytes


def pack_items(items: list[tuple[str, bytes]]) -> bytes:
    """(key, value) pairs as one payload: for each, ``<IQ>`` (key bytes, value bytes), the key, the value."""
    out = []
    for key, value in items:
        raw = key.encode()
        out += [_ITEM.pack(len(raw), len(value)), raw, value]
    return b"".join(out)


def unpack_items(payload: bytes) -> list[tuple[str, memoryview]]:
    """The pairs :func:`pack_items` packed (values are views of ``payload``); ValueError if it is truncated."""
    view, at, out = memoryview(payload), 0, []
    while at < len(view):
        if at + _ITEM.size > len(view):
            raise ValueError("truncated item header")
        key_len, value_len = _ITEM.unpack_from(view, at)
        at += _ITEM.size
        if at + key_len + value_len > len(view):
            raise ValueError("truncated item")
        key = bytes(view[at:at + key_len]).decode()
        at += key_len
        out.append((key, view[at:at + value_len]))
        at += value_len
    return out


def read_exact(f, n: int) -> bytes:
    """``n`` bytes from the binary stream ``f``; EOFError when it ends first."""
    buf = bytearray(n)
    view, at = memoryview(buf), 0
    while at < n:
        got = f.readinto(view[at:])
        if not got:
            raise EOFError(f"stream ended after {at} of {n} bytes")
        at += got
    return bytes(buf)


def serve(store, stdin, stdout) -> None:
    while True:
        try:
            op, key_len, payload_len = REQUEST.unpack(read_exact(stdin, REQUEST.size))
        except EOFError:
            return
        key = read_exact(stdin, key_len).decode()
        payload = read_exact(stdin, payload_len) if payload_len else b""
        out = b""
        if op == OP_CLOSE:
            stdout.write(RESPONSE.pack(0, 0))
            stdout.flush()
            return
        if op == OP_PUT:
            code = store.put(key, payload)
        elif op == OP_GET:
            out = bytes(store.get(key) or b"")
            code = 0
        elif op == OP_EXISTS:
            codes = store.batch_is_exist(payload.decode().split("\n"))
            out = struct.pack(f"<{len(codes)}i", *codes)
            code = 0
        elif op == OP_REMOVE:
            code = store.remove(key, True)
        elif op == OP_PUT_MANY:
            items = unpack_items(payload)
            code = store.put_batch([k for k, _ in items], [v for _, v in items]) if items else 0
        elif op == OP_GET_MANY:
            keys = payload.decode().split("\n") if payload else []
            out = pack_items([(k, bytes(v or b"")) for k, v in zip(keys, store.get_batch(keys) if keys else [])])
            code = 0
        else:
            code = -1
        stdout.write(RESPONSE.pack(code, len(out)) + out)
        stdout.flush()


def main(argv: list[str]) -> int:
    master, metadata, segment, local_host = argv[0], argv[1], int(argv[2]), argv[3]
    stdout = sys.stdout.buffer
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        stdout.write(f"READY -1 {exc}\n".encode())
        stdout.flush()
        return 1
    store = MooncakeDistributedStore()
    code = store.setup(local_host, metadata, segment, max(segment // 4, 16 << 20), "tcp", "", master)
    stdout.write(f"READY {code}\n".encode())
    stdout.flush()
    if code != 0:
        return 1
    try:
        serve(store, sys.stdin.buffer, stdout)
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
