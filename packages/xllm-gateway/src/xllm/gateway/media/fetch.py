"""Fetching an ``http(s)`` image URL, only from allowed hosts.

Rules (each broken rule is a 400 naming the part's ``image_url.url``):

- only ``http`` and ``https``; no user part (``user@host``); the host must be in
  :class:`~xllm.gateway.media.limits.AllowedMediaDomains` exactly (an IP-address host only when that
  literal is listed; an empty list refuses every remote URL);
- redirects are followed by hand, at most ``max_redirects``, each target checked by the same rules;
- the whole fetch (connect, redirects, body) must end within ``fetch_timeout_s``;
- the body is bounded by ``max_image_bytes``: a larger ``Content-Length`` is refused before the body is
  read, and the count is kept while it streams (a server that lies or sends no length is cut off);
- environment proxies and ``.netrc`` are ignored (``trust_env=False``): the request goes to the host.

The URL is parsed once, by ``httpx.URL``, and that parsed URL is what is checked and requested (no
parser differential between the check and the fetch).
"""

from __future__ import annotations

import asyncio

import httpx

from xllm.gateway.media.limits import AllowedMediaDomains, MediaLimits, is_ip_literal
from xllm.gateway.media.parts import ImagePart, shown
from xllm.gateway.openai.errors import APIError

SCHEMES = ("http", "https")
REDIRECTS = (301, 302, 303, 307, 308)
HEADERS = {"Accept": "image/*", "Accept-Encoding": "identity"}  # no compressed bodies to inflate


def checked_url(part: ImagePart, url: str, allow: AllowedMediaDomains, base: httpx.URL | None = None) -> httpx.URL:
    """``url`` parsed (relative to ``base``, a redirect's), when the rules let it be fetched; else the part's 400."""
    try:
        parsed = base.join(url) if base is not None else httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError):
        raise part.error(f"not a valid URL: {shown(url)!r}", code="invalid_image_url") from None
    if parsed.scheme not in SCHEMES:
        raise part.error(f"the scheme {parsed.scheme[:16]!r} is not supported: send a data: URL"
                         f"{' or an http(s) URL of an allowed host' if allow.enabled else ''}",
                         code="invalid_image_url")
    if not allow.enabled:
        raise part.error("this server does not fetch image URLs (no --allowed-media-domains): send a data: URL",
                         code="image_url_not_allowed")
    if parsed.userinfo:
        raise part.error("URLs with a user part are not fetched", code="image_url_not_allowed")
    host = parsed.host
    if not host or not allow.allows(host):
        kind = "the IP address" if host and is_ip_literal(host) else "the host"
        raise part.error(f"{kind} {host[:64]!r} is not in this server's --allowed-media-domains",
                         code="image_url_not_allowed")
    return parsed


async def fetch_image(part: ImagePart, limits: MediaLimits, allow: AllowedMediaDomains,
                      client: httpx.AsyncClient | None = None) -> tuple[bytes, str | None]:
    """The body of ``part``'s URL and its ``Content-Type`` (media type only, lower case, or None),
    under the rules above; a 400 naming the part otherwise (never another exception for a bad URL,
    an unreachable host or a misbehaving server). ``client`` (optional) must not follow redirects
    and should not trust the environment; a client of those settings is made for the call otherwise."""
    url = checked_url(part, part.url, allow)
    try:
        return await asyncio.wait_for(_fetch_with(part, url, limits, allow, client), limits.fetch_timeout_s)
    except asyncio.TimeoutError:
        raise part.error(f"fetching the image took longer than {limits.fetch_timeout_s:g} s",
                         code="image_fetch_failed") from None
    except (httpx.HTTPError, httpx.StreamError, OSError, UnicodeError, ValueError) as exc:  # what a server can cause
        raise part.error(f"the image could not be fetched ({type(exc).__name__})", code="image_fetch_failed") from None


def new_client(limits: MediaLimits) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` for image fetches: no automatic redirects, no environment proxies."""
    return httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=httpx.Timeout(limits.fetch_timeout_s))


async def _fetch_with(part: ImagePart, url: httpx.URL, limits: MediaLimits, allow: AllowedMediaDomains,
                      client: httpx.AsyncClient | None) -> tuple[bytes, str | None]:
    if client is not None:
        return await _fetch(part, url, limits, allow, client)
    async with new_client(limits) as own:
        return await _fetch(part, url, limits, allow, own)


async def _fetch(part: ImagePart, url: httpx.URL, limits: MediaLimits, allow: AllowedMediaDomains,
                 client: httpx.AsyncClient) -> tuple[bytes, str | None]:
    for _hop in range(limits.max_redirects + 1):
        async with client.stream("GET", url, headers=HEADERS) as response:
            if response.status_code in REDIRECTS:
                location = response.headers.get("location")
                if not location:
                    raise part.error(f"the server answered {response.status_code} without a Location",
                                     code="image_fetch_failed")
                url = checked_url(part, location, allow, base=url)
                continue
            if response.status_code != 200:
                raise part.error(f"the server answered HTTP {response.status_code}", code="image_fetch_failed")
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limits.max_image_bytes:
                raise _too_large(part, limits)
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limits.max_image_bytes:
                    raise _too_large(part, limits)
                chunks.append(chunk)
            kind = response.headers.get("content-type")
            kind = kind.split(";", 1)[0].strip().lower() if kind else None
            return b"".join(chunks), kind or None
    raise part.error(f"more than {limits.max_redirects} redirects", code="image_fetch_failed")


def _too_large(part: ImagePart, limits: MediaLimits) -> APIError:
    return part.error(f"the image is larger than {limits.max_image_bytes} bytes", code="image_too_large")
