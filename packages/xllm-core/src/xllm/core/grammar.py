"""Constrained decoding with llguidance: compiled grammars, per-sequence state, token masks.

Contracts:

- :class:`Grammars` is the engine's grammar engine (one per engine, built by the loader from the
  tokenizer's ``tokenizer.json``; an engine without one refuses constrained requests). It compiles a
  request's :class:`~xllm.proto.engine.v1.engine_pb2.StructuredOutput` once per distinct grammar text
  (:meth:`Grammars.compile`: a bounded LRU of compiled matchers, copied per request; any thread — an
  event loop hands it to a worker thread, :meth:`xllm.core.AsyncEngine.submit_async`).
- A sequence's :class:`GrammarState` holds its matcher and how many of its output tokens the matcher
  has consumed. The state follows the sequence's *known output* (``Sequence.all_output_ids()``: a
  resumed request's earlier output, a migration's appended tokens, a PD hand-off's first token,
  everything sampled), caught up lazily right before each mask, so preemption (recompute keeps the
  outputs) and every hand-off path need nothing of their own.
- :meth:`Grammars.begin` is called on the engine thread when a step starts (after the previous
  step's tokens landed, so with async scheduling too): it snapshots each constrained sequence's
  new tokens and computes the masks — on the grammar thread while the forward runs when the engine
  leaves a core free and its native kernels release the GIL (``overlap``, set by the engine: an
  OpenMP team whose cores the grammar thread shares waits at every barrier, and a kernel holding the
  GIL keeps the grammar thread from starting), else right there, before the forward (the default
  configuration: all cores, kernels holding the GIL; 25-40 µs per constrained sequence, one matcher
  after the other on the calling thread: no hand-off to a pool thread, and no torch call, which would
  drop the GIL to the HTTP event loop, before the masks). The sampler
  (:meth:`PendingMasks.apply`) applies the bitmasks to the constrained rows in one native pass. A
  sequence whose grammar has ended may only emit EOS.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import numpy as np
import torch

from xllm.core.sequence import Sequence
from xllm.engine_api.errors import InvalidRequestError
from xllm.engine_api.grammar_spec import grammar_text
from xllm.kernels.sampling import apply_token_bitmask
from xllm.proto.engine.v1 import engine_pb2

log = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256


@dataclass(eq=False)
class GrammarState:
    """One sequence's matcher; ``consumed`` of its output tokens are in it (engine/grammar thread)."""

    matcher: llguidance.LLMatcher
    consumed: int = 0
    failed: str = ""

    def catch_up(self, tokens: list[int]) -> None:
        """Feed the matcher ``tokens`` (the sequence's output after ``consumed``). A token the grammar
        refuses (only a resumed run's earlier output could be one) leaves the state failed."""
        for t in tokens:
            self.consumed += 1
            if self.failed or self.matcher.is_stopped():
                continue  # tokens after the end (EOS, or stop checks trailing by a step) change nothing
            if not self.matcher.consume_token(t):
                self.failed = self.matcher.get_error()[:200] or f"token {t} is not allowed"


@dataclass(eq=False)
class PendingMasks:
    """The masks of one step's constrained rows, being computed (on the grammar thread, or already
    done): llguidance's bitmask, applied by the sampler in one native pass
    (:func:`xllm.kernels.sampling.apply_token_bitmask`: 16-token masked stores of -inf; for 16 rows of
    SmolLM2's 49,152 tokens 0.47 ms with the copy of the logits, against 1.1 ms to expand the bitmask
    into a float mask and add it, measured side by side on a busy machine)."""

    rows: torch.Tensor        # sample rows (of the step's sampled sequences) that are constrained
    bitmask: np.ndarray       # int32 [len(rows), words]: bit t of a row = token t allowed
    future: Future | None = field(default=None, repr=False)

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with every disallowed token of the constrained rows at -inf (a new tensor)."""
        self.wait()
        return apply_token_bitmask(logits, torch.from_numpy(self.bitmask), self.rows)


class Grammars:
    """The engine's grammar engine over one tokenizer (``tokenizer_json``: the text of its
    ``tokenizer.json``); ``vocab_size`` is the width of the model's logits."""

    def __init__(self, tokenizer_json: str, eos_token_ids: frozenset[int], vocab_size: int,
                 cache_size: int = DEFAULT_CACHE_SIZE, overlap: bool = True) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=sorted(eos_token_ids) or None)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.cache_size = cache_size
        self.overlap = overlap  # masks on the grammar thread during the forward (else inline in begin)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xllm-grammar")
        self.hits = 0
        self.misses = 0

    def compile(self, msg: engine_pb2.StructuredOutput) -> llguidance.LLMatcher:
        """The compiled matcher of ``msg``'s grammar, from the cache or compiled into it (milliseconds
        for a large schema: callers on an event loop run this on a worker thread, see
        :meth:`xllm.core.AsyncEngine.submit_async`); :class:`InvalidRequestError` naming ``msg.field``
        if the constraint does not compile. Any thread."""
        text = grammar_text(msg)
        with self._lock:
            compiled = self._cache.get(text)
            if compiled is not None:
                self._cache.move_to_end(text)
                self.hits += 1
                return compiled
        compiled = llguidance.LLMatcher(self.tokenizer, text, log_level=0)  # drops the GIL
        if compiled.is_error():
            raise InvalidRequestError(f"invalid {msg.WhichOneof('constraint').replace('_', ' ')}: "
                                      f"{compiled.get_error()[:500]}", msg.field or "structured")
        with self._lock:
            self.misses += 1
            self._cache[text] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def state(self, msg: engine_pb2.StructuredOutput) -> GrammarState:
        """A fresh state for one request (a copy of the compiled matcher; see :meth:`compile`)."""
        return GrammarState(self.compile(msg).deep_copy())

    def begin(self, seqs: list[Sequence]) -> PendingMasks | None:
        """Start the masks of the constrained sequences among a step's sampled ``seqs`` (row ``i``
        samples ``seqs[i]``); engine thread, once the previous step's tokens have landed."""
        rows: list[int] = []
        work: list[tuple[GrammarState, list[int]]] = []
        for i, seq in enumerate(seqs):
            state = seq.grammar
            if state is None:
                continue
            outputs = seq.all_output_ids()
            rows.append(i)
            work.append((state, outputs[state.consumed:]))
        if not rows:
            return None
        # numpy, not torch, allocations: a torch call drops the GIL, and the HTTP event loop (woken by
        # the previous step's chunks) would take it and hold the engine thread up
        pending = PendingMasks(torch.from_numpy(np.array(rows, dtype=np.int64)),
                               np.zeros((len(rows), self.words), dtype=np.int32))
        if self.overlap:
            pending.future = self._thread.submit(self._compute, work, pending)
        else:
            self._compute(work, pending)
        return pending

    def _compute(self, work: list[tuple[GrammarState, list[int]]], pending: PendingMasks) -> None:
        """Each row's mask, one matcher at a time on this thread (llguidance's ``LLExecutor`` hands
        the batch to a pool thread: with every core in the torch team, waking it cost the engine
        thread ~1 ms per step at batch 16, ten times the masks themselves)."""
        bitmask = pending.bitmask
        row_bytes = self.words * 4
        base = bitmask.ctypes.data
        for k, (state, tokens) in enumerate(work):
            state.catch_up(tokens)
            if state.failed:
                log.warning("constrained output left its grammar (%s): only EOS allowed", state.failed)
                self._eos_only(bitmask[k])
            else:
                state.matcher.unsafe_compute_mask_ptr(base + k * row_bytes, row_bytes)

    def _eos_only(self, row: np.ndarray) -> None:
        row[:] = 0
        as_bytes = row.view(np.uint8)
        for t in self.tokenizer.eos_tokens:
            as_bytes[t // 8] |= 1 << (t % 8)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
