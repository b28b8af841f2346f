"""The models a gateway serves, each with its own front: tokenizer, chat template, context length.

Several models behind one gateway (``xllm serve --model A --model B``, or a cluster gateway given the
models its etcd instances serve): every request is tokenized, templated and detokenized with its own
model's tokenizer, bounded by its own context length, and routed among that model's instances only (the
registry's pools are per model). A model an instance registers but this gateway has no front for cannot be
served (404 naming it, and ``/v1/models`` does not list it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from xllm.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelFront:
    """One served model at the front: ``name`` (what clients pass as ``model``), its tokenizer (and chat
    template) and its context length (the instances' own, when they report a shorter one, wins)."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int


class ModelFronts:
    """The fronts by served name, the first the default (a request without ``model``)."""

    def __init__(self, fronts: list[ModelFront]) -> None:
        if not fronts:
            raise ValueError("a gateway serves at least one model")
        names = [f.name for f in fronts]
        if len(set(names)) != len(names):
            raise ValueError(f"served model names must differ: {', '.join(names)}")
        self._fronts = {f.name: f for f in fronts}
        self.default = fronts[0]

    def get(self, name: str) -> ModelFront | None:
        return self._fronts.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._fronts

    def __iter__(self) -> Iterator[ModelFront]:
        return iter(self._fronts.values())

    def tokenizers(self) -> dict[str, Tokenizer]:
        return {name: f.tokenizer for name, f in self._fronts.items()}
