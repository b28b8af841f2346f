"""The simulated cluster's settings, with the engine's and gateway's defaults.

KV defaults are SmolLM2-135M in bf16 (the model ``xllm`` serves on this machine): 30 layers × 3 KV
heads × 64 dims × K and V × 2 bytes = 23,040 bytes per token; xTensor's default block for it is 128
tokens (:func:`xllm.core.kv.xtensor.default_block_size`: 128, rounded up to whole 4 KiB pages per layer's
K block); the engine's default 2 GiB of KV is 728 such blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from xllm.sched.batch_policy import DEFAULT_OFFLINE_SLO_FRACTION, DEFAULT_TOKEN_BUDGET
from xllm.sched.encode import DEFAULT_MAX_ENCODE_IMAGES
from xllm.sched.registry import EPD_STRATEGIES

SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2
SMOLLM2_BLOCK_SIZE = 128
DEFAULT_KV_BLOCKS = (2 << 30) // (SMOLLM2_KV_BYTES_PER_TOKEN * SMOLLM2_BLOCK_SIZE)


@dataclass(frozen=True)
class SimConfig:
    """One simulated cluster. ``prefill_instances`` and ``decode_instances`` both > 0 is PD mode
    (then ``instances`` is ignored); otherwise ``instances`` mixed instances.

    - Policies by name: ``routing`` (``xllm.sched.ROUTING_POLICIES``; in PD mode it ranks the
      prefill pool, as the gateway's ``PDPlacement`` does), ``batch_policy``
      (``xllm.sched.BATCH_POLICIES``), ``pd_policy`` (``xllm.sched.PD_POLICIES``: role flips; PD
      mode only).
    - Engine: ``max_num_seqs``, ``max_num_batched_tokens``, ``chunked_prefill``, ``block_size``,
      ``kv_blocks`` per instance, ``max_model_len`` (0: unbounded), ``prefix_cache``.
    - Costs: ``kv_bytes_per_token`` and ``kv_bandwidth`` (bytes/s per receiving instance, transfers
      to one instance queue behind each other) plus ``transfer_latency_s`` per transfer: PD
      hand-offs and migrations; ``gateway_overhead_s`` before each dispatch; ``speed`` divides
      every step time (a faster or slower instance than the profile's); ``step_noise``: each step
      takes the model's time times a lognormal factor of mean 1 and this log-deviation (0: exactly
      the model's), the policies predicting the model's.
    - Gateway view: ``heartbeat_s`` (load reports are this old at most; 0 = the policies see live
      state); ``pd_interval_s`` between role-flip decisions; ``drain_moves`` how a flipping decode
      instance's requests leave (``auto``: ``xllm.sched.move_cost`` decides migrate or recompute;
      ``migrate``; ``recompute``; ``off``: they finish where they are); the dynamic role policy's
      ``window_s``, ``cooldown_s``, ``cluster_cooldown_s``, ``max_in_progress`` and
      ``max_flips_per_decision`` as ``pd_window_s``, ``pd_cooldown_s``, ``pd_cluster_cooldown_s``,
      ``pd_max_in_progress``, ``pd_max_flips`` (the gateway's defaults; the flip limits ``None``:
      ``xllm.sched.elastic.auto_flips``, a tenth of the PD instances); ``pd_overflow``: with
      ``slo_ttft_s``, ``PDPlacement`` runs a request whole on a decode instance when every prefill
      instance is predicted to miss the objective (the gateway's ``--pd-prefill-overflow``).
    - SLOs (seconds, ``None``: none) feed the policies that take them (role flips, co-location)
      and the SLO attainment of the report; ``offline_priority`` is the engine priority of offline
      requests (lower is more important; online requests have 0); ``offline_slo_fraction`` and
      ``offline_starvation_s`` are the co-location policy's headroom and starvation bound.
    - Images (requests with ``RequestSpec.images``): ``max_encode_images`` per step in the policy's encode
      phase (the engine's ``--max-encode-images``; 0: encoded in the request's first prefill step), each
      taking ``encode_image_s`` (divided by ``speed``; the default is a guess for a 2B VLM's vision tower
      on an accelerator: take it from the engine's ``encode phase`` log line).
    - EPD (``epd_strategy``, ``xllm.sched.EPD_STRATEGIES``; PD mode): ``ep+d`` encodes where the prompt is
      prefilled; ``e+p+d`` on ``encode_instances`` encode-only instances; ``ed+p`` on the decode instances;
      the embeddings then reach the prefill placement ``embedding_transfer_s`` later.
    """

    instances: int = 2
    prefill_instances: int = 0
    decode_instances: int = 0
    routing: str = "kv_aware"
    batch_policy: str = "decode_first"
    pd_policy: str = "static"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = DEFAULT_TOKEN_BUDGET
    chunked_prefill: bool = True
    block_size: int = SMOLLM2_BLOCK_SIZE
    kv_blocks: int = DEFAULT_KV_BLOCKS
    max_model_len: int = 0
    prefix_cache: bool = True
    kv_bytes_per_token: int = SMOLLM2_KV_BYTES_PER_TOKEN
    kv_bandwidth: float = 1e9
    transfer_latency_s: float = 0.0
    gateway_overhead_s: float = 0.0
    speed: float = 1.0
    step_noise: float = 0.0
    heartbeat_s: float = 0.5
    pd_interval_s: float = 0.5
    drain_moves: str = "auto"
    pd_window_s: float = 5.0
    pd_cooldown_s: float = 30.0
    pd_cluster_cooldown_s: float = 10.0
    pd_max_in_progress: int | None = None
    pd_max_flips: int | None = None
    pd_overflow: bool = True
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    offline_priority: int = 1
    offline_starvation_s: float = 30.0
    offline_slo_fraction: float = DEFAULT_OFFLINE_SLO_FRACTION
    max_encode_images: int = DEFAULT_MAX_ENCODE_IMAGES
    encode_image_s: float = 0.02
    epd_strategy: str = "ep+d"
    encode_instances: int = 0
    embedding_transfer_s: float = 0.0

    @property
    def pd(self) -> bool:
        return self.prefill_instances > 0 and self.decode_instances > 0

    @property
    def num_instances(self) -> int:
        return self.prefill_instances + self.decode_instances + self.encode_instances if self.pd else self.instances

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad setting."""
        if (self.prefill_instances > 0) != (self.decode_instances > 0):
            raise ValueError("PD mode needs both prefill_instances and decode_instances > 0")
        positive = {"instances": self.instances, "max_num_seqs": self.max_num_seqs,
                    "max_num_batched_tokens": self.max_num_batched_tokens, "block_size": self.block_size,
                    "kv_blocks": self.kv_blocks, "kv_bytes_per_token": self.kv_bytes_per_token,
                    "kv_bandwidth": self.kv_bandwidth, "speed": self.speed, "pd_interval_s": self.pd_interval_s,
                    "pd_max_in_progress": self.pd_max_in_progress, "pd_max_flips": self.pd_max_flips}
        for name, value in positive.items():
            if value is not None and not value > 0:  # None: the flip limits' automatic size
                raise ValueError(f"{name} must be > 0, got {value}")
        for name, value in (("heartbeat_s", self.heartbeat_s), ("gateway_overhead_s", self.gateway_overhead_s),
                            ("step_noise", self.step_noise),
                            ("transfer_latency_s", self.transfer_latency_s), ("max_model_len", self.max_model_len),
                            ("pd_window_s", self.pd_window_s), ("pd_cooldown_s", self.pd_cooldown_s),
                            ("pd_cluster_cooldown_s", self.pd_cluster_cooldown_s),
                            ("max_encode_images", self.max_encode_images), ("encode_image_s", self.encode_image_s)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        strategy = EPD_STRATEGIES.get(self.epd_strategy)  # (KeyError naming the known ones)
        if strategy.encode_role is not None and not self.pd:
            raise ValueError(f"epd_strategy {self.epd_strategy} needs PD mode (prefill and decode instances)")
        if (strategy.encode_role == "encode") != (self.encode_instances > 0):
            raise ValueError("encode_instances > 0 goes with epd_strategy e+p+d (and it needs them)")
        if self.embedding_transfer_s < 0:
            raise ValueError(f"embedding_transfer_s must be >= 0, got {self.embedding_transfer_s}")
        if self.drain_moves not in ("auto", "migrate", "recompute", "off"):
            raise ValueError(f"drain_moves must be auto, migrate, recompute or off, got {self.drain_moves!r}")
        for name, slo in (("slo_ttft_s", self.slo_ttft_s), ("slo_tpot_s", self.slo_tpot_s)):
            if slo is not None and not slo > 0:
                raise ValueError(f"{name} must be > 0, got {slo}")
        if not 0 < self.offline_slo_fraction <= 1:
            raise ValueError(f"offline_slo_fraction must be in (0, 1], got {self.offline_slo_fraction}")
