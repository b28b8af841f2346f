"""``--epd-strategy auto``: the EPD profiler's choice applied by the gateway, from what it measures live.

Every ``refresh_s`` (per model) :class:`EPDChooser` ranks the strategies the live instances allow with the
profiler's model (:func:`xllm.sched.epd.predict`, :func:`~xllm.sched.epd.rank`):

- the layout is the cluster as it stands: its prefill and decode instances (``ep+d`` and ``ed+p`` on them) and,
  when encode instances are live, ``e+p+d`` on all three pools;
- the phase costs are the instances' own measurements: seconds per encoded image from their counters (images
  encoded and the vision tower's seconds, in every heartbeat), prefill and decode step costs from the step-time
  model each instance reports (:class:`~xllm.sched.epd.EPDProfile` ``from_step_model``, the prefill and decode
  instances' models averaged);
- the workload is the one this gateway served in the last ``window_s``: its rate, share of image requests,
  images per such request, prompt and output lengths (:class:`WorkloadWindow`);
- the SLOs are ``--slo-ttft-ms`` / ``--slo-tpot-ms``.

Until the encode time is measured (no image encoded yet), or without prefill and decode instances, it keeps
``ep+d``; without PD, images go to encode instances when any are live. Each change of strategy is logged with
the predictions behind it, and ``xllm:epd_strategy{strategy}`` is 1 for the one in use.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from xllm.gateway.registry import InstanceState
from xllm.gateway.router import Router
from xllm.sched.epd import E_P_D, ED_P, EP_D, STRATEGIES, EPDProfile, EPDStrategy, Layout, WorkloadMix, predict, rank
from xllm.sched.latency import mean_model, predictor_from_report

log = logging.getLogger(__name__)

DECODE_BATCH = 64  # the decode batch the model assumes an instance can run (the engines' default max_num_seqs)


@dataclass(frozen=True)
class _Seen:
    at: float
    images: int
    prompt_tokens: int
    output_tokens: int


class WorkloadWindow:
    """The requests this gateway placed in the last ``window_s`` seconds, as a :class:`WorkloadMix`."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._seen: deque[_Seen] = deque()

    def observe(self, images: int, prompt_tokens: int, output_tokens: int) -> None:
        self._seen.append(_Seen(self.clock(), images, prompt_tokens, output_tokens))

    def mix(self) -> WorkloadMix | None:
        """The window's mix (None: no request in it)."""
        now = self.clock()
        while self._seen and self._seen[0].at < now - self.window_s:
            self._seen.popleft()
        seen = self._seen
        if not seen:
            return None
        with_images = [s for s in seen if s.images]
        span = min(self.window_s, max(now - seen[0].at, 1.0))
        return WorkloadMix(rate=len(seen) / span, image_fraction=len(with_images) / len(seen),
                           images_per_request=sum(s.images for s in with_images) / len(with_images)
                           if with_images else 0.0,
                           prompt_tokens=sum(s.prompt_tokens for s in seen) / len(seen),
                           output_tokens=sum(s.output_tokens for s in seen) / len(seen))


class EPDChooser:
    """Picks the strategy per model (see the module docstring)."""

    def __init__(self, router: Router, slo_ttft_s: float, slo_tpot_s: float, registry: CollectorRegistry | None = None,
                 window_s: float = 60.0, refresh_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.router = router
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.refresh_s = refresh_s
        self.clock = clock
        self.windows: dict[str, WorkloadWindow] = {}
        self._window_s = window_s
        self._chosen: dict[str, tuple[float, EPDStrategy]] = {}  # model -> (when, strategy)
        self.gauge = Gauge("xllm:epd_strategy", "The EPD strategy in use (--epd-strategy auto): 1 for it.",
                           ["model_name", "strategy"], registry=registry or CollectorRegistry())

    def observe(self, model: str, images: int, prompt_tokens: int, output_tokens: int) -> None:
        """A request of ``model`` is being placed: it joins the workload window."""
        window = self.windows.get(model)
        if window is None:
            window = self.windows[model] = WorkloadWindow(self._window_s, self.clock)
        window.observe(images, prompt_tokens, output_tokens)

    def strategy(self, model: str) -> EPDStrategy:
        """The strategy for ``model``'s requests now (re-decided every ``refresh_s``)."""
        now = self.clock()
        got = self._chosen.get(model)
        if got is not None and now - got[0] < self.refresh_s:
            return got[1]
        chosen = self._decide(model)
        if got is None or got[1] is not chosen:
            for s in STRATEGIES:
                self.gauge.labels(model, s.name).set(1 if s is chosen else 0)
        self._chosen[model] = (now, chosen)
        return chosen

    def _decide(self, model: str) -> EPDStrategy:
        live = [s for s in self.router.registry.routable(model) if s.flip is None]
        pools = {role: [s for s in live if s.role == role] for role in ("encode", "prefill", "decode")}
        n_e, n_p, n_d = (len(pools[r]) for r in ("encode", "prefill", "decode"))
        if not (n_p and n_d):
            return E_P_D if n_e else EP_D
        window = self.windows.get(model)
        mix = window.mix() if window is not None else None
        profile = self._profile(live, pools["prefill"] + pools["decode"], mix)
        if mix is None or profile is None:
            return self._chosen.get(model, (0.0, EP_D))[1]
        layouts = [Layout(EP_D, 0, n_p, n_d), Layout(ED_P, 0, n_p, n_d)]
        if n_e:
            layouts.append(Layout(E_P_D, n_e, n_p, n_d))
        ranked = rank([predict(lay, profile, mix, self.slo_ttft_s, self.slo_tpot_s) for lay in layouts])
        best = ranked[0].layout.strategy
        previous = self._chosen.get(model)
        if previous is None or previous[1] is not best:
            log.info("EPD strategy for %s: %s (%s)", model, best.name, "; ".join(
                f"{p.layout}: TTFT {p.ttft_s * 1e3:.0f} ms, TPOT {p.tpot_s * 1e3:.0f} ms"
                f"{'' if p.meets else ', misses'}" for p in ranked))
        return best

    @staticmethod
    def _profile(live: list[InstanceState], pd: list[InstanceState], mix: WorkloadMix | None) -> EPDProfile | None:
        """The phase costs the instances measured (None until an image was encoded and a step model reported)."""
        images = sum(s.counters.images_encoded for s in live if s.counters is not None)
        seconds = sum(s.counters.image_encode_seconds for s in live if s.counters is not None)
        models = [m for s in pd if s.load is not None and (m := predictor_from_report(s.load.step_predictor))]
        if not images or not models or mix is None:
            return None
        budget = max((s.load.step_predictor.token_budget for s in pd if s.load is not None), default=0)
        return EPDProfile.from_step_model(mean_model(models), seconds / images, mix.prompt_tokens, mix.output_tokens,
                                          DECODE_BATCH, budget)
