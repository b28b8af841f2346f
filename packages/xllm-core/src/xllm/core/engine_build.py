"""Building the parts of an :class:`~xllm.core.engine.LLMEngine` from its config: the platform, the
KV memory and the tiers below it, the model runner (and its compiled decode graph), the step-time
predictor and the scheduler over its batch policy, speculation, beam search, and the forward worker.

Each builder takes what it needs and returns one part (:func:`attach_tiers` attaches one, once the runner
exists); ``LLMEngine.__init__`` calls them in order and keeps what they return. Called on the thread that
builds the engine (its compute thread).
"""

from __future__ import annotations

import os
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from xllm.core.beam import BeamRunner
from xllm.core.beam_check import load_catalog
from xllm.core.config import EngineConfig
from xllm.core.detokenizer import EngineTokenizer
from xllm.core.grammar import Grammars
from xllm.core.graph_runner import build_compiled_decode
from xllm.core.kv import build_kv_cache
from xllm.core.kv.base import KVCacheBackend
from xllm.core.model_api import CausalLM
from xllm.core.model_runner import ModelRunner
from xllm.core.platform import Platform, configure_threads, detect_platform
from xllm.core.scheduler import Scheduler
from xllm.core.spec.speculator import Speculator
from xllm.core.step_timing import StepTiming, load_step_model
from xllm.engine_api.errors import ConfigError
from xllm.kernels import native

if TYPE_CHECKING:
    from xllm.core.executor.group import RankGroup
    from xllm.core.kv.page_store import PageAccess
from xllm.sched import BATCH_POLICIES, BatchSettings


def build_platform(config: EngineConfig, grammars: Grammars | None) -> Platform:
    """The platform ``config.device`` names (``ValueError`` if it lacks ``config.dtype``), with the
    torch threads set up; constrained decoding's masks then overlap the forward only on a spare
    core (an OpenMP team sharing its cores with the grammar thread waits at every barrier) and with
    kernels that release the GIL (else the grammar thread cannot run until the forward is over)."""
    platform = detect_platform(config.device)
    if not platform.supports_dtype(config.dtype):
        raise ValueError(f"dtype {config.dtype} is not supported on {platform.name}")
    threads = configure_threads(config.num_threads or
                                default_rank_threads(config.tensor_parallel_size // max(1, config.nnodes)))
    if grammars is not None:
        lib = native.library()
        grammars.overlap = threads < len(os.sched_getaffinity(0)) and (lib is None or not lib.holds_gil)
    return platform


def default_rank_threads(tensor_parallel_size: int) -> int | None:
    """A rank's torch threads when ``--threads`` is not given: the cores this process may use divided among
    the ranks (None with one rank: all of them)."""
    if tensor_parallel_size <= 1:
        return None
    return max(1, len(os.sched_getaffinity(0)) // tensor_parallel_size)


def build_kv(config: EngineConfig, model: CausalLM, device: torch.device, max_model_len: int) -> KVCacheBackend:
    """The KV memory ``config`` sizes for ``model`` (the tiers below it attach once the runner exists:
    :func:`attach_tiers`)."""
    return build_kv_cache(config.kv_cache_backend, model.kv_cache_spec(), config.dtype, device, config.max_num_seqs,
                          max_model_len, config.kv_cache_memory_gib, config.block_size, config.enable_prefix_cache,
                          config.kv_cache_dtype)


def attach_tiers(config: EngineConfig, kv: KVCacheBackend, pages: PageAccess | None) -> None:
    """Attach the tiers below ``kv`` (T1 host, T2 disk, T3 store; :mod:`xllm.core.kv.lower_tiers`) when
    ``config.kv_tiers_enabled`` and one opens. ``pages``: the KV pages they read and write, in the layout their
    blocks are stored in (its fingerprint names their namespace): the engine's transfer store, a
    tensor-parallel instance's every rank's heads (:meth:`~xllm.core.executor.runner.TensorParallelRunner.
    transfer_store`); ``ConfigError`` when there is none (quantized KV rows are not resharded)."""
    if not config.kv_tiers_enabled:
        return
    if pages is None:
        raise ConfigError(f"KV tiers (--kv-host-memory, --kv-disk-dir, --kv-store) with --tensor-parallel-size "
                          f"{config.tensor_parallel_size} need model-dtype KV pages: --kv-cache-dtype "
                          f"{config.kv_cache_dtype} rows are not resharded (use --kv-cache-dtype auto)")
    from xllm.core.kv.lower_tiers import LowerTiers, build_store
    store = build_store(pages.layout, config.kv_model_identity, config.kv_host_memory_gib, config.kv_host_dir,
                        config.kv_disk_dir, config.kv_disk_size_gib, config.kv_store, config.kv_store_metadata,
                        config.kv_store_segment_gib)
    if store is not None:
        kv.attach_tiers(LowerTiers(store, pages))


def build_runner(config: EngineConfig, model: CausalLM, kv: KVCacheBackend, device: torch.device,
                 ranks: RankGroup | None = None) -> ModelRunner:
    """The model runner over ``kv``, with a compiled decode graph when ``config.compile_decode``. With
    ``config.tensor_parallel_size`` above 1, rank 0's runner over ``ranks`` (the worker ranks the loader
    started, :mod:`xllm.core.executor`); one rank: the plain runner."""
    if config.tensor_parallel_size > 1:
        if ranks is None or ranks.size != config.tensor_parallel_size:
            raise ConfigError(f"--tensor-parallel-size {config.tensor_parallel_size}: the engine needs its "
                              f"{config.tensor_parallel_size - 1} worker rank(s) (xllm.engine.loader starts them)")
        from xllm.core.eplb import EplbSettings
        from xllm.core.executor.runner import TensorParallelRunner
        eplb = EplbSettings(config.enable_eplb, config.eplb_step_interval, config.eplb_policy, nodes=config.nnodes)
        tp_runner = TensorParallelRunner(model, kv, device, ranks, native_decode=config.native_decode, eplb=eplb)
        tp_runner.set_overlap(config.tp_overlap)  # --tp-overlap (xllm.core.overlap)
        return tp_runner
    runner = ModelRunner(model, kv, device, native_decode=config.native_decode)
    if config.compile_decode:
        runner.graph = build_compiled_decode(model, kv, runner, config.max_num_seqs)
    return runner


def build_step_timing(config: EngineConfig) -> StepTiming:
    """The step-time predictor: ``config.profile_path``'s model corrected online, else one fitted on
    the engine's own steps."""
    return StepTiming(load_step_model(config.profile_path) if config.profile_path else None)


def build_scheduler(config: EngineConfig, kv: KVCacheBackend, step_timing: StepTiming,
                    max_encode_images: int = 0) -> Scheduler:
    """The scheduler over ``kv``: online work as decode-first batching, offline (flex) work in what
    it leaves within the TPOT SLO (the ``colocation`` batch policy, priced by ``step_timing``); with
    ``max_encode_images``, the encode phase of multimodal requests (:mod:`xllm.sched.encode`)."""
    policy = BATCH_POLICIES.get("colocation").from_settings(BatchSettings(
        config.max_num_seqs, config.max_num_batched_tokens,
        slo_tpot_s=config.slo_tpot_ms / 1000 if config.slo_tpot_ms else None,
        offline_slo_fraction=config.offline_slo_fraction, predict=step_timing.step_seconds,
        starvation_s=config.offline_starvation_s, max_encode_images=max_encode_images))
    return Scheduler(policy, kv)


def build_spec(config: EngineConfig, model: CausalLM, draft_model: CausalLM | None, runner: ModelRunner,
               max_model_len: int, device: torch.device) -> Speculator | None:
    """Speculative decoding (:mod:`xllm.core.spec`): None unless ``config.speculative`` names a proposer."""
    if config.speculative is None:
        return None
    from xllm.core.spec.build import build_speculator
    spec = build_speculator(config, max_model_len, device, int(model.vocab_size), draft_model, target=model,
                            runner=runner)
    if config.tensor_parallel_size > 1 and config.speculative == "self":
        tp_self_draft(spec, runner, device, config.native_decode)
    return spec


def tp_self_draft(spec: Speculator, runner: ModelRunner, device: torch.device, native_decode: bool) -> None:
    """``--speculative self`` with tensor parallelism: the draft (rank 0's view of its shard's first layers,
    over its own KV memory) runs on every rank, through a draft runner on the served model's ranks and lock
    (:class:`~xllm.core.executor.runner.TensorParallelRunner` with ``draft_layers``)."""
    from xllm.core.executor.runner import TensorParallelRunner
    proposer = spec.proposer
    if not isinstance(runner, TensorParallelRunner):
        raise ConfigError("--speculative self with --tensor-parallel-size needs the tensor-parallel runner")
    proposer.runner = TensorParallelRunner(proposer.model, proposer.kv, device, runner.group,  # type: ignore[attr-defined]
                                           native_decode=native_decode, lock=runner.lock,
                                           draft_layers=proposer.num_layers)  # type: ignore[attr-defined]


def build_beams(config: EngineConfig, model: CausalLM, kv: KVCacheBackend, tokenizer: EngineTokenizer,
                eos: frozenset[int], runner: ModelRunner) -> BeamRunner:
    """Beam search (:mod:`xllm.core.beam`): groups decoding after their prompt, and the item catalogue. A
    tensor-parallel ``runner`` runs the beam rows' own forwards on every rank (its ``forward_beams``)."""
    catalog = load_catalog(config.item_catalog, int(model.vocab_size)) if config.item_catalog else None
    return BeamRunner(model, kv, tokenizer, eos, catalog, max(config.max_num_batched_tokens, 512),
                      forward=getattr(runner, "forward_beams", None))


def build_worker(config: EngineConfig, forward_executor: Executor | None) -> tuple[Executor | None, bool]:
    """Where async scheduling runs forwards, and whether the engine owns it (shuts it down): the
    caller's ``forward_executor`` (its ComputeThread, so that loading and forwards share one OpenMP
    pool; see :mod:`xllm.core.compute_thread`), else a worker of the engine's own; none without
    async scheduling."""
    if not config.async_scheduling:
        return None, False
    if forward_executor is not None:
        return forward_executor, False
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="xllm-forward"), True
