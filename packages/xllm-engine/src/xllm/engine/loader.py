"""Model + engine construction shared by the embedded server and the engine process."""

from __future__ import annotations

import pathlib
import time
from dataclasses import dataclass

from xllm.core import ComputeThread, EngineConfig, LLMEngine, StatsObserver
from xllm.core.grammar import Grammars
from xllm.kvstore.tier import model_identity
from xllm.models import Tokenizer, load_model, resolve_model
from xllm.proto.registry.v1 import instance_pb2


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
    """Resolve ``model`` (converting a GGUF once), then load it and build the engine on a new
    :class:`ComputeThread`, so loading and every step share one OpenMP pool (see
    :mod:`xllm.core.compute_thread`). ``name`` is the name it is served as."""
    model_dir = resolve_model(model, progress=progress)
    cfg = cfg or EngineConfig()
    if cfg.kv_tiers_enabled and not cfg.kv_model_identity:  # KV tiers share blocks only within these weights
        cfg.kv_model_identity = model_identity(model_dir)
    tokenizer = Tokenizer(model_dir)
    compute = ComputeThread()
    weights = compute.call(load_model, model_dir, cfg.dtype, progress=progress, mtp=cfg.speculative == "mtp")
    draft = None
    if cfg.speculative == "draft" and cfg.draft_model_path:  # speculative decoding's draft model
        draft = compute.call(load_model, resolve_model(cfg.draft_model_path, progress=progress), cfg.dtype,
                             progress=progress)
    engine = compute.call(LLMEngine, weights, tokenizer, cfg, observers=observers, instance_id=instance_id,
                          forward_executor=compute, grammars=load_grammars(model_dir, tokenizer, weights.vocab_size),
                          draft_model=draft)
    info = instance_pb2.InstanceInfo(
        instance_id=instance_id, role=instance_pb2.INSTANCE_ROLE_MIXED, start_time=time.time(),
        model=instance_pb2.ModelInfo(served_name=name, max_model_len=engine.max_model_len,
                                     dtype=str(cfg.dtype).removeprefix("torch."),
                                     block_size=engine.layout.block_size))
    return LoadedEngine(engine, tokenizer, info, compute)


def load_grammars(model_dir: pathlib.Path, tokenizer: Tokenizer, vocab_size: int) -> Grammars | None:
    """The engine's grammar engine over the model's ``tokenizer.json`` (None without one: the
    engine then refuses constrained requests with a 400)."""
    path = pathlib.Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    return Grammars(path.read_text(), tokenizer.eos_token_ids, int(vocab_size))
