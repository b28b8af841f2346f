"""The engine's command-line flags, defined once for ``xllm engine`` (an instance process) and
``xllm serve`` (whose embedded or spawned engines take the same engine flags).

No torch here: choices come from the name tables (:mod:`xllm.engine_api.names`). What the engine
builds from the flags (its ``EngineConfig`` and hand-off options) is the server half's:
:mod:`xllm.engine.config`.
"""

from __future__ import annotations

import argparse
import logging
import os

from xllm.common.argtypes import fraction, non_negative_float, non_negative_int, positive_float, positive_int
from xllm.engine_api import logs
from xllm.engine_api.bounds import RequestBounds
from xllm.engine_api.names import (
    DTYPES,
    KV_BACKENDS,
    KV_CACHE_DTYPES,
    KV_TRANSPORTS,
    PROPOSERS,
    TP_COMMS,
    quantization_choices,
)
from xllm.engine_api.registration.etcd import DEFAULT_PREFIX
from xllm.engine_api.security import TOKEN_ENV, ClusterSecurity, resolve_token
from xllm.engine_api.tracing import add_tracing_flags
from xllm.proto.enums import ROLE_NAMES
from xllm.sched.batch_policy import DEFAULT_OFFLINE_SLO_FRACTION, DEFAULT_TOKEN_BUDGET
from xllm.sched.encode import DEFAULT_MAX_ENCODE_IMAGES, ENCODE_SLO_SHARE
from xllm.sched.eplb import EPLB_POLICIES

ENGINE_DESCRIPTION = ("Run one engine instance serving the xllm.engine.v1.EngineService gRPC contract; with "
                      "--etcd (or --registry) it registers itself and heartbeats load and KV cache events so "
                      "gateways route to it.")


def context_length(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2 (a prompt token and a generated one), got {value}")
    return value


def lora_module(text: str) -> tuple[str, str]:
    """``NAME=PATH`` of ``--lora-modules`` -> ``(NAME, PATH)``."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a PEFT adapter directory), got {text!r}")
    return name, path


def add_model_flags(p: argparse.ArgumentParser, several: bool = False) -> None:
    """``--model`` and ``--served-model-name``; ``several`` (``xllm serve``): each may be repeated, one
    served model per ``--model`` (read them with :func:`served_models`)."""
    again = (" Repeat it to serve several models behind one gateway, each with its own tokenizer, chat template "
             "and engines (the first is the default of requests without `model`)") if several else ""
    p.add_argument("--model", default=None, action="append" if several else "store",
                   help="model to serve: a Hugging Face model directory (config.json + *.safetensors), "
                        "a .gguf file (its config and tokenizer converted once into the cache; its Q8_0/Q4_0/Q4_1 "
                        "weights served as stored, see --quantization), or SmolLM2-135M-Instruct; default: the "
                        "bundled SmolLM2-135M-Instruct (a Q4_1 GGUF)." + again)
    p.add_argument("--served-model-name", default=None, action="append" if several else "store",
                   help="name clients pass as `model` (default: SmolLM2-135M-Instruct or the --model value)"
                        + ("; with several --model, one per --model in the same order" if several else ""))


def served_models(args: argparse.Namespace) -> list[tuple[str | None, str | None]]:
    """(model, served name) for each ``--model`` of a command whose model flags take several
    (:func:`add_model_flags`); ``ValueError`` when the served names do not pair with the models."""
    models, names = args.model or [None], args.served_model_name or []
    if names and len(names) != len(models):
        raise ValueError(f"--served-model-name: {len(names)} given for {len(models)} --model; give one per --model "
                         "or none")
    return list(zip(models, names or [None] * len(models), strict=True))


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Flags of the engine itself (shared by ``serve`` and ``engine``; see :func:`engine_args`)."""
    p.add_argument("--dtype", default=None, choices=DTYPES.choices(),
                   help="precision of activations, KV cache and float weights (default: bfloat16). Given "
                        "explicitly with a GGUF model (the bundled default included) and --quantization auto, it "
                        "asks for the file's weights dequantized to this dtype")
    p.add_argument("--quantization", default="auto", choices=quantization_choices(),
                   help="weight format of the linear layers: auto (a GGUF keeps the Q8_0/Q4_0/Q4_1 weights it "
                        "stores unless --dtype is given; other models stay float), none (float weights in --dtype, "
                        "a GGUF dequantized), int8 (per-channel), int4 / int4_g128 (group-wise with zero points, "
                        "groups of 32 / 128) quantized at load from the float weights, w8a8 (int8 weights per channel "
                        "after SmoothQuant scaling, and activations rounded to int8 per token in every product: "
                        "VNNI int8 GEMMs at twice the bf16 multiply rate; changes outputs slightly). "
                        "Quantized weights run on the CPU with bfloat16 or float32 activations")
    p.add_argument("--max-num-seqs", type=positive_int, default=64,
                   help="most sequences decoded together in one step (the running batch)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=DEFAULT_TOKEN_BUDGET,
                   help="token budget per engine step: decodes first, then prompt chunks up to it (longer "
                        "prompts are prefilled in chunks). Smaller cuts TTFT in bursts, larger raises "
                        "prefill throughput; the default had the best goodput under a TTFT <= 1 s + "
                        "TPOT <= 100 ms SLO on 2 cores (python -m benchmarks budget)")
    p.add_argument("--max-model-len", type=context_length, default=None,
                   help="context length limit (prompt + output); default: the model's")
    p.add_argument("--kv-cache-memory", type=positive_float, default=2.0, metavar="GIB",
                   help="memory for the KV cache in GiB; bounds how many tokens can be cached at once")
    p.add_argument("--kv-cache-backend", default="xtensor", choices=KV_BACKENDS.choices(),
                   help="KV memory: xtensor (virtual-contiguous per sequence, pages mapped on demand; Linux), "
                        "paged (block tables; any platform) or contiguous (a max-length region per sequence)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="how K/V are stored: auto (the model dtype), int8 or fp8_e4m3 (one byte per value plus "
                        "an fp32 scale per token and KV head: about half the bytes of bf16, so about twice the "
                        "tokens in --kv-cache-memory; steps run the eager modules with native quantized "
                        "attention, not the fused native steps)")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="tokens per KV block/page, the prefix-cache granularity (default: 16; xtensor: 128 "
                        "rounded up so a block is whole OS pages, at most --max-model-len)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="disable reuse of cached prompt prefixes between requests")
    p.add_argument("--max-waiting", type=positive_int, default=4096,
                   help="queued requests beyond which new ones get HTTP 503")
    p.add_argument("--async-scheduling", action="store_true",
                   help="overlap scheduling, input preparation and output processing with the forward on a "
                        "worker thread (xLLM pipelined scheduling); tokens are emitted one step later")
    p.add_argument("--no-native-decode", action="store_true",
                   help="run every step through the eager module path instead of the model's fused native "
                        "steps (the decode kernel for <= 8 sequences, the general step for all others; for "
                        "ablation)")
    p.add_argument("--compile-decode", action="store_true",
                   help="build a torch.compile graph for larger decode batches at start-up (~1 min on 2 cores; "
                        "see docs/performance.md for when it pays)")
    p.add_argument("--device", default="cpu", help="cpu, cuda[:N], npu[:N] or auto")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch intra-op threads (default: all cores available to the process; with "
                        "--instances N, the cores divided among the N engines; with --tensor-parallel-size N, "
                        "per rank, the cores divided by N)")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                   help="split the model over N ranks on this host (tensor parallelism; `xllm engine --nnodes`: "
                        "over several hosts): this process and N-1 worker processes, each"
                        " holding 1/N of the attention heads, MLP and vocabulary and its "
                        "own KV memory for its heads; --threads is then per rank (default: the cores divided by "
                        "N). Not yet with --speculative mtp, --compile-decode or quantized KV in hand-offs and "
                        "KV tiers")
    p.add_argument("--tp-comm", choices=TP_COMMS, default="auto",
                   help="the ranks' all-reduce with --tensor-parallel-size: shm (native shared memory between "
                        "the ranks of this host, inside the fused native steps), gloo (torch.distributed over "
                        "TCP: slower, ~0.5 ms a call; the fused steps then run eager) or auto (shm where the "
                        "native kernels are built, else gloo)")
    p.add_argument("--tp-overlap", choices=("auto", "on", "off"), default="auto",
                   help="with --tensor-parallel-size: run an eager step of two or more sequences as two micro-batches "
                        "whose layers interleave, one's all-reduce in flight while the other computes (it pays with "
                        "--tp-comm gloo, whose all-reduce runs in its own threads; the shm all-reduce and the fused "
                        "native steps run on the rank's own thread). auto: per step size, rank 0 times both ways for "
                        "a few steps, keeps the faster and logs both; on: always; off: never (default auto)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size: each rank holds whole MoE experts (placed by rank, "
                        "attention still tensor-parallel) instead of a slice of every expert (Qwen3-MoE, "
                        "DeepSeek-V2/V3 from safetensors)")
    p.add_argument("--num-redundant-experts", type=non_negative_int, default=0, metavar="N",
                   help="with --enable-expert-parallel: N extra replicas per MoE layer for the hot experts (rounded "
                        "up so every rank holds as many experts; default 0)")
    p.add_argument("--enable-eplb", action="store_true",
                   help="with --enable-expert-parallel: rebalance the expert placement from the measured load at run "
                        "time (new experts loaded in the background, switched between steps on every rank at once)")
    p.add_argument("--eplb-step-interval", type=positive_int, default=1000, metavar="STEPS",
                   help="steps per expert-load window: /metrics reports each window's balance, and --enable-eplb "
                        "decides after each (default %(default)s)")
    p.add_argument("--eplb-policy", choices=EPLB_POLICIES, default="auto",
                   help="EPLB placement policy: global (replicate and pack over all ranks), hierarchical (expert "
                        "groups to hosts first, with --nnodes), auto (hierarchical where it applies)")
    p.add_argument("--seed", type=int, default=0, help="seed for requests that do not set their own")
    p.add_argument("--slo-ttft-ms", type=positive_float, default=None, metavar="MS",
                   help="online time-to-first-token target in ms (dynamic PD flips roles against it; "
                        "default: none)")
    p.add_argument("--slo-tpot-ms", type=positive_float, default=None, metavar="MS",
                   help="online time-per-output-token target in ms: offline (service_tier flex) decodes join "
                        "a step only as far as its predicted time stays within it (without it they take only "
                        "what online work leaves of the token budget and --max-num-seqs); dynamic PD flips "
                        "roles against it (default: none)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="step-time profile written by `xllm profile` (same model, dtype and threads): the "
                        "engine predicts step times from the model fitted to it, corrected online from its own "
                        "steps (default: a model fitted on this engine's own steps after a warm-up)")
    p.add_argument("--offline-slo-fraction", type=fraction, default=DEFAULT_OFFLINE_SLO_FRACTION, metavar="F",
                   help="co-location headroom: offline decodes and chunks join steps only as far as the average "
                        "predicted step time online decodes see (over their last 128 steps) stays within F x "
                        "--slo-tpot-ms (steps carrying online prompt chunks run long anyway, and an online "
                        "request's TPOT averages all its steps; default %(default)s, measured in xllm-sim)")
    p.add_argument("--offline-starvation-s", type=positive_float, default=30.0, metavar="SECONDS",
                   help="an offline request that made no progress this long gets a minimal guaranteed share "
                        "of every step (one decode row or a small prompt chunk) until it progresses")
    p.add_argument("--max-encode-images", type=non_negative_int, default=None, metavar="N",
                   help="multimodal models: images one step encodes in the encode phase (a request's images are "
                        "encoded in a step of their own, only while no prompt is mid-prefill, before its prefill "
                        "is admitted); 0 encodes each image inside its first prefill chunk instead. Default: "
                        "profiled at start-up with --slo-tpot-ms (the largest batch of 448x448 images encoded "
                        f"within {ENCODE_SLO_SHARE:g} of the target), else {DEFAULT_MAX_ENCODE_IMAGES}")
    p.add_argument("--speculative", default=None, choices=PROPOSERS.choices(),
                   help="speculative decoding: a proposer guesses the next tokens of each decoding sequence and "
                        "one forward verifies them (outputs unchanged: greedy identical, sampling exact). ngram: "
                        "prompt lookup over prompt + output (pays on editing, extraction, code rewriting); self: "
                        "the served model's own first layers (--speculative-self-layers) with its LM head; draft: "
                        "a smaller model with the same tokenizer (--draft-model); mtp: the model's "
                        "next-token-prediction layers (DeepSeek-V3 checkpoints with num_nextn_predict_layers, "
                        "loaded only then). With --async-scheduling a speculating sequence steps synchronously "
                        "(mtp: not with it). Default: off")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=3, metavar="K",
                   help="most draft tokens per sequence and step (1..16; the engine lowers it per request "
                        "when drafts are rejected, and pauses speculation for requests whose drafts fail)")
    p.add_argument("--speculative-max-batch", type=positive_int, default=8, metavar="N",
                   help="no speculation in a step decoding more than N sequences (larger decode steps are no "
                        "longer bound by reading the weights, so verifying drafts is not free)")
    p.add_argument("--speculative-self-layers", type=positive_int, default=None, metavar="N",
                   help="--speculative self: how many of the model's first layers draft (default: a quarter of "
                        "its layers, at least 1; more layers: better guesses, dearer drafts)")
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="the draft proposer's model: a Hugging Face directory of a smaller model with the "
                        "served model's tokenizer")
    p.add_argument("--item-catalog", default=None, metavar="FILE",
                   help="generative recommendation: the valid items, each a fixed-length tuple of token ids, as "
                        ".npy (an integer array [items, tokens]) or JSON lines (one array per line); loaded at "
                        "start-up into a compact trie. POST /v1/recommend (and item_catalog engine requests) "
                        "beam-search only these items. Default: none")
    add_lora_flags(p)
    add_kv_tier_flags(p)
    add_request_bound_flags(p)


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    """LoRA adapters served beside the base model in the same batches (xllm.core.lora)."""
    p.add_argument("--lora-modules", type=lora_module, nargs="+", default=None, metavar="NAME=PATH",
                   help="PEFT LoRA adapter directories (adapter_config.json + adapter_model.safetensors) loaded at "
                        "start, each served as model NAME; requests of different adapters and of the base model share "
                        "steps, and never share KV (their prefix-cache blocks are keyed by adapter). Adapters on "
                        "attention and dense MLP projections; not with --tensor-parallel-size above 1 or "
                        "--compile-decode")
    p.add_argument("--max-loras", type=positive_int, default=4, metavar="N",
                   help="adapters resident at once; another one is loaded in place of the least recently used "
                        "one no running request uses (a request finding every slot busy waits for one)")
    p.add_argument("--max-lora-rank", type=positive_int, default=16, metavar="R",
                   help="the largest adapter rank served (adapters above it are refused); sizes the adapter slots")


def add_request_bound_flags(p: argparse.ArgumentParser) -> None:
    """The request limits the gateway applies and every engine applies again
    (:class:`~xllm.engine_api.bounds.RequestBounds`; :func:`request_bounds`), defined once: ``xllm serve``
    gives them to its API limits and to its embedded or spawned engines, ``xllm engine`` to itself, so
    raising one on the gateway raises it on the engines started with it (start ``xllm engine`` processes
    with the same values). The engine sizes its largest accepted message by them (xllm.engine.intake)."""
    d = RequestBounds()
    g = p.add_argument_group("request limits", "how much one request may ask for; the gateway refuses more with "
                             "400, engines refuse it again (give gateway and engines the same values)")
    g.add_argument("--max-prompt-chars", type=positive_int, default=d.max_grammar_chars, metavar="N",
                   help="most characters of prompt (messages and tools, or the string prompts) one request may "
                        "send, checked by the gateway before tokenization; also the most characters of an output "
                        "constraint (JSON schema, regex, grammar, choices), checked again by the engine")
    g.add_argument("--max-stop", type=positive_int, default=d.max_stop, metavar="N",
                   help="most stop strings of one request")
    g.add_argument("--max-stop-chars", type=positive_int, default=d.max_stop_chars, metavar="N",
                   help="most characters of one stop string")
    g.add_argument("--max-stop-token-ids", type=positive_int, default=d.max_stop_token_ids, metavar="N",
                   help="most stop token ids of one request")
    g.add_argument("--max-logit-bias", type=positive_int, default=d.max_logit_bias, metavar="N",
                   help="most logit_bias entries of one request")


def request_bounds(args: argparse.Namespace) -> RequestBounds:
    """The request limits :func:`add_request_bound_flags` describes."""
    return RequestBounds(max_stop=args.max_stop, max_stop_chars=args.max_stop_chars,
                         max_stop_token_ids=args.max_stop_token_ids, max_logit_bias=args.max_logit_bias,
                         max_grammar_chars=args.max_prompt_chars)


def add_kv_tier_flags(p: argparse.ArgumentParser) -> None:
    """KV tiers below the engine's KV memory (xllm.core.kv.lower_tiers): prefixes evicted from it are
    written there and loaded back instead of recomputed."""
    p.add_argument("--kv-host-memory", type=positive_float, default=None, metavar="GIB",
                   help="T1 KV tier: host DRAM in GiB shared by the engine processes of this machine (files in a "
                        "tmpfs, --kv-host-dir) that outlives any of them; blocks evicted from the KV cache are "
                        "written there and loaded back for later requests with the same prefix; off by default")
    p.add_argument("--kv-host-dir", default="/dev/shm/xllm-kv", metavar="DIR",
                   help="where the host KV tier keeps its blocks: a tmpfs directory (RAM); engines of the same "
                        "model and KV layout using one directory share its blocks and its capacity")
    p.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                   help="T2 KV tier: a local SSD directory for evicted KV blocks (one checksummed file per block, "
                        "kept across restarts; a corrupt block is detected and recomputed; off by default")
    p.add_argument("--kv-disk-size", type=positive_float, default=10.0, metavar="GIB",
                   help="capacity of the --kv-disk-dir tier in GiB (least recently used blocks are removed)")
    p.add_argument("--kv-store", default=None, metavar="mooncake://HOST:PORT",
                   help="T3 KV tier: a Mooncake store shared by the cluster (its master; with --mooncake-metadata "
                        "URL): evicted blocks are written there and any instance loads them back; off by default. "
                        "`xllm serve --kv-store local-mooncake` starts a store on this machine (master and metadata "
                        "server on loopback, stopped with the server) for its engines")
    p.add_argument("--kv-store-segment", type=positive_float, default=1.0, metavar="GIB",
                   help="memory this engine lends to the --kv-store pool in GiB")
    p.add_argument("--mooncake-metadata", default=None, metavar="URL",
                   help="the Mooncake metadata server of --kv-store, e.g. http://127.0.0.1:8080/metadata")


def add_common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="hide progress bars while converting/loading")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log verbosity")
    p.add_argument("--log-format", default="text", choices=logs.LOG_FORMATS,
                   help="log lines as text or as one JSON object per line (time, level, logger, message, "
                        "request_id, trace_id) for log collectors; either way each line names its request")


def add_etcd_flags(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--etcd", default=None, metavar="HOST:PORT[,HOST:PORT...]", help=what)
    p.add_argument("--etcd-prefix", default=DEFAULT_PREFIX,
                   help="namespace prefix of the registry keys in etcd (instances/ and heartbeats/ below it)")
    p.add_argument("--etcd-ca", default=None, metavar="FILE",
                   help="PEM CA to verify etcd's certificate with (for https:// endpoints of an etcd started "
                        "with --cert-file/--key-file)")
    p.add_argument("--etcd-cert", default=None, metavar="FILE",
                   help="PEM client certificate presented to etcd (etcd --client-cert-auth; with etcd auth "
                        "enabled its common name is the etcd user)")
    p.add_argument("--etcd-key", default=None, metavar="FILE", help="PEM private key of --etcd-cert")


def add_security_flags(p: argparse.ArgumentParser) -> None:
    """How the internal gRPC services (engines, embedded registry, KV transfer) are protected
    (:mod:`xllm.engine_api.security`); the same flags on ``xllm serve`` and ``xllm engine``."""
    g = p.add_argument_group("cluster security", "authentication and TLS of the internal gRPC services")
    g.add_argument("--cluster-token", default=None, metavar="TOKEN",
                   help=f"shared secret every engine and gateway of the cluster presents and requires on the "
                        f"internal gRPC services (needed to bind them to a non-loopback address); without "
                        f"this flag and --cluster-token-file it is read from ${TOKEN_ENV}, which is better: "
                        f"other users can read command lines")
    g.add_argument("--cluster-token-file", default=None, metavar="PATH",
                   help="read the cluster token from this file (surrounding whitespace ignored)")
    g.add_argument("--insecure-cluster", action="store_true",
                   help="allow --etcd without a cluster token (refused otherwise): instance records are then "
                        "not verified, so anyone who can write to etcd can receive user traffic, and anyone who "
                        "can reach the engines' ports can call them; warned about loudly at start-up")
    g.add_argument("--tls-cert", default=None, metavar="FILE",
                   help="PEM certificate (chain) to serve the internal gRPC services over TLS with (with --tls-key)")
    g.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default=None, metavar="FILE",
                   help="PEM CA that signed the cluster's --tls-cert certificates: connections to engines and "
                        "registries use TLS and verify the server with it")
    g.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="name the servers' certificates carry, when it is not the host dialled (one certificate "
                        "for the whole cluster)")


def cluster_security(args: argparse.Namespace) -> ClusterSecurity:
    """The :class:`~xllm.engine_api.security.ClusterSecurity` the security and etcd flags describe (the
    token from ``--cluster-token``, ``--cluster-token-file`` or ``$XLLM_CLUSTER_TOKEN``); raises
    ``ValueError`` naming the flag to fix."""
    return ClusterSecurity(
        token=resolve_token(args.cluster_token, args.cluster_token_file), tls_cert=args.tls_cert,
        tls_key=args.tls_key, tls_ca=args.tls_ca, tls_server_name=args.tls_server_name,
        etcd_ca=args.etcd_ca, etcd_cert=args.etcd_cert, etcd_key=args.etcd_key,
        insecure=args.insecure_cluster)


def security_args(security: ClusterSecurity) -> list[str]:
    """The TLS and etcd TLS flags of ``security`` for a spawned engine process. Never the token: it
    goes through the environment (:meth:`ClusterSecurity.environment`), not the visible argv."""
    out: list[str] = []
    for flag, value in (("--tls-cert", security.tls_cert), ("--tls-key", security.tls_key),
                        ("--tls-ca", security.tls_ca), ("--tls-server-name", security.tls_server_name),
                        ("--etcd-ca", security.etcd_ca), ("--etcd-cert", security.etcd_cert),
                        ("--etcd-key", security.etcd_key)):
        if value:
            out += [flag, value]
    if security.insecure:
        out.append("--insecure-cluster")
    return out


def add_instance_flags(p: argparse.ArgumentParser) -> None:
    """Flags of an engine instance process: its address, registration and shutdown."""
    p.add_argument("--host", default="127.0.0.1",
                   help="interface the gRPC service binds (internal traffic: loopback by default)")
    p.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks a free one (it is registered)")
    p.add_argument("--instance-id", default=None,
                   help="unique name of this instance in the registry (default: HOSTNAME-PID)")
    p.add_argument("--advertise-address", default=None, metavar="HOST:PORT",
                   help="address gateways should dial, when it differs from --host:--port (NAT, 0.0.0.0)")
    add_etcd_flags(p, "register in this etcd cluster (lease + heartbeats) so gateways find this instance")
    p.add_argument("--registry", default=None, metavar="HOST:PORT",
                   help="register with a gateway's embedded registry service instead of etcd "
                        "(what `xllm serve --instances` passes to its engines)")
    p.add_argument("--lease-ttl", type=positive_float, default=3.0, metavar="SECONDS",
                   help="registration lease: the instance is dropped this long after its last heartbeat")
    p.add_argument("--heartbeat-interval", type=positive_float, default=0.5, metavar="SECONDS",
                   help="how often load and KV cache events are published (also renews the lease)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM: how long running requests may finish before the rest are handed "
                        "back to their gateways (which resume them on other instances)")
    p.add_argument("--detached-grace-s", type=non_negative_float, default=30.0, metavar="SECONDS",
                   help="how long a request whose gateway went away without aborting it (its Generate call "
                        "broke) keeps running, its output kept, for a gateway to continue it (Reattach); "
                        "then it is aborted. 0: a broken call aborts its request at once")
    add_step_timeout_flag(p)
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve this engine's step distributions (TTFT, inter-token latency, batch sizes, step-time "
                        "model error, finished requests) at http://--metrics-host:PORT/metrics for Prometheus (0: a "
                        "free port, printed); its counters and load reach the gateways' /metrics through its "
                        "heartbeats (none: no endpoint)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="interface of --metrics-port (unauthenticated, read-only: loopback by default)")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="shut down when the process that started this one exits (used by serve --instances)")
    p.add_argument("--role", default="mixed", choices=list(ROLE_NAMES.values()),
                   help="the part of requests this instance serves: mixed (whole requests), prefill (prompts "
                        "and first tokens, handing the KV to a decode instance), decode (continues from "
                        "handed-off KV) or encode (a multimodal model's images only, for another instance's "
                        "prefill: EPD, `xllm serve --epd-strategy e+p+d`); a gateway routes in PD mode when it "
                        "finds prefill and decode instances")
    add_handoff_flags(p)


def add_step_timeout_flag(p: argparse.ArgumentParser) -> None:
    """``--step-timeout``: the step watchdog of an engine process and of ``xllm serve``'s in-process engines
    (passed on to the engines it spawns)."""
    p.add_argument("--step-timeout", type=non_negative_float, default=60.0, metavar="SECONDS",
                   help="step watchdog: an engine that has work but completes no step for this long (or 4 times "
                        "its longest step so far, if more: a big prefill raises it) is taken for hung: its "
                        "requests fail as in a crash (gateways resume them elsewhere), its health turns bad and "
                        "the process exits with status 1 (an engine instance deregisters first; xllm serve "
                        "with its engines in-process stops serving). Keep it above the slowest step (the first, "
                        "with its warm-up, included); 0: no watchdog")


def add_handoff_flags(p: argparse.ArgumentParser) -> None:
    """How prefill/decode hand-offs move KV (every instance can serve either side)."""
    p.add_argument("--kv-transfer", default="fd", choices=KV_TRANSPORTS.choices(),
                   help="how this instance receives handed-off KV: fd (one host: the prefill instance's memfd "
                        "over a Unix socket, its pages copied from a mapping; needs the xtensor KV backend), grpc "
                        "(between hosts: pages over gRPC, each layer as soon as the prefill stored it) or "
                        "mooncake (through the cluster KV store of --kv-store: the prefill instance publishes the "
                        "blocks there under their hashes, this instance reads them, and they stay there as T3 "
                        "blocks for later requests; pip install 'xllm-kvstore[mooncake]')")
    p.add_argument("--kv-handoff-timeout", type=positive_float, default=30.0, metavar="SECONDS",
                   help="prefill side: release a request's KV if the decode instance has not confirmed this "
                        "long after the first token")
    p.add_argument("--kv-reservation-timeout", type=positive_float, default=60.0, metavar="SECONDS",
                   help="decode side: give up a KV reservation nobody filled by then (the request fails here "
                        "and the gateway resumes it elsewhere)")


def check_handoff_flags(args: argparse.Namespace) -> None:
    """``ValueError`` naming the missing companion flag of ``--kv-transfer`` (``xllm serve`` checks it
    before it spawns engines; :func:`xllm.engine.config.handoff_options` before it builds the options)."""
    if args.kv_transfer == "mooncake" and not args.kv_store:
        raise ValueError("--kv-transfer mooncake hands KV off through the cluster KV store: it needs --kv-store "
                         "mooncake://HOST:PORT with --mooncake-metadata URL (or `xllm serve --kv-store "
                         "local-mooncake`)")


def add_node_flags(p: argparse.ArgumentParser) -> None:
    """Where the ranks of a tensor-parallel instance run when they span hosts (``xllm engine`` only:
    :mod:`xllm.engine.nodes`). Every node runs the same command line but ``--node-rank``."""
    g = p.add_argument_group("tensor parallelism over hosts",
                             "one instance's --tensor-parallel-size ranks on several hosts: run the same `xllm "
                             "engine` command on each (same model, flags and cluster token) but --node-rank")
    g.add_argument("--nnodes", type=positive_int, default=1, metavar="H",
                   help="hosts the --tensor-parallel-size N ranks are spread over, N/H each (collectives and "
                        "step plans over gloo/TCP between every rank; a master address beyond loopback needs "
                        "the cluster token on every host)")
    g.add_argument("--node-rank", type=non_negative_int, default=0, metavar="R",
                   help="this host's node, 0..H-1: node 0 runs the engine service with ranks 0..N/H-1; node R "
                        "runs only ranks R*N/H..(R+1)*N/H-1 (no service) and exits nonzero when they fail")
    g.add_argument("--master-addr", default="127.0.0.1", metavar="HOST",
                   help="node 0's address the ranks meet at (rank 0's gloo rendezvous), the same on every node")
    g.add_argument("--master-port", type=positive_int, default=None, metavar="PORT",
                   help="node 0's rendezvous port, the same on every node (default: a free port, one host only; "
                        "required with --nnodes above 1)")


def add_engine_process_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of an engine instance process (``xllm engine``, ``python -m xllm.engine``)."""
    add_model_flags(p)
    add_instance_flags(p)
    add_security_flags(p)
    add_engine_flags(p)
    add_node_flags(p)
    add_tracing_flags(p)
    add_common_flags(p)


def engine_args(args: argparse.Namespace, instances: int) -> list[str]:
    """The engine flags of ``args`` as engine-process arguments (for spawned instances).

    Derived from :func:`add_engine_flags`, :func:`add_handoff_flags` and :func:`add_step_timeout_flag`
    themselves, so a new engine
    flag reaches spawned engines without being listed twice; ``--threads`` defaults to this process's
    cores split ``instances`` ways (and among each instance's ``--tensor-parallel-size`` ranks).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    flags = argparse.ArgumentParser(add_help=False)
    add_engine_flags(flags)
    add_handoff_flags(flags)
    add_step_timeout_flag(flags)
    out: list[str] = []
    for action in flags._actions:
        value = getattr(args, action.dest, None)  # (a flag the caller's parser lacks: the engine's default)
        if action.dest == "threads" and value is None:  # per rank with --tensor-parallel-size
            value = max(1, cores // instances // getattr(args, "tensor_parallel_size", 1))
        if action.nargs == 0:  # store_true switches
            out += [action.option_strings[0]] if value else []
        elif action.dest == "lora_modules":
            out += [action.option_strings[0], *(f"{n}={p}" for n, p in value)] if value else []
        elif value is not None:
            out += [action.option_strings[0], str(value)]
    return out


def setup_logging(level: str, fmt: str = "text") -> None:
    """Logging for a command (:func:`xllm.engine_api.logs.setup_logging`: request ids in every line; ``fmt``
    ``text`` or ``json``)."""
    logs.setup_logging(level, fmt)
    if level != "debug":  # one line per etcd request (heartbeats: several a second) is noise
        logging.getLogger("httpx").setLevel(logging.WARNING)
