"""Hybrid EPD disaggregation (xLLM §3.3): where a multimodal request's images are encoded, and which split of
instances a workload wants.

A request with images has three phases: encode (the vision tower), prefill, decode. With prefill and decode on
different instances, the encode phase goes to one of three places (:class:`EPDStrategy`):

- ``ep+d``: on the prefill instance, in its own encode phase (:mod:`xllm.sched.encode`); nothing moves.
- ``e+p+d``: on *encode* instances, which only encode; their embeddings go with the request to the prefill
  instance (``EngineService.Encode``).
- ``ed+p``: on the decode instances, between their decode steps; the same hand-off to the prefill instance.

Which one serves a workload best depends on the phases' costs on the served model and the workload's mix:
:func:`predict` models one :class:`Layout` (a strategy and its instance counts) from an :class:`EPDProfile`
(measured phase costs) and a :class:`WorkloadMix`, :func:`choose` ranks every layout of a number of instances
(the EPD profiler's choice). The gateway applies the strategy (``--epd-strategy``, ``auto``: the profiler's
pick); the simulator runs all three with the same code.

The model, per role: utilisation ``rho`` = arrival rate x the role's seconds of work per request / its
instances; a phase's latency is its service time / (1 - rho) (an M/M/1 queue's mean sojourn). Decode
instances batch: a step of ``B`` sequences takes ``decode_base_s + decode_per_seq_s * B``, and ``B`` follows
from Little's law (the tokens per second each decode instance must emit); their ``rho`` is the larger of
``B / max_batch`` and the share of their time the per-sequence cost takes. Encode work on decode instances
(``ed+p``) takes their time between steps, so their steps come ``1 / (1 - encode share)`` as slowly, and a
request's TPOT is taken at the 90th percentile of the encodes its decode life meets (Poisson). A
layout meets the SLOs when every ``rho`` < 1, the predicted TTFT of an image request is within the TTFT target
and the predicted TPOT within the TPOT target. Pure logic, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xllm.sched.latency import StepTimeModel

INF = float("inf")
TAIL_Z = 1.28  # the TPOT the model checks against the SLO is its 90th percentile where encodes interrupt decodes


@dataclass(frozen=True)
class EPDStrategy:
    """Where images are encoded: ``encode_role`` names the instances that encode a request's images before its
    prefill (``"encode"``, ``"decode"``), None: the prefill instance itself, in its encode phase."""

    name: str
    encode_role: str | None
    summary: str


EP_D = EPDStrategy("ep+d", None, "images encoded where the prompt is prefilled (its encode phase)")
E_P_D = EPDStrategy("e+p+d", "encode", "images encoded on encode instances, embeddings handed to prefill")
ED_P = EPDStrategy("ed+p", "decode", "images encoded on decode instances, embeddings handed to prefill")
STRATEGIES = (EP_D, E_P_D, ED_P)


@dataclass(frozen=True)
class EPDProfile:
    """The served model's phase costs on one instance, as measured: ``encode_s`` vision-tower seconds per image,
    ``prefill_s_per_token`` prefill seconds per prompt token, a decode step of ``B`` sequences
    ``decode_base_s + decode_per_seq_s * B`` seconds (at most ``max_batch``), ``handoff_s`` one embedding
    hand-off (encode instance -> gateway -> prefill instance)."""

    encode_s: float
    prefill_s_per_token: float
    decode_base_s: float
    decode_per_seq_s: float
    max_batch: int
    handoff_s: float = 0.0

    @classmethod
    def from_step_model(cls, model: StepTimeModel, encode_s: float, prompt_tokens: float, output_tokens: float,
                        max_batch: int, token_budget: int = 0, handoff_s: float = 0.0) -> EPDProfile:
        """The profile a step-time model (``xllm profile``'s) gives for prompts of ``prompt_tokens`` and
        decodes at the mean context of ``output_tokens`` outputs after them."""
        p = max(int(prompt_tokens), 1)
        ctx = int(prompt_tokens + output_tokens / 2)
        one, two = model.decode_seconds(1, ctx), model.decode_seconds(2, 2 * ctx)
        return cls(encode_s, model.prefill_seconds(p, 0, token_budget) / p, max(2 * one - two, 0.0),
                   max(two - one, 0.0), max_batch, handoff_s)


@dataclass(frozen=True)
class WorkloadMix:
    """A workload: ``rate`` requests/s, of which ``image_fraction`` carry ``images_per_request`` images each;
    ``prompt_tokens`` mean prompt tokens (image tokens included), ``output_tokens`` mean output tokens."""

    rate: float
    image_fraction: float
    images_per_request: float
    prompt_tokens: float
    output_tokens: float


@dataclass(frozen=True)
class Layout:
    """A strategy and its instance counts (``encode`` only with ``e+p+d``)."""

    strategy: EPDStrategy
    encode: int
    prefill: int
    decode: int

    def __str__(self) -> str:
        parts = ([f"{self.encode}E"] if self.encode else []) + [f"{self.prefill}P", f"{self.decode}D"]
        return f"{self.strategy.name} ({' '.join(parts)})"


@dataclass(frozen=True)
class Prediction:
    """:func:`predict`'s answer for one layout: utilisation per role, the image requests' TTFT, the TPOT,
    whether both SLOs are met, and ``headroom``: how far the busiest role is from saturation (1 - its rho)."""

    layout: Layout
    rho: dict[str, float]
    ttft_s: float
    tpot_s: float
    meets: bool

    @property
    def headroom(self) -> float:
        return 1.0 - max(self.rho.values())


def _sojourn(service_s: float, rho: float) -> float:
    return service_s / (1.0 - rho) if rho < 1.0 else INF


def predict(layout: Layout, profile: EPDProfile, mix: WorkloadMix, slo_ttft_s: float, slo_tpot_s: float
            ) -> Prediction:
    """The model of the module docstring for ``layout`` under ``mix``."""
    enc_req = mix.images_per_request * profile.encode_s            # one image request's encode seconds
    enc_work = mix.image_fraction * enc_req                       # per request, on average
    prefill = mix.prompt_tokens * profile.prefill_s_per_token
    name = layout.strategy.name
    rho = {"prefill": mix.rate * (prefill + (enc_work if name == "ep+d" else 0.0)) / layout.prefill}
    share = mix.rate * enc_work / layout.decode if name == "ed+p" else 0.0  # decode time spent encoding
    # decode: B sequences per instance step at (base + k B) / (1 - share) s a step; B from Little's law
    lam = mix.rate * mix.output_tokens / layout.decode            # tokens/s each decode instance must emit
    room = (1.0 - share) - lam * profile.decode_per_seq_s
    batch = lam * profile.decode_base_s / room if room > 0 else INF
    rho["decode"] = max(batch / max(profile.max_batch, 1), 1.0 - room) if room > 0 else INF
    if name == "e+p+d":
        rho["encode"] = mix.rate * enc_work / layout.encode if layout.encode else INF
    if name == "ep+d":
        ttft = _sojourn(enc_req + prefill, rho["prefill"])
    else:
        where = rho["encode"] if name == "e+p+d" else max(share, 0.0)
        ttft = _sojourn(enc_req, where) + profile.handoff_s + _sojourn(prefill, rho["prefill"])
    tpot = (profile.decode_base_s + profile.decode_per_seq_s * batch) / (1.0 - share) if room > 0 else INF
    if share > 0 and tpot < INF and mix.output_tokens > 0:  # the tail: a decode life hit by more encodes than average
        hits = share / profile.encode_s * mix.output_tokens * tpot  # encodes expected on its instance meanwhile
        tpot += TAIL_Z * math.sqrt(hits) * profile.encode_s / mix.output_tokens
    meets = max(rho.values()) < 1.0 and ttft <= slo_ttft_s and tpot <= slo_tpot_s
    return Prediction(layout, rho, ttft, tpot, meets)


def layouts(instances: int, strategies: tuple[EPDStrategy, ...] = STRATEGIES) -> list[Layout]:
    """Every layout of ``instances`` instances (at least one prefill and one decode; ``e+p+d`` at least one
    encode instance too)."""
    out = []
    for s in strategies:
        lowest_e = 1 if s.encode_role == "encode" else 0
        for e in range(lowest_e, instances - 1 if lowest_e else 1):
            for p in range(1, instances - e):
                out.append(Layout(s, e, p, instances - e - p))
    return out


def choose(profile: EPDProfile, mix: WorkloadMix, instances: int, slo_ttft_s: float, slo_tpot_s: float,
           strategies: tuple[EPDStrategy, ...] = STRATEGIES) -> list[Prediction]:
    """Every layout of ``instances`` ranked best first: those meeting the SLOs before the others, then by the
    headroom of their busiest role (the most load growth they absorb), then by predicted TTFT."""
    return rank([predict(lay, profile, mix, slo_ttft_s, slo_tpot_s) for lay in layouts(instances, strategies)])


def rank(predictions: list[Prediction]) -> list[Prediction]:
    """``predictions`` best first (:func:`choose`'s order), e.g. of the layouts a machine can run."""
    return sorted(predictions, key=lambda p: (not p.meets, -p.headroom, p.ttft_s, p.layout.strategy.name))
