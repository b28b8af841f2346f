"""Beam search in the engine: a request's beams decode as one group (xLLM §4.5).

A beam request (``SamplingParams.beam_width``) is prefilled by the normal path (prefix cache,
chunked prefill, any KV backend). When its prompt's last chunk has run, the engine hands the
sequence and that row's logits to :class:`BeamRunner`: the sequence leaves the scheduler's running
queue (status ``BEAM_SEARCH``) holding its prompt KV, and the group decodes one token per beam per
engine step until its search ends, its beams batched with every other group's in one forward.

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

Not thread-safe: the engine's thread only (the lookup thread touches only the immutable catalogue).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from xllm.core.beam_attention import BeamAttention, BeamKV, GroupRows
from xllm.core.beam_search import BeamSearch, Hypothesis
from xllm.core.detokenizer import TokenDecoder
from xllm.core.kv.base import KVCacheBackend
from xllm.core.model_api import CausalLM
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
    """What one engine step's beam work produced: finished requests' final chunks and counts."""

    finished: list[tuple[Sequence, engine_pb2.GenerateResponse]] = field(default_factory=list)
    rows: int = 0
    steps: int = 0
    scanned: int = 0
    early_terminations: int = 0


class BeamRunner:
    """The beam groups of one engine and their decode steps."""

    def __init__(self, model: CausalLM, kv: KVCacheBackend, decoder: TokenDecoder, eos_token_ids: frozenset[int],
                 catalog: ItemCatalog | None = None, max_rows: int = 512) -> None:
        self.model = model
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
        self._select(group, logits.float()[None], result)
        if search.done:
            result.finished.append((seq, self._final_chunk(group)))
        else:
            spec = self.kv.layout.spec
            group.kv = BeamKV(spec.num_layers, p.beam_width, max_tokens - 1, spec.num_kv_heads, spec.head_dim,
                              spec.v_head_dim, self.kv.layout.dtype)
            self.groups.append(group)
        return result

    def drop(self, seq: Sequence) -> None:
        """Forget ``seq``'s group (aborted); its prompt KV is the scheduler's to free."""
        self.groups = [g for g in self.groups if g.seq is not seq]

    def close(self) -> None:
        if self._lookups is not None:
            self._lookups.shutdown(wait=True)

    # ---- one step of every group ----------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> BeamStepResult:
        """One decode step of every group (in forwards of at most ``max_rows`` beam rows, a group
        never split); finished groups leave with their final chunk."""
        result = BeamStepResult()
        batch: list[BeamGroup] = []
        rows = 0
        for g in list(self.groups):
            if batch and rows + g.search.num_beams > self.max_rows:
                self._run(batch, result)
                batch, rows = [], 0
            batch.append(g)
            rows += g.search.num_beams
        if batch:
            self._run(batch, result)
        done = {id(seq) for seq, _ in result.finished}
        self.groups = [g for g in self.groups if id(g.seq) not in done]
        c = self.counters
        c.steps += result.steps
        c.rows += result.rows
        c.candidates_scanned += result.scanned
        c.early_terminations += result.early_terminations
        c.requests += len(result.finished)
        return result

    def _run(self, groups: list[BeamGroup], result: BeamStepResult) -> None:
        ids, positions, rows = [], [], []
        start = 0
        for g in groups:
            s = g.search
            b = s.num_beams
            if g.nodes is not None:  # the catalogue lookups run on the helper thread during the forward
                g.lookup = self._lookups.submit(self.catalog.children, s.steps, g.nodes)
            prompt = g.seq.num_tokens
            ids.append(s.tokens[:, -1])
            positions.append(torch.full((b,), prompt + s.steps - 1, dtype=torch.int64))
            rows.append(GroupRows(start, b, prompt, g.seq.slot, g.seq.kv_pages, g.kv, s.steps - 1))
            start += b
        ctx = BeamAttention(self.kv, rows)
        hidden = self.model.forward(torch.cat(ids), torch.cat(positions), ctx)
        logits = self.model.compute_logits(hidden)
        result.rows += start
        for g, r in zip(groups, rows, strict=True):
            old_steps = g.search.steps
            parents = self._select(g, logits[r.start:r.start + r.beams], result)
            result.steps += 1
            if g.search.done:
                result.early_terminations += g.search.stopped_early
                result.finished.append((g.seq, self._final_chunk(g)))
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
            self.counters.candidates_total += int(ch.valid.sum())
        else:
            s.ban_end_tokens(logits)  # after the normalizer, as HF's min-length processor after log_softmax
            cand = topk_candidates(s.scores, logits, s.keep, g.per_beam, row_offsets=lse)
            tokens = cand.cols
            result.scanned += cand.scanned
            self.counters.candidates_total += logits.numel()
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
