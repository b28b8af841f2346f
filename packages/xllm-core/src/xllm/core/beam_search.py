"""One beam-search request's search state, with Hugging Face ``generate(num_beams=W)`` semantics.

Per step the engine gives :meth:`BeamSearch.advance` the ``keep`` best candidates over live beams x
tokens (:func:`xllm.recsys.beam_topk.topk_candidates`), and the state does what HF's ``_beam_search``
does with its top ``keep = max(2, 1 + #end tokens) x W`` continuations:

- a candidate among the first ``W`` that ends (an end token, or the step that reaches
  ``max_tokens``) becomes a finished hypothesis scored ``sum_logprobs / generated_len **
  length_penalty`` (the end token counted), unless the search already cannot improve or (with
  ``early_stopping=True``) ``W`` hypotheses are finished; the ``W`` best hypotheses are kept;
- the first ``W`` candidates that do not end are the next step's beams;
- the search stops when ``W`` hypotheses are finished and ``early_stopping`` is ``True``, when the
  best running beam cannot beat the worst finished hypothesis (``early_stopping=False``: scored at
  the current length; ``"never"`` with a positive ``length_penalty``: at ``max_tokens``), or at
  ``max_tokens``.

Live beams may be fewer than ``W`` (a catalogue allows fewer continuations): beams with no finite
candidate never exist, so a step computes only real beams. Everything per step is tensor work over
the ``keep`` candidates; the only Python loop is over the (at most ``W``) hypotheses finishing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from xllm.recsys.beam_topk import TopCandidates

EarlyStopping = bool | str  # True, False or "never" (HF's, vLLM's)


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its generated tokens (an ending token included), their summed log-prob and
    its length-penalized score (what ranks hypotheses)."""

    tokens: tuple[int, ...]
    logprob: float
    score: float
    ended: bool  # by an end token (else by max_tokens)
    item: int = -1  # catalogue decoding: the item's node (its sorted row); else -1


@dataclass
class BeamSearch:
    """The search state of one request (see the module docstring). ``end_tokens`` end a beam (EOS,
    stop token ids); an empty set (catalogue decoding) keeps ``W`` candidates per step, else
    ``max(2, 1 + len(end_tokens)) x W`` as HF does."""

    width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    end_tokens: frozenset[int] = frozenset()
    min_tokens: int = 0
    tokens: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 0, dtype=torch.int64))  # [B, t]
    scores: torch.Tensor = field(default_factory=lambda: torch.zeros(1))  # [B] summed log-probs
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    steps: int = 0
    done: bool = False
    stopped_early: bool = False  # done before max_tokens by the heuristic or early_stopping
    _improvable: bool = True

    def __post_init__(self) -> None:
        self._end = torch.tensor(sorted(self.end_tokens), dtype=torch.int64)

    @property
    def keep(self) -> int:
        """Candidates to select per step."""
        return self.width if not self.end_tokens else max(2, 1 + len(self.end_tokens)) * self.width

    @property
    def num_beams(self) -> int:
        return len(self.scores)

    def ban_end_tokens(self, logprobs: torch.Tensor) -> None:
        """Before ``min_tokens`` tokens, end tokens cannot be chosen (HF's min-length processor);
        ``logprobs`` is a full-vocabulary ``[B, V]`` matrix (log-probs or logits), changed in place."""
        if self.steps < self.min_tokens and len(self._end):
            logprobs[:, self._end[self._end < logprobs.shape[1]]] = float("-inf")

    def advance(self, cand: TopCandidates, tokens: torch.Tensor, items: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Apply one step: ``cand`` (best first) with ``tokens[i]`` the token of candidate ``i`` (and
        ``items[i]`` the catalogue node it reaches). Returns the candidates that are the next step's
        beams, best first (int64 indices into ``cand``; their parents are ``cand.beams[...]``; empty
        once done)."""
        t = self.steps + 1  # generated length once this step's token is appended
        last = t >= self.max_tokens
        m = len(tokens)
        ends = torch.isin(tokens, self._end) if len(self._end) else torch.zeros(m, dtype=torch.bool)
        stop = torch.ones(m, dtype=torch.bool) if last else ends
        full = len(self.finished) >= self.width
        if self._improvable and not (full and self.early_stopping is True):
            new = torch.nonzero(stop[:self.width]).flatten().tolist()
            if new:
                penalty = float(t) ** self.length_penalty
                for i in new:
                    seq = (*tuple(self.tokens[int(cand.beams[i])].tolist()), int(tokens[i]))
                    lp = float(cand.scores[i])
                    item = int(items[i]) if items is not None else -1
                    self.finished.append(Hypothesis(seq, lp, lp / penalty, bool(ends[i]), item))
                self.finished.sort(key=lambda h: -h.score)
                del self.finished[self.width:]
        running = torch.nonzero(~stop).flatten()[:self.width]
        parents = cand.beams[running]
        self.tokens = torch.cat([self.tokens[parents], tokens[running, None]], dim=1)
        self.scores = cand.scores[running]
        self.steps = t
        if len(running) and len(self.finished) >= self.width:
            best_len = self.max_tokens if self.early_stopping == "never" and self.length_penalty > 0 else t
            best = float(self.scores[0]) / float(best_len) ** self.length_penalty
            self._improvable = self._improvable and best > self.finished[-1].score
        all_done = len(self.finished) >= self.width and self.early_stopping is True
        self.done = last or not len(running) or not self._improvable or all_done
        self.stopped_early = self.done and not last and bool(len(running))
        return running if not self.done else running[:0]

    def results(self) -> list[Hypothesis]:
        """The finished hypotheses, best first (call once :attr:`done`)."""
        return list(self.finished)
