"""Load a HF safetensors model directory (or a GGUF file as stored) into our model classes, in file order.

RTP-LLM §4: iterate the shard files in order and each file's tensors in the
order their bytes lie on disk, reading through a memory map and copying (and
casting) each tensor straight into its parameter, so the page cache is read
sequentially and no second full copy of the weights is ever held.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import struct
import time
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from xllm.common.memory import release_freed_memory
from xllm.core.parallel.comm import Communicator
from xllm.engine_api.names import WEIGHT_QUANTIZATIONS, canonical_quantization
from xllm.models.config import ModelConfig, ModelConfigError
from xllm.models.expert_parallel import CheckpointExperts, ExpertParallelSpec
from xllm.models.gguf_weights import StoredWeights, read_gguf_weights
from xllm.models.placement import StreamsWeights, place_weights
from xllm.models.quantize import install_quantized, quantize_model
from xllm.models.registry import model_class
from xllm.models.smoothing import calibration_ids, smooth_for_w8a8
from xllm.models.tensor_parallel import TPShard

log = logging.getLogger(__name__)


def shard_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    """The ``*.safetensors`` shards of ``model_dir``, in the order they should be read."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights")
    return files


def tensor_names_in_file_order(path: pathlib.Path) -> list[str]:
    """Tensor names of one safetensors file sorted by their byte offset."""
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return sorted(header, key=lambda n: header[n]["data_offsets"][0])


def iter_safetensors(files: list[pathlib.Path], progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` over all shards in file order; tensors are mmap views."""
    plan = [(f, tensor_names_in_file_order(f)) for f in files]
    total = sum(len(names) for _, names in plan)
    with tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress, leave=False) as bar:
        for file, names in plan:
            with safe_open(str(file), framework="pt") as handle:
                for name in names:
                    yield name, handle.get_tensor(name)
                    bar.update(1)


_INIT_FNS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
             "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def _skip_init() -> Iterator[None]:
    """Make ``torch.nn.init``'s initializers no-ops while the model is built on the meta device.

    Random init would be overwritten by the checkpoint anyway; on the meta device it computes
    nothing but its first call imports torch's compiler stack (~1.7 s of a SmolLM2 load). Not
    thread-safe (it patches module attributes), like every loader that does this.
    """
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FNS if hasattr(torch.nn.init, name)}
    try:
        for name in saved:
            setattr(torch.nn.init, name, _no_init)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace every meta parameter/buffer by uninitialized storage on ``device`` (floating
    ones in ``dtype``), keeping tied parameters tied. Like ``.to(dtype).to_empty(device)``
    without their per-tensor dispatch through torch's reference ops (which imports the
    symbolic-shapes stack on first use: ~0.4 s)."""
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                new = done.get(id(t))
                if new is None:
                    data = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
                    new = torch.nn.Parameter(data, requires_grad=t.requires_grad) if table is module._parameters \
                        else data
                    done[id(t)] = new
                table[name] = new


def _no_init(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def load_model(model_dir: str | pathlib.Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", progress: bool = True, tp_rank: int = 0,
               tp_size: int = 1, mtp: bool = False, quantization: str = "none",
               gguf_file: str | pathlib.Path | None = None, comm: Communicator | None = None,
               expert_parallel: bool = False, redundant_experts: int = 0) -> torch.nn.Module:
    """Build the model class for ``model_dir``'s architecture and load its weights.

    Parameters are allocated directly in ``dtype`` on ``device`` (no random
    init), then filled in file order. With ``tp_size > 1`` the model is built
    with rank ``tp_rank``'s local sizes and every sharded checkpoint tensor (float, or quantized as
    stored) is sliced before it is copied (see :mod:`xllm.models.tensor_parallel`); ``comm`` (rank
    ``tp_rank`` of a group of ``tp_size``) joins the ranks' partial results, so every rank's outputs are
    the full model's. Without ``comm`` the collectives are no-ops: the rank's partial outputs (the
    ranks' ``o_proj``/``down_proj`` outputs and embedding lookups sum to the full model's).
    ``mtp`` also loads the model's next-token-prediction layer (``--speculative mtp``; DeepSeek-V3
    checkpoints with ``num_nextn_predict_layers`` > 0, else :class:`ModelConfigError`).
    ``quantization`` (a name of :data:`xllm.engine_api.names.WEIGHT_QUANTIZATIONS`): ``"none"``/``"auto"`` float
    weights, ``"int8"``/``"int4"``/``"int4_g128"``/``"w8a8"`` the float model's linears quantized after loading
    (:func:`xllm.models.quantize.quantize_model`; for w8a8 after SmoothQuant scales are folded in,
    :mod:`xllm.models.smoothing`). ``gguf_file``: load the weights from this GGUF as stored
    (its Q8_0/Q4_0/Q4_1 tensors stay quantized, :mod:`xllm.models.gguf_weights`) instead of ``model_dir``'s
    safetensors, which then only gives the config (``model_dir`` is the GGUF's conversion).
    ``expert_parallel`` (with ``tp_size > 1``): the routed experts whole, ``redundant_experts`` extra replicas,
    placed over the ranks and rebalanced at run time (:mod:`xllm.models.expert_parallel`; safetensors only).
    Returns the model in eval mode.
    """
    model_dir = pathlib.Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    cls = model_class(cfg.architecture)
    try:
        fmt = WEIGHT_QUANTIZATIONS[canonical_quantization(quantization)]
    except ValueError as exc:
        raise ModelConfigError(str(exc)) from None
    if fmt is not None and gguf_file is not None:
        raise ModelConfigError(f"quantization {quantization!r}: a GGUF file loaded as stored keeps its own formats")
    if (fmt is not None or gguf_file is not None) and torch.device(device).type != "cpu":
        raise ModelConfigError("quantized weights run on the CPU (use --quantization none)")
    shard = None
    if expert_parallel and (tp_size == 1 or gguf_file is not None):
        raise ModelConfigError("--enable-expert-parallel needs --tensor-parallel-size > 1 and safetensors weights")
    if tp_size != 1 or tp_rank != 0:
        spec = ExpertParallelSpec(redundant_experts) if expert_parallel else None
        shard = TPShard.for_config(cfg, tp_rank, tp_size, comm, spec)
    if gguf_file is not None:
        if mtp:
            raise ModelConfigError(f"{gguf_file}: a GGUF model has no multi-token-prediction layers")
        start = time.perf_counter()
        stored = read_gguf_weights(gguf_file, cfg.num_heads, cfg.num_kv_heads)
        model = load_stored(model_dir, stored if shard is None else stored.sharded(shard), dtype, shard)
        log.info("loaded %s (%s activations; %s) from %s as stored in %.2fs", cfg.architecture, dtype,
                 ", ".join(f"{n} {k}" for k, n in sorted(stored.formats.items())), gguf_file,
                 time.perf_counter() - start)
        return model
    start = time.perf_counter()
    weights = iter_safetensors(shard_files(model_dir), progress)
    if shard is not None:
        cfg = shard.local_config(cfg)
        weights = shard.shard_stream(weights)
    if mtp and not int(cfg.get("num_nextn_predict_layers") or 0):
        raise ModelConfigError(f"{model_dir}: {cfg.architecture} has no multi-token-prediction layers "
                               "(num_nextn_predict_layers): --speculative mtp needs them")
    with torch.device("meta"), _skip_init():
        model = _build(cls, cfg, shard, mtp)
    _materialize(model, dtype, torch.device(device))
    if expert_parallel:  # each MoE layer's slots placed before the weights load (they pick their experts)
        model.attach_experts(tp_rank, tp_size, redundant_experts, CheckpointExperts(shard_files(model_dir), dtype))
    model.load_weights(weights)
    if fmt == "w8a8":  # outliers moved into the weights first (a calibration forward: post_load's state)
        model.post_load()
        smooth_for_w8a8(model, calibration_ids(model_dir, cfg.vocab_size,
                                               max_tokens=min(512, cfg.max_position_embeddings)))
    if fmt is not None:
        quantize_model(model, fmt)
        release_freed_memory()
    model.post_load()
    model.eval().requires_grad_(False)
    _place(model)
    log.info("loaded %s (%s%s) from %s in %.2fs", cfg.architecture, dtype, f", {fmt} linears" if fmt else "",
             model_dir, time.perf_counter() - start)
    return model


def _place(model: torch.nn.Module) -> None:
    """The streamed weights of a CPU model moved into one huge-page arena (:mod:`xllm.models.placement`),
    the memory they leave handed back to the OS."""
    if isinstance(model, StreamsWeights) and all(p.device.type == "cpu" for p in model.parameters()):
        place_weights(model)
        release_freed_memory()


def _build(cls: type, cfg: ModelConfig, shard: TPShard | None, mtp: bool = False) -> torch.nn.Module:
    """``cls`` over (local) ``cfg``, on rank ``shard`` when tensor-parallel."""
    kwargs: dict = {} if shard is None else {"tp": shard}
    if mtp:
        kwargs["mtp"] = True
    return cls(cfg, **kwargs)


def load_stored(model_dir: str | pathlib.Path, stored: StoredWeights, dtype: torch.dtype,
                shard: TPShard | None = None) -> torch.nn.Module:
    """The model of ``model_dir``'s config over ``stored`` weights (a GGUF's, :mod:`xllm.models.gguf_weights`):
    quantized linears and embedding swapped in on the meta device (never materialized as float,
    :func:`xllm.models.quantize.install_quantized`), the other parameters materialized in ``dtype`` (the
    activations' dtype: bfloat16 or float32) and loaded. ``shard``: the tensor-parallel rank ``stored``
    was sliced for (:meth:`StoredWeights.sharded`). Returns the model in eval mode."""
    cfg = ModelConfig.from_dir(pathlib.Path(model_dir))
    cls = model_class(cfg.architecture)
    if dtype not in (torch.bfloat16, torch.float32):
        raise ModelConfigError(f"quantized weights run with bfloat16 or float32 activations, not {dtype} (or serve "
                               "them dequantized: --quantization none)")
    if shard is not None:
        cfg = shard.local_config(cfg)
    with torch.device("meta"), _skip_init():
        model = _build(cls, cfg, shard)
    used = install_quantized(model, stored.quantized, model.stacked_names, dtype)
    _materialize(model, dtype, torch.device("cpu"))
    model.load_weights(stored.float_items(skip=used))
    model.post_load()
    model.eval().requires_grad_(False)
    _place(model)  # (also releases the gathers and dequantized copies made while reading)
    return model
