"""OpenAI ``image_url`` content parts, checked and located: each becomes an :class:`ImagePart` that
knows the field path errors name (``messages[0].content[1]``, then ``.image_url.url``, ...)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from xllm.gateway.openai.errors import APIError, bad_request

DETAILS = ("auto", "low", "high")
MAX_URL_SHOWN = 64  # characters of a URL an error message repeats


@dataclass(frozen=True)
class ImagePart:
    """One ``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`` part.

    ``where`` is the part's field path (``messages[0].content[1]``); :meth:`field` extends it. The
    path is written with brackets and dots, as OpenAI's own errors name nested fields."""

    url: str
    detail: str
    where: str

    def field(self, suffix: str = "") -> str:
        return f"{self.where}{suffix}"

    def error(self, message: str, suffix: str = ".image_url.url", code: str = "invalid_image") -> APIError:
        """The 400 for this part: ``param`` is the full field path, the message starts with it."""
        param = self.field(suffix)
        return bad_request(f"Invalid '{param}': {message}", param, code)


def parse_image_part(part: Any, where: str) -> ImagePart:
    """``part`` (a content part's JSON value at field path ``where``) as an :class:`ImagePart`; a 400
    naming the field when it is not an ``image_url`` part of the right shape. ``image_url`` may be an
    object ``{"url", "detail"?}`` or (as vLLM accepts) the URL string itself."""
    if not isinstance(part, Mapping) or part.get("type") != "image_url":
        raise bad_request(f"Invalid '{where}': expected an object with type 'image_url'", where)
    extra = set(part) - {"type", "image_url"}
    if extra:
        name = sorted(extra)[0][:32]
        raise bad_request(f"Unrecognized request argument supplied: {where}.{name}", f"{where}.{name}")
    image = part.get("image_url")
    if isinstance(image, str):
        image = {"url": image}
    if not isinstance(image, Mapping):
        raise bad_request(f"Invalid '{where}.image_url': expected an object with a 'url'", f"{where}.image_url")
    extra = set(image) - {"url", "detail"}
    if extra:
        name = sorted(extra)[0][:32]
        raise bad_request(f"Unrecognized request argument supplied: {where}.image_url.{name}",
                          f"{where}.image_url.{name}")
    url, detail = image.get("url"), image.get("detail", "auto")
    if not isinstance(url, str) or not url:
        raise bad_request(f"Invalid '{where}.image_url.url': expected a non-empty string", f"{where}.image_url.url")
    if detail is None:
        detail = "auto"
    if detail not in DETAILS:
        raise bad_request(f"Invalid '{where}.image_url.detail': expected one of {', '.join(DETAILS)}, got "
                          f"{str(detail)[:32]!r}", f"{where}.image_url.detail")
    return ImagePart(url=url, detail=detail, where=where)


def image_parts(messages: Sequence[Any], field: str = "messages") -> list[ImagePart]:
    """The ``image_url`` parts of chat ``messages`` (their JSON values, in order), located under
    ``field``; text parts and string contents are skipped, other part shapes are the schema's concern."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, Mapping) and part.get("type") == "image_url":
                    found.append(parse_image_part(part, f"{field}[{i}].content[{j}]"))
    return found


def shown(url: str) -> str:
    """A URL as an error message repeats it: its start only (a data: URL's payload is not echoed)."""
    if url.startswith("data:"):
        return url.split(",", 1)[0][:MAX_URL_SHOWN] + ",..."
    return url if len(url) <= MAX_URL_SHOWN else url[:MAX_URL_SHOWN - 3] + "..."


def count_images(parts: Iterable[ImagePart], max_images: int) -> None:
    """400 naming the first part past ``max_images``."""
    for n, part in enumerate(parts, 1):
        if n > max_images:
            raise bad_request(f"Invalid '{part.where}': a request may carry at most {max_images} images",
                              part.where, "too_many_images")
