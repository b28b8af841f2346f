"""What clients saw, checked: one row of a fault scenario's table, streams against a reference run
(character diff, greedy near-ties), HTTP status counts and OpenAI error bodies. Shared by the reliability
scenario (:mod:`benchmarks.faults`, :mod:`benchmarks.reliability`), the moves cells
(:mod:`benchmarks.movecells`) and the chaos soak (:mod:`benchmarks.chaos_run`)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xllm.testing.sse import CompletionStream as Stream

if TYPE_CHECKING:
    import httpx

    from xllm.testing.hostile import HostileCase

NEAR_TIE = 1e-3  # a greedy stream may part from its reference where the top-2 logprobs are this close


@dataclass
class Row:
    """One scenario's line of the table (``None``: not measured by this scenario)."""

    scenario: str
    title: str
    cases: int = 0
    answered: int = 0
    c4xx: int = 0
    c5xx: int = 0
    c5xx_all_503: bool = False  # every 5xx was a 503 with Retry-After (the flood's expected refusals)
    lost_chars: int | None = None
    leaked_blocks: int | None = None
    recover_s: float | None = None
    recover_what: str = ""
    problems: list[str] = field(default_factory=list)   # what failed a requirement (empty: passed)
    notes: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


def char_diff(got: str, ref: str) -> tuple[int, int]:
    """(characters of ``ref`` missing from ``got``, characters of ``got`` not in ``ref``) along
    the longest matching blocks (difflib, no junk heuristic)."""
    missing = extra = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, ref, got, autojunk=False).get_opcodes():
        if tag in ("delete", "replace"):
            missing += i2 - i1
        if tag in ("insert", "replace"):
            extra += j2 - j1
    return missing, extra


def near_tie(got: Stream, ref: Stream, tie: float = NEAR_TIE) -> bool:
    """``got`` parts from ``ref`` at a token where the reference's top-2 logprobs are within
    ``tie`` (a float near-tie that recompute may break the other way: not a loss)."""
    j = next((k for k, (a, b) in enumerate(zip(got.tokens, ref.tokens)) if a != b), None)
    if j is None or j >= len(ref.top) or len(ref.top[j]) < 2:
        return False
    best = sorted(ref.top[j].values(), reverse=True)
    return best[0] - best[1] < tie


@dataclass
class Comparison:
    lost: int = 0        # characters missing + extra, over the streams compared
    differing: int = 0   # streams whose text is not the reference's (near-ties excluded)
    ties: int = 0        # greedy streams that parted at a near-tie (not counted as lost)


def compare(got: list[Stream], ref: list[Stream], greedy: list[bool]) -> Comparison:
    """Each stream's text against the reference run's; a greedy stream that parted at a near-tie
    is counted apart, not as lost characters."""
    out = Comparison()
    for g, r, is_greedy in zip(got, ref, greedy, strict=True):
        if g.text == r.text:
            continue
        if is_greedy and near_tie(g, r):
            out.ties += 1
            continue
        missing, extra = char_diff(g.text, r.text)
        out.lost += missing + extra
        out.differing += 1
    return out


def status_counts(answers: list[Stream]) -> tuple[int, int]:
    """(4xx, 5xx) among the answers' HTTP statuses."""
    return (sum(1 for a in answers if a.status is not None and 400 <= a.status < 500),
            sum(1 for a in answers if a.status is not None and a.status >= 500))


def openai_error_problem(status: int, content_type: str, payload, want_status: int, want_param: str | None,
                         want_type: str) -> str | None:
    """What is wrong with an answer that should be an OpenAI error ``{"error": {"message", "type",
    "param", "code"}}`` with ``want_status``, ``want_type`` and ``want_param`` (None: nothing)."""
    if status != want_status:
        return f"HTTP {status}, expected {want_status}"
    if not content_type.startswith("application/json"):
        return f"content-type {content_type!r}"
    if not isinstance(payload, dict) or set(payload) != {"error"} or not isinstance(payload["error"], dict):
        return f"not an OpenAI error body: {str(payload)[:120]}"
    err = payload["error"]
    if set(err) != {"message", "type", "param", "code"} or not isinstance(err["message"], str) or not err["message"]:
        return f"error fields {sorted(err)}"
    if (err["type"], err["param"]) != (want_type, want_param):
        return f"type/param {err['type']}/{err['param']}, expected {want_type}/{want_param}"
    return None


def send_hostile(client: httpx.Client, case: HostileCase) -> tuple[int, str | None]:
    """Send one hostile request (its body as it is, as JSON) and check the answer: its HTTP status and what
    is wrong with it (:func:`openai_error_problem` against the case's expected status, type and param)."""
    r = client.post(case.path, content=case.content(), headers={"content-type": "application/json"})
    try:
        payload = r.json()
    except ValueError:
        payload = None
    return r.status_code, openai_error_problem(r.status_code, r.headers.get("content-type", ""), payload,
                                               case.status, case.param, case.type_)
