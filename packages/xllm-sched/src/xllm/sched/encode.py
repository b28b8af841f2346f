"""The encode phase of multimodal requests inside an engine's steps (xLLM §3.3, "optimized batch processing").

A request with images is in its *encode phase* until the engine has computed its images' embeddings
(``encode_pending`` > 0 on the sequence: images still to encode). With the phase on (``max_encode_images`` > 0
in :class:`~xllm.sched.batch_policy.BatchSettings`) the batch policies schedule three phases per step:

1. the running decodes, then the running sequences' unfinished prefill chunks (as without images);
2. admissions to prefill, under the token budget, of waiting sequences that are *ready*: text-only ones and
   those whose encode phase is done (a sequence in its encode phase is passed over, not waited for);
3. only when no running sequence was mid-prefill at the start of the step, the encode phase of new requests
   (:func:`encodes_for_step`): waiting sequences with images to encode, in queue order (online before
   offline), up to ``max_encode_images`` images per step and no more sequences than there are free slots.

So the prompts already in prefill finish first (their TTFT), and an image is encoded in a step of its own, in
a batch whose size is bounded. The bound comes from a start-up profile (:func:`largest_within`: the largest
batch whose measured encode time stays within the share of the TPOT target the engine gives encoding), or
from ``--max-encode-images``.

With the phase off (``max_encode_images`` = 0), images are encoded inside the prefill chunk that first needs
them, and ``encode_pending`` is never read.

Pure logic, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

DEFAULT_MAX_ENCODE_IMAGES = 1
"""Images encoded per step when no TPOT target sets the bound by profile (``--max-encode-images``). Measured, not
guessed (``python -m benchmarks multimodal``, docs/performance.md): on 2 CPU cores one image per step cut the
longest decode-carrying step by a third and text TTFT p90 by 14-50 % against the phase off in both workload
seeds, image TTFT unchanged; four per step was the best in one seed and the worst in the other."""
ENCODE_SLO_SHARE = 0.5
"""The share of the TPOT target a step's encode batch may take in the start-up profile (the rest is the
language model's step: decodes and the prefill admitted beside it)."""


class EncodingSeq(Protocol):
    """What the encode phase reads of a sequence."""

    @property
    def encode_pending(self) -> int: ...  # images still to encode before its prefill (0: none, or done)

    @property
    def offline(self) -> bool: ...


def encodes_for_step(waiting: Sequence[EncodingSeq], max_images: int, free_slots: int) -> list[EncodingSeq]:
    """The waiting sequences whose images this step encodes: those with ``encode_pending``, online before
    offline, each in queue order, while their images total at most ``max_images`` (the first one is taken
    whatever its count, so a request with more images than the bound is encoded alone rather than never) and
    no more than ``free_slots`` sequences (an encoded request waits for a slot; encoding more than can be
    admitted only fills the encoder cache)."""
    if max_images < 1 or free_slots < 1:
        return []
    out: list[EncodingSeq] = []
    images = 0
    for seq in [*(s for s in waiting if not s.offline), *(s for s in waiting if s.offline)]:
        n = seq.encode_pending
        if n < 1:
            continue
        if out and images + n > max_images:
            break
        out.append(seq)
        images += n
        if images >= max_images or len(out) >= free_slots:
            break
    return out


def largest_within(measure: Callable[[int], float], limit_s: float, max_k: int) -> int:
    """The largest ``k`` in 1..``max_k`` with ``measure(k)`` ≤ ``limit_s``, by binary search over a ``measure``
    that does not decrease with ``k`` (the encode time of a batch of ``k`` images); 1 when even one image takes
    longer (a step must encode something). Calls ``measure`` O(log ``max_k``) times."""
    if max_k < 1:
        raise ValueError(f"max_k must be >= 1, got {max_k}")
    if measure(1) > limit_s:
        return 1
    lo, hi = 1, max_k + 1  # measure(lo) within the limit; hi beyond the range or over it
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if measure(mid) <= limit_s:
            lo = mid
        else:
            hi = mid
    return lo
