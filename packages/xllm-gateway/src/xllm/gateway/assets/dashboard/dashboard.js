/* xLLM live cluster page: the live feed. Reads GET /dashboard/api/events (Server-Sent Events) with
   fetch() and a ReadableStream parser, so that it can send the API key (EventSource cannot send headers);
   on 401 it asks for the key (kept in sessionStorage: this tab only). The stream ends by itself now and
   then (and when the gateway restarts): the page reconnects with the last event id it saw.
   window.xllmDashboard exposes what the page measured (tests and the curious):
   {latencies_ms: [event published -> shown, ...], snapshots, lastSeq, state}. */
"use strict";

(() => {
  const $ = XR.$;
  const KEY = "xllm-dashboard-key";
  const stats = window.xllmDashboard = {latencies_ms: [], snapshots: 0, lastSeq: 0, state: "connecting",
                                        snapshotLag_ms: null};
  let helloSeq = 0;
  let prevCounters = null;  // {time, handoffs, bytes} of the previous snapshot: rates
  let rates = null;

  // ---- theme -------------------------------------------------------------------------------------------
  const theme = localStorage.getItem("xllm-theme");
  if (theme) document.documentElement.dataset.theme = theme;
  $("theme").addEventListener("click", () => {
    const dark = getComputedStyle(document.documentElement).getPropertyValue("--bg").trim().startsWith("#0");
    const next = dark ? "light" : "dark";
    document.documentElement.dataset.theme = next;
    localStorage.setItem("xllm-theme", next);
  });
  setInterval(() => { $("clock").textContent = new Date().toLocaleTimeString(); }, 1000);

  const replay = new URLSearchParams(location.search).has("replay");
  $(replay ? "mode-replay" : "mode-live").classList.add("active");
  if (replay) {
    setConn("replay", "replay");
    XReplay.start();
    return;
  }
  XR.clearEvents();

  function setConn(state, text) {
    const pill = $("conn");
    pill.dataset.state = state;
    pill.textContent = text || state;
    stats.state = state;
  }

  // ---- the key -------------------------------------------------------------------------------------------
  function askKey(refused) {
    const dialog = $("key-dialog");
    $("key-error").hidden = !refused;
    $("key-button").hidden = false;
    if (!dialog.open) dialog.showModal();
    $("key-input").focus();
  }
  $("key-form").addEventListener("submit", () => {
    const key = $("key-input").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY, key);
    $("key-input").value = "";
    connect();
  });
  $("key-button").addEventListener("click", () => askKey(false));

  // ---- the stream ------------------------------------------------------------------------------------------
  let connecting = false;
  async function connect() {
    if (connecting) return;
    connecting = true;
    const headers = {Accept: "text/event-stream"};
    const key = sessionStorage.getItem(KEY);
    if (key) headers.Authorization = "Bearer " + key;
    let res;
    try {
      res = await fetch(`/dashboard/api/events?after=${stats.lastSeq}`, {headers, cache: "no-store"});
    } catch (err) {
      connecting = false;
      return retry("gateway unreachable");
    }
    if (res.status === 401) {
      connecting = false;
      setConn("locked", "API key needed");
      if (key) sessionStorage.removeItem(KEY);
      askKey(!!key);
      return;
    }
    if (!res.ok || !res.body) {
      connecting = false;
      return retry(`HTTP ${res.status}`);
    }
    setConn("live", "live");
    try {
      await read(res.body);
      connecting = false;
      setConn("reconnecting", "reconnecting…");
      setTimeout(connect, 50);  // the stream's lifetime ended: carry on from the last id
    } catch (err) {
      connecting = false;
      retry("stream broken");
    }
  }
  function retry(why) {
    setConn("reconnecting", `reconnecting (${why})…`);
    setTimeout(connect, 1500);
  }

  /* Server-Sent Events framing: lines "field: value", a blank line ends a message; "data" lines join with
     "\n"; lines starting with ":" are comments; CR, LF and CRLF all end a line. */
  async function read(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buf = "", msg = {data: []};
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      buf += decoder.decode(value, {stream: true});
      let nl;
      while ((nl = buf.search(/\r\n|\r|\n/)) >= 0) {
        const line = buf.slice(0, nl);
        buf = buf.slice(nl + (buf[nl] === "\r" && buf[nl + 1] === "\n" ? 2 : 1));
        if (line === "") {
          if (msg.data.length) dispatch(msg.event || "message", msg.data.join("\n"), msg.id);
          msg = {data: []};
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? "" : line.slice(colon + 1);
        if (val.startsWith(" ")) val = val.slice(1);
        if (field === "data") msg.data.push(val);
        else if (field === "event") msg.event = val;
        else if (field === "id") msg.id = val;
      }
    }
  }

  function dispatch(event, data, id) {
    let body;
    try { body = JSON.parse(data); } catch (err) { return; }
    if (event === "hello") {
      helloSeq = body.seq;
      return;
    }
    if (event === "snapshot") {
      onSnapshot(body);
      return;
    }
    if (event === "dropped") {
      console.warn(`the page missed ${body.events} event(s): it was too slow`);
      return;
    }
    if (id !== undefined) stats.lastSeq = Math.max(stats.lastSeq, Number(id));
    const backlog = body.seq <= helloSeq;
    const li = XR.addEvent(body, (t) => new Date(t * 1000).toLocaleTimeString(), backlog);
    if (!backlog) {
      const lag = Number(li.dataset.shownMs) - Number(li.dataset.publishedMs);
      stats.latencies_ms.push(lag);
      const sorted = [...stats.latencies_ms].sort((a, b) => a - b);
      const median = sorted[Math.floor(sorted.length / 2)];
      $("latency-note").textContent = `Events shown ${lag} ms after the gateway published them ` +
        `(median ${median} ms over ${sorted.length}; this browser's clock against the gateway's).`;
    }
  }

  function onSnapshot(snap) {
    stats.snapshots += 1;
    stats.snapshotLag_ms = Date.now() - snap.time * 1000;
    let handoffs = 0, bytes = 0;
    for (const i of snap.instances) {
      const c = i.counters || {};
      handoffs += c.kv_handoffs_installed || 0;
      bytes += c.kv_transfer_bytes || 0;
    }
    if (prevCounters && snap.time > prevCounters.time) {
      const dt = snap.time - prevCounters.time;
      rates = {handoffs: Math.max(handoffs - prevCounters.handoffs, 0) / dt,
               bytes: Math.max(bytes - prevCounters.bytes, 0) / dt};
    }
    prevCounters = {time: snap.time, handoffs, bytes};
    const windowText = snap.window_s ? `over the last ${Math.round(snap.window_s / 60)} min` : "";
    const view = {
      live: true, instances: snap.instances, pools: snap.pools, moves: snap.moves,
      kv_bytes_under_way: snap.kv_bytes_under_way, kv_bandwidth_bytes_s: snap.kv_bandwidth_bytes_s,
      latency: snap.latency, windowLabel: windowText,
      series: (snap.latency_series || []).map((r) => ({...r, x: -r.t})),
      seriesLabel: (x) => (Math.round(-x) === 0 ? "now" : `${Math.round(-x)} s ago`),
      requests: snap.requests, tracing_hint: snap.tracing_hint,
      loadScale: Math.max(16, ...snap.instances.map((i) => i.running + i.waiting)),
    };
    const age = `snapshot ${Math.max(Math.round(stats.snapshotLag_ms), 0)} ms old`;
    XR.render(view, [["Uptime", XR.ago(snap.uptime_s), age]], rates);
    document.body.dataset.snapshotTime = String(snap.time);
  }

  connect();
})();
