"""Resumable stream ids: what any gateway of a cluster needs to continue a stream another one started.

The response id of a resumable streamed response (chat or completions) is a *stream id*:
``<prefix>-<payload>.<mac>`` where ``prefix`` is ``chatcmpl`` or ``cmpl`` (the chunks' object type),
``payload`` the base64url of a compact JSON :class:`StreamTicket` (model, created, usage options, each
prompt's token count, the choices per prompt, the service tier) with a random nonce (each id is unique),
and ``mac`` a truncated HMAC-SHA256 of both under the cluster's stream key
(:class:`xllm.engine_api.credential.ClusterKeys`; a random key per process without a cluster token, where
a single gateway serves). A client can neither forge a stream id
nor alter one; the engine request of choice ``k`` runs under ``<stream id>-<k>`` on its instance (the
instance is found by asking, see :mod:`xllm.gateway.openai.serving_resume`).

Each event of such a stream carries ``id: <stream id>/<tokens of each choice so far>``
(:func:`xllm.gateway.openai.serving.event_id`), which a reconnecting client sends back as
``Last-Event-ID``; :func:`parse_last_event_id` reads it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass

from xllm.gateway.openai.errors import APIError, bad_request

OBJECTS = {"chatcmpl": "chat.completion.chunk", "cmpl": "text_completion"}
MAC_BYTES = 12
NONCE_BYTES = 9  # random bytes that make each stream id unique
MAX_STREAM_ID = 4096  # characters; longer ids are refused unread


@dataclass(frozen=True)
class StreamTicket:
    """What a stream id says about its stream (all a gateway needs to format the rest of it)."""

    prefix: str                 # "chatcmpl" / "cmpl"
    model: str
    created: int
    include_usage: bool
    continuous_usage: bool
    prompt_tokens: tuple[int, ...]  # of each prompt (chat: one)
    per_prompt: int                 # choices per prompt (n)
    service_tier: str = "default"

    @property
    def object(self) -> str:
        return OBJECTS[self.prefix]

    @property
    def choices(self) -> int:
        return len(self.prompt_tokens) * self.per_prompt

    def _payload(self) -> list:
        return [1, self.model, self.created, int(self.include_usage), int(self.continuous_usage),
                list(self.prompt_tokens), self.per_prompt, self.service_tier]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class StreamSeal:
    """Issues and checks stream ids under one key (``key`` None: a random key, this process only)."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or secrets.token_bytes(32)

    def _mac(self, prefix: str, payload: str) -> str:
        return _b64(hmac.new(self._key, f"{prefix}-{payload}".encode(), hashlib.sha256).digest()[:MAC_BYTES])

    def issue(self, ticket: StreamTicket) -> str:
        """A new stream id for ``ticket`` (a response id: unique, a random nonce ends the payload, so two
        identical requests in the same second get two streams)."""
        fields = [*ticket._payload(), secrets.token_urlsafe(NONCE_BYTES)]
        payload = _b64(json.dumps(fields, separators=(",", ":")).encode())
        return f"{ticket.prefix}-{payload}.{self._mac(ticket.prefix, payload)}"

    def open(self, stream_id: str) -> StreamTicket:
        """The ticket of a stream id this cluster issued; raises a 404 :class:`APIError` naming the id
        for anything else (malformed, forged, altered)."""
        unknown = APIError(404, f"no stream {stream_id[:200]!r}", "not_found_error", "stream_id", "stream_not_found")
        prefix, _, rest = stream_id.partition("-")
        payload, _, mac = rest.rpartition(".")
        if len(stream_id) > MAX_STREAM_ID or prefix not in OBJECTS or not payload:
            raise unknown
        if not hmac.compare_digest(mac, self._mac(prefix, payload)):
            raise unknown
        try:
            v, model, created, usage, continuous, prompts, per_prompt, tier, _nonce = json.loads(_unb64(payload))
        except (ValueError, TypeError, binascii.Error):
            raise unknown from None
        if v != 1:
            raise unknown
        return StreamTicket(prefix, model, created, bool(usage), bool(continuous), tuple(prompts), per_prompt, tier)


def parse_last_event_id(stream_id: str, value: str | None, choices: int) -> list[int] | None:
    """The output tokens of each choice a client received, from its ``Last-Event-ID`` (None when absent:
    nothing received, the stream is sent from its start); a 400 for an id of another stream or malformed."""
    if value is None or not value.strip():
        return None
    head, _, counts = value.strip().rpartition("/")
    if head != stream_id:
        raise bad_request("Last-Event-ID names another stream", "Last-Event-ID")
    try:
        tokens = [int(c) for c in counts.split(",")]
    except ValueError:
        raise bad_request("Last-Event-ID is malformed", "Last-Event-ID") from None
    if len(tokens) != choices or min(tokens) < 0:
        raise bad_request(f"Last-Event-ID must count the tokens of {choices} choice(s)", "Last-Event-ID")
    return tokens
