"""Engine configuration, validated with real errors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from xllm.common import UnknownNameError
from xllm.engine_api.bounds import RequestBounds
from xllm.engine_api.credential import ClusterKeys
from xllm.engine_api.errors import ConfigError
from xllm.engine_api.names import DTYPES, KV_BACKENDS, KV_CACHE_DTYPES, PROPOSERS, TP_COMMS, canonical_quantization
from xllm.sched.batch_policy import DEFAULT_OFFLINE_SLO_FRACTION, DEFAULT_TOKEN_BUDGET
from xllm.sched.eplb import EPLB_POLICIES


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/``"float32"``/... -> ``torch.dtype``."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES.get(name)
    except UnknownNameError as exc:
        raise ConfigError(str(exc)) from None


@dataclass
class EngineConfig:
    """Settings of one engine instance.

    ``max_model_len`` of ``None`` takes the model's context length.
    ``kv_cache_memory_gib`` bounds the physical KV memory; the token capacity
    is that divided by the model's KV bytes per token. ``block_size`` of
    ``None`` picks the backend's natural size (xTensor: 128 tokens, rounded up so a layer's
    K/V block is whole OS pages; paged: 16). ``kv_cache_backend`` is ``"xtensor"``
    (virtual-contiguous, Linux), ``"paged"`` (block tables) or ``"contiguous"`` (max-length
    reservation per slot, no prefix cache).
    ``native_decode`` runs steps through a model's fused native forward when it
    has one (slot-addressed KV only): pure decode steps of up to 8 sequences
    through its decode kernel, every other step through its general step.
    ``async_scheduling`` overlaps scheduling, input preparation and output
    processing with the forward (xLLM §4.1), streaming each token one step later.
    ``compile_decode`` compiles (torch.compile, at start-up) one graph for pure
    decode batches the native path does not take (see ``graph_runner``).
    ``profile_path``: an ``xllm profile`` JSON whose fitted step model the engine's step-time
    predictor starts from (``xllm.core.step_timing``; ``None``: it fits its own after a warm-up).
    ``slo_ttft_ms`` / ``slo_tpot_ms`` are the online latency targets (``None``: none): the batch
    policy admits offline (``service_tier: flex``) work only as far as the predicted step times
    keep the average step online decodes see within ``offline_slo_fraction`` × ``slo_tpot_ms``;
    an offline sequence that made no progress for ``offline_starvation_s`` gets a minimal
    guaranteed share (``xllm.sched.colocation``).
    ``max_encode_images``: images a step encodes in the encode phase of multimodal requests (0: no encode
    phase, images encoded in their prefill chunk; ``None``: from a start-up profile with ``slo_tpot_ms``, else
    the default; :mod:`xllm.core.images`, :mod:`xllm.sched.encode`). A text model ignores it.
    ``speculative`` names a proposer of :data:`xllm.engine_api.names.PROPOSERS` (``None``: no
    speculative decoding): up to ``num_speculative_tokens`` drafts per decoding sequence, verified
    in one forward, while a step decodes at most ``speculative_max_batch`` sequences
    (:mod:`xllm.core.spec.speculator`); ``draft_model_path`` is the ``draft`` proposer's model
    directory; ``speculative_self_layers`` the ``self`` proposer's number of target layers (``None``:
    a quarter of them, at least 1). With ``async_scheduling`` a speculating sequence steps
    synchronously (held until its step in flight lands), the others overlapped.
    KV tiers below the engine's memory (:mod:`xllm.core.kv.lower_tiers`): ``kv_host_memory_gib``
    (T1: host DRAM shared by the engine processes of the machine, files under ``kv_host_dir``, a
    tmpfs) and ``kv_disk_dir`` / ``kv_disk_size_gib`` (T2: local SSD files); ``None``: no such tier.
    ``kv_store`` (``mooncake://HOST:PORT``, its metadata server ``kv_store_metadata``): T3, the
    Mooncake store shared by the cluster, to which this engine lends ``kv_store_segment_gib``.
    Blocks are shared only within ``kv_model_identity`` (the model's weights; the loader sets it
    from the model directory) and the KV layout.
    ``tensor_parallel_size``: ranks the model is split over on this host (:mod:`xllm.core.executor`; rank 0
    is the engine process, ranks 1..N-1 worker processes; ``num_threads`` is then per rank, by default the
    cores divided by N). With more than one rank, the ``mtp`` proposer, ``compile_decode`` and KV
    tiers over a quantized ``kv_cache_dtype`` are refused (a ``ConfigError`` naming the flag); prefill/decode
    hand-offs and the KV tiers move every rank's KV heads in the one-rank layout
    (:mod:`xllm.core.executor.kv_pages`; hand-offs not with a quantized ``kv_cache_dtype``), beam groups
    decode on every rank (:mod:`xllm.core.beam_mirror`) and so does the ``self`` proposer's draft
    (:mod:`xllm.core.executor.draft_rank`).
    ``nnodes`` hosts share those ranks, ``tensor_parallel_size / nnodes`` each (:mod:`xllm.engine.nodes`): this
    process is node ``node_rank``'s (node 0 holds ranks ``0..N/H-1`` and the engine, node R ranks
    ``R*N/H..(R+1)*N/H-1`` and no engine); the ranks meet at ``master_addr:master_port`` (rank 0's
    rendezvous; ``None``: a free port, one host only), collectives and plans over gloo. ``cluster_keys``: the
    cluster token's keys every rank proves before the group is used (:mod:`xllm.core.parallel.trust`; needed
    for a ``master_addr`` beyond loopback); never shown.
    ``enable_expert_parallel`` (with ``tensor_parallel_size`` above 1, a MoE model from safetensors): each rank
    holds whole routed experts (``num_redundant_experts`` extra replicas), placed by rank; ``enable_eplb``
    rebalances that placement every ``eplb_step_interval`` steps by ``eplb_policy`` (:mod:`xllm.core.eplb`).
    ``tp_overlap`` (``--tp-overlap``: auto/on/off): eager TP steps as two overlapped micro-batches (xllm.core.overlap).
    ``quantization`` (:data:`xllm.engine_api.names.WEIGHT_QUANTIZATIONS`): the linears' weight format the loader
    builds (``"auto"``: a GGUF's stored formats; ``"none"``: float in ``dtype``; ``"int8"``/``"int4"``/
    ``"int4_g128"``/``"w8a8"``: quantized at load); quantized weights need bfloat16/float32 and no ``compile_decode``.
    ``lora_modules`` (``--lora-modules NAME=PATH``): PEFT LoRA adapters registered at start, served as model names,
    at most ``max_loras`` resident at once (LRU), each of rank at most ``max_lora_rank`` (:mod:`xllm.core.lora`);
    adapters are refused with ``tensor_parallel_size`` above 1 and with ``compile_decode``.
    """

    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = DEFAULT_TOKEN_BUDGET
    max_model_len: int | None = None
    block_size: int | None = None
    kv_cache_memory_gib: float = 2.0
    kv_cache_backend: str = "xtensor"
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) or a quantized KV kind (xllm.engine_api.names)
    enable_prefix_cache: bool = True
    native_decode: bool = True
    async_scheduling: bool = False
    compile_decode: bool = False
    max_waiting_requests: int = 4096
    num_threads: int | None = None
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    offline_starvation_s: float = 30.0
    offline_slo_fraction: float = DEFAULT_OFFLINE_SLO_FRACTION
    max_encode_images: int | None = None
    profile_path: str | None = None
    speculative: str | None = None
    num_speculative_tokens: int = 3
    speculative_max_batch: int = 8
    draft_model_path: str | None = None
    kv_host_memory_gib: float | None = None
    kv_host_dir: str = "/dev/shm/xllm-kv"
    kv_disk_dir: str | None = None
    kv_disk_size_gib: float = 10.0
    kv_model_identity: str | None = None
    kv_store: str | None = None
    kv_store_metadata: str | None = None
    kv_store_segment_gib: float = 1.0
    speculative_self_layers: int | None = None
    item_catalog: str | None = None  # generative recommendation's valid items (xllm.recsys.catalog file)
    quantization: str = "none"  # the linears' weight format (xllm.engine_api.names.WEIGHT_QUANTIZATIONS)
    tensor_parallel_size: int = 1  # ranks the model is split over (xllm.core.executor)
    tp_comm: str = "auto"  # the ranks' all-reduce: auto, shm or gloo (xllm.engine_api.names.TP_COMMS)
    tp_overlap: str = "auto"  # eager TP steps as two overlapped micro-batches: auto, on or off (xllm.core.overlap)
    nnodes: int = 1  # hosts the ranks are spread over (xllm.engine.nodes)
    node_rank: int = 0  # this host's node (0: the engine's)
    master_addr: str = "127.0.0.1"  # rank 0's rendezvous host
    master_port: int | None = None  # ... and port (None: a free one; one host only)
    enable_expert_parallel: bool = False  # MoE experts whole, placed over the ranks (xllm.models.expert_parallel)
    num_redundant_experts: int = 0  # extra expert replicas per MoE layer with expert parallelism
    enable_eplb: bool = False  # rebalance the expert placement from the measured load (xllm.core.eplb)
    eplb_step_interval: int = 1000  # steps per load window (and between EPLB decisions)
    eplb_policy: str = "auto"  # xllm.sched.eplb.EPLB_POLICIES
    cluster_keys: ClusterKeys | None = field(default=None, repr=False, compare=False)  # the ranks' credential
    # what one request may ask for beyond the context length, applied again after the gateway (the request
    # limit flags, xllm.engine_api.flags.add_request_bound_flags); sizes the largest accepted message too
    request_bounds: RequestBounds = field(default_factory=RequestBounds)
    lora_modules: dict[str, str] = field(default_factory=dict)  # LoRA adapter name -> PEFT directory
    max_loras: int = 4  # adapters resident at once (slots)
    max_lora_rank: int = 16  # the largest adapter rank served

    def __post_init__(self) -> None:
        self.dtype = parse_dtype(self.dtype)
        self._check_quantization()
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_backend not in KV_BACKENDS:
            raise ConfigError(f"kv_cache_backend: unknown KV cache backend {self.kv_cache_backend!r}; "
                              f"known: {', '.join(KV_BACKENDS.choices())}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype: unknown KV cache dtype {self.kv_cache_dtype!r}; "
                              f"known: {', '.join(KV_CACHE_DTYPES)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory_gib <= 0:
            raise ConfigError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1, got {self.num_threads}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        if not self.offline_starvation_s > 0:
            raise ConfigError(f"offline_starvation_s must be > 0, got {self.offline_starvation_s}")
        if not 0 < self.offline_slo_fraction <= 1:
            raise ConfigError(f"offline_slo_fraction must be in (0, 1], got {self.offline_slo_fraction}")
        if self.max_encode_images is not None and self.max_encode_images < 0:
            raise ConfigError(f"max_encode_images (--max-encode-images) must be >= 0, got {self.max_encode_images}")
        self._check_speculative()
        self._check_kv_tiers()
        self._check_tensor_parallel()
        self._check_lora()

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} (--{name.replace('_', '-')}) must be >= 1, got {getattr(self, name)}")
        if not self.lora_modules:
            return
        if self.tensor_parallel_size > 1:
            raise ConfigError(f"--lora-modules: LoRA adapters are not served with --tensor-parallel-size "
                              f"{self.tensor_parallel_size} yet")
        if self.compile_decode:
            raise ConfigError("--lora-modules: LoRA adapters are not served with --compile-decode")

    def _check_tensor_parallel(self) -> None:
        n = self.tensor_parallel_size
        if int(n) < 1:
            raise ConfigError(f"tensor_parallel_size (--tensor-parallel-size) must be >= 1, got {n}")
        if self.tp_comm not in TP_COMMS:
            raise ConfigError(f"tp_comm (--tp-comm) must be one of {', '.join(TP_COMMS)}, got {self.tp_comm!r}")
        self._check_nodes()
        self._check_experts()
        if n == 1:
            return
        refused = []
        if self.kv_tiers_enabled and self.kv_cache_dtype != "auto":  # quantized rows are not resharded
            refused.append(f"KV tiers (--kv-host-memory, --kv-disk-dir, --kv-store) with --kv-cache-dtype "
                           f"{self.kv_cache_dtype}")
        if self.speculative == "mtp":
            refused.append("--speculative mtp")
        if self.compile_decode:
            refused.append("--compile-decode")
        if refused:
            raise ConfigError(f"--tensor-parallel-size {n} does not support {', '.join(refused)} yet")

    def _check_experts(self) -> None:
        if self.num_redundant_experts < 0:
            raise ConfigError(f"--num-redundant-experts must be >= 0, got {self.num_redundant_experts}")
        if self.eplb_step_interval < 1:
            raise ConfigError(f"--eplb-step-interval must be >= 1, got {self.eplb_step_interval}")
        if self.eplb_policy not in EPLB_POLICIES:
            raise ConfigError(f"--eplb-policy must be one of {', '.join(EPLB_POLICIES)}, got {self.eplb_policy!r}")
        if self.enable_expert_parallel and self.tensor_parallel_size < 2:
            raise ConfigError("--enable-expert-parallel places experts over the ranks: it needs --tensor-parallel-size "
                              "2 or more")
        needs_ep = [f for f, on in (("--enable-eplb", self.enable_eplb),
                                    ("--num-redundant-experts", self.num_redundant_experts > 0)) if on]
        if needs_ep and not self.enable_expert_parallel:
            raise ConfigError(f"{' and '.join(needs_ep)} need --enable-expert-parallel")

    def _check_nodes(self) -> None:
        n, hosts, node = self.tensor_parallel_size, self.nnodes, self.node_rank
        if int(hosts) < 1:
            raise ConfigError(f"nnodes (--nnodes) must be >= 1, got {hosts}")
        if not 0 <= int(node) < hosts:
            raise ConfigError(f"node_rank (--node-rank) must be in 0..{hosts - 1} (below --nnodes {hosts}), got {node}")
        if self.master_port is not None and not 0 < int(self.master_port) < 65536:
            raise ConfigError(f"master_port (--master-port) must be in 1..65535, got {self.master_port}")
        if not self.master_addr:
            raise ConfigError("master_addr (--master-addr) must name rank 0's host")
        if hosts == 1:
            return
        if n % hosts:
            raise ConfigError(f"--tensor-parallel-size {n} does not split over --nnodes {hosts}: each host holds "
                              "the same number of ranks")
        if self.master_port is None:
            raise ConfigError(f"--nnodes {hosts} needs --master-port (rank 0's rendezvous port, the same on every "
                              "node)")
        if self.tp_comm == "shm":
            raise ConfigError(f"--tp-comm shm is one host's: --nnodes {hosts} takes --tp-comm gloo (or auto)")

    def _check_quantization(self) -> None:
        try:
            self.quantization = canonical_quantization(self.quantization)
        except ValueError as exc:
            raise ConfigError(f"quantization: {exc}") from None
        if self.quantization in ("auto", "none"):
            return  # "auto" with a GGUF is checked when the loader knows the model is quantized
        if self.dtype not in (torch.bfloat16, torch.float32):
            raise ConfigError(f"quantization {self.quantization!r} runs its activations in bfloat16 or float32, "
                              f"not {str(self.dtype).removeprefix('torch.')} (--dtype)")
        if self.compile_decode:
            raise ConfigError(f"quantization {self.quantization!r}: compiled decode graphs (--compile-decode) do not "
                              "take quantized linears")

    @property
    def kv_tiers_enabled(self) -> bool:
        return self.kv_host_memory_gib is not None or self.kv_disk_dir is not None or self.kv_store is not None

    def _check_kv_tiers(self) -> None:
        if self.kv_store is not None:
            if not self.kv_store.startswith("mooncake://") or ":" not in self.kv_store[len("mooncake://"):]:
                raise ConfigError(f"kv_store: a Mooncake store is named mooncake://HOST:PORT, got {self.kv_store!r}")
            if not self.kv_store_metadata:
                raise ConfigError("kv_store needs kv_store_metadata, the Mooncake metadata server's URL "
                                  "(--mooncake-metadata), e.g. http://127.0.0.1:8080/metadata")
        for name in ("kv_host_memory_gib", "kv_disk_size_gib", "kv_store_segment_gib"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        if self.kv_tiers_enabled and (self.kv_cache_backend == "contiguous" or not self.enable_prefix_cache):
            raise ConfigError("KV tiers (kv_host_memory_gib, kv_disk_dir, kv_store) back the prefix cache: they need "
                              "a paged KV backend (xtensor or paged) with the prefix cache on")

    def _check_speculative(self) -> None:
        if self.speculative_self_layers is not None and self.speculative_self_layers < 1:
            raise ConfigError(f"speculative_self_layers must be >= 1, got {self.speculative_self_layers}")
        if self.speculative_self_layers is not None and self.speculative != "self":
            raise ConfigError("speculative_self_layers (--speculative-self-layers) is for --speculative self, "
                              f"not {self.speculative!r}")
        if self.speculative is None:
            return
        if self.speculative not in PROPOSERS:
            raise ConfigError(f"speculative: unknown speculative proposer {self.speculative!r}; "
                              f"known: {', '.join(PROPOSERS.choices())}")
        self.speculative = PROPOSERS.canonical(self.speculative)
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}")
        if self.speculative_max_batch < 1:
            raise ConfigError(f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}")
        if self.speculative == "draft" and not self.draft_model_path:
            raise ConfigError("the draft proposer needs draft_model_path (--draft-model DIR)")

    def resolve_max_model_len(self, model_max: int) -> int:
        """The effective context length: the configured one, never above the model's."""
        if self.max_model_len is None:
            return model_max
        if self.max_model_len > model_max:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's context length {model_max}")
        return self.max_model_len
