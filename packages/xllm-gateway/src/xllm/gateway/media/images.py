"""Image inputs: bytes from a ``data:`` URL or an allowed remote URL, decoded safely into RGB.

Decoding (:func:`decode_image`), every failure a 400 naming the part's ``image_url.url``:

- only PNG, JPEG, WebP and GIF decoders are tried (``Image.open(formats=...)``); GIF and animated
  WebP give their first frame;
- the size is read from the header, and ``width * height`` checked against ``max_image_pixels``
  *before* any pixel is decoded. Pillow's own bomb guard (``Image.MAX_IMAGE_PIXELS``, a process
  global this module never changes) may refuse first: its ``DecompressionBombError`` (or its warning,
  where warnings are errors) is the same 400;
- a ``data:`` URL's declared type must be the decoded format (``image/jpeg`` holding a PNG is a 400),
  as must a fetched body's ``Content-Type`` when it names one of the four image types;
- a truncated or corrupt image (``Image.load()`` fails) is a 400 (``ImageFile.LOAD_TRUNCATED_IMAGES``
  is left off);
- transparency is composited onto white, as HF's ``convert_to_rgb`` does, so the pixels hashed are
  the pixels the model's processor sees.

The content hash (:func:`pixel_hash`) is BLAKE2b-256 of the decoded RGB pixels with the size: the same
picture re-encoded losslessly (PNG, lossless WebP, a GIF of its palette) hashes the same; a lossy
re-encoding (JPEG) changes pixels and so the hash; the container, metadata and ``detail`` do not count.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from PIL import Image

from xllm.gateway.media.fetch import fetch_image
from xllm.gateway.media.limits import AllowedMediaDomains, MediaLimits
from xllm.gateway.media.parts import ImagePart, count_images
from xllm.gateway.openai.errors import APIError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MIME_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/pjpeg": "JPEG",
                "image/webp": "WEBP", "image/gif": "GIF"}

Runner = Callable[..., Awaitable[Any]]  # run(fn, *args): fn on a worker thread (Preprocessor.run, asyncio.to_thread)


@dataclass(frozen=True)
class ImageInput:
    """One decoded image of a request: ``image`` (RGB, fully loaded), its ``size`` (width, height),
    ``hash`` (:func:`pixel_hash`, hex), the ``detail`` asked for, the ``format`` it came in and the
    field path of its part (``where``)."""

    image: Image.Image
    size: tuple[int, int]
    hash: str
    detail: str
    format: str
    where: str


def pixel_hash(image: Image.Image) -> str:
    """BLAKE2b-256 (hex) of an RGB image's size and pixels (row-major, 3 bytes a pixel)."""
    if image.mode != "RGB":
        raise ValueError(f"pixel_hash takes an RGB image, got mode {image.mode}")
    width, height = image.size
    h = hashlib.blake2b(digest_size=32, person=b"xllm-img-rgb")
    h.update(width.to_bytes(4, "little") + height.to_bytes(4, "little"))
    h.update(image.tobytes())
    return h.hexdigest()


def data_url_bytes(part: ImagePart, limits: MediaLimits) -> tuple[bytes, str]:
    """The payload and declared MIME type of ``part``'s ``data:`` URL (``data:image/<type>;base64,...``);
    a 400 for another form, an unsupported type, bad base64 or more than ``max_image_bytes``."""
    head, sep, payload = part.url.partition(",")
    params = head[len("data:"):].split(";")
    mime = params[0].strip().lower()
    if not sep or "base64" not in (p.strip().lower() for p in params[1:]):
        raise part.error("a data: URL must be base64: data:image/<type>;base64,<data>", code="invalid_image_url")
    if mime not in MIME_FORMATS:
        raise part.error(f"unsupported image type {mime[:32]!r} (PNG, JPEG, WebP or GIF)", code="invalid_image_format")
    payload = "".join(payload.split())  # line breaks some encoders insert
    if len(payload) // 4 * 3 > limits.max_image_bytes + 2:
        raise part.error(f"the image is larger than {limits.max_image_bytes} bytes", code="image_too_large")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise part.error("the data: URL is not valid base64", code="invalid_image_url") from None
    if len(raw) > limits.max_image_bytes:
        raise part.error(f"the image is larger than {limits.max_image_bytes} bytes", code="image_too_large")
    return raw, mime


def decode_image(part: ImagePart, raw: bytes, declared: str | None, limits: MediaLimits) -> ImageInput:
    """``raw`` decoded to an :class:`ImageInput` by the rules above (CPU work: run off the event loop).
    ``declared``: the MIME type the sender named (a ``data:`` URL's, a response's ``Content-Type``)."""
    try:
        with Image.open(io.BytesIO(raw), formats=FORMATS) as img:
            width, height = img.size
            if width * height > limits.max_image_pixels:
                raise _too_many_pixels(part, width, height, limits)
            fmt = "JPEG" if img.format == "MPO" else (img.format or "")  # MPO: a JPEG with more pictures
            expected = MIME_FORMATS.get(declared or "")
            if expected is not None and expected != fmt:
                raise part.error(f"declared as {declared} but the data is {fmt or 'another format'}",
                                 code="invalid_image_format")
            img.seek(0)  # the first frame of an animation
            img.load()
            rgb = to_rgb(img)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise _too_many_pixels(part, None, None, limits) from None
    except Image.UnidentifiedImageError:
        raise part.error("the data is not a PNG, JPEG, WebP or GIF image", code="invalid_image_format") from None
    except APIError:
        raise
    except Exception:  # truncated or corrupt data: Pillow raises OSError, SyntaxError, ValueError, ...
        raise part.error("the image is truncated or corrupt", code="invalid_image") from None
    return ImageInput(image=rgb, size=rgb.size, hash=pixel_hash(rgb), detail=part.detail, format=fmt,
                      where=part.where)


def to_rgb(img: Image.Image) -> Image.Image:
    """``img`` as RGB; transparency composited onto white (HF ``convert_to_rgb``)."""
    if img.mode == "RGB":
        return img.copy()
    has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
    if not has_alpha:
        return img.convert("RGB")
    rgba = img.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


async def load_image(part: ImagePart, limits: MediaLimits, allow: AllowedMediaDomains,
                     run: Runner | None = None, client: httpx.AsyncClient | None = None) -> ImageInput:
    """One part's image: a ``data:`` URL decoded, an ``http(s)`` URL fetched by the allow-list's rules
    (:mod:`xllm.gateway.media.fetch`), any other scheme refused; decoded on ``run``'s thread."""
    run = run or asyncio.to_thread
    if part.url[:5].lower() == "data:":
        return await run(decode_data_url, part, limits)
    raw, declared = await fetch_image(part, limits, allow, client)
    return await run(decode_image, part, raw, declared, limits)


def decode_data_url(part: ImagePart, limits: MediaLimits) -> ImageInput:
    """``part``'s ``data:`` URL decoded (base64, then the image): CPU work, off the event loop."""
    raw, declared = data_url_bytes(part, limits)
    return decode_image(part, raw, declared, limits)


async def load_images(parts: Sequence[ImagePart], limits: MediaLimits, allow: AllowedMediaDomains,
                      run: Runner | None = None, client: httpx.AsyncClient | None = None) -> list[ImageInput]:
    """The images of a request's ``parts`` (:func:`xllm.gateway.media.parts.image_parts`), in order.
    The count is checked before anything is fetched; remote images are fetched concurrently; the
    first failure (in part order) is raised as its 400 and the other fetches are cancelled."""
    count_images(parts, limits.max_images)
    tasks = [asyncio.ensure_future(load_image(p, limits, allow, run, client)) for p in parts]
    try:
        return [await t for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _too_many_pixels(part: ImagePart, width: int | None, height: int | None, limits: MediaLimits) -> APIError:
    if width is None:  # Pillow's own guard (Image.MAX_IMAGE_PIXELS) refused it first
        return part.error("the image declares more pixels than this server decodes", code="image_too_large")
    return part.error(f"the image is {width}x{height} pixels; the limit is {limits.max_image_pixels} pixels",
                      code="image_too_large")
