"""Throw-away TLS material for tests: a self-signed certificate made with the ``openssl`` command."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SelfSigned:
    """PEM files: ``cert`` (also the CA to trust: it signed itself) and its ``key``."""

    cert: Path
    key: Path


def have_openssl() -> bool:
    return shutil.which("openssl") is not None


def self_signed(directory: Path, name: str = "xllm-test", hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
                ) -> SelfSigned:
    """A P-256 certificate for ``hosts`` (IP addresses and DNS names in its subjectAltName; its
    common name is ``name``), valid for a day, written to ``directory``. Needs ``openssl`` ≥ 1.1.1."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    sans = ",".join(f"IP:{h}" if h[0].isdigit() or ":" in h else f"DNS:{h}" for h in (*hosts, name))
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={name}",
                    "-addext", f"subjectAltName={sans}"],
                   check=True, capture_output=True, timeout=60)
    return SelfSigned(cert, key)
