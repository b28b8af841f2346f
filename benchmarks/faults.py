"""The reliability benchmark's scenarios: each injects one fault into a running cluster and returns
its :class:`~benchmarks.streamcheck.Row`.

Three clusters, started only when one of their scenarios is picked, scenarios in this order (the
destructive ones last on their cluster: ``xllm serve --instances N`` does not restart a killed
engine):

- ``xllm serve --instances 2`` (max 128 sequences per engine): ``streams``, ``hostile``,
  ``disconnect``, ``kill9``;
- ``xllm serve --instances 1 --max-inflight-requests 16`` with an engine of 4 sequences and a queue
  of 4 (``--max-waiting``): ``flood``;
- etcd + ``xllm engine`` e0, e1 (``--drain-timeout 1``) + two ``xllm serve --etcd`` gateways
  (round robin, watch timeout 2 s): ``etcd``, ``gateway``, ``sigterm``.

Texts are compared with a reference run of the same requests on the same cluster just before the
fault (float32 engines; seeded sampling draws from a generator keyed by (seed, output index), so a
resumed sampled stream must match too).
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import time
import uuid
from collections.abc import Callable

import httpx

from benchmarks.clusters import (
    DRAIN_TIMEOUT,
    HEADERS,
    LEASE_TTL,
    MODEL,
    WAIT,
    EtcdCluster,
    LocalCluster,
    Settings,
    body,
    client,
    counter,
    gone_watch,
    healthy,
    kv_baseline,
    loads,
    most_streams,
    rss_mib,
    run_streams,
    stream,
    wait_idle,
    wait_until,
    watch_up,
)
from benchmarks.metrics import scrape
from benchmarks.movecells import move_figures, moved_pauses_ms, pause_note, run_timed
from benchmarks.streamcheck import Row, compare, send_hostile, status_counts
from xllm.testing import hostile

STREAM_TOKENS = 32      # streams: output tokens of each of the 256 streams
FAULT_STREAMS = 32      # kill9 and sigterm: streams in flight at the fault
KILL_TOKENS = 64        # kill9: output tokens per stream
DRAIN_TOKENS = 240      # sigterm: long enough to outlast the 1 s drain
DISCONNECTS = 20
GATEWAY_STREAMS = 6     # per gateway
GATEWAY_TOKENS = 200
ETCD_DOWN_S = 5.0       # etcd: how long it stays down (> the engines' lease TTL and the watch timeout)
FLOOD_INFLIGHT = 16     # the gateway's --max-inflight-requests
FLOOD_WAVES = 3


def _prompts(tag: str, n: int) -> list[str]:
    """``n`` prompts that share no prefix (independent clients: no prefix cache pulls them together)."""
    return [f"{uuid.uuid4().hex[:8]} {tag} {i}: once upon a time" for i in range(n)]


def _mixed_bodies(prompts: list[str], max_tokens: int, seed: int) -> tuple[list[dict], list[bool]]:
    """Half greedy (even), half seeded sampled (odd) streams; and which are greedy."""
    bodies = [body(i, p, max_tokens, sampled=bool(i % 2), seed=1000 + seed) for i, p in enumerate(prompts)]
    return bodies, [i % 2 == 0 for i in range(len(prompts))]


def _check_reference(row: Row, ref: list, max_tokens: int) -> bool:
    bad = sum(1 for r in ref if not r.complete(max_tokens))
    if bad:
        row.problems.append(f"the uninterrupted reference run itself had {bad} incomplete streams")
    return not bad


# ---- on xllm serve --instances 2 ----------------------------------------------------------------

def streams(cl: LocalCluster, s: Settings) -> Row:
    row = Row("streams", f"{s.streams} concurrent streams, --instances 2")
    bodies = [body(i, p, STREAM_TOKENS, logprobs=False) for i, p in enumerate(_prompts("Stream", s.streams))]
    baseline = kv_baseline(cl.url, cl.instances)
    peak = {"busy": 0.0}
    done = asyncio.Event()

    async def watch_load() -> None:  # the most requests the engines held at once, as /metrics saw it
        while not done.is_set():
            try:
                ld = await asyncio.to_thread(loads, cl.url, cl.instances)
                peak["busy"] = max(peak["busy"], sum(x.running + x.waiting for x in ld.values()))
            except (OSError, ValueError, httpx.HTTPError):
                pass
            await asyncio.sleep(0.2)

    async def run() -> list:
        watcher = asyncio.ensure_future(watch_load())
        try:
            return await run_streams(cl.url, bodies)
        finally:
            done.set()
            await watcher

    t0 = time.monotonic()
    got = asyncio.run(run())
    took = time.monotonic() - t0
    row.cases = len(got)
    row.answered = sum(1 for g in got if g.complete(STREAM_TOKENS))
    row.c4xx, row.c5xx = status_counts(got)
    _, row.leaked_blocks = wait_idle(cl.url, cl.instances, cl.blocks, baseline)
    by_instance = collections.Counter(g.instance for g in got)
    row.notes.append(f"all {len(got)} opened at once, {STREAM_TOKENS} tokens each; done in {took:.1f} s; at most "
                     f"{peak['busy']:.0f} running + waiting in the engines at one heartbeat; per instance "
                     f"{dict(sorted(by_instance.items(), key=str))}")
    if row.answered < row.cases:
        row.problems.append(f"{row.cases - row.answered} streams incomplete: "
                            f"{[(g.status, g.errors[:1], g.finish) for g in got if not g.complete(STREAM_TOKENS)][:3]}")
    if row.leaked_blocks:
        row.problems.append(f"{row.leaked_blocks} KV blocks still in use after the streams ended")
    return row


def hostile_requests(cl: LocalCluster, s: Settings) -> Row:
    row = Row("hostile", f"{len(hostile.CASES)} malformed or abusive requests")
    health_failures = []
    with httpx.Client(base_url=cl.url, timeout=60, trust_env=False, headers=HEADERS) as h:
        for case in hostile.CASES:
            status, problem = send_hostile(h, case)
            row.cases += 1
            if 400 <= status < 500:
                row.c4xx += 1
            elif status >= 500:
                row.c5xx += 1
            health = h.get("/health").status_code
            if health != 200:
                health_failures.append(f"{case.name}: /health {health}")
            if problem is None and health == 200:
                row.answered += 1
            elif problem is not None:
                row.problems.append(f"{case.name}: {problem}")
        after = h.post("/v1/chat/completions", json=hostile.chat(max_tokens=4, temperature=0, ignore_eos=True))
    row.problems += health_failures
    if after.status_code != 200:
        row.problems.append(f"a valid request after them got {after.status_code}: {after.text[:200]}")
    row.notes.append(f"each answered with the expected status and an OpenAI error body naming the field, /health 200 "
                     f"after each, a valid request served after all: {'yes' if not row.problems else 'no'}")
    return row


def disconnect(cl: LocalCluster, s: Settings) -> Row:
    row = Row("disconnect", f"{DISCONNECTS} clients leave mid-stream")
    max_tokens = 1900  # near the context limit (2048): only an abort ends these soon
    baseline = kv_baseline(cl.url, cl.instances)
    generated0 = counter(cl.url, "xllm:generation_tokens_total")

    async def run() -> list:
        read = [asyncio.Event() for _ in range(DISCONNECTS)]
        leave = asyncio.Event()

        async def one(i: int, prompt: str):
            async with client(cl.url) as c:
                return await stream(c, body(i, prompt, max_tokens, logprobs=False), read[i], read_chunks=3,
                                    leave=leave)

        tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(_prompts("Leave", DISCONNECTS))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in read)), WAIT)
        # leave once a heartbeat shows them running: the idle state seen afterwards is newer than that
        await asyncio.to_thread(wait_until, lambda: sum(x.running + x.waiting for x in loads(
            cl.url, cl.instances).values()) >= DISCONNECTS, WAIT, "the streams in the engines' load")
        leave.set()
        return list(await asyncio.gather(*tasks))

    started = time.monotonic()
    got = asyncio.run(run())
    left_at = max(g.done_at for g in got)
    row.cases = len(got)
    row.answered = sum(1 for g in got if g.status == 200 and g.text and not g.errors)
    row.c4xx, row.c5xx = status_counts(got)
    waited_from = time.monotonic()
    idle_after, row.leaked_blocks = wait_idle(cl.url, cl.instances, cl.blocks, baseline)
    if idle_after is not None:
        row.recover_s = waited_from - left_at + idle_after
    row.recover_what = "last client gone → engines idle, KV at its idle value"
    generated = counter(cl.url, "xllm:generation_tokens_total") - generated0
    row.details.update(generated_tokens=generated, asked_tokens=DISCONNECTS * max_tokens,
                       connected_s=left_at - started)
    row.notes.append(f"each read 3 chunks of a {max_tokens}-token stream, waited until /metrics showed all "
                     f"{DISCONNECTS} in the engines, and closed its connection; idle = xllm:num_requests_running and "
                     f"_waiting 0 and xllm:kv_cache_usage_perc back at its value before (per instance, from the "
                     f"heartbeats the gateway's /metrics shows); tokens generated for them: {generated:.0f} of the "
                     f"{DISCONNECTS * max_tokens} asked, in the {left_at - started:.1f} s they were connected and "
                     f"after")
    if row.answered < row.cases:
        row.problems.append(f"{row.cases - row.answered} streams did not start")
    if row.recover_s is None:
        row.problems.append(f"the engines did not go idle: {row.leaked_blocks} KV blocks still in use")
    if generated > DISCONNECTS * max_tokens / 2:
        row.problems.append(f"the engines generated {generated:.0f} tokens for the departed clients")
    return row


def kill9(cl: LocalCluster, s: Settings) -> Row:
    row = Row("kill9", f"kill -9 of an engine, {FAULT_STREAMS} streams in flight")
    bodies, greedy = _mixed_bodies(_prompts("Story", FAULT_STREAMS), KILL_TOKENS, s.seed)
    t0 = time.monotonic()
    ref = asyncio.run(run_streams(cl.url, bodies))
    row.details["reference_s"] = max(r.done_at for r in ref) - t0
    _check_reference(row, ref, KILL_TOKENS)
    resumed0 = counter(cl.url, "xllm:router_resumed_requests_total")
    fault: dict = {}

    def kill(so_far: list) -> None:
        victim = most_streams(so_far)
        pid = cl.engine_pid(victim)
        os.kill(pid, signal.SIGKILL)
        fault.update(victim=victim, at=time.monotonic(), gone=gone_watch(cl.url, victim, time.monotonic()))

    got = asyncio.run(run_streams(cl.url, bodies, kill))
    _fault_row(row, got, ref, greedy, KILL_TOKENS, fault)
    survivors = cl.instances - {fault["victim"]}
    _, row.leaked_blocks = wait_idle(cl.url, survivors, cl.blocks, {i: 0.0 for i in survivors})
    resumed = counter(cl.url, "xllm:router_resumed_requests_total") - resumed0
    row.notes.insert(0, f"{fault['moved']} of {FAULT_STREAMS} streams were on {fault['victim']} "
                        f"({fault['moved_seeded']} seeded sampled), resumed on the other instance by recompute "
                        f"({resumed:.0f} resumes counted by the gateway)")
    if row.leaked_blocks:
        row.problems.append(f"{row.leaked_blocks} KV blocks in use on the surviving instance after the streams")
    return row


def _fault_row(row: Row, got: list, ref: list, greedy: list[bool], max_tokens: int, fault: dict) -> None:
    """Fill ``row`` for streams that lived through a fault at ``fault['at']`` on ``fault['victim']``."""
    gone = fault["gone"].join()
    row.cases = len(got)
    row.answered = sum(1 for g in got if g.complete(max_tokens))
    row.c4xx, row.c5xx = status_counts(got)
    cmp = compare(got, ref, greedy)
    row.lost_chars = cmp.lost
    row.recover_s = max(g.done_at for g in got) - fault["at"]
    row.recover_what = "fault → last stream done"
    fault["moved"] = sum(1 for g in got if g.instance == fault["victim"])
    fault["moved_seeded"] = sum(1 for g, gr in zip(got, greedy) if g.instance == fault["victim"] and not gr)
    row.details.update(victim=fault["victim"], off_health_s=gone, near_ties=cmp.ties, differing=cmp.differing,
                       ends_after_fault_s=[g.done_at - fault["at"] for g in got],
                       moved=[g.instance == fault["victim"] for g in got])
    row.notes.append((f"{fault['victim']} left /health {gone:.1f} s after the fault" if gone is not None
                      else f"{fault['victim']} still listed healthy in /health 60 s after the fault")
                     + f"; the uninterrupted run of the same streams took {row.details['reference_s']:.1f} s")
    row.notes.append(f"every stream's text against the uninterrupted run: {cmp.differing} differ "
                     f"({cmp.lost} characters missing + extra); greedy streams parted at a float near-tie "
                     f"(top-2 logprobs within 1e-3, not counted): {cmp.ties}")
    if row.answered < row.cases:
        bad = [(g.status, g.errors[:1], g.finish) for g in got if not g.complete(max_tokens)]
        row.problems.append(f"{len(bad)} streams incomplete: {bad[:3]}")
    if cmp.lost:
        row.problems.append(f"{cmp.differing} streams differ from the uninterrupted run ({cmp.lost} characters)")
    if not fault["moved"]:
        row.problems.append("no stream was on the instance at the fault")
    if gone is None:
        row.problems.append(f"{fault['victim']} never left /health")


# ---- flood --------------------------------------------------------------------------------------

def flood(cl: LocalCluster, s: Settings) -> Row:
    n = 4 * FLOOD_INFLIGHT
    row = Row("flood", f"flood: {FLOOD_WAVES} x {n} at once, bound {FLOOD_INFLIGHT} in flight")
    rss0, _ = rss_mib(cl.server.pid)
    rss_after, codes, per_wave = [], collections.Counter(), []
    for wave in range(FLOOD_WAVES):
        bodies = [body(i, p, STREAM_TOKENS, logprobs=False) for i, p in enumerate(_prompts(f"Flood{wave}", n))]
        got = asyncio.run(run_streams(cl.url, bodies))
        rss_after.append(rss_mib(cl.server.pid)[0])
        ok = [g for g in got if g.complete(STREAM_TOKENS)]
        refused = [g for g in got if g.status == 503]
        good_503 = [g for g in refused if g.retry_after and _is_openai_error(g.error_body)]
        per_wave.append((len(ok), len(refused)))
        for g in refused:
            err = (g.error_body or {}).get("error") or {}
            codes[f"{err.get('code')}: {str(err.get('message'))[:70]}"] += 1
        row.cases += len(got)
        row.answered += len(ok) + len(good_503)
        c4, c5 = status_counts(got)
        row.c4xx += c4
        row.c5xx += c5
        other = [(g.status, g.errors[:1]) for g in got if g not in ok and g not in good_503]
        if other:
            row.problems.append(f"wave {wave}: {len(other)} answers neither a complete 200 nor a 503 with "
                                f"Retry-After and an error body: {other[:3]}")
        if 200 not in {g.status for g in got}:
            row.problems.append(f"wave {wave}: nothing was served")
        if healthy(cl.url) != cl.instances:
            row.problems.append(f"wave {wave}: /health not healthy after the flood")
    after = asyncio.run(run_streams(cl.url, [body(0, "after the flood", 4, logprobs=False)]))[0]
    if not after.complete(4):
        row.problems.append(f"a request after the flood got {after.status} {after.errors[:1]}")
    row.c5xx_all_503 = sum(n for _, n in codes.items()) == row.c5xx and row.answered == row.cases
    _, peak = rss_mib(cl.server.pid)
    row.leaked_blocks = wait_idle(cl.url, cl.instances, cl.blocks, {i: 0.0 for i in cl.instances})[1]
    row.details.update(rss_mib_before=rss0, rss_mib_after_waves=rss_after, rss_mib_peak=peak,
                       errors_503=dict(codes), per_wave=per_wave)
    row.notes.append(f"per wave (200, 503): {per_wave}; all 503s carry Retry-After and an OpenAI error body: "
                     f"{'yes' if row.answered == row.cases else 'no'}; their errors: "
                     + "; ".join(f"{n} x {m!r}" for m, n in codes.most_common()))
    row.notes.append(f"gateway RSS {rss0:.0f} MiB before, {' / '.join(f'{x:.0f}' for x in rss_after)} MiB after each "
                     f"wave, peak {peak:.0f} MiB")
    if row.leaked_blocks:
        row.problems.append(f"{row.leaked_blocks} KV blocks in use after the flood")
    return row


def _is_openai_error(payload) -> bool:
    return (isinstance(payload, dict) and set(payload) == {"error"} and isinstance(payload["error"], dict)
            and {"message", "type", "param", "code"} <= set(payload["error"]))


# ---- on etcd ------------------------------------------------------------------------------------

def etcd_restart(ec: EtcdCluster, s: Settings) -> Row:
    row = Row("etcd", "etcd killed and restarted under traffic")
    urls = [gw.base_url for gw in ec.gateways]
    log: list[tuple[str, int | None]] = []
    phase = {"now": "before"}
    marks: dict[str, float] = {}

    async def traffic(stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=60, trust_env=False, headers=HEADERS) as c:
            async def worker(k: int) -> None:
                i = 0
                while not stop.is_set():
                    now, url = phase["now"], urls[(k + i) % len(urls)]
                    try:
                        r = await c.post(url + "/v1/completions", json={
                            "model": MODEL, "prompt": f"etcd {k}.{i} {uuid.uuid4().hex[:6]}", "max_tokens": 4,
                            "temperature": 0})
                        log.append((now, r.status_code))
                    except httpx.HTTPError:
                        log.append((now, None))
                    i += 1

            await asyncio.gather(*(worker(k) for k in range(4)))

    async def answered_in(name: str, n: int) -> None:
        while sum(1 for p, st in log if p == name and st == 200) < n:
            await asyncio.sleep(0.05)

    async def all_(pred: Callable[[str], bool]) -> None:
        while not all(await asyncio.gather(*(asyncio.to_thread(_safe, pred, u) for u in urls))):
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        stop = asyncio.Event()
        load = asyncio.ensure_future(traffic(stop))
        try:
            await asyncio.wait_for(answered_in("before", 8), WAIT)
            marks["kill"] = time.monotonic()
            await asyncio.to_thread(ec.etcd.kill)
            phase["now"] = "etcd down"
            await asyncio.wait_for(all_(lambda u: not watch_up(u)), WAIT)
            marks["down"] = time.monotonic()
            await asyncio.wait_for(answered_in("etcd down", 8), WAIT)
            await asyncio.sleep(max(0.0, marks["kill"] + ETCD_DOWN_S - time.monotonic()))  # the outage
            phase["now"] = "restarting"
            marks["start"] = time.monotonic()
            await asyncio.to_thread(ec.etcd.start)
            marks["etcd healthy"] = time.monotonic()
            await asyncio.wait_for(all_(watch_up), WAIT)
            marks["up"] = time.monotonic()
            phase["now"] = "after"
            await asyncio.wait_for(answered_in("after", 8), WAIT)
        finally:
            stop.set()
            await load

    asyncio.run(scenario())
    row.cases = len(log)
    row.answered = sum(1 for _, st in log if st == 200)
    row.c4xx = sum(1 for _, st in log if st and 400 <= st < 500)
    row.c5xx = sum(1 for _, st in log if st and st >= 500)
    row.recover_s = marks["up"] - marks["start"]
    row.recover_what = "etcd start → both gateways' watches up"
    by_phase = collections.Counter(p for p, _ in log)
    row.notes.append(f"4 clients through both gateways; requests before / etcd down / restarting / after: "
                     f"{by_phase['before']} / {by_phase['etcd down']} / {by_phase['restarting']} / {by_phase['after']}"
                     f"; the watches counted as down {marks['down'] - marks['kill']:.1f} s after the kill "
                     f"(xllm:registry_watch_up); etcd was down {marks['start'] - marks['kill']:.1f} s (longer than the "
                     f"engines' {LEASE_TTL:g} s lease) and answered its /health "
                     f"{marks['etcd healthy'] - marks['start']:.1f} s after its start on the same data dir")
    row.details.update(marks={k: v - marks["kill"] for k, v in marks.items()}, by_phase=dict(by_phase))
    if row.answered < row.cases:
        row.problems.append(f"{row.cases - row.answered} requests not answered 200: "
                            f"{collections.Counter((p, st) for p, st in log if st != 200)}")
    for url in urls:
        if healthy(url) != {"e0", "e1"}:
            row.problems.append(f"{url}: /health lists {healthy(url)} after the restart")
    return row


def _safe(pred: Callable[[str], bool], url: str) -> bool:
    try:
        return bool(pred(url))
    except (OSError, ValueError, httpx.HTTPError):
        return False


def gateway_restart(ec: EtcdCluster, s: Settings) -> Row:
    row = Row("gateway", "one of two gateways killed mid-stream, restarted")
    ga, gb = ec.gateways
    bodies_a = [body(i, p, GATEWAY_TOKENS) for i, p in enumerate(_prompts("Gateway A", GATEWAY_STREAMS))]
    # the killed gateway's streams ask for ~10x more: only an abort frees the engines before the survivor's end
    bodies_b = [body(i, p, 1900, logprobs=False) for i, p in enumerate(_prompts("Gateway B", GATEWAY_STREAMS))]
    ref = asyncio.run(run_streams(ga.base_url, bodies_a))
    _check_reference(row, ref, GATEWAY_TOKENS)
    instances = {"e0", "e1"}
    marks: dict[str, float] = {}

    async def both() -> tuple[list, list]:
        async with client(ga.base_url) as ca, client(gb.base_url) as cb:
            firsts = [asyncio.Event() for _ in range(2 * GATEWAY_STREAMS)]
            on_a = [asyncio.ensure_future(stream(ca, b, firsts[i])) for i, b in enumerate(bodies_a)]
            on_b = [asyncio.ensure_future(stream(cb, b, firsts[GATEWAY_STREAMS + i])) for i, b in enumerate(bodies_b)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), WAIT)
            os.killpg(gb.pid, signal.SIGKILL)
            marks["kill"] = time.monotonic()
            return list(await asyncio.gather(*on_a)), list(await asyncio.gather(*on_b))

    got_a, got_b = asyncio.run(both())
    gb.stop()  # reaps it and closes its log
    waited_from = time.monotonic()
    released, row.leaked_blocks = wait_idle(ga.base_url, instances, ec.blocks, {i: 0.0 for i in instances},
                                            timeout=10.0)
    if released is not None:
        released += waited_from - marks["kill"]
    restarted = ec.gateway(1, port=gb.port)
    marks["restart"] = time.monotonic()
    restarted.start(timeout=WAIT)
    ec.gateways[1] = restarted
    wait_until(lambda: healthy(restarted.base_url) == instances, WAIT, "the restarted gateway's view")
    after = asyncio.run(run_streams(restarted.base_url, [body(i, p, 8) for i, p in enumerate(_prompts("Back", 4))]))
    marks["serving"] = min(a.done_at for a in after if a.complete(8)) if any(a.complete(8) for a in after) else None
    cmp = compare(got_a, ref, [True] * len(ref))
    row.cases = len(got_a) + len(after)
    row.answered = sum(1 for g in got_a if g.complete(GATEWAY_TOKENS)) + sum(1 for a in after if a.complete(8))
    c4a, c5a = status_counts(got_a + after)
    row.c4xx, row.c5xx = c4a, c5a
    row.lost_chars = cmp.lost
    if marks["serving"] is not None:
        row.recover_s = marks["serving"] - marks["restart"]
        row.recover_what = "restart → first request served by the new gateway (process start included)"
    cut = sum(1 for g in got_b if not g.complete(1900))
    survivor_end = max(g.done_at for g in got_a) - marks["kill"]
    row.notes.append(f"{GATEWAY_STREAMS} streams through each gateway, {GATEWAY_TOKENS} tokens each; the survivor's "
                     f"{GATEWAY_STREAMS} against an uninterrupted run: {cmp.differing} differ ({cmp.ties} near-ties); "
                     f"the killed gateway's own {GATEWAY_STREAMS} streams (1900 tokens each) were cut with it ({cut} "
                     f"cut: their connection was to the dead process)")
    row.notes.append(f"the engines had let go of the dead gateway's requests (running 0, KV idle on /metrics) by "
                     f"{released:.1f} s after the kill (checked from the end of the survivor's streams, "
                     f"{survivor_end:.1f} s after it; unaborted, the dead gateway's would have run far longer)"
                     if released is not None
                     else "the engines did not let go of the dead gateway's requests within 10 s of the survivor's "
                          "streams' end")
    row.details.update(cut=cut, released_s=released, survivor_end_s=survivor_end)
    if row.answered < row.cases:
        row.problems.append(f"{row.cases - row.answered} of the survivor's streams or the restarted gateway's "
                            f"requests failed")
    if cmp.lost:
        row.problems.append(f"{cmp.differing} of the survivor's streams differ ({cmp.lost} characters)")
    if released is None:
        row.problems.append("the engines still ran the dead gateway's requests 10 s after the survivor's streams "
                            "ended")
    if row.leaked_blocks:
        row.problems.append(f"{row.leaked_blocks} KV blocks in use after the dead gateway's streams")
    return row


def sigterm(ec: EtcdCluster, s: Settings) -> Row:
    row = Row("sigterm", f"SIGTERM drain, {FAULT_STREAMS} streams in flight (moved off by the gateway)")
    ga = ec.gateways[0].base_url
    bodies, greedy = _mixed_bodies(_prompts("Drain", FAULT_STREAMS), DRAIN_TOKENS, s.seed)
    t0 = time.monotonic()
    ref = asyncio.run(run_timed(ga, bodies))
    row.details["reference_s"] = max(r.done_at for r in ref) - t0
    _check_reference(row, ref, DRAIN_TOKENS)
    before = scrape(ga)
    fault: dict = {}

    def term(so_far: list) -> None:
        victim = most_streams(so_far)
        os.kill(ec.engines[victim].pid, signal.SIGTERM)
        fault.update(victim=victim, at=time.monotonic(), gone=gone_watch(ga, victim, time.monotonic()))

    got = asyncio.run(run_timed(ga, bodies, term))
    _fault_row(row, got, ref, greedy, DRAIN_TOKENS, fault)
    code = ec.engines[fault["victim"]].wait(WAIT)
    survivors = {"e0", "e1"} - {fault["victim"]}
    _, row.leaked_blocks = wait_idle(ga, survivors, ec.blocks, {i: 0.0 for i in survivors})
    fig = move_figures(before, scrape(ga))  # after the idle heartbeats: the destination's counters are in
    pauses = moved_pauses_ms(got, fault["victim"], fault["at"])
    row.notes.insert(0, f"{fault['moved']} of {FAULT_STREAMS} streams ({DRAIN_TOKENS} tokens each) were on "
                        f"{fault['victim']} ({fault['moved_seeded']} seeded sampled); the gateway moved "
                        f"{', '.join(f'{n:.0f} {how}' for how, n in fig.moves.items()) or 'none'} (--drain-moves "
                        f"auto), KV migrations {', '.join(f'{n:.0f} {o}' for o, n in fig.migrations.items()) or 'none'}"
                        f"; {fig.resumed:.0f} handed back at the {DRAIN_TIMEOUT:g} s drain timeout and resumed by "
                        f"recompute; it exited with {code}")
    if pauses:
        row.notes.insert(1, f"pause of the moved streams as the client saw it (largest gap between chunks after the "
                            f"SIGTERM): mean {sum(pauses) / len(pauses):.0f} ms, max {max(pauses):.0f} ms over "
                            f"{len(pauses)}; the gateway's histogram: {pause_note(fig.pause)}")
    row.details.update(moves=fig.moves, migrations=fig.migrations, resumed=fig.resumed, pause_ms=pauses,
                       gateway_pause=fig.pause, exit_code=code)
    if code != 0:
        row.problems.append(f"the drained engine exited with {code}")
    if not fig.moved:
        row.problems.append(f"no stream moved (request moves {fig.moves}, {fig.resumed:.0f} handed back)")
    if fig.moves.get("migration_failed") or fig.migrations.get("failed"):
        row.problems.append(f"migrations failed: {fig.moves.get('migration_failed', 0):.0f} counted by the gateway, "
                            f"{fig.migrations.get('failed', 0):.0f} by the engines")
    if row.leaked_blocks:
        row.problems.append(f"{row.leaked_blocks} KV blocks in use on the surviving instance after the streams")
    return row


# ---- running ------------------------------------------------------------------------------------

GROUPS = (
    ("local", ("streams", "hostile", "disconnect", "kill9")),
    ("flood", ("flood",)),
    ("etcd", ("etcd", "gateway", "sigterm")),
)
RUNNERS = {"streams": streams, "hostile": hostile_requests, "disconnect": disconnect, "kill9": kill9,
           "flood": flood, "etcd": etcd_restart, "gateway": gateway_restart, "sigterm": sigterm}


def _cluster(group: str, s: Settings):
    if group == "local":
        return LocalCluster(s, "serve-instances-2", ["--instances", "2", "--max-num-seqs", "128"]).start(2)
    if group == "flood":
        return LocalCluster(s, "serve-flood", ["--instances", "1", "--max-inflight-requests", str(FLOOD_INFLIGHT),
                                               "--max-num-seqs", "4", "--max-waiting", "4"]).start(1)
    return EtcdCluster(s).start()


def run(scenarios: list[str], s: Settings, record: Callable[[Row], None], errors: dict[str, str]) -> None:
    """Run ``scenarios`` cluster by cluster; ``record`` each row; a scenario that raises is recorded in
    ``errors`` (and its cluster's later scenarios still run, unless the cluster is gone)."""
    for group, names in GROUPS:
        picked = [n for n in names if n in scenarios]
        if not picked:
            continue
        print(f"[reliability] starting the {group} cluster for {', '.join(picked)}", flush=True)
        try:
            cluster = _cluster(group, s)
        except Exception as exc:
            for n in picked:
                errors[n] = f"cluster did not start: {type(exc).__name__}: {exc}"[:1000]
            print(f"[reliability] {group} cluster failed: {exc}", flush=True)
            continue
        try:
            for n in picked:
                print(f"[reliability] {n} ...", flush=True)
                try:
                    record(RUNNERS[n](cluster, s))
                except Exception as exc:  # record it and go on
                    errors[n] = f"{type(exc).__name__}: {exc}"[:1000]
                    print(f"[reliability] {n} failed: {errors[n]}", flush=True)
        finally:
            cluster.stop()
