"""The step-plan codec: what a worker rank needs of a :class:`~xllm.core.model_runner.BatchInputs` to run
the same forward as rank 0, packed as one int64 array (a fixed header, then the fields' values).

Encoded: the packed rows (input ids, positions), the decode context lengths, the prefill chunk starts
and context lengths, the logit rows (sample, prompt-logprob and speculative rows), the address tensors
(slot or page addressing), the counts execute's mode choice reads (sampled sequences, speculative
spans, prompt spans, chunks), the mode rank 0 chose, ``greedy``, and the KV mapping operations rank 0's
backend made since the previous step (:meth:`~xllm.core.kv.xtensor.XTensorKVCache.drain_mappings`).
Decoded, sequence-valued fields are placeholder lists of the right length (a worker never samples).

Rank 0 sends the path its runner takes (:meth:`ModelRunner.path`) and a worker checks that its own is
the same before any collective runs (different paths call different collectives: the ranks would
deadlock). A step carrying beam rows (:mod:`xllm.core.beam_mirror`) has their words last.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from xllm.core.kv.addressing import PageAddress, SlotAddress
from xllm.core.model_runner import BatchInputs

MODES = ("native", "native_verify", "native_step", "compiled", "eager", "overlap")
_MAGIC = 0x584C4C4D_504C414E  # "XLLMPLAN"
_SLOT, _PAGE = 0, 1
# header words
(_H_MAGIC, _H_MODE, _H_GREEDY, _H_ADDR, _H_T, _H_D, _H_P, _H_S, _H_PROMPT, _H_SPEC, _H_SPANS, _H_PSPANS,
 _H_CHUNKS, _H_OPS, _H_WIDTH, _H_BEAMS) = range(16)
HEADER_WORDS = 16
OP_WORDS = 4  # (slot, block, page or -1 to unmap, run)


@dataclass
class StepMessage:
    """A decoded step plan: the batch to execute, the mode rank 0 runs it in, and the KV mapping
    operations to apply first."""

    batch: BatchInputs
    mode: str
    greedy: bool
    kv_ops: np.ndarray  # int64 [n, 4]
    beams: np.ndarray | None = None  # the beam rows riding after the batch's (xllm.core.beam_mirror); None: none


def _ints(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.detach().to("cpu", torch.int64).numpy().reshape(-1)
    return np.asarray(t, dtype=np.int64).reshape(-1)


def encode_step(batch: BatchInputs, mode: str, greedy: bool, kv_ops: np.ndarray | None = None,
                beams: np.ndarray | None = None) -> np.ndarray:
    """``batch`` (and the mode, ``greedy``, KV operations and the words of any beam rows riding after its rows,
    :func:`xllm.core.beam_mirror.encode_beams`) as one int64 array."""
    addr = batch.address
    t, d, p = len(batch.input_ids), batch.num_decode, batch.num_prefill_seqs
    ops = np.zeros((0, OP_WORDS), dtype=np.int64) if kv_ops is None else kv_ops.reshape(-1, OP_WORDS)
    head = np.zeros(HEADER_WORDS, dtype=np.int64)
    head[_H_MAGIC], head[_H_MODE], head[_H_GREEDY] = _MAGIC, MODES.index(mode), int(greedy)
    head[_H_T], head[_H_D], head[_H_P], head[_H_S] = t, d, p, len(batch.sample_rows)
    head[_H_PROMPT], head[_H_SPEC] = len(batch.prompt_rows), len(batch.spec_rows)
    head[_H_SPANS], head[_H_PSPANS], head[_H_CHUNKS] = len(batch.spec_spans), len(batch.prompt_spans), len(batch.chunks)
    head[_H_OPS] = len(ops)
    if len(batch.sample_seqs) != len(batch.sample_rows):
        raise ValueError("encode_step: a batch has one sample row per sampled sequence")
    parts = [head, _ints(batch.input_ids), _ints(batch.positions), _ints(batch.decode_context_lens),
             _ints(batch.prefill_query_starts), _ints(batch.prefill_context_lens), _ints(batch.sample_rows),
             _ints(batch.prompt_rows), _ints(batch.spec_rows)]
    if isinstance(addr, SlotAddress):
        head[_H_ADDR] = _SLOT
        parts += [_ints(addr.token_slots), _ints(addr.decode_slots), _ints(addr.prefill_slots)]
    elif isinstance(addr, PageAddress):
        head[_H_ADDR] = _PAGE
        tables = addr.decode_block_tables
        head[_H_WIDTH] = -1 if tables is None else tables.shape[1]
        parts += [_ints(addr.slot_mapping), np.zeros(0, np.int64) if tables is None else _ints(tables),
                  np.array([len(x) for x in addr.prefill_block_tables], dtype=np.int64)]
        parts += [_ints(x) for x in addr.prefill_block_tables]
    else:
        raise TypeError(f"encode_step: unknown address {type(addr).__name__}")
    parts.append(ops.reshape(-1))
    head[_H_BEAMS] = -1 if beams is None else len(beams)
    if beams is not None:
        parts.append(beams)
    return np.concatenate(parts)


class _Reader:
    def __init__(self, words: np.ndarray, at: int) -> None:
        self.words = words
        self.at = at

    def take(self, n: int) -> np.ndarray:
        out = self.words[self.at:self.at + n]
        if len(out) != n:
            raise ValueError("decode_step: the step plan is truncated")
        self.at += n
        return out

    def tensor(self, n: int, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(self.take(n).copy()).to(device)

    def list(self, n: int) -> list[int]:
        return self.take(n).tolist()


def decode_step(words: np.ndarray, device: torch.device) -> StepMessage:
    """The inverse of :func:`encode_step` (``ValueError`` for anything else)."""
    if len(words) < HEADER_WORDS or int(words[_H_MAGIC]) != _MAGIC:
        raise ValueError("decode_step: not a step plan")
    head = words[:HEADER_WORDS].tolist()
    t, d, p, s = head[_H_T], head[_H_D], head[_H_P], head[_H_S]
    r = _Reader(words, HEADER_WORDS)
    input_ids, positions = r.tensor(t, device), r.tensor(t, device)
    dec_lens = r.tensor(d, device)
    pf_starts, pf_lens = r.list(p + 1), r.list(p)
    sample_rows = r.tensor(s, device)
    prompt_rows, spec_rows = r.list(head[_H_PROMPT]), r.list(head[_H_SPEC])
    address: SlotAddress | PageAddress
    if head[_H_ADDR] == _SLOT:
        address = SlotAddress(token_slots=r.tensor(t, device), decode_slots=r.tensor(d, device),
                              prefill_slots=r.list(p))
    else:
        mapping = r.tensor(t, device)
        width = head[_H_WIDTH]
        tables = None if width < 0 else r.tensor(d * width, device).reshape(d, width)
        lens = r.list(p)
        address = PageAddress(mapping, tables, [r.tensor(n, device) for n in lens])
    ops = r.take(head[_H_OPS] * OP_WORDS).reshape(-1, OP_WORDS).copy()
    beams = None if head[_H_BEAMS] < 0 else r.take(head[_H_BEAMS]).copy()
    if r.at != len(words):
        raise ValueError(f"decode_step: {len(words) - r.at} words left over")
    batch = BatchInputs(
        input_ids=input_ids, positions=positions, num_decode=d, decode_context_lens=dec_lens,
        prefill_query_starts=pf_starts, prefill_context_lens=pf_lens, sample_rows=sample_rows,
        sample_seqs=[None] * s, address=address, prompt_rows=prompt_rows,  # type: ignore[list-item]
        prompt_spans=[(None, 0, 0)] * head[_H_PSPANS], spec_rows=spec_rows,  # type: ignore[list-item]
        spec_spans=[(None, [])] * head[_H_SPANS], chunks=[(None, 0)] * head[_H_CHUNKS])  # type: ignore[list-item]
    return StepMessage(batch, MODES[head[_H_MODE]], bool(head[_H_GREEDY]), ops, beams)


def encode_ops(kv_ops: np.ndarray) -> np.ndarray:
    """KV mapping operations alone (an ``OPS`` message)."""
    return kv_ops.reshape(-1).astype(np.int64, copy=False)


def decode_ops(words: np.ndarray) -> np.ndarray:
    return words.reshape(-1, OP_WORDS).copy()
