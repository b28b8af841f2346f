"""Model configuration read from a HF ``config.json`` (no torch: a cluster gateway reads it too)."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import Any


class ModelConfigError(ValueError):
    """The model directory's configuration is missing, malformed or unsupported."""


@dataclass
class ModelConfig:
    """The fields every decoder model shares, plus the raw dict for the rest.

    Architecture-specific fields are read from :attr:`raw` by each model.
    """

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> ModelConfig:
        file = pathlib.Path(path) / "config.json"
        if not file.is_file():
            raise ModelConfigError(f"{path} has no config.json; is it a Hugging Face model directory?")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{file} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        if not archs:
            raise ModelConfigError("config.json has no 'architectures' entry")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            cfg = cls(
                architecture=str(archs[0]),
                hidden_size=hidden,
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                vocab_size=int(raw["vocab_size"]),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_parameters(raw).get("rope_theta", 10000.0)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                raw=raw,
            )
        except KeyError as exc:
            raise ModelConfigError(f"config.json lacks required field {exc}") from exc
        # MLA models (DeepSeek) have no per-head K/V: their num_key_value_heads is a leftover.
        if cfg.num_heads % cfg.num_kv_heads and "kv_lora_rank" not in raw:
            raise ModelConfigError(
                f"num_attention_heads={cfg.num_heads} is not a multiple of num_key_value_heads={cfg.num_kv_heads}"
            )
        return cfg

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def require_silu(self, model: str) -> None:
        """Raise :class:`ModelConfigError` unless the MLP activation is SiLU (all our MLPs are SwiGLU)."""
        act = self.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"hidden_act {act!r} is not supported by {model} (only silu)")


def rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from either the transformers-5 ``rope_parameters`` dict or the
    older ``rope_theta`` + ``rope_scaling`` fields; always has ``rope_type``."""
    params = dict(raw.get("rope_parameters") or {})
    if not params:
        params = dict(raw.get("rope_scaling") or {})
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
    if "rope_theta" not in params and "rope_theta" in raw:
        params["rope_theta"] = raw["rope_theta"]
    params.setdefault("rope_type", "default")
    return params
