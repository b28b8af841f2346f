"""The bounds of image inputs and the hosts images may be fetched from (``xllm serve`` flags:
:func:`xllm.gateway.api_flags.add_media_flags`). Plain frozen dataclasses: no global state."""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, fields

MIB = 1024 * 1024


@dataclass(frozen=True)
class MediaLimits:
    """Limits of the images of one request (each checked before the image costs more than its bytes).

    - ``max_image_bytes`` (``--max-image-mib``, 20 MiB): the encoded bytes of one image (a ``data:``
      URL's decoded payload, checked from its base64 length first; a fetched body, checked from its
      ``Content-Length`` and again while it streams).
    - ``max_image_pixels`` (``--max-image-pixels``, 16 Mi = 4096 x 4096): width x height of one image,
      read from its header before any pixel is decoded (decompression bombs).
    - ``max_images`` (``--max-images-per-request``, 8): image parts in one request, counted before any
      is fetched or decoded.
    - ``fetch_timeout_s`` (``--media-fetch-timeout-s``, 10 s): the whole fetch of one remote image,
      redirects included.
    - ``max_redirects`` (3): redirects followed per fetch (each one's target checked again).
    """

    max_image_bytes: int = 20 * MIB
    max_image_pixels: int = 4096 * 4096
    max_images: int = 8
    fetch_timeout_s: float = 10.0
    max_redirects: int = 3

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "fetch_timeout_s":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                    raise ValueError(f"{f.name} must be a positive number of seconds, got {value!r}")
                continue
            low = 0 if f.name == "max_redirects" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{f.name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class AllowedMediaDomains:
    """The hosts ``http(s)`` image URLs may name: exact host names, compared case-insensitively and
    without a trailing dot (no wildcards, no subdomains). Empty: no remote fetch at all. A host that
    is an IP address literal is allowed only when that literal is listed. The list is about names:
    where an allowed name resolves to is the operator's DNS (list only hosts you trust)."""

    hosts: frozenset[str] = frozenset()

    @classmethod
    def of(cls, hosts: Iterable[str]) -> AllowedMediaDomains:
        """From host names (blank entries dropped); ``ValueError`` for one with a scheme, path,
        port or user part."""
        clean = set()
        for host in hosts:
            host = normalize_host(host.strip())
            if not host:
                continue
            if any(c in host for c in "/:@?#[] ") and not _is_ip(host):
                raise ValueError(f"--allowed-media-domains takes bare host names, got {host!r}")
            clean.add(host)
        return cls(frozenset(clean))

    @property
    def enabled(self) -> bool:
        return bool(self.hosts)

    def allows(self, host: str) -> bool:
        return normalize_host(host) in self.hosts


def normalize_host(host: str) -> str:
    """``host`` as the allow-list compares it: lower case, no trailing dot, IPv6 without brackets."""
    return host.lower().rstrip(".").removeprefix("[").removesuffix("]")


def is_ip_literal(host: str) -> bool:
    """True when ``host`` is an IPv4 or IPv6 address rather than a name."""
    return _is_ip(normalize_host(host))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def parse_domains(values: Iterable[str] | None) -> AllowedMediaDomains:
    """The allow-list of repeated and comma-separated flag values."""
    return AllowedMediaDomains.of(h for v in values or () for h in v.split(","))


def media_limits(args: argparse.Namespace) -> MediaLimits:
    """The limits the ``xllm serve`` media flags describe; ``ValueError`` for values out of range."""
    return MediaLimits(max_image_bytes=max(int(args.max_image_mib * MIB), 1), max_image_pixels=args.max_image_pixels,
                       max_images=args.max_images_per_request, fetch_timeout_s=args.media_fetch_timeout_s)


def allowed_media_domains(args: argparse.Namespace) -> AllowedMediaDomains:
    """The ``--allowed-media-domains`` allow-list of the flags."""
    return parse_domains(args.allowed_media_domains)
