"""Multi-token prediction (``--speculative mtp``): DeepSeek-V3's next-token-prediction layer drafts
from the target's own hidden states (:class:`~xllm.core.spec.base.MTPLayer`; the model is loaded
with it: ``load_model(..., mtp=True)``).

MTP position ``i`` reads the target's token ``i + 1`` and its final hidden state ``h_i`` and
predicts token ``i + 2``, so the shadow sequence (:mod:`xllm.core.spec.shadow`) is the target's
tokens from index 1 on (``shift`` = 1). Where the MTP stands:

- **target hidden states**: the target's model runner hands every forward's final hidden states to
  :meth:`MTPProposer.on_target_hidden` (``ModelRunner.hidden_sink``, set only with this proposer:
  no cost otherwise; such steps run the eager path), kept per sequence and position
  (:class:`HiddenRows`) until the MTP's catch-up has read them. A position the target never
  computed in this engine (a prefix-cache hit) enters the MTP with a zero hidden state: the drafts
  stay deterministic, acceptance falls there.
- **catch-up** (chunked, as for every shadow drafter): positions up to the target's last computed
  one, each from ``h_i``; their MTP KV is *exact* and kept while the tokens agree;
- **chaining** (k > 1, as vLLM does with one MTP layer): draft ``j + 1`` runs the same layer at the
  next position on draft ``j`` and the layer's own output hidden state in place of the target's.
  Those positions' KV is not the target-fed one, so it is dropped at the next sync and recomputed
  from the target's hidden states once the target has computed them (:meth:`valid_computed`).
  Acceptance falls with depth; the speculator's adaptive ``k`` follows it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xllm.core.model_api import AttentionContext, KVCacheSpec
from xllm.core.model_runner import BatchInputs
from xllm.core.sequence import SeqStatus, Sequence
from xllm.core.spec.base import MTPLayer, ProposerContext, SupportsMTP
from xllm.core.spec.shadow import TAIL, ShadowDrafter
from xllm.engine_api.errors import ConfigError


@dataclass
class HiddenRows:
    """One sequence's target hidden states by position: rows for positions ``[base, base + len)``
    (positions never written read as zeros); a later write of a position replaces the earlier one
    (a rejected draft's row is recomputed with the accepted token)."""

    base: int = 0
    rows: torch.Tensor | None = None
    end: int = 0  # one past the highest position written

    def put(self, first: int, hidden: torch.Tensor) -> None:
        if first < self.base:
            hidden, first = hidden[self.base - first:], self.base
        n = hidden.shape[0]
        if n < 1:
            return
        need = first + n - self.base
        if self.rows is None or self.rows.shape[0] < need:
            size = max(need, 2 * (0 if self.rows is None else self.rows.shape[0]), 16)
            grown = hidden.new_zeros(size, hidden.shape[1])
            if self.rows is not None:
                grown[:self.rows.shape[0]] = self.rows
            self.rows = grown
        self.rows[first - self.base:first - self.base + n] = hidden
        self.end = max(self.end, first + n)

    def get(self, first: int, last: int, like: torch.Tensor) -> torch.Tensor:
        """Rows of positions ``[first, last)`` (zeros where none was written), like ``like``."""
        out = like.new_zeros(last - first, like.shape[-1])
        lo, hi = max(first, self.base), min(last, self.end)
        if self.rows is not None and lo < hi:
            out[lo - first:hi - first] = self.rows[lo - self.base:hi - self.base]
        return out

    def drop_below(self, position: int) -> None:
        """Forget positions below ``position`` (read already), compacting once half is dead."""
        if self.rows is None or position - self.base <= self.rows.shape[0] // 2:
            return
        cut = min(position - self.base, self.rows.shape[0])
        self.rows = self.rows[cut:].clone()
        self.base += cut


class _MTPModel:
    """The :class:`~xllm.core.model_api.CausalLM` face of an MTP layer for a model runner: each
    forward reads ``previous`` (the hidden-state input of every packed row, set by the proposer just
    before) and leaves its output hidden states in ``output``."""

    def __init__(self, layer: MTPLayer) -> None:
        self.layer = layer
        self.max_context_len = layer.max_context_len
        self.vocab_size = layer.vocab_size
        self.previous: torch.Tensor | None = None
        self.output: torch.Tensor | None = None

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.layer.kv_cache_spec()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        self.output = self.layer.forward(input_ids, positions, self.previous, ctx)
        return self.output

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer.compute_logits(hidden)


class MTPProposer(ShadowDrafter):
    """:class:`~xllm.core.spec.base.Proposer` running the target's first MTP layer."""

    shift = 1

    def __init__(self, ctx: ProposerContext, catchup_tokens: int | None = None) -> None:
        target = ctx.target
        layers = target.mtp_layers() if isinstance(target, SupportsMTP) else []
        if not layers:
            raise ConfigError(f"--speculative mtp: the served model ({type(target).__name__}) has no "
                              "multi-token-prediction layers loaded (DeepSeek-V3 checkpoints with "
                              "num_nextn_predict_layers > 0, loaded with mtp=True)")
        self.mtp = _MTPModel(layers[0])
        super().__init__(ctx, self.mtp, catchup_tokens=catchup_tokens)  # type: ignore[arg-type]
        self._hidden: dict[Sequence, HiddenRows] = {}      # target -> its hidden states not yet read
        self._exact: dict[Sequence, int] = {}              # shadow -> positions computed from them
        self._last: dict[Sequence, torch.Tensor] = {}      # shadow -> the MTP's output at its last row
        self._like: torch.Tensor | None = None             # an empty row of the target's hidden states

    # ---- the target's hidden states -----------------------------------------------------------
    def on_target_hidden(self, batch: BatchInputs, hidden: torch.Tensor) -> None:
        """The target's forward over ``batch`` produced final hidden states ``hidden`` (every row)."""
        positions = batch.positions.tolist()
        self._like = hidden[:0]
        row = 0
        for seq, n in batch.chunks:
            rows = self._hidden.get(seq)
            if rows is None:
                rows = self._hidden[seq] = HiddenRows()
            rows.put(positions[row], hidden[row:row + n])
            row += n
        done = [seq for seq in self._hidden if seq.status is SeqStatus.FINISHED and seq not in self._shadows]
        for seq in done:  # sequences that never speculated (the speculator releases the others)
            del self._hidden[seq]

    # ---- ShadowDrafter ------------------------------------------------------------------------
    def valid_computed(self, seq: Sequence, shadow: Sequence) -> int:
        return self._exact.get(shadow, 0)

    def run(self, batch: BatchInputs, chunks: list[tuple[Sequence, int]], first: bool) -> torch.Tensor:
        if self._like is None:
            raise RuntimeError("the mtp proposer drafts from the target's hidden states: the target's model "
                               "runner must hand them over (ModelRunner.hidden_sink)")
        inputs = []
        for shadow, n in chunks:
            start = shadow.num_computed_tokens
            if first:
                rows = self._hidden.get(self._target[shadow])
                if rows is None:
                    rows = self._hidden[self._target[shadow]] = HiddenRows()
                inputs.append(rows.get(start, start + n, self._like))
                self._exact[shadow] = start + n
                rows.drop_below(start + n - TAIL)
            else:
                inputs.append(self._last[shadow])
        self.mtp.previous = torch.cat(inputs)
        logits = self.runner.execute(batch)
        out = self.mtp.output
        row = 0
        for shadow, n in chunks:
            row += n
            self._last[shadow] = out[row - 1:row]
        self.mtp.previous = self.mtp.output = None
        return logits

    def forget(self, shadow: Sequence) -> None:
        self._exact.pop(shadow, None)
        self._last.pop(shadow, None)

    def release(self, seq: Sequence) -> None:
        super().release(seq)
        self._hidden.pop(seq, None)

    def close(self) -> None:
        super().close()
        self._hidden.clear()
