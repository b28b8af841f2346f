"""The machine's physical limits and what they imply for a model.

``probe()`` measures (with torch, on a given number of threads) memory read bandwidth and bf16/fp32
matmul FLOP/s. :class:`ModelShape` (pure Python, from ``config.json``) derives, for a Llama-style
decoder, the bytes read per decode step (weights + KV) and the FLOPs per token, hence:

- the decode ceiling at batch B: B / max(bytes_per_step / bandwidth, B · flops_per_token / flops);
- the prefill / large-batch ceiling: flops / flops_per_token (compute-bound);
- a scenario ceiling (B requests, P prompt tokens, O output tokens) by summing per-step lower bounds.
"""

from __future__ import annotations

import json
import pathlib
import time
from dataclasses import asdict, dataclass

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, cfg: dict) -> ModelShape:
        heads = int(cfg["num_attention_heads"])
        return cls(hidden=int(cfg["hidden_size"]), intermediate=int(cfg["intermediate_size"]),
                   layers=int(cfg["num_hidden_layers"]), heads=heads,
                   kv_heads=int(cfg.get("num_key_value_heads", heads)),
                   head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
                   vocab=int(cfg["vocab_size"]), tied=bool(cfg.get("tie_word_embeddings", False)))

    @classmethod
    def from_dir(cls, model_dir: str | pathlib.Path) -> ModelShape:
        return cls.from_config(json.loads((pathlib.Path(model_dir) / "config.json").read_text()))

    # parameters ---------------------------------------------------------------------------------
    @property
    def layer_matmul_params(self) -> int:
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h
        return attn + 3 * h * self.intermediate

    @property
    def matmul_params(self) -> int:
        """Parameters multiplied per token: every layer's projections and the LM head."""
        return self.layers * self.layer_matmul_params + self.vocab * self.hidden

    @property
    def params(self) -> int:
        """All parameters (embedding counted once when tied)."""
        norms = self.layers * 2 * self.hidden + self.hidden
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_matmul_params + norms + embed

    # per step / per token -----------------------------------------------------------------------
    def weight_bytes_per_step(self, dtype: str) -> int:
        """Weights read by one forward step (the embedding lookup's few rows are negligible)."""
        norms = self.layers * 2 * self.hidden + self.hidden
        return (self.matmul_params + norms) * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def flops_per_token(self, context: float = 0.0) -> float:
        """Forward FLOPs for one token attending to ``context`` tokens (2 per multiply-add)."""
        return 2.0 * self.matmul_params + 4.0 * self.layers * self.heads * self.head_dim * context

    def decode_step_seconds(self, batch: int, context: float, dtype: str, bandwidth: float, flops: float) -> float:
        """Lower bound of one decode step of ``batch`` sequences at ``context`` tokens each."""
        bytes_read = self.weight_bytes_per_step(dtype) + batch * context * self.kv_bytes_per_token(dtype)
        return max(bytes_read / bandwidth, batch * self.flops_per_token(context) / flops)

    def decode_ceiling(self, batch: int, context: float, dtype: str, bandwidth: float, flops: float) -> float:
        """Most output tokens/s a decode step of ``batch`` sequences can reach."""
        return batch / self.decode_step_seconds(batch, context, dtype, bandwidth, flops)

    def prefill_ceiling(self, prompt_len: int, flops: float) -> float:
        """Most prompt tokens/s (compute-bound): flops / FLOPs per token at half the prompt's context."""
        return flops / self.flops_per_token(prompt_len / 2)

    def scenario_seconds(self, batch: int, prompt_len: int, output_len: int, dtype: str, bandwidth: float,
                         flops: float) -> float:
        """Lower bound of ``batch`` requests of ``prompt_len`` -> ``output_len`` tokens run as one batch.

        Prefill of all prompts (compute- or bandwidth-bound, whichever is slower) gives the first
        output token; then ``output_len - 1`` decode steps with a growing context.
        """
        prefill_flops = batch * prompt_len * self.flops_per_token(prompt_len / 2)
        t = max(prefill_flops / flops, self.weight_bytes_per_step(dtype) / bandwidth)
        for k in range(1, output_len):
            t += self.decode_step_seconds(batch, prompt_len + k, dtype, bandwidth, flops)
        return t

    def scenario_ceiling(self, batch: int, prompt_len: int, output_len: int, dtype: str, bandwidth: float,
                         flops: float) -> float:
        """Most output tokens/s for that scenario."""
        return batch * output_len / self.scenario_seconds(batch, prompt_len, output_len, dtype, bandwidth, flops)


@dataclass
class MachineLimits:
    threads: int
    bandwidth_gbs: float            # memory read bandwidth (sum over a large fp32 tensor)
    matmul_gflops: dict             # dtype -> GFLOP/s of a square matmul
    gemv_gbs: dict                  # dtype -> effective GB/s of a vocab x hidden GEMV (M = 1)
    matmul_size: int
    bandwidth_mib: int

    def flops(self, dtype: str) -> float:
        return self.matmul_gflops[dtype] * 1e9

    @property
    def bandwidth(self) -> float:
        return self.bandwidth_gbs * 1e9

    def to_dict(self) -> dict:
        return asdict(self)


def probe(threads: int = 2, bandwidth_mib: int = 256, matmul_size: int = 2048, repeats: int = 5,
          gemv_shape: tuple[int, int] = (49152, 576)) -> MachineLimits:
    """Measure bandwidth and matmul throughput with torch on ``threads`` threads (best of ``repeats``)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            bandwidth = read_bandwidth_gbs(threads, bandwidth_mib, repeats * 4)
            matmul = {}
            for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
                a = torch.randn(matmul_size, matmul_size).to(dt)
                b = torch.randn(matmul_size, matmul_size).to(dt)
                best = _best(lambda a=a, b=b: torch.mm(a, b), repeats)
                matmul[name] = 2 * matmul_size**3 / best / 1e9
            gemv = {}
            for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
                w = torch.randn(*gemv_shape).to(dt)
                v = torch.randn(1, gemv_shape[1]).to(dt)
                best = _best(lambda w=w, v=v: torch.nn.functional.linear(v, w), repeats * 4)
                gemv[name] = w.numel() * w.element_size() / best / 1e9
    finally:
        torch.set_num_threads(old)
    return MachineLimits(threads, bandwidth, matmul, gemv, matmul_size, bandwidth_mib)


def read_bandwidth_gbs(threads: int = 2, mib: int = 256, repeats: int = 20, huge_pages: bool = False) -> float:
    """Memory read bandwidth in GB/s: the best of ``repeats`` ``sum()`` over a ``mib`` MiB fp32 tensor on
    ``threads`` threads (what a bandwidth-bound decode step can stream at most). ``huge_pages``: the tensor
    on 2 MiB pages (:class:`xllm.kernels.hugepages.HugePageArena`, where the system gives them), as the
    served weights are (the hardware prefetchers stop at every 4 KiB page boundary: measured 28-31 GB/s on
    4 KiB pages against 33-37 GB/s on 2 MiB ones, AMD EPYC, 2 threads)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            n = mib * 2**20 // 4
            if huge_pages:
                from xllm.kernels.hugepages import HugePageArena

                x = HugePageArena(n * 4).take((n,), torch.float32)
                x.fill_(1.0)
            else:
                x = torch.ones(n, dtype=torch.float32)
            return x.numel() * 4 / _best(lambda: x.sum().item(), repeats) / 1e9
    finally:
        torch.set_num_threads(old)


def _best(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def model_ceilings(shape: ModelShape, limits: MachineLimits, dtype: str, prompt_len: int = 32,
                   output_len: int = 128) -> dict:
    """The headline ceilings for ``dtype``: batch-1 decode, prefill, and the scenario at a few batch sizes."""
    bw, fl = limits.bandwidth, limits.flops(dtype)
    ctx = prompt_len + output_len / 2
    return {
        "weight_bytes_per_step": shape.weight_bytes_per_step(dtype),
        "kv_bytes_per_token": shape.kv_bytes_per_token(dtype),
        "gflop_per_token": shape.flops_per_token(ctx) / 1e9,
        "decode_batch1_tok_s": shape.decode_ceiling(1, ctx, dtype, bw, fl),
        "prefill_tok_s": shape.prefill_ceiling(prompt_len, fl),
        "scenario_output_tok_s": {str(b): shape.scenario_ceiling(b, prompt_len, output_len, dtype, bw, fl)
                                  for b in (1, 16, 64)},
    }
