/* xLLM live cluster page: replaying an xllm-sim run (`xllm-sim run ... --json run.json --timeline 1`).
   The run's timeline (frames of every instance's role, load and KV use; flips and moves as they happened)
   is played through the drawing code of the live page (render.js), with play/pause, speed and a scrubber.
   Nothing leaves the browser: the file is read locally. window.xllmReplay exposes the state (tests). */
"use strict";

const XReplay = (() => {
  const $ = XR.$;
  const state = window.xllmReplay = {run: null, frame: 0, simTime: 0, playing: false, speed: 10, shownEvents: 0};
  let events = [];      // the timeline's events, sorted by time, as {seq, kind, time, data}
  let nextEvent = 0;    // the first event not shown yet
  let last = 0;         // performance.now() of the previous animation frame
  const flipReasons = new Map();  // instance -> its flip under way {from, to, trigger, reason, since}

  function start() {
    $("replay-bar").hidden = false;
    XR.clearEvents("Open a simulation run to replay its role flips and moves.");
    const input = $("replay-file"), drop = $("drop");
    input.addEventListener("change", () => input.files[0] && load(input.files[0]));
    drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
    drop.addEventListener("dragleave", () => drop.classList.remove("over"));
    drop.addEventListener("drop", (e) => {
      e.preventDefault();
      drop.classList.remove("over");
      if (e.dataTransfer.files[0]) load(e.dataTransfer.files[0]);
    });
    $("play").addEventListener("click", () => (state.playing ? pause() : play()));
    $("speed").addEventListener("change", () => { state.speed = Number($("speed").value); });
    state.speed = Number($("speed").value);
    $("scrub").addEventListener("input", () => seek(Number($("scrub").value) * interval()));
  }

  function load(file) {
    const reader = new FileReader();
    reader.onload = () => {
      try {
        open(parse(reader.result), file.name);
      } catch (err) {
        fail(`${file.name}: ${err.message}`);
      }
    };
    reader.onerror = () => fail(`${file.name}: could not be read`);
    reader.readAsText(file);
  }
  /* JSON as Python writes it: NaN and +/-Infinity (an empty percentile) stand bare as values; read them as null. */
  function parse(text) {
    return JSON.parse(text.replace(/([:\[,]\s*)(?:NaN|-?Infinity)(?=\s*[,\]}])/g, "$1null"));
  }
  function fail(text) {
    const box = $("replay-error");
    box.textContent = text;
    box.hidden = false;
  }

  /* Start replaying `run` (an xllm-sim report with a "timeline"); throws with a readable message when
     it has none. */
  function open(run, name) {
    const tl = run && run.timeline;
    if (!tl || !Array.isArray(tl.frames) || !Array.isArray(tl.instances)) {
      throw new Error("no timeline in this file: run xllm-sim with --json OUT --timeline SECONDS");
    }
    if (!tl.frames.length) throw new Error("the timeline has no frame");
    $("replay-error").hidden = true;
    state.run = run;
    events = (tl.events || []).map((e, i) => ({seq: i + 1, kind: e.kind, time: e.t, data: e}))
      .sort((a, b) => a.time - b.time || a.seq - b.seq);
    $("replay-controls").hidden = false;
    $("scrub").max = String(tl.frames.length - 1);
    $("replay-name").textContent = `${name} · ${tl.instances.length} instances · ` +
      `${run.requests ?? "?"} requests · ${events.length} events`;
    seek(0);
    play();
  }

  const interval = () => state.run.timeline.interval_s;
  const endTime = () => state.run.timeline.frames[state.run.timeline.frames.length - 1].t;

  function play() {
    if (!state.run) return;
    if (state.simTime >= endTime()) seek(0);
    state.playing = true;
    $("play").textContent = "❚❚ Pause";
    last = performance.now();
    requestAnimationFrame(tick);
  }
  function pause() {
    state.playing = false;
    $("play").textContent = "▶ Play";
  }
  function tick(now) {
    if (!state.playing) return;
    const dt = Math.min((now - last) / 1000, 0.25);
    last = now;
    advance(state.simTime + dt * state.speed);
    if (state.simTime >= endTime()) {
      pause();
      return;
    }
    requestAnimationFrame(tick);
  }

  /* Jump to `t` (simulated seconds): the event list is rebuilt up to it. */
  function seek(t) {
    XR.clearEvents("No role flip or move yet in this run.");
    nextEvent = 0;
    flipReasons.clear();
    state.shownEvents = 0;
    state.frame = -1;
    advance(t, true);
  }

  function advance(t, quiet) {
    const frames = state.run.timeline.frames;
    state.simTime = Math.min(Math.max(t, 0), endTime());
    const when = (s) => `t+${s.toFixed(1)} s`;
    const batch = [];
    while (nextEvent < events.length && events[nextEvent].time <= state.simTime) batch.push(events[nextEvent++]);
    for (const ev of batch) {
      const d = ev.data;
      if (ev.kind === "role_flip_started") {
        flipReasons.set(d.instance, {from: d.from_role, to: d.to_role, trigger: d.trigger, reason: d.reason,
                                     since: ev.time});
      } else if (ev.kind === "role_flip_finished") {
        const f = flipReasons.get(d.instance);
        if (f) { d.started = f.since; d.ended = ev.time; }
        flipReasons.delete(d.instance);
      }
    }
    // a long jump shows only the last events (the list keeps 300 anyway)
    for (const ev of batch.slice(-120)) XR.addEvent(ev, when, quiet);
    state.shownEvents += batch.length;
    let i = frameAt(frames, state.simTime);
    if (i !== state.frame || batch.length) {
      state.frame = i;
      renderFrame(frames, i);
    }
    $("scrub").value = String(i);
    $("sim-time").textContent = `${state.simTime.toFixed(1)} s / ${endTime().toFixed(1)} s`;
  }

  function frameAt(frames, t) {
    let lo = 0, hi = frames.length - 1;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (frames[mid].t <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
  }

  /* One frame as the live page's view (render.js). */
  function renderFrame(frames, idx) {
    const run = state.run, tl = run.timeline, f = frames[idx];
    const model = (run.profile && run.profile.model) || "simulated";
    const instances = tl.instances.map((id, i) => {
      const pool = f.role[i];
      const parts = pool.split("_to_");
      const flipping = parts.length === 2;
      const why = flipReasons.get(id);
      return {
        id, model, role: parts[0], registered_role: parts[0], health: "healthy", health_detail: "",
        flip: flipping ? {from: parts[0], to: parts[1], trigger: why ? why.trigger : "",
                          reason: why ? why.reason : "", seconds: why ? f.t - why.since : undefined} : null,
        running: f.running[i], waiting: f.waiting[i], inflight: f.running[i] + f.waiting[i], kv_usage: f.kv[i],
        kv_free_tokens: null, tiers: [], prefix_hit_rate: null, counters: {},
      };
    });
    const lo = Math.max(0, idx - Math.round(300 / tl.interval_s));
    const series = frames.slice(lo, idx + 1).map((fr) => ({x: fr.t, ttft_p50: fr.ttft_p50, ttft_p99: fr.ttft_p99,
                                                          tpot_p50: fr.tpot_p50, tpot_p99: fr.tpot_p99}));
    const slo = run.slo || {};
    const summary = (key, sloMs) => {
      const s = run[key + "_ms"] || {};
      const toS = (v) => (v === null || v === undefined ? null : v / 1000);
      return {n: s.n, p50: toS(s.p50), p90: toS(s.p90), p99: toS(s.p99), slo: toS(sloMs), attainment: null};
    };
    const moving = events.slice(0, nextEvent).reduce((open, ev) => {
      if (ev.kind === "move_started") open.set(ev.data.request_id, ev.data);
      else if (ev.kind === "move_finished") open.delete(ev.data.request_id);
      return open;
    }, new Map());
    const view = {
      live: false, instances, pools: {}, moves: [...moving.values()],
      kv_bytes_under_way: [...moving.values()].reduce((a, m) => a + (m.kv_bytes || 0), 0),
      kv_bandwidth_bytes_s: run.config ? run.config.kv_bandwidth : 0,
      latency: {ttft: summary("ttft", slo.ttft_ms), tpot: summary("tpot", slo.tpot_ms), e2e: summary("e2e")},
      windowLabel: "(the whole run; charts: per frame)",
      attainmentNote: `run: ${XR.pct(run.slo_attainment, 1)} met all`,
      series, seriesLabel: (x) => `t=${x.toFixed(0)} s`,
      requests: [], tracing_hint: "A simulated run has no request spans.",
      loadScale: Math.max(8, run.config ? run.config.max_num_seqs || 8 : 8),
    };
    XR.render(view, [
      ["Simulated time", `${f.t.toFixed(1)} s`, `frame ${idx + 1} of ${frames.length}`],
      ["Finished", `${f.finished ?? "–"}`, `of ${f.arrived ?? "–"} arrived`],
      ["SLO attainment", XR.pct(run.slo_attainment, 1), "whole run"],
    ], null);
    document.body.dataset.replayFrame = String(idx);
  }

  return {start, open, seek, play, pause, state};
})();
