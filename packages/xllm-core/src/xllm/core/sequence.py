"""Per-request state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xllm.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from xllm.core.grammar import GrammarState
    from xllm.core.images import SequenceImages
    from xllm.core.request_trace import RequestTrace

PLACEHOLDER = -1  # stands for a token still being computed (async scheduling)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    RESERVING = "reserving"      # decode phase: waiting for KV memory to receive the prompt's KV into
    AWAITING_KV = "awaiting_kv"  # decode phase: KV reserved, the prefill instance is computing / sending it
    HANDING_OFF = "handing_off"  # prefill phase: first token out, KV held until the decode side has it
    LOADING = "loading"          # its prefix is coming up from a lower KV tier (xllm.core.kv.lower_tiers)
    BEAM_SEARCH = "beam_search"  # prompt computed, KV held: its beams decode as one group (xllm.core.beam)


class Phase(enum.Enum):
    """Which part of a request this engine serves (prefill/decode disaggregation)."""

    MIXED = "mixed"      # the whole request
    PREFILL = "prefill"  # the prompt and the first token, then hand the KV off
    DECODE = "decode"    # receive the prompt's KV (reusing the local prefix cache), then decode


@dataclass
class PromptLogprobs:
    """The prompt's logprobs as computed so far: ``entries[i]`` is ``(token, logprob, top)`` for prompt
    token ``i + 1`` (teacher forced: the row of position ``i``); sent with the first output chunk."""

    entries: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    sent: bool = False


@dataclass(eq=False)
class Sequence:
    """One request's tokens and progress.

    ``num_computed_tokens`` counts tokens whose KV is in the cache; the engine
    feeds ``token_ids[num_computed_tokens:]`` (in chunks) and samples a new
    token once all known tokens are computed. With async scheduling the last
    output may be :data:`PLACEHOLDER` while the forward that produces it runs;
    the real token is swapped in before anything reads it as input.
    Identity-compared.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    seed: int = 0            # sampling draws are keyed by (seed, output index): xllm.kernels.sampling
    num_resumed: int = 0     # the last prompt tokens that are output of an earlier run (a resumed request)
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    slot: int | None = None
    kv_pages: list[int] = field(default_factory=list)      # page per block (paged: the block table)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks, as computed
    num_hashed_blocks: int = 0                              # blocks registered in the prefix cache
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    phase: Phase = Phase.MIXED
    moving: bool = False     # a migration stops it once no step in flight computes it
    offline: bool = False    # best-effort work (service_tier flex): xllm.sched.colocation
    lora_slot: int = -1      # the LoRA adapter slot its rows use (-1: the base model; xllm.core.lora)
    hash_root: int = 0       # the parent of its first KV block's hash: its adapter's identity (0: the base model)
    images: SequenceImages | None = None  # a multimodal prompt's images (xllm.core.images)
    encode_pending: int = 0  # images to encode before its prefill (the encode phase: xllm.sched.encode)
    grammar: GrammarState | None = None  # constrained decoding (xllm.core.grammar): follows the known output
    prompt_logprobs: PromptLogprobs | None = None  # asked for (SamplingParams.prompt_logprobs): what is computed
    trace: RequestTrace | None = None  # a traced request's record (xllm.core.request_trace), filled after each step

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens known at arrival (a resumed request's earlier output included): what the KV
        cache, prefill and hand-offs work on."""
        return len(self.prompt_ids)

    @property
    def num_request_prompt_tokens(self) -> int:
        """The client's prompt: without the output of an earlier run of a resumed request."""
        return len(self.prompt_ids) - self.num_resumed

    def num_output_tokens(self) -> int:
        """Generated tokens known so far across runs (a resumed run's earlier output included)."""
        return self.num_resumed + len(self.real_output_ids)

    def all_output_ids(self) -> list[int]:
        """Generated tokens known so far across runs, earlier runs' first."""
        earlier = self.prompt_ids[len(self.prompt_ids) - self.num_resumed:] if self.num_resumed else []
        return earlier + self.real_output_ids if earlier else self.real_output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output without building the full list."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    @property
    def real_output_ids(self) -> list[int]:
        """Generated tokens known so far, without pending placeholders."""
        end = len(self.output_ids)
        while end and self.output_ids[end - 1] == PLACEHOLDER:
            end -= 1
        return self.output_ids if end == len(self.output_ids) else self.output_ids[:end]

    @property
    def prompt_logprobs_pending(self) -> int | None:
        """The first prompt position whose logprob row is still to compute, or None when none is
        (not asked for, all computed, or a resumed run: the first run sent them). While some are
        pending the prefix cache is not used for this sequence: a cached block has no logits."""
        lp = self.prompt_logprobs
        if lp is None or self.num_resumed:
            return None
        done = len(lp.entries)
        return done if done < len(self.prompt_ids) - 1 else None

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]
