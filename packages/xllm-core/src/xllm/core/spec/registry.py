"""The speculative proposers by name (torch is imported only when one is built)."""

from __future__ import annotations

from xllm.common import NameRegistry

PROPOSERS: NameRegistry = NameRegistry("speculative proposer", {
    "ngram": "xllm.core.spec.ngram:NgramProposer",
    "draft": "xllm.core.spec.draft:DraftProposer",
})
