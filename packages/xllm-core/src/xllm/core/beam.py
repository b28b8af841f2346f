"""Beam search in the engine: a request's beams decode as one group (xLLM §4.5).

A beam request (``SamplingParams.beam_width``) is prefilled by the normal path (prefix cache,
chunked prefill, any KV backend). When its prompt's last chunk has run, the engine hands the
sequence and that row's logits to :class:`BeamRunner`: the sequence leaves the scheduler's running
queue (status ``BEAM_SEARCH``) holding its prompt KV, and the group decodes one token per beam per
engine step until its search ends, its beams batched with every other group's in one forward.
That forward is the engine step's own: a step with ordinary work (decodes, prefill chunks) takes the
groups' rows as well (:meth:`BeamRunner.begin`; the shared-prefix attention for the beam rows and the
batch's own attention for the rest, in one eager forward of the model, since the fused native kernels
cannot attend over a shared prompt; a step with many rows of its own runs them fused and the beam
rows after them, see ``ModelRunner.share_max_rows``); a step with nothing else runs them alone
(:meth:`BeamRunner.step`).

- KV: the prompt's pages are shared by all beams, read in place and never copied (nor is a new
  page taken); each beam's decoded tokens' KV lives in the group's :class:`~xllm.core.beam_attention.BeamKV`
  (see :mod:`xllm.core.beam_attention` for the attention).
- Selection: per group the ``keep`` best beam x candidate totals
  (:func:`xllm.recsys.beam_topk.topk_candidates`: a ``topk`` per beam, then over the ``B x k``
  survivors), the search's bookkeeping in :class:`~xllm.core.beam_search.BeamSearch` (HF semantics).
- Catalogue decoding (``item_catalog``, :class:`xllm.recsys.catalog.ItemCatalog`): the candidates of a
  beam are its trie node's children only; their token columns are looked up on a helper thread while
  the forward runs (they depend only on the beams' nodes), and their log-probs gathered from the
  full-vocabulary log-softmax (so an item's score is its log-probability under the model).

Threads: the groups' list and counters belong to the engine's thread; a :class:`BeamPass` (the
groups of one forward) is landed on the thread that runs that forward (with async scheduling, the
engine's forward worker), while the engine thread may start new groups or drop aborted ones; the
lookup thread touches only the immutable catalogue.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from xllm.core.beam_attention import BeamAttention, BeamKV, GroupRows
from xllm.core.beam_search import BeamSearch, Hypothesis
from xllm.core.detokenizer import TokenDecoder
from xllm.core.kv.contracts import KVTensors
from xllm.core.model_api import AttentionContext, CausalLM
from xllm.core.sequence import SeqStatus, Sequence
from xllm.proto.engine.v1 import engine_pb2
from xllm.recsys.beam_topk import topk_candidates
from xllm.recsys.catalog import Children, ItemCatalog


@dataclass
class BeamCounters:
    """Cumulative beam-search work (``/metrics``: ``xllm:beam_*``)."""

    steps: int = 0                 # group decode steps (one per group per engine step)
    rows: int = 0                  # beam rows computed
    candidates_scanned: int = 0    # candidates a heap scan examines (see TopCandidates.scanned)
    candidates_total: int = 0      # beams x candidates offered (what a full scan examines)
    early_terminations: int = 0    # searches that ended before max_tokens
    requests: int = 0              # finished beam requests


@dataclass(eq=False)
class BeamGroup:
    """One beam request decoding: its sequence (prompt KV), search state, beams' KV and, with a
    catalogue, each live beam's trie node."""

    seq: Sequence
    search: BeamSearch
    per_beam: int | None
    kv: BeamKV | None = None
    nodes: torch.Tensor | None = None
    lookup: Future | None = field(default=None, repr=False)


@dataclass
class BeamStepResult:
    """What one engine step's beam work produced: the groups whose search ended, and counts."""

    finished: list[BeamGroup] = field(default_factory=list)
    rows: int = 0
    steps: int = 0
    scanned: int = 0
    total: int = 0  # candidates a full scan would examine (BeamCounters.candidates_total)
    early_terminations: int = 0

    def add_counts(self, other: BeamStepResult) -> None:
        """Add ``other``'s counts (not its finished groups) to these."""
        self.rows += other.rows
        self.steps += other.steps
        self.scanned += other.scanned
        self.total += other.total
        self.early_terminations += other.early_terminations


@dataclass
class BeamRows:
    """The packed inputs of some groups' beam rows for one forward (a group's rows are contiguous);
    ``mrope_positions`` ``[3, R]`` when a group's prompt has images (its rows at ``position + delta`` on every
    M-RoPE axis, :class:`~xllm.core.images.SequenceImages`), else None."""

    groups: list[BeamGroup]
    input_ids: torch.Tensor
    positions: torch.Tensor
    ctx: AttentionContext
    rows: list[GroupRows]
    mrope_positions: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return len(self.input_ids)


class BeamPass:
    """One decode step of the live groups as part of an engine step's forward: :attr:`first` rides in
    that forward (after its ordinary rows); the groups beyond ``max_rows`` beam rows run in forwards
    of their own when it lands (:meth:`land`, on the forward's thread)."""

    def __init__(self, runner: BeamRunner, first: BeamRows, rest: list[list[BeamGroup]]) -> None:
        self.runner = runner
        self.first = first
        self.rest = rest
        self.result = BeamStepResult()

    @property
    def seqs(self) -> list[Sequence]:
        return [g.seq for g in self.first.groups] + [g.seq for batch in self.rest for g in batch]

    @torch.inference_mode()
    def land(self, logits: torch.Tensor) -> BeamStepResult:
        """``logits`` ``[first.num_rows, V]`` are the first rows' (the forward is over): select, then
        step the other groups."""
        self.runner._land(self.first, logits, self.result)
        for batch in self.rest:
            self.runner._run(batch, self.result)
        return self.result


class BeamRunner:
    """The beam groups of one engine and their decode steps. ``forward``: the logits of beam rows in a forward
    of their own (a tensor-parallel instance's runner runs them on every rank,
    :meth:`~xllm.core.executor.runner.TensorParallelRunner.forward_beams`); None: ``model``'s forward here."""

    def __init__(self, model: CausalLM, kv: KVTensors, decoder: TokenDecoder, eos_token_ids: frozenset[int],
                 catalog: ItemCatalog | None = None, max_rows: int = 512,
                 forward: Callable[[BeamRows], torch.Tensor] | None = None) -> None:
        self.model = model
        self.forward = forward
        self._keys = itertools.count()  # BeamKV.key: a group's name to tensor-parallel workers
        self.kv = kv
        self.decoder = decoder
        self.eos_token_ids = eos_token_ids
        self.catalog = catalog
        self.max_rows = max_rows
        self.groups: list[BeamGroup] = []
        self.counters = BeamCounters()
        self._lookups = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xllm-beam-mask") if catalog else None

    # ---- lifecycle ------------------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, seq: Sequence, logits: torch.Tensor) -> BeamStepResult:
        """``seq``'s prompt is computed and ``logits`` (``[V]``) is its last row: choose the first
        tokens and either finish at once (``max_tokens`` 1) or add the group."""
        p = seq.params
        seq.status = SeqStatus.BEAM_SEARCH
        if seq.output_ids:  # the sampler's token (or its placeholder) for the prompt row: not a beam's
            seq.output_ids.clear()
        if p.item_catalog:
            if self.catalog is None:
                raise RuntimeError("a catalogue request reached an engine without a catalogue")
            max_tokens, end = self.catalog.item_len, frozenset()
        else:
            max_tokens = p.max_tokens
            end = p.stop_token_ids | (frozenset() if p.ignore_eos else frozenset(self.eos_token_ids))
        search = BeamSearch(p.beam_width, max_tokens, p.length_penalty, p.early_stopping, end, p.min_tokens)
        group = BeamGroup(seq, search, p.top_k or None)
        if self.catalog is not None and p.item_catalog:
            group.nodes = self.catalog.root()
        result = BeamStepResult()
        # the first selection is no beam step: its candidates are not counted with the steps' (the
        # per-step figure of xllm:beam_candidates_scanned), a search it ends is an early termination
        self._select(group, logits.float()[None], BeamStepResult())
        if search.done:
            result.finished.append(group)
            result.early_terminations += search.stopped_early
        else:
            spec = self.kv.layout.spec
            group.kv = BeamKV(spec.num_layers, p.beam_width, max_tokens - 1, spec.num_kv_heads, spec.head_dim,
                              spec.v_head_dim, self.kv.layout.dtype, key=next(self._keys))
            self.groups.append(group)
        return result

    def drop(self, seq: Sequence) -> None:
        """Forget ``seq``'s group (aborted); its prompt KV is the scheduler's to free."""
        self.groups = [g for g in self.groups if g.seq is not seq]

    def close(self) -> None:
        if self._lookups is not None:
            self._lookups.shutdown(wait=True)

    # ---- one step of every group ----------------------------------------------------------------
    def _batches(self) -> list[list[BeamGroup]]:
        """The live groups in batches of at most ``max_rows`` beam rows (a group never split)."""
        batches: list[list[BeamGroup]] = []
        rows = 0
        for g in self.groups:
            if g.search.done:  # finished in a step not retired yet
                continue
            if not batches or rows + g.search.num_beams > self.max_rows:
                batches.append([])
                rows = 0
            batches[-1].append(g)
            rows += g.search.num_beams
        return batches

    @torch.inference_mode()
    def begin(self) -> BeamPass | None:
        """The next decode step of every live group, its first batch to ride in the forward about to
        start (engine thread; call it once any step before has landed). None without live groups."""
        batches = self._batches()
        if not batches:
            return None
        return BeamPass(self, self._inputs(batches[0]), batches[1:])

    @torch.inference_mode()
    def step(self) -> BeamStepResult:
        """One decode step of every live group in forwards of their own (of at most ``max_rows`` beam
        rows); :meth:`retire` the result."""
        result = BeamStepResult()
        for batch in self._batches():
            self._run(batch, result)
        return result

    def retire(self, result: BeamStepResult) -> list[tuple[Sequence, engine_pb2.GenerateResponse]]:
        """Count a landed step's work (or a start's), forget its finished groups and return their
        requests' final chunks (engine thread)."""
        done = {id(g) for g in result.finished}
        self.groups = [g for g in self.groups if id(g) not in done]
        c = self.counters
        c.steps += result.steps
        c.rows += result.rows
        c.candidates_scanned += result.scanned
        c.candidates_total += result.total
        c.early_terminations += result.early_terminations
        c.requests += len(result.finished)
        return [(g.seq, self._final_chunk(g)) for g in result.finished]

    def _inputs(self, groups: list[BeamGroup]) -> BeamRows:
        ids, positions, rows, deltas = [], [], [], []
        start = 0
        for g in groups:
            s = g.search
            b = s.num_beams
            if g.nodes is not None:  # the catalogue lookups run on the helper thread during the forward
                g.lookup = self._lookups.submit(self.catalog.children, s.steps, g.nodes)
            prompt = g.seq.num_tokens
            ids.append(s.tokens[:, -1])
            positions.append(torch.full((b,), prompt + s.steps - 1, dtype=torch.int64))
            deltas.append(g.seq.images.delta if g.seq.images is not None else None)
            rows.append(GroupRows(start, b, prompt, g.seq.slot, g.seq.kv_pages, g.kv, s.steps - 1))
            start += b
        mrope = None
        if any(d is not None for d in deltas):  # an image prompt: M-RoPE text positions after it
            mrope = torch.cat([p + (d or 0) for p, d in zip(positions, deltas, strict=True)]).expand(3, -1)
        return BeamRows(groups, torch.cat(ids), torch.cat(positions), BeamAttention(self.kv, rows), rows, mrope)

    def _run(self, groups: list[BeamGroup], result: BeamStepResult) -> None:
        """One step of ``groups`` in a forward of their own."""
        inputs = self._inputs(groups)
        if self.forward is not None:
            logits = self.forward(inputs)
        else:
            rope = {} if inputs.mrope_positions is None else {"mrope_positions": inputs.mrope_positions}
            logits = self.model.compute_logits(self.model.forward(inputs.input_ids, inputs.positions, inputs.ctx,
                                                                  **rope))
        self._land(inputs, logits, result)

    def _land(self, inputs: BeamRows, logits: torch.Tensor, result: BeamStepResult) -> None:
        """Select the next beams of each group from its rows of ``logits``."""
        result.rows += inputs.num_rows
        for g, r in zip(inputs.groups, inputs.rows, strict=True):
            old_steps = g.search.steps
            parents = self._select(g, logits[r.start:r.start + r.beams], result)
            result.steps += 1
            if g.search.done:
                result.early_terminations += g.search.stopped_early
                result.finished.append(g)
            else:
                g.kv.reorder(parents, old_steps)

    def _select(self, g: BeamGroup, logits: torch.Tensor, result: BeamStepResult) -> torch.Tensor:
        """Choose the next beams of ``g`` from its rows' logits ``[B, V]``; returns their parents."""
        s = g.search
        logits = logits.float()
        lse = torch.logsumexp(logits, dim=-1)  # log-probs = logits - lse, formed for candidates only
        items = None
        if g.nodes is not None:
            ch: Children = g.lookup.result() if g.lookup is not None else self.catalog.children(s.steps, g.nodes)
            g.lookup = None
            cand_lp = (logits.gather(1, ch.tokens) - lse[:, None]).masked_fill_(~ch.valid, float("-inf"))
            cand = topk_candidates(s.scores, cand_lp, s.keep, g.per_beam)
            tokens = ch.tokens[cand.beams, cand.cols]
            items = ch.first[cand.beams] + cand.cols  # the node each candidate reaches
            result.scanned += cand.scanned
            result.total += int(ch.valid.sum())
        else:
            s.ban_end_tokens(logits)  # after the normalizer, as HF's min-length processor after log_softmax
            cand = topk_candidates(s.scores, logits, s.keep, g.per_beam, row_offsets=lse)
            tokens = cand.cols
            result.scanned += cand.scanned
            result.total += logits.numel()
        running = s.advance(cand, tokens, items)
        if g.nodes is not None:
            g.nodes = items[running]
        return cand.beams[running]

    def _final_chunk(self, g: BeamGroup) -> engine_pb2.GenerateResponse:
        seq, p = g.seq, g.seq.params
        hyps = g.search.results()
        beams = [self._hypothesis(h, p.skip_special_tokens) for h in hyps]
        best = beams[0].finish_reason if beams else engine_pb2.FINISH_REASON_LENGTH
        prompt = seq.num_request_prompt_tokens
        return engine_pb2.GenerateResponse(
            request_id=seq.request_id, finish_reason=best, beams=beams,
            usage=engine_pb2.Usage(prompt_tokens=prompt, completion_tokens=len(hyps[0].tokens) if hyps else 0,
                                   cached_prompt_tokens=min(seq.num_cached_prompt_tokens, prompt)))

    def _hypothesis(self, h: Hypothesis, skip_special: bool) -> engine_pb2.BeamHypothesis:
        item = self.catalog.item_id(h.item) if h.item >= 0 and self.catalog is not None else -1
        reason = engine_pb2.FINISH_REASON_STOP if h.ended else engine_pb2.FINISH_REASON_LENGTH
        text = "" if item >= 0 else self.decoder.decode(list(h.tokens), skip_special_tokens=skip_special)
        return engine_pb2.BeamHypothesis(token_ids=list(h.tokens), text=text, logprob=h.logprob, score=h.score,
                                         finish_reason=reason, item_id=item)
