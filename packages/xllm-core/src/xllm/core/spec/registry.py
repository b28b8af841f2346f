"""The speculative proposers by name (torch is imported only when one is built)."""

from __future__ import annotations

from xllm.common import NameRegistry

PROPOSERS: NameRegistry = NameRegistry("speculative proposer", {
    "ngram": "xllm.core.spec.ngram:NgramProposer",
    "self": "xllm.core.spec.selfspec:SelfProposer",
    "draft": "xllm.core.spec.draft:DraftProposer",
    "mtp": "xllm.core.spec.mtp:MTPProposer",
})
