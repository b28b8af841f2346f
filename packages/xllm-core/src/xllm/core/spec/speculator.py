"""The engine's side of speculative decoding: which decoding sequences speculate and how far,
their drafts' KV room, the acceptance bookkeeping and the counters.

Lifecycle of a verify step (see ``docs/architecture.md``; with async scheduling the engine holds a
speculating sequence out of the next step until its step in flight lands, :meth:`Speculator.wants`):

1. after scheduling, :meth:`Speculator.draft` asks the proposer for up to ``k`` drafts for each
   eligible decode chunk and reserves KV room for them (``kv.allocate(seq, 1 + len(drafts))``;
   no room: no drafts); the chunk becomes ``1 + len(drafts)`` rows (the last known token, then
   the drafts) and the forward returns logits for all of them;
2. :func:`xllm.core.spec.verify.verify` draws each row as the non-speculative sampler would and
   keeps the drafts up to the first mismatch, plus the target's token there;
3. :meth:`Speculator.land` sets ``num_computed_tokens`` back to the accepted tokens (the rejected
   rows' KV is overwritten by the next step; a page they took stays with the sequence, and the
   prefix cache registers blocks only up to ``num_computed_tokens``, so never a rejected row) and
   updates the request's acceptance rate.

Adaptive, so that speculation is never a loss by construction: per request an EWMA of the acceptance
rate and a decayed estimate of the per-position acceptance; either below ``MIN_RATE``, the request
stops speculating for a back-off of steps (doubling, up to ``MAX_BACKOFF``) and then probes again
with ``k`` = 1. How many drafts each speculating request gets is priced: the engine reports every
decode/verify step's forward time by its row count (:meth:`Speculator.observe_step`,
:class:`~xllm.core.spec.costs.StepCosts`) and :func:`~xllm.core.spec.costs.plan_drafts` adds drafts
while the expected tokens (from each request's per-position acceptance estimate) per estimated
second rise, so k shrinks where rows stop being nearly free (larger steps, compute-bound kernels) or
acceptance falls. The proposer's own time counts too (:class:`~xllm.core.spec.costs.DraftCosts`:
seconds per drafting round, measured around each call), so a model-backed drafter whose rounds cost
more than the accepted tokens save stops drafting except for the periodic exploration and probes.
Before any step was timed, ``k`` = ``k_max`` · rate / ``FULL_RATE`` (at least 1).
A step with more than ``max_batch`` decoding sequences does not speculate at all.

A proposer that rarely agrees with the model (``self`` on a model whose early layers guess badly:
3-6 % on SmolLM2) costs every new request its first drafts and the drafter's catch-up over its
prompt before that request's own back-off sets in: 10-14 % of batch-1 tok/s measured. So the
speculator also keeps the proposer's acceptance over its recent verifies (decayed per-position
counts, as each request's); while it is below ``MIN_RATE``, a new request starts backed off for
``MAX_BACKOFF`` steps, except one in ``EXPLORE_REQUESTS``, which speculates as usual and keeps the
estimate current.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xllm.core.kv.contracts import KVAllocator
from xllm.core.sequence import PLACEHOLDER, Phase, SeqStatus, Sequence
from xllm.core.spec.base import Proposer
from xllm.core.spec.costs import DraftCosts, StepCosts, plan_drafts
from xllm.core.spec.verify import Verified

if TYPE_CHECKING:
    from xllm.core.model_runner import BatchInputs

ALPHA = 0.3        # EWMA weight of the latest step's acceptance rate
FULL_RATE = 0.6    # an acceptance rate at or above which k is k_max
MIN_RATE = 0.15    # below it a request stops speculating for a back-off
FIRST_BACKOFF = 8  # steps
MAX_BACKOFF = 256
EXPLORE_EVERY = 32  # every this many speculating steps, one draft more than the cost model picks
POS_DECAY = 0.9     # per verify, the weight the per-position acceptance counts keep
PROPOSER_DECAY = 0.97  # per verify, the weight the proposer-wide counts keep (~30 recent verifies)
PROPOSER_MIN_TRIES = 8.0  # proposer-wide tries before its rate is believed
EXPLORE_REQUESTS = 8  # while the proposer-wide rate is low, one new request in this many speculates


@dataclass
class SpecState:
    """One request's speculation: its acceptance-rate EWMA, and the back-off when it is off."""

    rate: float = 1.0
    off_steps: int = 0      # steps left without speculation
    backoff: int = FIRST_BACKOFF
    probing: bool = False   # the first speculation after a back-off (k = 1)
    hits: float = 0.5       # decayed counts of draft positions accepted / tried: their ratio is the
    tries: float = 1.0      # probability that a draft is accepted given the ones before it were

    @property
    def position_rate(self) -> float:
        return self.hits / self.tries

    def k(self, k_max: int) -> int:
        if self.probing:
            return 1
        return max(1, min(k_max, math.floor(k_max * self.rate / FULL_RATE + 1e-9)))


@dataclass
class SpecCounters:
    """Cumulative speculation counters (vLLM's ``spec_decode_*`` names): drafts proposed and verified,
    drafts accepted, and accepted drafts by position (``accepted_per_pos[j]``: the (j+1)-th draft)."""

    num_drafts: int = 0             # verify runs (sequences that speculated, summed over steps)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, v: Verified) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += v.num_drafts
        self.num_accepted_tokens += v.num_accepted
        if len(self.accepted_per_pos) < v.num_drafts:
            self.accepted_per_pos.extend([0] * (v.num_drafts - len(self.accepted_per_pos)))
        for j in range(v.num_accepted):
            self.accepted_per_pos[j] += 1


class Speculator:
    """Drafts for a step's decode chunks (through ``proposer``) and what their verification leaves."""

    def __init__(self, proposer: Proposer, k_max: int, max_batch: int) -> None:
        if k_max < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k_max}")
        self.proposer = proposer
        self.k_max = k_max
        self.max_batch = max_batch
        self.counters = SpecCounters()
        self.costs = StepCosts()
        self.drafting = DraftCosts()
        self._state: dict[Sequence, SpecState] = {}
        self._speculating_steps = 0
        self._hits = 0.0   # proposer-wide decayed per-position counts (see the module docstring)
        self._tries = 0.0
        self._new_requests = 0

    @property
    def proposer_rate(self) -> float | None:
        """The proposer's recent per-position acceptance over every request (None: too few tries)."""
        return self._hits / self._tries if self._tries >= PROPOSER_MIN_TRIES else None

    def _new_state(self) -> SpecState:
        """A new request's state: backed off from the start while the proposer rarely agrees (but for
        one request in :data:`EXPLORE_REQUESTS`)."""
        state = SpecState()
        self._new_requests += 1
        rate = self.proposer_rate
        if rate is not None and rate < MIN_RATE and self._new_requests % EXPLORE_REQUESTS != 0:
            state.off_steps = state.backoff = MAX_BACKOFF
        return state

    def eligible(self, seq: Sequence) -> bool:
        """Whether ``seq`` may speculate at all: a plain decode (not a PD phase, not moving), no
        output constraint, no penalties (they depend on the drafts before each row) and past its
        ``min_tokens`` (the ban of EOS depends on the output position)."""
        p = seq.params
        return (seq.phase is Phase.MIXED and seq.grammar is None and not seq.moving and not p.needs_penalties
                and seq.num_output_tokens() >= p.min_tokens)

    def wants(self, seq: Sequence) -> bool:
        """Whether ``seq`` would speculate in its next step (eligible, not backing off). With async
        scheduling the engine then holds it until its step in flight lands (its drafts need its last
        token, and a verify step's accepted length is known only once it lands)."""
        if not self.eligible(seq):
            return False
        state = self._state.get(seq)
        return state is None or state.off_steps == 0

    def draft(self, decodes: list[Sequence], kv: KVAllocator, budget: int, max_model_len: int
              ) -> dict[Sequence, list[int]]:
        """Drafts for this step's decoding sequences ``decodes`` (each scheduled for its one known
        token), within ``budget`` extra tokens, their KV room reserved. Sequences absent from the
        result decode as usual."""
        self._sweep()
        if not decodes or len(decodes) > self.max_batch or budget < 1:
            return {}
        requests: list[tuple[Sequence, int]] = []
        for seq in decodes:
            if not self.eligible(seq):
                continue
            state = self._state.get(seq)
            if state is None:
                state = self._state[seq] = self._new_state()
            if state.off_steps > 0:
                state.off_steps -= 1
                if state.off_steps == 0:
                    state.probing = True
                continue
            if seq.output_ids and seq.output_ids[-1] == PLACEHOLDER:
                continue  # its last token is still being computed (async scheduling): no guess yet
            # room: the drafts and the target's token after them must fit max_tokens and the context
            room = min(seq.params.max_tokens - seq.num_output_tokens() - 1, max_model_len - seq.num_tokens - 1)
            k = min(self.k_max if self.costs.known else state.k(self.k_max), room)
            if k >= 1:
                requests.append((seq, k))
        if not requests:
            return {}
        if self.costs.known:  # priced: drafts while expected tokens per second rise
            self._speculating_steps += 1
            cands = [(seq, k, self._state[seq].position_rate) for seq, k in requests if not self._state[seq].probing]
            plan = plan_drafts(self.costs, len(decodes), cands, explore=self._speculating_steps % EXPLORE_EVERY == 0,
                               drafting=self.drafting)
            # a request probing after a back-off tries one draft whatever the price
            requests = [(seq, 1 if self._state[seq].probing else plan.get(seq, 0)) for seq, _ in requests]
            requests = [(seq, k) for seq, k in requests if k >= 1]
            if not requests:
                return {}
        out: dict[Sequence, list[int]] = {}
        started = time.perf_counter()
        proposals = self.proposer.propose(requests)
        self.drafting.observe(max(k for _, k in requests), time.perf_counter() - started)
        for (seq, _), drafts in zip(requests, proposals, strict=True):
            drafts = drafts[:budget]
            if drafts and kv.allocate(seq, 1 + len(drafts)):
                out[seq] = drafts
                budget -= len(drafts)
            if budget < 1:
                break
        return out

    def land(self, v: Verified, start: int) -> None:
        """``v.seq``'s verify step landed: its KV is valid for its last known token (at ``start``) and
        the accepted drafts; the tokens join its output. Updates the acceptance rate."""
        seq = v.seq
        seq.num_computed_tokens = start + 1 + v.num_accepted
        seq.output_ids.extend(v.tokens)
        self.counters.add(v)
        self._hits = PROPOSER_DECAY * self._hits + v.num_accepted
        self._tries = PROPOSER_DECAY * self._tries + v.num_accepted + (v.num_accepted < v.num_drafts)
        state = self._state.get(seq)
        if state is None:
            return
        rate = v.num_accepted / v.num_drafts
        state.hits = POS_DECAY * state.hits + v.num_accepted
        state.tries = POS_DECAY * state.tries + v.num_accepted + (v.num_accepted < v.num_drafts)
        state.rate = rate if state.probing else (1 - ALPHA) * state.rate + ALPHA * rate
        if state.probing and rate > 0:
            state.probing = False
            state.backoff = FIRST_BACKOFF
            state.rate = max(state.rate, FULL_RATE / self.k_max)
        elif (state.rate < MIN_RATE or (state.tries >= 3 and state.position_rate < MIN_RATE)
              or (state.probing and rate == 0)):
            state.off_steps = state.backoff
            state.backoff = min(2 * state.backoff, MAX_BACKOFF)
            state.probing = False
            state.rate = FULL_RATE / self.k_max  # resume from k = 1 after the back-off
            state.hits, state.tries = 0.5, 1.0

    def observe_step(self, batch: BatchInputs, seconds: float) -> None:
        """A landed step's forward + sampling time: counted by row count when the step held decode
        rows and verify chunks only (what :meth:`draft` prices)."""
        if batch.num_prefill_seqs == len(batch.spec_spans) and not batch.prompt_rows:
            self.costs.observe(len(batch.input_ids), seconds)

    def state(self, seq: Sequence) -> SpecState | None:
        return self._state.get(seq)

    def _sweep(self) -> None:
        """Forget finished sequences (the proposer releases what it keeps for them)."""
        done = [seq for seq in self._state if seq.status is SeqStatus.FINISHED]
        for seq in done:
            del self._state[seq]
            self.proposer.release(seq)

    def close(self) -> None:
        self.proposer.close()
