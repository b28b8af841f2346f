"""The process that holds an engine's Mooncake store client (``python -m xllm.kvstore.mooncake_worker``).

Why a process of its own: the Mooncake client holds the GIL while a call waits for its transfer
threads, and an engine's OpenMP team keeps the cores busy, so in the engine's process one ``put``
stalled the engine thread for up to seconds (TTFT p50 13x worse in ``benchmarks/kv_tiers``). Here
the engine's writer and loader threads only wait on a pipe.

Protocol over stdin/stdout, one request at a time: a request is ``<BIQ>`` (op, key bytes, payload
bytes), the key, the payload; a response is ``<iQ>`` (code, payload bytes) and the payload. The
worker writes ``READY <code>`` (a line) once its client joined the store (code 0) or failed.
"""

from __future__ import annotations

import struct
import sys

REQUEST = struct.Struct("<BIQ")
RESPONSE = struct.Struct("<iQ")
OP_CLOSE, OP_PUT, OP_GET, OP_EXISTS, OP_REMOVE = 0, 1, 2, 3, 4


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
