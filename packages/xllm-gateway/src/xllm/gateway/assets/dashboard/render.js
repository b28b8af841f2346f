/* xLLM live cluster page: drawing. One "view" shape feeds every panel, built from a live snapshot
   (dashboard.js) or from a frame of an xllm-sim timeline (replay.js):
   {instances: [{id, model, role, flip, health, health_detail, running, waiting, inflight, kv_usage,
   kv_free_tokens, tiers, prefix_hit_rate, recent_ttft, recent_tpot, address, counters}], pools, moves,
   kv_bytes_under_way, kv_bandwidth_bytes_s, latency: {ttft|tpot|e2e: {n, p50, p90, p99, slo, attainment}},
   series: [{x, ttft_p50, ttft_p99, tpot_p50, tpot_p99}], seriesLabel, requests, tracing_hint}.
   Everything is written with textContent or escaped: names come from the cluster, not from us. */
"use strict";

const XR = (() => {
  const COMPACT_ABOVE = 24;  // instances: beyond this, the grid of small tiles
  const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({
    "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"})[c]);
  const $ = (id) => document.getElementById(id);

  function ms(seconds) {
    if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "–";
    const v = seconds * 1000;
    if (v >= 10000) return (v / 1000).toFixed(1) + " s";
    if (v >= 100) return v.toFixed(0) + " ms";
    if (v >= 10) return v.toFixed(1) + " ms";
    return v.toFixed(2) + " ms";
  }
  function pct(f, digits = 0) {
    return f === null || f === undefined || Number.isNaN(f) ? "–" : (f * 100).toFixed(digits) + "%";
  }
  function bytes(n) {
    if (!n) return "0 B";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
    return (n >= 100 || i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
  }
  function ago(seconds) {
    if (seconds < 60) return seconds.toFixed(seconds < 10 ? 1 : 0) + " s";
    return Math.floor(seconds / 60) + " min " + Math.round(seconds % 60) + " s";
  }
  /* Widths and heights through the CSSOM (data-w / data-h, in %): the page's CSP allows no inline style. */
  function sized(root) {
    root.querySelectorAll("[data-w]").forEach((e) => { e.style.width = e.dataset.w + "%"; });
    root.querySelectorAll("[data-h]").forEach((e) => { e.style.height = e.dataset.h + "%"; });
  }
  /* A request id as shown: long ones (resumable stream ids) cut in the middle; the whole id in a tooltip. */
  const shortId = (id) => {
    const s = String(id ?? "");
    return s.length > 26 ? `${s.slice(0, 14)}…${s.slice(-8)}` : s;
  };
  const reqId = (id) => `<b class="mono" title="${esc(id)}">${esc(shortId(id))}</b>`;
  const pool = (inst) => inst.flip ? `${inst.flip.from}_to_${inst.flip.to}` : inst.role;
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };

  // ---- summary cards -------------------------------------------------------------------------------
  function cards(view, extra) {
    const insts = view.instances;
    const byHealth = {};
    for (const i of insts) byHealth[i.health] = (byHealth[i.health] || 0) + 1;
    const byPool = {};
    for (const i of insts) byPool[pool(i)] = (byPool[pool(i)] || 0) + 1;
    const flipping = insts.filter((i) => i.flip).length;
    const running = insts.reduce((a, i) => a + i.running, 0);
    const waiting = insts.reduce((a, i) => a + i.waiting, 0);
    const kv = insts.length ? insts.reduce((a, i) => a + i.kv_usage, 0) / insts.length : 0;
    const rates = insts.filter((i) => i.prefix_hit_rate !== null && i.prefix_hit_rate !== undefined);
    const hit = rates.length ? rates.reduce((a, i) => a + i.prefix_hit_rate, 0) / rates.length : null;
    const present = ["prefill", "decode", "mixed"].filter((r) => byPool[r]);
    const roles = present.map((r) => `${byPool[r]} ${r[0].toUpperCase()}`).join(" · ") || "none";
    const list = [
      ["Instances", String(insts.length), `${byHealth.healthy || 0} healthy` +
        (insts.length - (byHealth.healthy || 0) ? ` · ${insts.length - (byHealth.healthy || 0)} not` : "")],
      ["Roles", roles, (present.length ? present.join(" · ") + "; " : "") +
        (flipping ? `${flipping} flipping now` : "no flip under way")],
      ["Requests", `${running} running`, `${waiting} waiting`],
      ["KV memory", pct(kv), "mean use per instance"],
      ["Prefix cache", hit === null ? "–" : pct(hit), "prompt tokens found, since start"],
      ["Moves in flight", String(view.moves.length), view.kv_bytes_under_way ?
        bytes(view.kv_bytes_under_way) + " of KV under way" : "no KV under way"],
      ...(extra || []),
    ];
    const box = $("cards");
    box.replaceChildren(...list.map(([label, value, sub]) => {
      const c = el("div", "card");
      c.append(el("div", "label", label), el("div", "value", value), el("div", "sub", sub));
      return c;
    }));
  }

  // ---- instances ------------------------------------------------------------------------------------
  const tiles = new Map();  // id -> element (kept across updates: hover and tooltips stay put)

  function instances(view) {
    const box = $("instances");
    const compact = view.instances.length > COMPACT_ABOVE;
    box.classList.toggle("compact", compact);
    const seen = new Set();
    view.instances.forEach((inst, idx) => {
      seen.add(inst.id);
      let t = tiles.get(inst.id);
      if (!t || t.dataset.compact !== String(compact)) {
        if (t) t.remove();
        t = el("div", "tile");
        t.dataset.id = inst.id;
        t.dataset.compact = String(compact);
        tiles.set(inst.id, t);
      }
      if (box.children[idx] !== t) box.insertBefore(t, box.children[idx] || null);
      t.dataset.role = inst.role;
      t.dataset.flipping = String(!!inst.flip);
      t.dataset.health = inst.health;
      t.dataset.pool = pool(inst);
      const load = inst.running + inst.waiting;
      const loadFrac = Math.min(load / Math.max(view.loadScale || 16, 1), 1);
      const flipText = inst.flip ? `flipping ${inst.flip.from} → ${inst.flip.to}` +
        (inst.flip.reason ? `: ${inst.flip.reason}` : "") : "";
      t.title = `${inst.id} (${inst.model}) — ${inst.role}${inst.flip ? ", " + flipText : ""}\n` +
        `${inst.health}${inst.health_detail ? ": " + inst.health_detail : ""}\n` +
        `running ${inst.running}, waiting ${inst.waiting}; KV ${pct(inst.kv_usage, 1)}` +
        (inst.prefix_hit_rate !== null && inst.prefix_hit_rate !== undefined ?
          `; prefix hits ${pct(inst.prefix_hit_rate)}` : "");
      if (compact) {
        t.innerHTML = `<span class="fill" data-h="${Math.round(Math.max(loadFrac, inst.kv_usage) * 100)}"></span>`;
        sized(t);
        return;
      }
      const healthDot = `<span class="dot health-${esc(inst.health)}" title="${esc(inst.health)}"></span>`;
      t.innerHTML =
        `<div class="top">${healthDot}<span class="name">${esc(inst.id)}</span>` +
        `<span class="role">${esc(inst.role)}${inst.registered_role && inst.registered_role !== inst.role ?
          ` (was ${esc(inst.registered_role)})` : ""}</span></div>` +
        (inst.flip ? `<div class="flip">⇄ ${esc(inst.flip.from)} → ${esc(inst.flip.to)} · ` +
          `${esc(inst.flip.trigger)}` +
          `${inst.flip.seconds !== undefined ? " · " + esc(inst.flip.seconds.toFixed(1)) + " s" : ""}` +
          `</div>` : "") +
        `<div class="bar${loadFrac > 0.8 ? " hot" : ""}"><i data-w="${(loadFrac * 100).toFixed(1)}"></i></div>` +
        `<div class="barlabel"><span>load</span><span>${inst.running} running · ${inst.waiting} waiting</span></div>` +
        `<div class="bar kv${inst.kv_usage > 0.9 ? " hot" : ""}">` +
        `<i data-w="${(inst.kv_usage * 100).toFixed(1)}"></i></div>` +
        `<div class="barlabel"><span>KV</span><span>${pct(inst.kv_usage, 1)}</span></div>` +
        `<div class="meta"><span>${esc(inst.model)}</span>` +
        (inst.prefix_hit_rate !== null && inst.prefix_hit_rate !== undefined ?
          `<span>prefix ${pct(inst.prefix_hit_rate)}</span>` : "") +
        (inst.health !== "healthy" ? `<span class="error">${esc(inst.health)}</span>` : "") + `</div>`;
      sized(t);
    });
    for (const [id, t] of tiles) {
      if (!seen.has(id)) { t.remove(); tiles.delete(id); }
    }
    if (!view.instances.length) box.replaceChildren(el("p", "hint", "No instance registered yet."));
    else box.querySelectorAll(".hint").forEach((h) => h.remove());
  }

  // ---- latency ---------------------------------------------------------------------------------------
  function latency(view) {
    const rows = [["TTFT", "ttft"], ["TPOT", "tpot"], ["E2E", "e2e"]];
    const L = view.latency || {};
    const head = "<tr><th></th><th>p50</th><th>p90</th><th>p99</th><th>samples</th><th>SLO attainment</th></tr>";
    const body = rows.map(([name, key]) => {
      const s = L[key] || {};
      const att = s.attainment === null || s.attainment === undefined ? `<span class="muted">${
        s.slo ? (view.attainmentNote || "no sample") + " · SLO " + ms(s.slo) :
          key === "e2e" ? "" : "no SLO set"}</span>` :
        `<span class="attain"><span class="bar"><i data-w="${(s.attainment * 100).toFixed(1)}"></i></span>` +
        `${pct(s.attainment, 1)} ≤ ${ms(s.slo)}</span>`;
      return `<tr data-latency="${key}" data-n="${s.n ?? 0}"><td>${name}</td>` +
        `<td>${ms(s.p50)}</td><td>${ms(s.p90)}</td>` +
        `<td>${ms(s.p99)}</td><td>${s.n ?? "–"}</td><td>${att}</td></tr>`;
    }).join("");
    $("latency-table").innerHTML = `<table class="figures">${head}${body}</table>`;
    sized($("latency-table"));
    $("latency-window").textContent = view.windowLabel || "";
    const series = view.series || [];
    lineChart($("chart-ttft"), series, "ttft", (L.ttft || {}).slo, view.seriesLabel);
    lineChart($("chart-tpot"), series, "tpot", (L.tpot || {}).slo, view.seriesLabel);
  }

  /* An SVG chart of p50 and p99 (seconds, drawn in ms) over rows {x, <kind>_p50, <kind>_p99}. */
  function lineChart(box, rows, kind, slo, xLabel) {
    const W = 360, H = 150, L = 44, R = 8, T = 8, B = 22;
    const pts = rows.filter((r) => r[kind + "_p50"] !== null && r[kind + "_p50"] !== undefined);
    if (!pts.length) {
      box.innerHTML = `<svg viewBox="0 0 ${W} ${H}" role="img"><text class="empty" x="${W / 2}" y="${H / 2}" ` +
        `text-anchor="middle">no requests in the window yet</text></svg>`;
      return;
    }
    const xs = rows.map((r) => r.x);
    const x0 = Math.min(...xs), x1 = Math.max(...xs);
    const top = Math.max(...pts.map((r) => Math.max(r[kind + "_p99"] ?? 0, r[kind + "_p50"])));
    const sloShown = slo && slo <= 3 * top;  // an objective far above the figures would flatten them: noted instead
    const ymax = niceCeil(Math.max(top, sloShown ? slo : 0) * 1000 * 1.1 || 1);
    const sx = (x) => L + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (W - L - R);
    const sy = (v) => T + (1 - v * 1000 / ymax) * (H - T - B);
    const path = (key) => {
      let d = "", pen = false;
      for (const r of rows) {
        const v = r[key];
        if (v === null || v === undefined) { pen = false; continue; }
        d += `${pen ? "L" : "M"}${sx(r.x).toFixed(1)},${sy(v).toFixed(1)}`;
        pen = true;
      }
      return d;
    };
    const ticks = [0, 0.5, 1].map((f) => f * ymax);
    let g = ticks.map((v) => `<line class="axis" x1="${L}" x2="${W - R}" y1="${sy(v / 1000)}" y2="${sy(v / 1000)}"/>` +
      `<text x="${L - 4}" y="${sy(v / 1000) + 3}" text-anchor="end">${fmtTick(v)}</text>`).join("");
    const xl = xLabel || ((x) => x.toFixed(0));
    g += `<text x="${L}" y="${H - 6}">${esc(xl(x0))}</text>` +
      `<text x="${W - R}" y="${H - 6}" text-anchor="end">${esc(xl(x1))}</text>`;
    if (sloShown) g += `<line class="slo" x1="${L}" x2="${W - R}" y1="${sy(slo)}" y2="${sy(slo)}"/>`;
    else if (slo) g += `<text x="${W - R}" y="${T + 8}" text-anchor="end">SLO ${esc(ms(slo))} (above)</text>`;
    const single = pts.length === 1 ? pts.map((r) =>
      `<circle cx="${sx(r.x)}" cy="${sy(r[kind + "_p50"])}" r="3" class="pt"/>`).join("") : "";
    box.innerHTML = `<svg viewBox="0 0 ${W} ${H}" role="img" aria-label="${kind} percentiles">${g}` +
      `<path class="p99" d="${path(kind + "_p99")}"/><path class="p50" d="${path(kind + "_p50")}"/>${single}</svg>`;
  }
  function niceCeil(v) {
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }
  const fmtTick = (v) => (v >= 1000 ? (v / 1000).toFixed(v % 1000 ? 1 : 0) + " s" :
    v < 10 ? v.toFixed(1) : v.toFixed(0));

  // ---- KV --------------------------------------------------------------------------------------------
  function kv(view) {
    const rows = view.instances.map((i) => {
      const tiers = (i.tiers || []).map((t) => `${esc(t.tier)} ${t.capacity_bytes ?
        pct(t.used_bytes / t.capacity_bytes) : bytes(t.used_bytes)}` +
        (t.queries ? ` · ${pct(t.hits / t.queries)} hits` : "") + (t.up ? "" : " · down")).join("<br>");
      return `<tr data-id="${esc(i.id)}"><td><span class="sw role-${i.flip ? "flipping" : esc(i.role)}"></span> ` +
        `${esc(i.id)}</td><td><div class="bar kv${i.kv_usage > 0.9 ? " hot" : ""}"><i data-w="${
          (i.kv_usage * 100).toFixed(1)}"></i></div></td><td class="num">${pct(i.kv_usage, 1)}</td>` +
        `<td class="num">${i.kv_free_tokens !== undefined && i.kv_free_tokens !== null ?
          i.kv_free_tokens.toLocaleString() : "–"}</td>` +
        `<td>${tiers || '<span class="muted">none</span>'}</td>` +
        `<td class="num">${i.prefix_hit_rate === null || i.prefix_hit_rate === undefined ? "–" :
          pct(i.prefix_hit_rate, 1)}</td></tr>`;
    }).join("");
    $("kv").innerHTML = `<div class="scroll"><table class="list"><tr><th>instance</th><th>memory</th>` +
      `<th class="num">used</th><th class="num">free tokens</th><th>lower tiers (used · hits)</th>` +
      `<th class="num">prefix hits</th></tr>${rows}</table></div>`;
    sized($("kv"));
  }

  // ---- transfers ------------------------------------------------------------------------------------
  function transfers(view, rates) {
    const now = Date.now() / 1000;
    const head = `<div class="cards">` + [
      ["Migrations in flight", String(view.moves.filter((m) => m.how === "migrate").length)],
      ["Recomputes in flight", String(view.moves.filter((m) => m.how === "recompute").length)],
      ["KV under way", bytes(view.kv_bytes_under_way || 0)],
      ["Measured KV bandwidth", view.kv_bandwidth_bytes_s ? bytes(view.kv_bandwidth_bytes_s) + "/s" : "–"],
      ["PD hand-offs", rates ? `${rates.handoffs.toFixed(1)}/s` : "–"],
      ["KV transferred", rates ? bytes(rates.bytes) + "/s" : "–"],
    ].map(([l, v]) => `<div class="card"><div class="label">${l}</div><div class="value">${esc(v)}</div></div>`)
      .join("") + `</div>`;
    const rows = view.moves.map((m) => `<tr data-request="${esc(m.request_id)}">` +
      `<td class="mono" title="${esc(m.request_id)}">${
      esc(shortId(m.request_id))}</td><td>${esc(m.source)} → ${esc(m.destination)}</td><td>${esc(m.how)}</td>` +
      `<td class="num">${m.tokens ?? "–"}</td><td class="num">${bytes(m.kv_bytes || 0)}</td>` +
      `<td class="num">${m.started && view.live ? ago(Math.max(now - m.started, 0)) : "–"}</td></tr>`).join("");
    $("transfers").innerHTML = head + (view.moves.length ?
      `<div class="scroll"><table class="list"><tr><th>request</th><th>from → to</th><th>how</th>` +
      `<th class="num">tokens</th><th class="num">KV</th><th class="num">for</th></tr>${rows}</table></div>` :
      `<p class="hint">No request is moving now. Migrations start when an instance drains (SIGTERM) or a ` +
      `decode instance flips to prefill.</p>`);
  }

  // ---- request timelines ------------------------------------------------------------------------------
  function requests(view) {
    const box = $("requests");
    if (view.requests === null || view.requests === undefined) {
      box.innerHTML = `<p class="hint">${esc(view.tracing_hint ||
        "Tracing is off: start the gateway with --otlp-traces-endpoint URL to see each request's spans here.")}</p>`;
      return;
    }
    if (!view.requests.length) {
      box.innerHTML = `<p class="hint">${esc(view.tracing_hint || "No request traced yet.")}</p>`;
      return;
    }
    box.replaceChildren(...view.requests.map(requestRow));
  }
  function requestRow(r) {
    const row = el("div", "req");
    row.dataset.trace = r.trace_id;
    const label = el("div", "label");
    label.append(el("b", "", r.name || "request"),
      el("span", "muted mono", `${r.request_id || r.trace_id} · ${ms(r.duration_s)} · ${r.status || ""}`));
    const spans = el("div", "spans");
    const t0 = r.start_unix, dur = Math.max(r.duration_s || 0, 1e-6);
    const byParent = new Map();
    for (const s of r.spans || []) {
      const k = s.parent_id || "";
      if (!byParent.has(k)) byParent.set(k, []);
      byParent.get(k).push(s);
    }
    const ids = new Set((r.spans || []).map((s) => s.span_id));
    const roots = (r.spans || []).filter((s) => !s.parent_id || !ids.has(s.parent_id));
    const walk = (s, depth) => {
      const line = el("div", "span" + (s.error || (s.attributes && s.attributes.error) ? " error" : ""));
      const left = Math.max((s.start_unix - t0) / dur, 0) * 100;
      const width = Math.max((s.end_unix - s.start_unix) / dur, 0) * 100;
      const bar = el("i");
      bar.style.left = left.toFixed(2) + "%";
      bar.style.width = Math.min(width, 100 - left).toFixed(2) + "%";
      const indent = depth ? "· ".repeat(depth - 1) + "└ " : "";  // nesting: a child under its parent
      const name = el("span", "", `${indent}${s.name} ${ms(s.end_unix - s.start_unix)}`);
      line.dataset.depth = String(depth);
      name.style.left = Math.min(left, 70).toFixed(2) + "%";
      line.title = `${s.name}: ${ms(s.end_unix - s.start_unix)}\n` + Object.entries(s.attributes || {})
        .map(([k, v]) => `${k} = ${v}`).join("\n");
      line.append(bar, name);
      spans.append(line);
      for (const c of (byParent.get(s.span_id) || []).sort((a, b) => a.start_unix - b.start_unix)) walk(c, depth + 1);
    };
    roots.sort((a, b) => a.start_unix - b.start_unix).forEach((s) => walk(s, 0));
    row.append(label, spans);
    return row;
  }

  // ---- events -------------------------------------------------------------------------------------------
  /* Prepend one event ({seq, kind, time, data}); `when` formats its time. Marks the element with the
     publish time and the moment it was shown (data-published-ms, data-shown-ms): the page's update
     latency. Returns the element. */
  function addEvent(ev, when, backlog) {
    const list = $("events");
    list.querySelectorAll(".none").forEach((n) => n.remove());
    const d = ev.data || {};
    const li = el("li");
    li.dataset.kind = ev.kind;
    li.dataset.seq = String(ev.seq);
    if (d.instance) li.dataset.instance = d.instance;
    if (d.request_id) li.dataset.request = d.request_id;
    if (d.outcome) li.dataset.outcome = d.outcome;
    let tag, what, why = "";
    if (ev.kind === "role_flip_started") {
      tag = "flip";
      what = `<b>${esc(d.instance)}</b> ${esc(d.from_role)} → ${esc(d.to_role)} started`;
      why = `${esc(d.trigger)}${d.reason ? ": " + esc(d.reason) : ""}`;
    } else if (ev.kind === "role_flip_finished") {
      tag = "flip";
      const took = d.ended && d.started ? ` after ${ms(d.ended - d.started)}` : "";
      what = `<b>${esc(d.instance)}</b> is now ${esc(d.to_role)}${took}`;
      why = d.outcome && d.outcome !== "done" ? esc(d.outcome) : "";
      if (d.outcome === "abandoned") li.classList.add("failed");
    } else if (ev.kind === "move_started") {
      tag = d.how === "migrate" ? "migration" : "recompute";
      what = `request ${reqId(d.request_id)} ${d.how === "migrate" ? "migrating" : "recomputing"} ` +
        `${esc(d.source)} → ${esc(d.destination)}`;
      why = `${d.tokens ?? "?"} tokens` + (d.kv_bytes ? `, ${bytes(d.kv_bytes)} of KV` : "");
    } else if (ev.kind === "move_finished") {
      tag = d.how === "migrate" ? "migration" : "recompute";
      what = `request ${reqId(d.request_id)} ${d.how === "migrate" ? "migration" : "recompute"} ` +
        `${esc(d.outcome || "done")} (${esc(d.source)} → ${esc(d.destination)})`;
      why = d.error ? esc(d.error) : "";
      if (d.outcome === "failed") li.classList.add("failed");
    } else {
      tag = ev.kind;
      what = esc(JSON.stringify(d)).slice(0, 200);
    }
    li.innerHTML = `<span class="when">${esc(when(ev.time))}</span><span class="what"><span class="tag">${
      esc(tag)}</span>${what}${why ? `<div class="why">${why}</div>` : ""}</span>`;
    li.dataset.publishedMs = String(Math.round(ev.time * 1000));
    if (backlog) li.dataset.backlog = "true";
    list.prepend(li);
    while (list.children.length > 300) list.lastElementChild.remove();
    li.dataset.shownMs = String(Date.now());
    return li;
  }
  function clearEvents(text) {
    $("events").replaceChildren(el("span", "none", text || "No role flip or move yet."));
  }

  function render(view, extraCards, rates) {
    cards(view, extraCards);
    instances(view);
    latency(view);
    kv(view);
    transfers(view, rates);
    requests(view);
  }

  return {render, addEvent, clearEvents, ms, pct, bytes, ago, esc, $};
})();
