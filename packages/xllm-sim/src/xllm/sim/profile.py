"""Step-time profiles for the simulator: the shipped default and the provisional synthetic one.

The default (``profiles/default.json``) is a :class:`xllm.sched.latency.PerfProfile` as ``xllm
profile`` writes it, measured on this project's machine; the simulator fits its
:class:`~xllm.sched.latency.StepTimeModel` from it. :func:`provisional_profile` makes a stand-in
from a hand-set model with plausible numbers for SmolLM2-135M in bf16 on 2 cores (a decode step of
16 sequences ~20 ms, of 64 ~70 ms, a 512-token prefill chunk ~250 ms); its JSON says so in
``machine`` and ``note``. It is used only until a measured profile replaces the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from xllm.sched.latency import PerfProfile, StepSample, StepShape, StepTimeModel

DEFAULT_PROFILE = Path(__file__).resolve().parent / "profiles" / "default.json"
PROVISIONAL_COEFFICIENTS = (0.004, 0.0004, 3.1e-7, 2.0e-7, 0.0005)  # const, tokens, prefill attn, decode ctx, seqs
PROVISIONAL_NOTE = ("PROVISIONAL: synthetic, not measured. Samples generated from the hand-set StepTimeModel "
                    f"{PROVISIONAL_COEFFICIENTS} (const, tokens, prefill_attention, decode_context, num_seqs) "
                    "with plausible SmolLM2-135M bf16 numbers on 2 cores; replace with `xllm profile` output.")


def provisional_profile() -> PerfProfile:
    """A profile whose samples lie exactly on the provisional model (decode batches 1..64 at several
    contexts, prefill chunks of 32..2048 tokens over cached prefixes, mixed steps)."""
    model = StepTimeModel(PROVISIONAL_COEFFICIENTS)
    shapes: list[StepShape] = []
    for batch in (1, 2, 4, 8, 16, 32, 64):
        for ctx in (128, 512, 1024):
            shapes.append(StepShape((ctx,) * batch))
    for chunk in (32, 128, 256, 512, 1024, 2048):
        for cached in (0, 512, 1536):
            shapes.append(StepShape((), ((cached, chunk),)))
    for batch, chunk in ((8, 256), (16, 480), (32, 256)):
        shapes.append(StepShape((512,) * batch, ((0, chunk),)))
    samples = [StepSample(s, model.step_seconds(s)) for s in shapes]
    return PerfProfile(model="SmolLM2-135M-Instruct", dtype="bfloat16", threads=2,
                       machine="provisional-synthetic (not measured)", token_budget=512, samples=samples)


def write_provisional(path: str | Path = DEFAULT_PROFILE) -> None:
    """Write :func:`provisional_profile` with its note (the ``provisional`` and ``note`` keys are
    extra: ``PerfProfile.load`` ignores them)."""
    data = json.loads(provisional_profile().to_json())
    data["provisional"] = True
    data["note"] = PROVISIONAL_NOTE
    Path(path).write_text(json.dumps(data, indent=1))


def load_model(path: str | Path | None = None) -> tuple[StepTimeModel, PerfProfile]:
    """The step-time model fitted from the profile at ``path`` (default: the shipped one)."""
    profile = PerfProfile.load(path or DEFAULT_PROFILE)
    return profile.fit(), profile


def is_provisional(path: str | Path | None = None) -> bool:
    return bool(json.loads(Path(path or DEFAULT_PROFILE).read_text()).get("provisional", False))
