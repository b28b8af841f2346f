"""The ``xllm serve`` flags of the OpenAI API's security and limits, and what they build: the
:class:`~xllm.gateway.openai.limits.ApiLimits` and :class:`~xllm.gateway.access.AccessPolicy`
of the gateway (defaults come from those classes, documented there). No torch here."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from xllm.common.argtypes import non_negative_int, positive_float, positive_int
from xllm.gateway.access import API_KEY_ENV, AccessPolicy, parse_keys
from xllm.gateway.http_guard import HttpGuardOptions
from xllm.gateway.media.intake import MediaIntake
from xllm.gateway.media.limits import AllowedMediaDomains, MediaLimits
from xllm.gateway.openai.limits import MIB, OPENAI_MAX_N, ApiLimits
from xllm.gateway.openai.protocol import DEFAULT_OFFLINE_PRIORITY


def add_api_flags(p: argparse.ArgumentParser) -> None:
    """The API key, priority and request-limit flags of ``xllm serve``. The limits the engines apply again
    (``--max-prompt-chars``, ``--max-stop``, ...) are engine flags, defined once for both
    (:func:`xllm.engine_api.flags.add_request_bound_flags`): the parser has them already."""
    d = ApiLimits()
    g = p.add_argument_group("API security and limits",
                             "who may call the OpenAI API (/v1/*) and how large a request may be")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every /v1/* route (repeatable; also "
                        f"${API_KEY_ENV}, comma-separated, which keeps keys off the command line); "
                        f"/health and /metrics stay open")
    g.add_argument("--priority-api-key", action="append", default=None, metavar="KEY",
                   help="an API key whose requests may raise their priority (a negative `priority`, `service_tier` "
                        "priority/scale; repeatable; also a valid API key); other clients asking for it get 403")
    g.add_argument("--admin-api-key", action="append", default=None, metavar="KEY",
                   help="an API key that may also load and unload LoRA adapters (POST /v1/load_lora_adapter, "
                        "/v1/unload_lora_adapter; repeatable; also a valid API key); with keys set, other clients "
                        "get 403 there; without any key those routes are open (bind loopback)")
    g.add_argument("--allow-client-priority", action="store_true",
                   help="without --api-key: let every client raise its priority (default: 403)")
    g.add_argument("--offline-priority", type=int, default=DEFAULT_OFFLINE_PRIORITY, metavar="N",
                   help="requests with a `priority` of at least N are offline, like `service_tier: flex` ones: "
                        "best-effort work in the capacity online requests leave, within the engines' "
                        "--slo-tpot-ms, preempted first (anyone may ask to be offline)")
    g.add_argument("--max-inflight-requests", type=non_negative_int, default=0, metavar="N",
                   help="most generation requests (streams until they end) the gateway holds at once; one more "
                        "gets 503 with Retry-After; 0: unlimited")
    g.add_argument("--max-body-mib", type=positive_float, default=d.max_body_bytes / MIB, metavar="MIB",
                   help="largest HTTP request body, in MiB; a larger one gets 413 before it is read")
    g.add_argument("--max-prompts", type=positive_int, default=d.max_prompts, metavar="N",
                   help="most prompts in one /v1/completions request")
    g.add_argument("--max-n", type=positive_int, default=d.max_n, metavar="N",
                   help=f"most choices (`n`) per prompt (at most {OPENAI_MAX_N})")
    g.add_argument("--max-logprobs", type=non_negative_int, default=d.max_logprobs, metavar="N",
                   help="most alternatives per token a request may ask for (`top_logprobs`, completions `logprobs`)")
    add_http_flags(p)
    add_media_flags(p)


def add_media_flags(p: argparse.ArgumentParser) -> None:
    """The image-input flags of ``xllm serve`` (:class:`~xllm.gateway.media.limits.MediaLimits`,
    :class:`~xllm.gateway.media.limits.AllowedMediaDomains`; built by :func:`media_intake`)."""
    d = MediaLimits()
    g = p.add_argument_group("Image inputs", "image_url content parts: where images may come from and how large")
    g.add_argument("--allowed-media-domains", action="append", default=None, metavar="HOST[,HOST...]",
                   help="host names http(s) image URLs may name, exactly (no wildcards or subdomains; an IP "
                        "address only when listed; repeatable or comma-separated); redirects are checked again. "
                        "Default: none, so only data: URLs are accepted")
    g.add_argument("--max-image-mib", type=positive_float, default=d.max_image_bytes / MIB, metavar="MIB",
                   help="largest encoded image (a data: URL's payload or a fetched body), in MiB; larger is 400. "
                        "A data: URL is also bounded by --max-body-mib")
    g.add_argument("--max-image-pixels", type=positive_int, default=d.max_image_pixels, metavar="N",
                   help="most pixels (width x height) of one image, checked from its header before decoding; "
                        "more is 400 (decompression bombs)")
    g.add_argument("--max-images-per-request", type=positive_int, default=d.max_images, metavar="N",
                   help="most image parts in one request; more is 400")
    g.add_argument("--media-fetch-timeout-s", type=positive_float, default=d.fetch_timeout_s, metavar="SECONDS",
                   help="the whole fetch of one image URL (redirects and body included) must end within this; "
                        "else 400")


def add_http_flags(p: argparse.ArgumentParser) -> None:
    """The HTTP connection bounds of ``xllm serve`` (:mod:`xllm.gateway.http_guard`)."""
    d = HttpGuardOptions()
    g = p.add_argument_group("HTTP connections", "how long a client may take to send a request, and how many "
                             "connections it may hold (refusals counted in xllm:http_refused_total{reason})")
    g.add_argument("--http-header-timeout-s", type=positive_float, default=d.header_timeout_s, metavar="SECONDS",
                   help="a request head (request line and headers) must be complete this long after the connection "
                        "opened, or after the first byte of a later request on a kept-alive connection; else 408 "
                        "and the connection is closed (slowloris)")
    g.add_argument("--http-body-timeout-s", type=positive_float, default=d.body_timeout_s, metavar="SECONDS",
                   help="a request body must be complete this long after its head; else 408 and the connection is "
                        "closed. Only reading the request is timed: a streamed response runs as long as it needs")
    g.add_argument("--http-keep-alive-s", type=positive_float, default=d.keep_alive_s, metavar="SECONDS",
                   help="an idle kept-alive connection (no request under way, no byte of the next) is closed after "
                        "this long")
    g.add_argument("--max-connections-per-client", type=non_negative_int, default=d.max_connections_per_client,
                   metavar="N", help="most connections one remote address may hold open; one more has its request "
                                     "answered 429 with Retry-After and is closed (behind a reverse proxy every "
                                     "client is the proxy's address); 0: unlimited")
    g.add_argument("--max-connections", type=non_negative_int, default=d.max_connections, metavar="N",
                   help="most HTTP connections open at once; one more has its request answered 503 with Retry-After "
                        "and is closed; 0: unlimited. The default is three quarters of this process's open-file limit")


def http_guard_options(args: argparse.Namespace) -> HttpGuardOptions:
    """The HTTP connection bounds the flags describe (0 caps: none)."""
    return HttpGuardOptions(header_timeout_s=args.http_header_timeout_s, body_timeout_s=args.http_body_timeout_s,
                            keep_alive_s=args.http_keep_alive_s,
                            max_connections_per_client=args.max_connections_per_client or None,
                            max_connections=args.max_connections or None)


def api_limits(args: argparse.Namespace) -> ApiLimits:
    """The limits the flags describe (the engines' request bounds among them); ``ValueError`` for values out
    of range."""
    return ApiLimits(max_body_bytes=max(int(args.max_body_mib * MIB), 1), max_prompt_chars=args.max_prompt_chars,
                     max_prompts=args.max_prompts, max_n=args.max_n, max_logprobs=args.max_logprobs,
                     max_stop=args.max_stop, max_stop_chars=args.max_stop_chars,
                     max_stop_token_ids=args.max_stop_token_ids, max_logit_bias=args.max_logit_bias,
                     max_inflight_requests=args.max_inflight_requests or None)


def media_intake(args: argparse.Namespace) -> MediaIntake:
    """The image intake of the flags (:mod:`xllm.gateway.media.intake`); ``ValueError`` for a bad host or limit."""
    hosts = [h for value in args.allowed_media_domains or [] for h in value.split(",") if h.strip()]
    return MediaIntake(MediaLimits(max_image_bytes=max(int(args.max_image_mib * MIB), 1),
                                   max_image_pixels=args.max_image_pixels, max_images=args.max_images_per_request,
                                   fetch_timeout_s=args.media_fetch_timeout_s),
                       AllowedMediaDomains.of(hosts))


def access_policy(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> AccessPolicy:
    """The API keys of the flags and of ``$XLLM_API_KEY`` (in ``environ``, default ``os.environ``);
    ``ValueError`` for a blank key or --allow-client-priority with API keys."""
    environ = os.environ if environ is None else environ
    return AccessPolicy(api_keys=parse_keys(args.api_key, environ.get(API_KEY_ENV)),
                        priority_keys=parse_keys(args.priority_api_key), admin_keys=parse_keys(args.admin_api_key),
                        allow_client_priority=args.allow_client_priority, offline_priority=args.offline_priority)
