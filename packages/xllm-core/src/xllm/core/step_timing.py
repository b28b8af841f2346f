"""The engine's step-time predictor (xLLM §3.1): how long a step of a given shape takes here.

:class:`StepTiming` holds a :class:`xllm.sched.latency.StepTimeModel` fitted from a profile
(``--profile FILE``, written by ``xllm profile``; :func:`load_step_model`) and corrects it online from
the steps this engine actually runs (:class:`xllm.sched.latency.OnlineCorrection`). Without a profile
it fits its own model from its recent steps once it has seen enough of them (after skipping the first
``warmup`` steps, which pay for weight packing and kernel choices), so predictions exist on any engine
after a warm-up; until then :meth:`StepTiming.step_seconds` returns ``None`` and callers must not rely
on it.

**What a step's time is** (what the engine feeds :meth:`StepTiming.observe`, and therefore what a
profile measures, since ``xllm profile`` reads the same observations): with the synchronous engine,
the wall time of ``LLMEngine.step()`` from scheduling to the emitted outputs (schedule, pack,
forward, sampling, detokenization), i.e. the interval a decoding request sees between two tokens;
with ``--async-scheduling``, the forward and sampling on the worker thread (the host work overlaps
the previous step's forward, so the forward is the step's period while the host keeps up).

A step's shape comes from :func:`xllm.sched.latency.step_shape`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from pathlib import Path

from xllm.engine_api.errors import ConfigError
from xllm.proto.registry.v1 import instance_pb2
from xllm.sched.latency import (
    OnlineCorrection,
    PerfProfile,
    StepSample,
    StepShape,
    StepTimeModel,
    fit_step_model,
)


def load_step_model(path: str | Path) -> StepTimeModel:
    """The step model fitted to the profile at ``path`` (``xllm profile`` output). Raises
    :class:`ConfigError` naming the file when it is missing, unreadable, not a profile or too small
    to fit."""
    try:
        return PerfProfile.load(path).fit()
    except FileNotFoundError:
        raise ConfigError(f"--profile {path}: no such file (write one with `xllm profile --output {path}`)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--profile {path}: cannot read it: {exc}") from None
    except (ValueError, KeyError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        what = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ConfigError(f"--profile {path}: not a valid xllm profile ({what})") from None


class StepTiming:
    """Predicts step seconds from a profiled model corrected online, or from a model refitted on this
    engine's own recent steps (``window`` of them, refitted every ``refit_every`` observations once
    ``min_samples`` are kept, the first ``warmup`` steps never kept). Also tracks how good its
    predictions were: :attr:`error` (an exponentially weighted mean of |predicted − measured| /
    measured) and :attr:`last` (the last observed step). Not thread-safe: the engine loop owns it."""

    def __init__(self, model: StepTimeModel | None = None, window: int = 512, refit_every: int = 64,
                 min_samples: int = 32, alpha: float = 0.05, warmup: int = 4) -> None:
        self.profiled = model is not None
        self._alpha = alpha
        self.correction: OnlineCorrection | None = OnlineCorrection(model, alpha) if model is not None else None
        self._recent: deque[StepSample] = deque(maxlen=window)
        self._refit_every, self._min_samples, self._warmup = refit_every, min_samples, warmup
        self._since_fit = 0
        self.observed = 0             # steps observed (all of them, warm-up included)
        self.last: StepSample | None = None
        self.error = 0.0              # EWMA of the relative error of the predictions made (0: none yet)
        self.errors_seen = 0
        # totals over the steps that had a prediction: measured and predicted seconds
        self.measured_seconds = 0.0
        self.predicted_seconds = 0.0
        self.listeners: list[Callable[[StepSample], None]] = []  # hear every observed step (xllm profile)

    @property
    def model(self) -> StepTimeModel | None:
        """The uncorrected model (profiled or self-fitted); None until one exists."""
        return self.correction.model if self.correction is not None else None

    @property
    def factor(self) -> float:
        """Measured over predicted step time (1.0 before any correction)."""
        return self.correction.factor if self.correction is not None else 1.0

    def observe(self, shape: StepShape, seconds: float) -> float | None:
        """Record that a step of ``shape`` took ``seconds``. Returns the relative error
        |predicted − measured| / measured of the prediction there was for it before this observation
        (None: no model yet, or an empty step)."""
        if not shape.num_seqs or seconds <= 0 or not math.isfinite(seconds):
            return None
        self.observed += 1
        self.last = StepSample(shape, seconds)
        for listener in self.listeners:
            listener(self.last)
        predicted = self.step_seconds(shape)
        err = abs(predicted - seconds) / seconds if predicted is not None else None
        if err is not None:
            self.measured_seconds += seconds
            self.predicted_seconds += self.correction.model.step_seconds(shape)  # uncorrected
            self.errors_seen += 1
            self.error += (err - self.error) / min(self.errors_seen, round(1 / self._alpha))
        if self.correction is not None:
            self.correction.observe(shape, seconds)
        if self.profiled or self.observed <= self._warmup:
            return err
        self._recent.append(self.last)
        self._since_fit += 1
        if len(self._recent) >= self._min_samples and (self.correction is None or self._since_fit >= self._refit_every):
            self._since_fit = 0
            self.correction = OnlineCorrection(fit_step_model(list(self._recent)), self._alpha)
        return err

    def step_seconds(self, shape: StepShape) -> float | None:
        """Predicted seconds of a step of ``shape``; ``None`` while no model exists yet."""
        return self.correction.step_seconds(shape) if self.correction is not None else None

    def report(self, token_budget: int = 0) -> instance_pb2.StepTimePredictor:
        """The predictor as the instance's load report carries it (coefficients empty: no model yet), with
        the ``token_budget`` its prefills are chunked by."""
        model = self.model
        return instance_pb2.StepTimePredictor(
            coefficients=list(model.coefficients) if model is not None else [], correction=self.factor,
            profiled=self.profiled, prediction_error=self.error, token_budget=token_budget,
            measured_seconds=self.measured_seconds, predicted_seconds=self.predicted_seconds)

