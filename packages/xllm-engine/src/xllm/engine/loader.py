"""Model + engine construction shared by the embedded server and the engine process."""

from __future__ import annotations

import logging
import pathlib
import time
from dataclasses import dataclass

import torch

from xllm.core import ComputeThread, EngineConfig, LLMEngine
from xllm.core.grammar import Grammars
from xllm.core.platform import detect_platform
from xllm.engine.ranks import model_kwargs, start_ranks
from xllm.engine_api.errors import ConfigError
from xllm.engine_api.stats import StatsObserver
from xllm.kvstore.tier import model_identity
from xllm.models import Tokenizer, load_model, resolve_model
from xllm.models.quantize import weight_format
from xllm.models.reload import read_weights
from xllm.models.source import gguf_file
from xllm.proto.registry.v1 import instance_pb2
from xllm.sched.latency import PerfProfile

log = logging.getLogger(__name__)


@dataclass
class LoadedEngine:
    """An engine built on its :class:`ComputeThread` (which must also run its loop), its tokenizer,
    and the instance info to register (``address`` not set yet)."""

    engine: LLMEngine
    tokenizer: Tokenizer
    info: instance_pb2.InstanceInfo
    compute: ComputeThread


def load_engine(model: str | None, name: str, cfg: EngineConfig | None, instance_id: str, progress: bool,
                observers: list[StatsObserver] | None = None) -> LoadedEngine:
    """Resolve ``model`` (converting a GGUF once), then load it (a GGUF's quantized weights as stored with
    ``cfg.quantization`` ``"auto"``, see :func:`stored_gguf`) and build the engine on a new
    :class:`ComputeThread`, so loading and every step share one OpenMP pool (see
    :mod:`xllm.core.compute_thread`). ``name`` is the name it is served as. With ``cfg.tensor_parallel_size``
    N > 1 the model is split over N ranks (:mod:`xllm.engine.ranks`): this process loads rank 0's shard and
    the engine holds the worker ranks (``engine.close()`` stops them)."""
    cfg = cfg or EngineConfig()
    stored = stored_gguf(model, cfg)
    model_dir = resolve_model(model, progress=progress, weights=stored is None)  # as stored: config + tokenizer
    if cfg.kv_tiers_enabled and not cfg.kv_model_identity:  # KV tiers share blocks only within these weights
        cfg.kv_model_identity = model_identity(model_dir) + weights_suffix(cfg, stored)
    tokenizer = Tokenizer(model_dir)
    # --tensor-parallel-size N: the worker ranks start (and load their shards) while this process loads rank 0's
    ranks = start_ranks(model_dir, cfg, stored) if cfg.tensor_parallel_size > 1 else None
    device = detect_platform(cfg.device).device  # the weights go where the engine runs (ValueError if absent)
    compute = ComputeThread()
    try:
        shard = model_kwargs(0, cfg.tensor_parallel_size, ranks.comm, cfg.enable_expert_parallel,
                             cfg.num_redundant_experts) if ranks is not None else {}
        weights = compute.call(load_model, model_dir, cfg.dtype, progress=progress, mtp=cfg.speculative == "mtp",
                               quantization=cfg.quantization, gguf_file=stored, device=device, **shard)
        draft = None
        if cfg.speculative == "draft" and cfg.draft_model_path:  # speculative decoding's draft model
            draft_stored = stored_gguf(cfg.draft_model_path, cfg)
            draft_dir = resolve_model(cfg.draft_model_path, progress=progress, weights=draft_stored is None)
            draft = compute.call(load_model, draft_dir, cfg.dtype, progress=progress, quantization=cfg.quantization,
                                 gguf_file=draft_stored, device=device)
        engine = compute.call(LLMEngine, weights, tokenizer, cfg, observers=observers, instance_id=instance_id,
                              forward_executor=compute,
                              grammars=load_grammars(model_dir, tokenizer, weights.vocab_size), draft_model=draft,
                              ranks=ranks)
        compute.call(engine.attach_weights, str(model_dir), read_weights, weights_refusal(cfg, stored, weights))
    except BaseException:
        if ranks is not None:
            ranks.close()
        compute.shutdown(wait=False)
        raise
    if cfg.profile_path:
        warn_profile_mismatch(cfg, weights, compute)
    info = instance_pb2.InstanceInfo(
        instance_id=instance_id, role=instance_pb2.INSTANCE_ROLE_MIXED, start_time=time.time(),
        model=instance_pb2.ModelInfo(served_name=name, max_model_len=engine.max_model_len,
                                     dtype=str(cfg.dtype).removeprefix("torch."),
                                     block_size=engine.layout.block_size, lora_names=engine.lora_names(),
                                     lora_hash_roots=engine.lora_hash_roots()))
    return LoadedEngine(engine, tokenizer, info, compute)


def warn_profile_mismatch(cfg: EngineConfig, weights, compute: ComputeThread) -> None:
    """Log a warning when ``cfg.profile_path`` was measured on another kind of engine (dtype, quantized
    weights, threads): its predictions are then wrong by step shape, not by one factor the online
    correction absorbs. The engine has already loaded the profile (a bad file fails there)."""
    profile = PerfProfile.load(cfg.profile_path)
    threads = compute.call(torch.get_num_threads)
    differences = profile.mismatches(str(cfg.dtype).removeprefix("torch."), weight_format(weights) or "", threads)
    if differences:
        log.warning("--profile %s was measured on another engine than this one: %s; its step-time predictions "
                    "will be off by step shape (measure this engine with `xllm profile` and the same flags)",
                    cfg.profile_path, ", ".join(differences))


def stored_gguf(model: str | None, cfg: EngineConfig) -> pathlib.Path | None:
    """The GGUF file whose weights ``model`` is served with as stored (``--quantization auto`` and a GGUF
    model, the bundled default included), else None; ``ConfigError`` for what quantized weights refuse."""
    path = gguf_file(model) if cfg.quantization == "auto" else None
    if path is not None and cfg.compile_decode:
        raise ConfigError(f"{path.name} is served with its quantized weights, which compiled decode graphs "
                          "(--compile-decode) do not take: drop it, or ask for dequantized weights (--dtype or "
                          "--quantization none)")
    return path


def weights_suffix(cfg: EngineConfig, stored: pathlib.Path | None) -> str:
    """What tells apart the weights one model directory is served with (float, as stored, quantized at load),
    appended to its KV-tier identity: their KV differs."""
    if stored is not None:  # the conversion may hold no weights: name the file
        return f":gguf-as-stored:{stored.name}:{stored.stat().st_size}"
    return "" if cfg.quantization in ("auto", "none") else f":{cfg.quantization}"


def weights_refusal(cfg: EngineConfig, stored: pathlib.Path | None, weights) -> str | None:
    """Why the engine cannot read its weights again from a safetensors directory (sleep level 2, weight
    updates: :mod:`xllm.core.engine_weights`), None when it can: float weights only."""
    if stored is not None:
        return f"its weights are served as stored from {stored.name} (GGUF): serve float weights (--dtype)"
    fmt = weight_format(weights)
    if fmt is not None or cfg.quantization not in ("auto", "none"):
        return f"its weights are quantized ({fmt or cfg.quantization}): serve float weights (--quantization none)"
    return None


def load_grammars(model_dir: pathlib.Path, tokenizer: Tokenizer, vocab_size: int) -> Grammars | None:
    """The engine's grammar engine over the model's ``tokenizer.json`` (None without one: the
    engine then refuses constrained requests with a 400)."""
    path = pathlib.Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    return Grammars(path.read_text(), tokenizer.eos_token_ids, int(vocab_size))
