"""Every gRPC channel and server option the packages pass is a key gRPC core knows: core ignores an
unknown key without a word (the servers' keepalive permit was once passed under the C macro's name,
so the 5-minute default stayed and long-queued streams failed with GOAWAY "too_many_pings")."""

from __future__ import annotations

import pathlib
import re

import grpc._cython.cygrpc as cygrpc

ROOT = pathlib.Path(__file__).resolve().parents[3]
KEY = re.compile(r'"(grpc\.[a-z0-9_.]+)"')


def test_every_grpc_option_key_in_the_sources_is_one_grpc_core_knows():
    core = pathlib.Path(cygrpc.__file__).read_bytes()  # gRPC core is linked into this extension
    used: dict[str, list[str]] = {}
    for path in sorted((ROOT / "packages").glob("*/src/**/*.py")):
        if "/proto/" in str(path):
            continue
        for key in KEY.findall(path.read_text()):
            used.setdefault(key, []).append(str(path.relative_to(ROOT)))
    assert "grpc.http2.min_ping_interval_without_data_ms" in used  # the scan sees the keepalive permit
    unknown = {key: files for key, files in used.items() if key.encode() + b"\0" not in core}
    assert not unknown, f"option keys gRPC core does not know: {unknown}"


def test_the_scan_tells_a_known_key_from_an_unknown_one():
    core = pathlib.Path(cygrpc.__file__).read_bytes()
    assert b"grpc.keepalive_time_ms\0" in core
    assert b"grpc.http2.min_recv_ping_interval_without_data_ms\0" not in core
