"""The engine's settings from its command-line flags (:mod:`xllm.engine_api.flags`): the
:class:`~xllm.core.EngineConfig` and the :class:`~xllm.engine.handoff.base.HandoffOptions` an engine is
built with. The server half's side of the flags: the flags themselves are torch-free, these build the
engine runtime's objects (callers load an engine: ``xllm engine``, ``xllm profile``, ``xllm serve`` on
one machine)."""

from __future__ import annotations

import argparse

from xllm.core.config import EngineConfig
from xllm.engine.handoff.base import HandoffOptions
from xllm.engine_api.credential import ClusterKeys
from xllm.engine_api.errors import ConfigError
from xllm.engine_api.flags import check_handoff_flags, request_bounds
from xllm.engine_api.security import resolve_token
from xllm.kvstore.mooncake_local import LOCAL


def _store_url(value: str | None) -> str | None:
    if value == LOCAL:
        raise ValueError(f"--kv-store {LOCAL} starts a store for `xllm serve` and its engines; an engine on its own "
                         "joins a running one: --kv-store mooncake://HOST:PORT --mooncake-metadata URL")
    return value


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The :class:`~xllm.core.EngineConfig` the engine flags describe (raises ``ConfigError``; with
    ``--tensor-parallel-size`` above 1 also for a prefill/decode ``--role`` with a quantized
    ``--kv-cache-dtype``: hand-offs reshard KV by heads, which quantized rows are not)."""
    tp = getattr(args, "tensor_parallel_size", 1)
    if tp > 1 and getattr(args, "role", "mixed") != "mixed" and args.kv_cache_dtype != "auto":
        raise ConfigError(f"--tensor-parallel-size {tp} with --role {args.role} (prefill/decode hand-offs) does "
                          f"not support --kv-cache-dtype {args.kv_cache_dtype} yet (use --kv-cache-dtype auto)")
    quantization = args.quantization
    if quantization == "auto" and args.dtype is not None:
        quantization = "none"  # an explicit --dtype asks for a GGUF's weights dequantized (README: Quantization)
    return EngineConfig(
        dtype=args.dtype or "bfloat16", quantization=quantization, device=args.device, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        kv_cache_memory_gib=args.kv_cache_memory, max_waiting_requests=args.max_waiting,
        kv_cache_backend=args.kv_cache_backend, kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
        enable_prefix_cache=not args.no_prefix_cache, async_scheduling=args.async_scheduling,
        native_decode=not args.no_native_decode, compile_decode=args.compile_decode,
        num_threads=args.threads, seed=args.seed, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
        offline_starvation_s=args.offline_starvation_s, offline_slo_fraction=args.offline_slo_fraction,
        max_encode_images=getattr(args, "max_encode_images", None),
        profile_path=args.profile, speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens, speculative_max_batch=args.speculative_max_batch,
        draft_model_path=args.draft_model, speculative_self_layers=args.speculative_self_layers,
        kv_host_memory_gib=args.kv_host_memory, kv_host_dir=args.kv_host_dir, kv_disk_dir=args.kv_disk_dir,
        kv_disk_size_gib=args.kv_disk_size, kv_store=_store_url(args.kv_store),
        kv_store_metadata=args.mooncake_metadata,
        kv_store_segment_gib=args.kv_store_segment, item_catalog=args.item_catalog,
        tensor_parallel_size=tp, tp_comm=getattr(args, "tp_comm", "auto"),
        tp_overlap=getattr(args, "tp_overlap", "auto"), **node_options(args, tp), **expert_options(args),
        request_bounds=request_bounds(args), **lora_options(args))


def expert_options(args: argparse.Namespace) -> dict:
    """The expert-parallel flags as :class:`EngineConfig` fields."""
    return dict(enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
                num_redundant_experts=getattr(args, "num_redundant_experts", 0),
                enable_eplb=getattr(args, "enable_eplb", False),
                eplb_step_interval=getattr(args, "eplb_step_interval", 1000),
                eplb_policy=getattr(args, "eplb_policy", "auto"))


def lora_options(args: argparse.Namespace) -> dict:
    """``--lora-modules`` / ``--max-loras`` / ``--max-lora-rank`` as :class:`EngineConfig` fields (``ConfigError``
    for an adapter name given twice)."""
    modules: dict[str, str] = {}
    for name, path in getattr(args, "lora_modules", None) or []:
        if name in modules:
            raise ConfigError(f"--lora-modules: adapter name {name!r} given twice")
        modules[name] = path
    return dict(lora_modules=modules, max_loras=getattr(args, "max_loras", 4),
                max_lora_rank=getattr(args, "max_lora_rank", 16))


def node_options(args: argparse.Namespace, tp: int) -> dict:
    """The ranks' hosts and rendezvous (``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``:
    ``xllm engine`` only) and, with several ranks, the cluster token's keys they prove to each other."""
    token = resolve_token(args.cluster_token, args.cluster_token_file) if tp > 1 and hasattr(args, "cluster_token") \
        else None
    keys = ClusterKeys.from_token(token) if token else None
    return dict(nnodes=getattr(args, "nnodes", 1), node_rank=getattr(args, "node_rank", 0),
                master_addr=getattr(args, "master_addr", "127.0.0.1"), master_port=getattr(args, "master_port", None),
                cluster_keys=keys)


def handoff_options(args: argparse.Namespace) -> HandoffOptions:
    """The hand-off settings the flags describe (``ValueError`` names a missing companion flag)."""
    check_handoff_flags(args)
    return HandoffOptions(
        transport=args.kv_transfer, handoff_timeout=args.kv_handoff_timeout,
        reservation_timeout=args.kv_reservation_timeout, transport_options={"timeout": args.kv_handoff_timeout})
