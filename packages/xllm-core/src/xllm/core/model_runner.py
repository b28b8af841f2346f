"""Turns a step plan into one model forward: packed inputs, attention over the KV
backend, and the logits of the sequences that sample this step."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch

from xllm.core.images import BatchImages, EncoderCache, batch_images, encode_phase, encode_requests
from xllm.core.kv.addressing import PageAddress, SlotAddress
from xllm.core.kv.contracts import KVTensors
from xllm.core.model_api import (
    AttentionContext,
    CausalLM,
    FusedForward,
    LoraSlots,
    StepTokens,
    SupportsFusedForward,
    SupportsGreedyHead,
)
from xllm.core.overlap import MicroBatch, OverlapChooser, overlap_chooser, split_step
from xllm.core.sequence import Sequence
from xllm.kernels.sampling import argmax_rows
from xllm.proto.engine.v1 import engine_pb2


@dataclass
class BatchInputs:
    """A packed step: decode tokens first (one per sequence), then prefill chunks.

    ``sample_rows[i]`` is the packed row whose hidden state yields the next
    token of ``sample_seqs[i]`` (the last row of a sequence that completes its
    known tokens this step). ``address`` is what the KV backend's addressing
    packed for the step (slots or block tables). ``prompt_rows`` are the prefill rows whose logits a
    prompt-logprobs request needs (``prompt_spans``: per sequence, its first position and row count,
    in row order); the forward returns the logits of :attr:`logit_rows` (sample rows, then those, then
    ``spec_rows``). A speculating sequence (``spec_spans``: the sequence and its drafts, in row order)
    runs as a chunk of its last known token plus its drafts, is not in ``sample_seqs``, and all its
    rows are in ``spec_rows`` (:mod:`xllm.core.spec`). ``lora_slots``: the LoRA adapter slot of every row
    (-1: the base model), None when every row is the base model's (:mod:`xllm.core.lora`). ``images``: the
    M-RoPE positions and image embeddings of a step with image sequences (:mod:`xllm.core.images`), else None.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    num_decode: int
    decode_context_lens: torch.Tensor
    prefill_query_starts: list[int]
    prefill_context_lens: list[int]
    sample_rows: torch.Tensor
    sample_seqs: list[Sequence]
    address: SlotAddress | PageAddress
    prompt_rows: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[Sequence, int, int]] = field(default_factory=list)
    spec_rows: list[int] = field(default_factory=list)
    spec_spans: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    chunks: list[tuple[Sequence, int]] = field(default_factory=list)  # the packed chunks, in row order
    lora_slots: torch.Tensor | None = None
    images: BatchImages | None = None

    @property
    def logit_rows(self) -> torch.Tensor:
        extra = self.prompt_rows + self.spec_rows
        if not extra:
            return self.sample_rows
        return torch.cat([self.sample_rows, torch.tensor(extra, dtype=torch.long, device=self.sample_rows.device)])

    @property
    def needs_logits(self) -> bool:
        return bool(self.sample_seqs or self.prompt_rows or self.spec_rows)

    @property
    def num_prefill_seqs(self) -> int:
        return len(self.prefill_query_starts) - 1


class ExtraRows(Protocol):
    """Rows that ride in a step's forward after its own, with their own attention (the beam rows of
    :mod:`xllm.core.beam`): ``input_ids``/``positions`` ``[R]``, the context their queries attend
    through (it stores their K/V as it likes) and their M-RoPE positions ``[3, R]`` (None: ``positions`` on
    every axis)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    ctx: AttentionContext
    mrope_positions: torch.Tensor | None


class ModelRunner:
    """Runs ``model`` on scheduled chunks with KV from ``kv`` (held as its tensor/addressing contract,
    :class:`~xllm.core.kv.contracts.KVTensors`: the runner never allocates).

    Each step picks its graph mode (xLLM §4.2). With the model's fused native forward
    (:class:`~xllm.core.model_api.SupportsFusedForward`) and a backend with slot rows (model-dtype or
    quantized; ``KVAddressing.fused_steps``): a pure
    decode step of up to ``max_batch`` sequences runs the fused decode kernel ("native"), and so does a
    step of decode rows and speculative verify chunks of up to ``max_batch`` rows in all
    ("native_verify": a verify chunk's rows share its slot at consecutive positions); any
    other step of up to ``max_step_tokens`` tokens the fused general step ("native_step"), all
    unless a caller listens to each layer (``on_layer``). Otherwise a pure decode step takes a
    compiled decode graph covering its batch size (``graph``, see :mod:`xllm.core.graph_runner`)
    and everything else the eager modules. A step carrying extra rows (beam groups) runs them in
    the same eager forward as its own rows ("beams": the fused kernels attend over slots only) when it
    has at most ``share_max_rows`` rows of its own or no fused path; a larger step runs its own rows
    fused and the extra rows in an eager forward after it (the fused general step's speed on
    prefill chunks is worth more than one pass over the weights).

    A tensor-parallel shard may run an eager step of two or more sequences as two interleaved micro-batches
    ("overlap": one's all-reduce in flight while the other computes, :mod:`xllm.core.overlap`) when
    :meth:`set_overlap` armed a chooser (rank 0's; the workers take rank 0's choice from the plan).
    """

    def __init__(self, model: CausalLM, kv: KVTensors, device: torch.device, native_decode: bool = True) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.fused: FusedForward | None = None
        if native_decode and kv.addressing.fused_steps and isinstance(model, SupportsFusedForward):
            self.refresh_fused(initial=True)
        self.graph = None  # a CompiledDecode for larger decode batches (see graph_runner)
        # hears every forward's final hidden states ``[rows, hidden]`` (the ``mtp`` proposer); while
        # set, every step runs eager (the fused and compiled paths return the sampled rows only)
        self.hidden_sink: Callable[[BatchInputs, torch.Tensor], None] | None = None
        self.mode_steps = {"native": 0, "native_verify": 0, "native_step": 0, "compiled": 0, "eager": 0, "beams": 0,
                           "overlap": 0}
        self.greedy_head_steps = 0  # steps whose tokens came from the model's greedy head (no logits)
        self._greedy_head = isinstance(model, SupportsGreedyHead)  # (a protocol check costs ~25 us a step)
        # a step with extra rows shares one eager forward with them up to this many rows of its own;
        # from the quiet step table (docs/performance.md): eager costs more than the fused step, ~10 ms at 16
        # decode rows, ~21 ms at 64, 140 ms at 15 decodes + a 512-token chunk; a forward of the extra rows
        # alone costs one more pass over the weights (~30 ms for SmolLM2)
        self.share_max_rows = 64
        self.overlap: OverlapChooser | None = None  # decides eager vs overlapped steps (set_overlap)
        # the model's LoRA adapter slots (xllm.core.lora sets them): a step with adapter rows gives its rows' slots
        # to the model's projections; it runs fused where the fused forward serves_lora, else eager (the compiled
        # graphs and the overlapped forward know no adapters)
        self.lora: LoraSlots | None = None
        self.encoder_cache = EncoderCache()  # image embeddings by content hash (xllm.core.images)

    def encode(self, seqs: list[Sequence]) -> int:
        """The encode phase of ``seqs``: their images' embeddings into :attr:`encoder_cache` in one batch (on the
        thread that runs the forwards; :func:`xllm.core.images.encode_phase`). Returns the images encoded."""
        with torch.inference_mode():
            return encode_phase(seqs, self.model, self.encoder_cache)

    def forget_encoded(self) -> None:
        """Drop the cached image embeddings (after the weights changed: they were made with the old ones)."""
        self.encoder_cache.clear()

    def encode_requests(self, requests: list[list[engine_pb2.ImageInput]], weights_identity: str) -> list:
        """``Encode`` calls: :func:`xllm.core.images.encode_requests` through :attr:`encoder_cache`."""
        with torch.inference_mode():
            return encode_requests(self.model, self.encoder_cache, requests, weights_identity)

    def set_overlap(self, mode: str) -> None:
        """``--tp-overlap`` ``mode`` (``auto``, ``on``, ``off``): whether eager steps may run overlapped
        (only a model that supports it here, :func:`~xllm.core.overlap.overlap_chooser`)."""
        self.overlap = overlap_chooser(mode, self.model)

    @property
    def native_decode(self) -> bool:
        return self.fused is not None

    @property
    def native_decode_steps(self) -> int:
        return self.mode_steps["native"]

    def step_tokens(self, batch: BatchInputs) -> StepTokens:
        """The packed step as the fused general step reads it (slot addressing only)."""
        addr = batch.address
        nd = batch.num_decode
        starts = list(range(nd + 1)) + [nd + s for s in batch.prefill_query_starts[1:]]
        dev = self.device

        def tensor(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=dev)

        lens = batch.decode_context_lens
        if batch.prefill_context_lens:
            lens = torch.cat([lens, tensor(batch.prefill_context_lens)])
        slots = addr.decode_slots
        if addr.prefill_slots:
            slots = torch.cat([slots, tensor(addr.prefill_slots)])
        return StepTokens(input_ids=batch.input_ids, positions=batch.positions, token_slots=addr.token_slots,
                          seq_starts=tensor(starts), context_lens=lens, seq_slots=slots,
                          sample_rows=batch.logit_rows)

    def prepare(self, chunks: list[tuple[Sequence, int]],
                drafts: dict[Sequence, list[int]] | None = None) -> BatchInputs:
        """Pack ``(seq, num_tokens)`` chunks; decodes must come first. A sequence in ``drafts``
        (speculative decoding) has a chunk of its one last known token plus those drafts."""
        ids: list[int] = []
        pos: list[int] = []
        num_decode = 0
        decode_seqs: list[Sequence] = []
        dec_lens: list[int] = []
        prefill_seqs: list[Sequence] = []
        pf_starts: list[int] = []
        pf_lens: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[Sequence, int, int]] = []
        spec_rows: list[int] = []
        spec_spans: list[tuple[Sequence, list[int]]] = []
        for seq, n in chunks:
            start = seq.num_computed_tokens
            end = start + n
            draft = drafts.get(seq) if drafts else None
            if n == 1 and end == seq.num_tokens and start > 0 and not draft:  # a decode token
                if prefill_seqs:
                    raise ValueError("decode chunks must precede prefill chunks")
                num_decode += 1
                decode_seqs.append(seq)
                dec_lens.append(end)
            else:
                prefill_seqs.append(seq)
                pf_starts.append(len(ids) - num_decode)
                pf_lens.append(end)
            pending = seq.prompt_logprobs_pending
            if pending is not None:  # rows of positions [first, last) predict prompt tokens first+1..last
                first, last = max(start, pending), min(end, seq.num_prompt_tokens - 1)
                if first < last:
                    prompt_rows.extend(range(len(ids) + first - start, len(ids) + last - start))
                    prompt_spans.append((seq, first, last - first))
            if draft:
                spec_rows.extend(range(len(ids), len(ids) + n))
                spec_spans.append((seq, draft))
                ids.extend(seq.token_slice(start, end - len(draft)) + draft)
                pos.extend(range(start, end))
                continue
            ids.extend(seq.token_slice(start, end))
            pos.extend(range(start, end))
            if end == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        pf_starts.append(len(ids) - num_decode)
        dev = self.device
        lora_slots = None
        if any(seq.lora_slot >= 0 for seq, _ in chunks):
            lora_slots = torch.tensor([seq.lora_slot for seq, n in chunks for _ in range(n)], dtype=torch.long,
                                      device=dev)

        def tensor(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=dev)

        return BatchInputs(
            input_ids=tensor(ids), positions=tensor(pos), num_decode=num_decode,
            decode_context_lens=tensor(dec_lens), prefill_query_starts=pf_starts, prefill_context_lens=pf_lens,
            sample_rows=tensor(sample_rows), sample_seqs=sample_seqs,
            address=self.kv.addressing.pack(chunks, decode_seqs, prefill_seqs, tensor),
            prompt_rows=prompt_rows, prompt_spans=prompt_spans, spec_rows=spec_rows, spec_spans=spec_spans,
            chunks=list(chunks), lora_slots=lora_slots,
            images=batch_images(chunks, self.model, self.encoder_cache, dev))

    def refresh_fused(self, initial: bool = False) -> None:
        """Take the model's fused forward again (it is rebuilt after the model's weights changed in place: the old
        one is bound over the old packed copies); a runner that does not run fused stays so (``initial``: the
        first binding, at construction)."""
        if self.fused is None and not initial:
            return
        fused = self.model.fused_forward()  # type: ignore[attr-defined]
        self.fused = fused if fused is not None and fused.supports(self.kv) else None

    def _skinny_verify(self, batch: BatchInputs) -> bool:
        """Whether ``batch`` is decode rows plus speculative verify chunks only (no prompt chunk, no
        prompt-logprob rows) within the decode kernel's row limit."""
        return (bool(batch.spec_spans) and len(batch.spec_spans) == batch.num_prefill_seqs and not batch.prompt_rows
                and len(batch.input_ids) <= self.fused.max_batch)

    def _head(self, hidden: torch.Tensor, greedy: bool) -> torch.Tensor:
        """The logits of ``hidden``'s rows, or with ``greedy`` their argmax (the model's own greedy head
        where it has one: no logits written)."""
        if not greedy:
            return self.model.compute_logits(hidden)
        if self._greedy_head:
            self.greedy_head_steps += 1
            return self.model.compute_greedy(hidden)
        return argmax_rows(self.model.compute_logits(hidden))

    def path(self, batch: BatchInputs, listening: bool = False) -> str:
        """The path :meth:`execute` takes for ``batch`` without extra rows (a key of ``mode_steps``):
        ``native``, ``native_verify`` or ``native_step`` (the fused forward, unless a caller listens to each
        layer, ``listening``, or ``hidden_sink`` is set), ``compiled`` (a pure decode step the graph covers),
        ``overlap`` (an eager step of two or more sequences that :attr:`overlap` chooses to overlap), else
        ``eager``. Tensor-parallel ranks compare it before a step: every rank must take the same one (a
        worker, which has no chooser, takes rank 0's ``overlap`` for its ``eager``). A step with LoRA adapter
        rows (``batch.lora_slots``) runs fused when the fused forward ``serves_lora``, else ``eager``."""
        if batch.images is not None or (batch.lora_slots is not None
                                        and not (self.fused is not None and self.fused.serves_lora)):
            return "eager"  # (M-RoPE and image embeddings: the eager forward only)
        pure_decode = batch.num_decode == len(batch.input_ids)
        if self.fused is not None and not listening and self.hidden_sink is None:
            if pure_decode and batch.num_decode <= self.fused.max_batch:
                return "native"
            if self._skinny_verify(batch):
                return "native_verify"
            if len(batch.input_ids) <= self.fused.max_step_tokens:
                return "native_step"
        if batch.lora_slots is not None:
            return "eager"
        if pure_decode and self.graph is not None and self.hidden_sink is None and self.graph.covers(batch.num_decode):
            return "compiled"
        if (self.overlap is not None and not listening and self.hidden_sink is None
                and batch.num_decode + batch.num_prefill_seqs >= 2
                and self.overlap.choose(len(batch.input_ids)) == "overlap"):
            return "overlap"
        return "eager"

    @torch.inference_mode()
    def execute(self, batch: BatchInputs, on_layer: Callable[[int], None] | None = None,
                extra: ExtraRows | None = None, greedy: bool = False, mode: str | None = None) -> torch.Tensor:
        """Forward the packed batch; float32 logits of :attr:`BatchInputs.logit_rows` (one per sampled
        sequence, then the prompt-logprob rows), ``[rows, vocab]``; with ``greedy``, their argmax instead
        (int64 ``[rows]``, first index on ties: the logits' argmax exactly, not written where the model has
        a greedy head). ``on_layer`` hears each layer's index once the forward stored its KV (such a step
        runs eager). ``extra`` rows join the forward after the batch's (one pass over the weights for
        both); their logits follow the batch's, every row of them (not with ``greedy``). ``mode``: the path
        rank 0 chose (a tensor-parallel worker's; default :meth:`path`'s)."""
        if extra is not None and greedy:
            raise ValueError("execute: extra rows need their logits (greedy is for the batch's rows alone)")
        if extra is not None:
            if (self.fused is None or on_layer is not None or self.hidden_sink is not None
                    or batch.lora_slots is not None or batch.images is not None
                    or len(batch.input_ids) <= self.share_max_rows):
                return self._execute_with(batch, on_layer, extra)
            # fused, then the extra rows in a forward of their own; a tensor-parallel worker runs the same nested
            # call without a chooser, so rank 0's runs without one too (the same path, the same collectives)
            chooser, self.overlap = self.overlap, None
            try:
                own = self.execute(batch)
            finally:
                self.overlap = chooser
            hidden = self.model.forward(extra.input_ids, extra.positions, extra.ctx)
            return torch.cat([own, self.model.compute_logits(hidden)]) if len(own) else \
                self.model.compute_logits(hidden)
        mode = mode or self.path(batch, listening=on_layer is not None)
        self.mode_steps[mode] += 1
        if mode.startswith("native"):
            with self._lora_rows(batch.lora_slots):
                return self._execute_fused(batch, mode, greedy)
        if mode == "compiled":
            logits = self.graph(batch.input_ids, batch.positions, self.kv.addressing.decode_slots(batch))
            return argmax_rows(logits) if greedy else logits
        timed = self.overlap is not None and batch.num_decode + batch.num_prefill_seqs >= 2
        start = self.overlap.clock() if timed else 0.0
        if mode == "overlap":
            hidden = self._forward_overlapped(batch)
        else:
            ctx = self.kv.addressing.context(batch)
            if on_layer is not None:
                ctx = _ReportingContext(ctx, on_layer)
            with self._lora_rows(batch.lora_slots):
                hidden = self.model.forward(batch.input_ids, batch.positions, ctx, **_image_kwargs(batch))
        if self.hidden_sink is not None:
            self.hidden_sink(batch, hidden)
        out = self._head(hidden[batch.logit_rows], greedy) if batch.needs_logits else _no_rows(greedy)
        if timed:
            self.overlap.record(len(batch.input_ids), mode, self.overlap.clock() - start)
        return out

    def _execute_fused(self, batch: BatchInputs, mode: str, greedy: bool) -> torch.Tensor:
        """A step of the fused forward (``mode``: ``native``, ``native_verify`` or ``native_step``)."""
        if mode == "native":
            hidden = self.fused(batch.input_ids, batch.positions, self.kv.addressing.decode_slots(batch), self.kv)
            return self._head(hidden, greedy)
        if mode == "native_verify":
            # decode rows and verify chunks only, few rows: the decode kernel streams the weights
            # once for all of them; a verify chunk's rows share its slot at consecutive positions,
            # which the kernel attends causally. Every row is a logit row, in logit_rows order.
            hidden = self.fused(batch.input_ids, batch.positions, batch.address.token_slots, self.kv)
            return self._head(hidden, greedy)
        if not batch.needs_logits:
            self.fused.step(self.step_tokens(batch), self.kv)
            return _no_rows(greedy)
        return self._head(self.fused.step(self.step_tokens(batch), self.kv), greedy)

    def _lora_rows(self, slots: torch.Tensor | None):
        """The context of a forward whose rows use the adapter slots ``slots`` (None: the base model's)."""
        return nullcontext() if slots is None or self.lora is None else self.lora.rows(slots)

    def _forward_overlapped(self, batch: BatchInputs) -> torch.Tensor:
        """The eager forward of ``batch`` as two micro-batches by whole sequences, each attending through its
        own context, their all-reduces interleaved (:mod:`xllm.core.overlap`)."""
        parts = split_step(batch, batch.input_ids)
        if parts is None:
            raise ValueError("an overlapped step needs two or more sequences")
        return self.model.forward_overlapped(  # type: ignore[attr-defined]
            [MicroBatch(p.input_ids, p.positions, self.kv.addressing.context(p)) for p in parts])

    def _execute_with(self, batch: BatchInputs, on_layer: Callable[[int], None] | None,
                      extra: ExtraRows) -> torch.Tensor:
        self.mode_steps["beams"] += 1
        n = len(batch.input_ids)
        ctx: AttentionContext = _SplitContext(self.kv.addressing.context(batch), n, extra.ctx)
        if on_layer is not None:
            ctx = _ReportingContext(ctx, on_layer)
        slots = batch.lora_slots  # the extra rows (beams) are the base model's
        if slots is not None:
            slots = torch.cat([slots, slots.new_full((len(extra.input_ids),), -1)])
        with self._lora_rows(slots):
            hidden = self.model.forward(torch.cat([batch.input_ids, extra.input_ids]),
                                        torch.cat([batch.positions, extra.positions]), ctx,
                                        **_image_kwargs(batch, extra))
        if self.hidden_sink is not None:
            self.hidden_sink(batch, hidden[:n])
        rows = torch.cat([batch.logit_rows, torch.arange(n, len(hidden), device=batch.logit_rows.device)])
        return self.model.compute_logits(hidden[rows])


def _image_kwargs(batch: BatchInputs, extra: ExtraRows | None = None) -> dict:
    """The forward's image arguments of ``batch`` and the ``extra`` rows after its rows (none when neither has
    images); rows without M-RoPE positions of their own take their plain positions on all three axes."""
    extra_rope = extra.mrope_positions if extra is not None else None
    if batch.images is None and extra_rope is None:
        return {}
    kwargs = batch.images.forward_kwargs() if batch.images is not None else {
        "mrope_positions": batch.positions.expand(3, -1)}
    if extra is not None:
        rope = extra_rope if extra_rope is not None else extra.positions.expand(3, -1)
        kwargs["mrope_positions"] = torch.cat([kwargs["mrope_positions"], rope.to(batch.positions.device)], dim=1)
    return kwargs


def _no_rows(greedy: bool) -> torch.Tensor:
    """What :meth:`ModelRunner.execute` returns for a batch without logit rows."""
    return torch.empty(0, dtype=torch.int64) if greedy else torch.empty(0, 0, dtype=torch.float32)


class _SplitContext:
    """Attention for a forward of a batch's ``n`` rows then extra rows, each part by its own context."""

    def __init__(self, batch: AttentionContext, n: int, extra: AttentionContext) -> None:
        self.batch = batch
        self.n = n
        self.extra = extra

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scale: float,
                  v_dim: int | None = None) -> torch.Tensor:
        n = self.n
        if n == 0:
            return self.extra.attention(layer, q, k, v, scale, v_dim)
        head = self.batch.attention(layer, q[:n], k[:n], None if v is None else v[:n], scale, v_dim)
        tail = self.extra.attention(layer, q[n:], k[n:], None if v is None else v[n:], scale, v_dim)
        return torch.cat([head, tail])


class _ReportingContext:
    """An :class:`AttentionContext` that reports each layer once its KV is stored."""

    def __init__(self, inner: AttentionContext, on_layer: Callable[[int], None]) -> None:
        self.inner = inner
        self.on_layer = on_layer

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scale: float,
                  v_dim: int | None = None) -> torch.Tensor:
        out = self.inner.attention(layer, q, k, v, scale, v_dim)
        self.on_layer(layer)
        return out
