"""One cell of the moves benchmark (a prompt length x a way to move) and what it reads, also used by
the reliability benchmark's ``sigterm`` scenario:

- a streaming client that keeps each chunk's arrival time (:class:`TimedStream`), and the pause a
  move shows in a stream (:func:`pause_after`);
- the gateway's move figures from two ``/metrics`` scrapes (:func:`move_figures`);
- the gateway's and the engines' log lines about moves (:func:`decisions`, :func:`migration_lines`);
- the two clusters: ``xllm serve --instances 2 --drain-moves MODE`` and, for ``off``, etcd + two
  ``xllm engine --drain-timeout T`` + one ``xllm serve --etcd`` (:func:`run_cell`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import pathlib
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from benchmarks.clusters import (
    API_KEY,
    HEADERS,
    MODEL,
    WAIT,
    LocalCluster,
    Settings,
    Watch,
    body,
    healthy,
    kv_blocks,
    most_streams,
    share_cluster_token,
    wait_idle,
    wait_until,
)
from benchmarks.metrics import scrape
from benchmarks.stats import percentile
from benchmarks.streamcheck import compare
from xllm.testing.sse import CompletionStream, stream_many

MODES = ("migrate", "recompute", "auto", "off")
HOWS = ("migrated", "recomputed", "migration_failed", "stayed")


# ---- a client that keeps the chunks' arrival times ------------------------------------------------

TimedStream = CompletionStream
"""What the client saw of one stream, with the arrival time of each chunk that carried tokens."""


async def run_timed(base_url: str, bodies: list[dict], action: Callable[[list[TimedStream]], None] | None = None,
                    timeout: float = 600) -> list[TimedStream]:
    """:func:`benchmarks.clusters.run_streams` with longer waits (SmolLM2 prompts of 1536 tokens)."""
    return await stream_many(base_url, bodies, action, timeout, headers=HEADERS, record_http_errors=True,
                             first_timeout=WAIT * 2)


def pause_after(arrivals: list[float], at: float) -> float | None:
    """The largest gap between two successive chunks, the later one after ``at`` (the move's pause
    when ``at`` is the SIGTERM); None when no chunk came after ``at``."""
    gaps = [b - a for a, b in itertools.pairwise(arrivals) if b > at]
    return max(gaps) if gaps else None


def move_index(arrivals: list[float], at: float) -> int | None:
    """The index of the chunk that ends the largest gap after ``at`` (see :func:`pause_after`)."""
    gaps = [(b - a, i + 1) for i, (a, b) in enumerate(itertools.pairwise(arrivals)) if b > at]
    return max(gaps)[1] if gaps else None


def divergence(got: TimedStream, ref: TimedStream) -> dict | None:
    """Where ``got``'s tokens part from ``ref``'s (None: they do not): the token index, the two
    tokens, the reference's top-2 logprob margin there (None: not recorded)."""
    j = next((k for k, (a, b) in enumerate(zip(got.tokens, ref.tokens)) if a != b), None)
    if j is None:
        return None if len(got.tokens) == len(ref.tokens) else {"token": min(len(got.tokens), len(ref.tokens))}
    top = sorted(ref.top[j].values(), reverse=True) if j < len(ref.top) else []
    return {"token": j, "got": got.tokens[j], "ref": ref.tokens[j],
            "margin": top[0] - top[1] if len(top) > 1 else None,
            "got_in_ref_top2": got.tokens[j] in (ref.top[j] if j < len(ref.top) else {}),
            "shift": shifted(got.tokens, ref.tokens, j)}


def shifted(got: list[str], ref: list[str], j: int, max_shift: int = 4, min_tail: int = 4) -> int | None:
    """Whether ``got``, parting from ``ref`` at token ``j``, is ``ref`` with tokens lost (d > 0: the
    d tokens from ``j`` on are missing) or repeated (d < 0) there: the whole rest of one matches the
    other shifted by |d| <= ``max_shift`` (at least ``min_tail`` tokens). None: it is not (it went on
    differently, as a float difference makes it)."""
    n = len(ref)
    for d in range(1, max_shift + 1):
        lost = ref[j + d:]
        if len(lost) >= min_tail and got[j:j + len(lost)] == lost:
            return d
        repeated = ref[j:n - d]
        if len(repeated) >= min_tail and got[j + d:j + d + len(repeated)] == repeated:
            return -d
    return None


def median_gap(streams: list[TimedStream]) -> float | None:
    """The median gap between successive chunks over ``streams`` (seconds)."""
    gaps = [b - a for s in streams for a, b in itertools.pairwise(s.arrivals)]
    return percentile(gaps, 50) if gaps else None


# ---- the gateway's move figures -----------------------------------------------------------------

def _by(samples: dict, name: str, label: str, **where: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for lb, v in samples.get(name, []):
        if all(lb.get(k) == x for k, x in where.items()):
            out[lb.get(label, "")] = out.get(lb.get(label, ""), 0.0) + v
    return out


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(before) | set(after))
            if after.get(k, 0.0) - before.get(k, 0.0)}


@dataclass
class MoveFigures:
    """What the gateway counted between two scrapes: moves by how, KV migrations by outcome (the
    engines' counters, every instance), requests resumed after a failure or hand-back, and per how
    the pause histogram (count, mean in ms, the bucket bound the largest pause is under)."""

    moves: dict[str, float]
    migrations: dict[str, float]
    resumed: float
    pause: dict[str, dict]

    @property
    def moved(self) -> float:
        return self.moves.get("migrated", 0.0) + self.moves.get("recomputed", 0.0)


def move_figures(before: dict, after: dict) -> MoveFigures:
    """:class:`MoveFigures` from two parsed ``/metrics`` (:func:`benchmarks.metrics.parse`)."""
    def d(name: str, label: str, **where: str) -> dict[str, float]:
        return _delta(_by(before, name, label, **where), _by(after, name, label, **where))

    pause = {}
    for how, count in d("xllm:request_move_pause_seconds_count", "how").items():
        total = d("xllm:request_move_pause_seconds_sum", "how").get(how, 0.0)
        buckets = sorted((float(le), n) for le, n in d("xllm:request_move_pause_seconds_bucket", "le", how=how).items())
        under = next((le for le, n in buckets if n >= count), None)
        pause[how] = {"count": count, "mean_ms": 1e3 * total / count,
                      "max_under_ms": None if under is None or under == float("inf") else 1e3 * under}
    resumed = sum(d("xllm:router_resumed_requests_total", "model_name").values())
    return MoveFigures(d("xllm:request_moves_total", "how"), d("xllm:kv_migrations_total", "outcome"), resumed,
                       pause)


def pause_note(pause: dict[str, dict]) -> str:
    """:attr:`MoveFigures.pause` in words."""
    return "; ".join(f"{how} {v['count']:.0f}, mean {v['mean_ms']:.0f} ms, max under {_f(v['max_under_ms'])} ms"
                     for how, v in pause.items()) or "empty"


def moved_pauses_ms(got: list[TimedStream], victim: str, at: float) -> list[float]:
    """The pause (:func:`pause_after`, ms) of each stream that started on ``victim``."""
    return [1e3 * p for g in got if g.instance == victim and (p := pause_after(g.arrivals, at)) is not None]


# ---- the logs -----------------------------------------------------------------------------------

MOVING = re.compile(r"moving (\S+) off (\S+): (\d+) tokens, (\d+) KV bytes; transfer ([\d.]+ ms|unknown) vs "
                    r"recompute ([\d.]+ ms|unknown): (migrating|recomputing)")
MIGRATED = re.compile(r"migrated (\S+) to (\S+) over (\S+): (\d+) bytes, .*?; ([\d.]+) ms in all, ([\d.]+) ms stopped")
STOPPED = re.compile(r"instance (\S+) stopped \((\d+) request\(s\) handed back\)")


def _ms_or_none(text: str) -> float | None:
    return None if text == "unknown" else float(text.split()[0])


def decisions(text: str) -> list[dict]:
    """The gateway's move decisions in a log: tokens, KV bytes, predicted ms each way, the choice."""
    return [{"request": m[1], "source": m[2], "tokens": int(m[3]), "kv_bytes": int(m[4]),
             "transfer_ms": _ms_or_none(m[5]), "recompute_ms": _ms_or_none(m[6]),
             "choice": "migrate" if m[7] == "migrating" else "recompute"} for m in MOVING.finditer(text)]


def migration_lines(text: str) -> list[dict]:
    """The source engines' finished migrations in a log: bytes, ms in all, ms stopped."""
    return [{"request": m[1], "to": m[2], "transport": m[3], "bytes": int(m[4]), "total_ms": float(m[5]),
             "stopped_ms": float(m[6])} for m in MIGRATED.finditer(text)]


def handed_back(text: str, instance: str) -> int | None:
    """How many requests ``instance`` handed back when it stopped (None: no such line)."""
    got = [int(m[2]) for m in STOPPED.finditer(text) if m[1] == instance]
    return got[-1] if got else None


def exited(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (Linux ``/proc``)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


# ---- clusters -----------------------------------------------------------------------------------

class MoveCluster(Protocol):
    """A two-engine cluster of one cell: its gateway's URL, instances, KV blocks per instance (once
    started), an engine's pid, every log of the cell as text."""

    url: str
    instances: set[str]
    blocks: dict[str, int]

    def start(self) -> MoveCluster: ...
    def engine_pid(self, instance: str) -> int: ...
    def log_text(self) -> str: ...
    def stop(self) -> None: ...


@dataclass(frozen=True)
class RunSettings:
    model_dir: pathlib.Path
    out: pathlib.Path
    dtype: str
    kv_cache_memory: float
    streams: int
    output_len: int
    routing: str
    off_drain_timeout: float
    kv_bandwidth_prior: float | None
    seed: int

    def settings(self) -> Settings:
        return Settings(self.model_dir, self.out, self.dtype, self.kv_cache_memory, self.streams, self.seed)


class ServeCluster:
    """``xllm serve --instances 2 --drain-moves MODE`` (engines without prefix cache)."""

    def __init__(self, rs: RunSettings, name: str, mode: str) -> None:
        extra = ["--instances", "2", "--drain-moves", mode, "--routing", rs.routing, "--no-prefix-cache"]
        if rs.kv_bandwidth_prior is not None:
            extra += ["--kv-bandwidth-prior", str(rs.kv_bandwidth_prior)]
        self.local = LocalCluster(rs.settings(), name, extra)

    def start(self) -> ServeCluster:
        self.local.start(2)
        self.url, self.instances, self.blocks = self.local.url, self.local.instances, self.local.blocks
        return self

    def engine_pid(self, instance: str) -> int:
        return self.local.engine_pid(instance)

    def log_text(self) -> str:
        return self.local.log.read_text(errors="replace")

    def stop(self) -> None:
        self.local.stop()


class EtcdDrainCluster:
    """etcd + ``xllm engine --etcd --drain-timeout T`` e0, e1 + one ``xllm serve --etcd`` gateway
    with ``--drain-moves off``: the old behaviour with a drain timeout of our choosing."""

    def __init__(self, rs: RunSettings, name: str) -> None:
        self.rs, self.name = rs, name
        self.logs = rs.out / "logs" / name
        self.etcd = None
        self.engines: dict = {}
        self.gateway = None
        self.instances: set[str] = set()
        self.blocks: dict[str, int] = {}

    @property
    def url(self) -> str:
        return self.gateway.base_url

    def start(self) -> EtcdDrainCluster:
        from benchmarks.peers.venv import ServerProcess, free_port
        from xllm.testing.processes import EtcdServer, spawn

        self.logs.mkdir(parents=True, exist_ok=True)
        share_cluster_token()
        self.etcd = EtcdServer(self.logs / "etcd")
        self.etcd.work.mkdir(parents=True, exist_ok=True)
        self.etcd.start()
        prefix = f"/xllm-moves-{self.name.replace('/', '-')}"
        for iid in ("e0", "e1"):
            cmd = [sys.executable, "-m", "xllm.gateway", "engine", "--instance-id", iid,
                   *self.rs.settings().engine_flags(), "--no-prefix-cache", "--served-model-name", MODEL,
                   "--etcd", self.etcd.endpoint, "--etcd-prefix", prefix,
                   "--drain-timeout", str(self.rs.off_drain_timeout)]
            self.engines[iid] = spawn(cmd, self.logs / f"engine-{iid}.log")
        port = free_port()
        cmd = [sys.executable, "-m", "xllm.gateway", "serve", "--model", str(self.rs.model_dir),
               "--served-model-name", MODEL, "--port", str(port), "--api-key", API_KEY, "--etcd", self.etcd.endpoint,
               "--etcd-prefix", prefix, "--routing", self.rs.routing, "--drain-moves", "off", "--no-progress"]
        self.gateway = ServerProcess("gateway", cmd, port, self.logs / "gateway.log", health_path="/health")
        self.gateway.start(timeout=WAIT)
        self.instances = wait_until(lambda: (h := healthy(self.url)) == {"e0", "e1"} and h, WAIT,
                                    "both engines in the gateway's view")
        self.blocks = kv_blocks(*(self.logs / f"engine-{i}.log" for i in self.engines))
        return self

    def engine_pid(self, instance: str) -> int:
        return self.engines[instance].pid

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.logs.glob("*.log")))

    def stop(self) -> None:
        from xllm.testing.processes import stop_process_group

        if self.gateway is not None:
            with contextlib.suppress(Exception):
                self.gateway.stop()
        for proc in self.engines.values():
            with contextlib.suppress(Exception):
                stop_process_group(proc, 30.0)
        if self.etcd is not None:
            with contextlib.suppress(Exception):
                self.etcd.stop()


# ---- one cell -----------------------------------------------------------------------------------

@dataclass
class Cell:
    """One prompt length x one way to move: what the client and the gateway saw (ms; see
    :mod:`benchmarks.moves`)."""

    context: int
    mode: str
    streams: int
    output_len: int
    victim: str = ""
    on_victim: int = 0
    moves: dict[str, float] = field(default_factory=dict)          # gateway: how -> requests
    migrations: dict[str, float] = field(default_factory=dict)     # engines: outcome -> migrations
    resumed: float = 0.0                                           # gateway: resumed after failure/hand-back
    handed_back: int | None = None                                 # the drained engine's own count
    pauses_ms: list[float] = field(default_factory=list)           # client: per stream on the victim
    bystander_gaps_ms: list[float] = field(default_factory=list)   # client: the same, other streams
    reference_gap_ms: float | None = None                          # client: median gap, uninterrupted run
    gateway_pause: dict[str, dict] = field(default_factory=dict)   # how -> count, mean_ms, max_under_ms
    decisions: list[dict] = field(default_factory=list)            # gateway log: predicted ms, choice
    migrations_logged: list[dict] = field(default_factory=list)    # source engine log: ms in all / stopped
    drain_s: float | None = None                                   # SIGTERM -> the drained engine gone
    complete: int = 0
    differing: int = 0
    lost_chars: int = 0
    near_ties: int = 0
    leaked_blocks: int = 0
    diverged: list[dict] = field(default_factory=list)  # per stream not identical: where it parted, the move
    reference_s: float = 0.0
    fault_to_end_s: float = 0.0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def bodies(prompts: list[list[int]], output_len: int, seed: int) -> tuple[list[dict], list[bool]]:
    """One stream per prompt; greedy and seeded sampled in pairs (0, 1 greedy; 2, 3 sampled; ...),
    so that round robin over two instances gives each a mix."""
    greedy = [(i // 2) % 2 == 0 for i in range(len(prompts))]
    return ([body(i, p, output_len, sampled=not g, seed=1000 + seed) for i, (p, g) in enumerate(zip(prompts, greedy))],
            greedy)


def fill_moves(cell: Cell, got: list[TimedStream], ref: list[TimedStream], greedy: list[bool], at: float,
               figures: MoveFigures) -> None:
    """The client's and the gateway's figures of a fault run at ``at`` on ``cell.victim``."""
    cell.on_victim = sum(1 for g in got if g.instance == cell.victim)
    for g in got:
        gap = pause_after(g.arrivals, at)
        if gap is not None:
            (cell.pauses_ms if g.instance == cell.victim else cell.bystander_gaps_ms).append(1e3 * gap)
    gap = median_gap(ref)
    cell.reference_gap_ms = None if gap is None else 1e3 * gap
    cell.complete = sum(1 for g in got if g.complete(cell.output_len))
    cmp = compare(got, ref, greedy)
    cell.differing, cell.lost_chars, cell.near_ties = cmp.differing, cmp.lost, cmp.ties
    for i, (g, r) in enumerate(zip(got, ref)):
        if g.text != r.text and (where := divergence(g, r)) is not None:
            k = move_index(g.arrivals, at)
            cell.diverged.append({"stream": i, "greedy": greedy[i], "moved": g.instance == cell.victim,
                                  "tokens_before_move": g.counts[k - 1] if k else None, **where})
    cell.moves, cell.migrations, cell.resumed = figures.moves, figures.migrations, figures.resumed
    cell.gateway_pause = figures.pause


def seam_errors(diverged: list[dict]) -> list[dict]:
    """Of a cell's ``diverged`` streams, those that lost or repeated tokens (:func:`shifted`)."""
    return [d for d in diverged if d.get("shift")]


def _check(cell: Cell, exact: bool) -> None:
    """Fill ``cell.problems``. ``exact`` (float32): every text must equal the uninterrupted run's
    (greedy near-ties apart); in bfloat16 a stream's logits depend on what else is in its batch
    (seen on streams that never moved), so only tokens lost or repeated count there."""
    if cell.complete < cell.streams:
        cell.problems.append(f"{cell.streams - cell.complete} streams incomplete")
    if exact and cell.lost_chars:
        cell.problems.append(f"{cell.differing} streams differ from the uninterrupted run ({cell.lost_chars} "
                             f"characters lost or duplicated)")
    if seams := seam_errors(cell.diverged):
        cell.problems.append(f"{len(seams)} streams lost or repeated tokens: " + "; ".join(
            f"stream {d['stream']}: {abs(d['shift'])} {'lost' if d['shift'] > 0 else 'repeated'} at token "
            f"{d['token']}" for d in seams))
    if cell.moves.get("migration_failed") or cell.migrations.get("failed"):
        cell.problems.append(f"migrations failed: {cell.moves.get('migration_failed', 0):.0f} counted by the "
                             f"gateway, {cell.migrations.get('failed', 0):.0f} by the engines")
    if cell.leaked_blocks:
        cell.problems.append(f"{cell.leaked_blocks} KV blocks in use on the surviving engine after the streams")
    if cell.mode == "off":
        if not cell.resumed:
            cell.problems.append("nothing was handed back: every stream finished within the drain timeout")
    elif not (cell.moves.get("migrated", 0) + cell.moves.get("recomputed", 0)):
        cell.problems.append("no stream moved")
    elif cell.mode in ("migrate", "recompute"):
        other = "recomputed" if cell.mode == "migrate" else "migrated"
        if cell.moves.get(other):
            cell.problems.append(f"--drain-moves {cell.mode}, yet {cell.moves[other]:.0f} {other}")


def run_cell(context: int, mode: str, prompts: list[list[int]], rs: RunSettings) -> Cell:
    """Start the cluster of ``mode``, run the streams uninterrupted, then again with a SIGTERM to
    the engine running most of them once each has its first chunk; stop the cluster."""
    name = f"ctx{context}-{mode}"
    cluster: MoveCluster = EtcdDrainCluster(rs, name) if mode == "off" else ServeCluster(rs, name, mode)
    cell = Cell(context, mode, len(prompts), rs.output_len)
    payloads, greedy = bodies(prompts, rs.output_len, rs.seed)
    print(f"[moves] {context}/{mode}: starting the cluster", flush=True)
    try:
        cluster.start()
        t0 = time.monotonic()
        ref = asyncio.run(run_timed(cluster.url, payloads))
        cell.reference_s = time.monotonic() - t0
        print(f"[moves] {context}/{mode}: reference run {cell.reference_s:.1f} s; now with a SIGTERM", flush=True)
        if bad := sum(1 for r in ref if not r.complete(rs.output_len)):
            cell.problems.append(f"the uninterrupted reference run itself had {bad} incomplete streams")
        before = scrape(cluster.url)
        fault: dict = {}

        def term(so_far: list[TimedStream]) -> None:
            victim = most_streams(so_far)
            pid = cluster.engine_pid(victim)
            os.kill(pid, signal.SIGTERM)
            at = time.monotonic()
            fault.update(victim=victim, at=at, exit=Watch(lambda: exited(pid), at, WAIT, 0.02))

        got = asyncio.run(run_timed(cluster.url, payloads, term))
        cell.victim, at = fault["victim"], fault["at"]
        cell.fault_to_end_s = max(g.done_at for g in got) - at
        cell.drain_s = fault["exit"].join()
        survivors = cluster.instances - {cell.victim}
        _, cell.leaked_blocks = wait_idle(cluster.url, survivors, cluster.blocks, {i: 0.0 for i in survivors})
        fill_moves(cell, got, ref, greedy, at, move_figures(before, scrape(cluster.url)))
        text = cluster.log_text()
    finally:
        cluster.stop()
    cell.decisions = decisions(text)
    cell.migrations_logged = migration_lines(text)
    cell.handed_back = handed_back(text, cell.victim)
    _check(cell, exact=rs.dtype == "float32")
    _notes(cell)
    return cell


def _notes(cell: Cell) -> None:
    cell.notes.append(f"{cell.on_victim} of {cell.streams} streams on {cell.victim}; the uninterrupted run took "
                      f"{cell.reference_s:.1f} s, SIGTERM → last stream done {cell.fault_to_end_s:.1f} s"
                      + (f"; {cell.victim} exited {cell.drain_s:.1f} s after the SIGTERM"
                         if cell.drain_s is not None else "")
                      + (f"; {cell.handed_back} handed back at the drain timeout" if cell.handed_back else ""))
    if cell.decisions:
        preds = "; ".join(f"{d['tokens']} tok {d['kv_bytes'] / 2**20:.1f} MiB: transfer {_f(d['transfer_ms'])} vs "
                          f"recompute {_f(d['recompute_ms'])} ms → {d['choice']}" for d in cell.decisions)
        cell.notes.append(f"gateway's predictions: {preds}")
    if cell.migrations_logged:
        stops = sorted(m["stopped_ms"] for m in cell.migrations_logged)
        alls = sorted(m["total_ms"] for m in cell.migrations_logged)
        cell.notes.append(f"source engine: {len(stops)} migrations over {cell.migrations_logged[0]['transport']}, "
                          f"{sum(m['bytes'] for m in cell.migrations_logged) / 2**20:.1f} MiB in all; stopped "
                          f"{percentile(stops, 50):.1f} ms p50 / {stops[-1]:.1f} ms max; copy start → handed off "
                          f"{percentile(alls, 50):.0f} ms p50 / {alls[-1]:.0f} ms max")
    if cell.gateway_pause:
        cell.notes.append(f"gateway's pause histogram: {pause_note(cell.gateway_pause)}")
    if cell.diverged:
        cell.notes.append("streams that parted from the uninterrupted run (token where, tokens received before the "
                          "stream's largest gap after the SIGTERM, the reference's top-2 logprob margin there): "
                          + "; ".join(_parted(d) for d in cell.diverged))
    if cell.near_ties:
        cell.notes.append(f"{cell.near_ties} greedy streams parted from the uninterrupted run at a float near-tie "
                          f"(top-2 logprobs within 1e-3; not counted as lost)")


def _parted(d: dict) -> str:
    margin = "?" if d.get("margin") is None else f"{d['margin']:.3f}"
    shift = "" if not d.get("shift") else f", {abs(d['shift'])} token(s) {'lost' if d['shift'] > 0 else 'repeated'}"
    return (f"#{d['stream']} {'greedy' if d['greedy'] else 'sampled'} {'moved' if d['moved'] else 'not moved'}: "
            f"token {d['token']}, {d['tokens_before_move']} before, margin {margin}{shift}")


def _f(x: float | None) -> str:
    return "?" if x is None else f"{x:.0f}"
