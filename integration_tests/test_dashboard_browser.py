"""The live cluster page (``/dashboard``) in a real headless Chromium (Debian's, driven by Selenium:
:mod:`xllm.testing.browser`) over a real cluster: etcd, ``xllm engine`` processes of the tiny model
(one prefill, one decode), a gateway with an API key, dynamic PD roles and ``--drain-moves migrate``.

- Without the key the page's data is refused (401, the OpenAI-style body of ``/v1/*``) and the page asks
  for the key; with it, it shows both instances with their roles.
- A third engine (prefill) joins: the prefill side is idle, so the gateway flips one prefill instance to
  decode (``prefill_idle``); the page shows the flip (its reason) and the instance's new role.
- SIGTERM of the engine decoding a long stream: it drains, the gateway migrates the request with its KV
  to the other decode instance (the client's stream unbroken); the page shows the migration start and end.
- The page replays a real ``xllm-sim`` run of 256 instances (96 prefill, 160 decode, dynamic roles): all
  its instances as a compact grid of tiles, its role flips in the event list.

Every wait polls the DOM (``WebDriverWait``), never sleeps. The browser's console has no error but the
401 of the key check (asserted); the update latency (event published by the gateway → shown in the
page, from the ``data-published-ms`` / ``data-shown-ms`` the page sets on each event) is printed and
written with the screenshots under ``$XLLM_TEST_ARTIFACTS`` (default ``test-artifacts/``)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid

import httpx
import pytest

from xllm.testing.browser import artifacts_dir, headless_chromium
from xllm.testing.processes import wait_for

MODEL = "tiny"
KEY = "sk-dashboard-" + uuid.uuid4().hex[:12]
AUTH = {"Authorization": f"Bearer {KEY}"}
SIM_FLAGS = ("--prefill-instances", "96", "--decode-instances", "160", "--pd-policy", "dynamic", "--slo-ttft-ms",
             "2000", "--slo-tpot-ms", "100", "--pd-flip-window", "1", "--pd-cluster-cooldown", "1", "--trace",
             "phases", "--phase-s", "8,8", "--rate", "150", "--requests", "1000", "--timeline", "1", "--no-progress")


def _healthy(gw) -> set[str]:
    r = httpx.get(f"{gw.url}/health", timeout=10, trust_env=False)
    return {k for k, v in r.json().get("instances", {}).items() if v["healthy"]}


def _key_refused(entry: dict) -> bool:
    """The one console error the page may log: its data refused (401) before the key was given."""
    return "/dashboard/api/events" in entry.get("message", "") and "401" in entry.get("message", "")


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory):
    """A real ``xllm-sim`` run of 256 instances with a timeline (started now, read when first needed)."""
    out = tmp_path_factory.mktemp("sim") / "run256.json"
    proc = subprocess.Popen([sys.executable, "-m", "xllm.sim", "run", *SIM_FLAGS, "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def result():
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, output
        return out
    yield result
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def cluster(etcd, engines, tiny_model_dir, launch_server, sim_run):
    prefix = f"/xllm-dash-{uuid.uuid4().hex[:8]}"
    common = ("--model", str(tiny_model_dir), "--served-model-name", MODEL, "--etcd", etcd.endpoint,
              "--etcd-prefix", prefix, "--kv-transfer", "grpc", "--lease-ttl", "3", "--drain-timeout", "20")
    started = {"e0": engines("e0", *common, "--role", "prefill"), "e1": engines("e1", *common, "--role", "decode")}
    gw = launch_server("--model", str(tiny_model_dir), "--served-model-name", MODEL, "--etcd", etcd.endpoint,
                       "--etcd-prefix", prefix, "--api-key", KEY, "--pd-policy", "dynamic", "--slo-ttft-ms", "20000",
                       "--slo-tpot-ms", "5000", "--pd-flip-window", "0.5", "--pd-flip-cooldown", "0",
                       "--pd-cluster-cooldown", "0", "--no-pd-prefill-overflow", "--drain-moves", "migrate")
    try:
        wait_for(lambda: _healthy(gw) == {"e0", "e1"}, 120, "both engines registered")
        yield {"gw": gw, "engines": started, "common": common, "engine": engines}
    finally:
        gw.stop()


def _event(browser, kind: str, **attrs: str):
    """The newest event element of ``kind`` (with these ``data-`` attributes), or None."""
    sel = f'li[data-kind="{kind}"]' + "".join(f'[data-{k}="{v}"]' for k, v in attrs.items())
    found = browser.driver.find_elements("css selector", sel)
    return found[0] if found else None


def _lag_ms(element) -> int:
    return int(element.get_attribute("data-shown-ms")) - int(element.get_attribute("data-published-ms"))


def _tile_role(browser, iid: str) -> str | None:
    """The role the page shows for instance ``iid`` (None: no tile)."""
    return browser.js("const t = document.querySelector(`.tile[data-id=\"${arguments[0]}\"]`);"
                      "return t ? t.dataset.role : null;", iid)


def test_the_live_page_shows_the_cluster_a_role_flip_and_a_migration_behind_the_key(cluster, tmp_path):
    gw, started = cluster["gw"], cluster["engines"]
    url = f"{gw.url}/dashboard"
    # the data is refused without the key, exactly as /v1/* refuses; the page itself is open
    refused = httpx.get(f"{gw.url}/dashboard/api/snapshot", timeout=10, trust_env=False)
    v1 = httpx.get(f"{gw.url}/v1/models", timeout=10, trust_env=False)
    assert refused.status_code == 401 == v1.status_code and refused.json() == v1.json()
    assert httpx.get(url, timeout=10, trust_env=False).status_code == 200
    lags: dict[str, int] = {}
    with headless_chromium(tmp_path) as browser:
        browser.open(url)
        browser.wait(lambda d: d.find_element("id", "key-dialog").get_attribute("open") is not None, 15,
                     "the page to ask for the API key")
        assert browser.driver.find_element("id", "conn").get_attribute("data-state") == "locked"
        browser.screenshot("dashboard-key")
        refusals = [e for e in browser.console() if e.get("level") == "SEVERE"]
        assert refusals and all(_key_refused(e) for e in refusals), refusals
        browser.driver.find_element("id", "key-input").send_keys(KEY)
        browser.driver.find_element("id", "key-ok").click()
        browser.wait(lambda _d: _tile_role(browser, "e0") == "prefill" and _tile_role(browser, "e1") == "decode", 15,
                     "both instances with their roles")
        assert browser.driver.find_element("id", "conn").get_attribute("data-state") == "live"
        browser.screenshot("dashboard-instances")

        # a second prefill instance joins; the prefill side is idle, so one of the two flips to decode
        started["e2"] = cluster["engine"]("e2", *cluster["common"], "--role", "prefill")
        browser.wait(lambda _d: _tile_role(browser, "e2") is not None, 120, "the third instance on the page")
        flip = browser.wait(lambda _d: _event(browser, "role_flip_started"), 60, "a role flip on the page")
        flipped = flip.get_attribute("data-instance")
        assert flipped in ("e0", "e2") and "prefill" in flip.text and "decode" in flip.text and "idle" in flip.text
        done = browser.wait(lambda _d: _event(browser, "role_flip_finished", instance=flipped), 30,
                            "the flip's end on the page")
        browser.wait(lambda _d: _tile_role(browser, flipped) == "decode", 10, "the flipped instance's new role")
        health = httpx.get(f"{gw.url}/health", timeout=10, trust_env=False).json()["instances"]
        assert health[flipped]["role"] == "decode" and health[flipped]["registered_role"] == "prefill"
        lags["role_flip_started"], lags["role_flip_finished"] = _lag_ms(flip), _lag_ms(done)
        browser.screenshot("dashboard-flip")

        # a long stream decodes on one of the two decode instances; SIGTERM it: the request migrates
        out: dict = {}
        first = threading.Event()
        client = threading.Thread(target=_stream, args=(gw.url, out, first), daemon=True)
        client.start()
        assert first.wait(60), out
        decoding = out["instance"]
        assert decoding in ("e1", flipped), out
        started[decoding].terminate()
        moved = browser.wait(lambda _d: _event(browser, "move_started"), 30, "the migration's start on the page")
        assert f"{decoding} → " in moved.text and "migrating" in moved.text
        landed = browser.wait(lambda _d: _event(browser, "move_finished", outcome="done"), 30,
                              "the migration's end on the page")
        lags["move_started"], lags["move_finished"] = _lag_ms(moved), _lag_ms(landed)
        browser.screenshot("dashboard-migration")
        client.join(120)
        assert out.get("status") == 200 and not out.get("errors") and out.get("finish") == "length", out
        assert started[decoding].wait(60) == 0
        # what the clients saw: the stream's TTFT and its TPOT samples, with their SLOs
        browser.wait(lambda _d: min(browser.js("return [...document.querySelectorAll('tr[data-latency]')]"
                                               ".map((r) => Number(r.dataset.n))") or [0]) >= 1, 15,
                     "the latency figures")
        browser.wait(lambda _d: _tile_role(browser, decoding) is None, 30, "the drained instance gone from the page")
        browser.screenshot("dashboard-live")
        hint = browser.driver.find_element("css selector", "#requests .hint").text
        assert "--otlp-traces-endpoint" in hint  # tracing is off on this gateway: the panel says how to turn it on
        errors = browser.errors()
        assert errors == [], errors
        measured = browser.js("return window.xllmDashboard")
        assert measured["snapshots"] >= 3 and len(measured["latencies_ms"]) >= 4
    print(f"dashboard update latency (published -> shown), ms: {lags}; all live events: "
          f"{measured['latencies_ms']}")
    (artifacts_dir() / "dashboard-latency.json").write_text(json.dumps(
        {"events_ms": lags, "all_live_events_ms": measured["latencies_ms"]}, indent=1))
    assert all(0 <= v < 3000 for v in lags.values()), lags


def _stream(base: str, out: dict, first: threading.Event) -> None:
    """A long greedy streaming completion (with the key); fills ``out`` (instance, status, finish, errors)."""
    body = {"model": MODEL, "prompt": "Once upon a time, in a library by the sea,", "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True, "stream": True}
    out["errors"] = []
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=AUTH, timeout=120,
                          trust_env=False) as r:
            out["status"], out["instance"] = r.status_code, r.headers.get("x-xllm-instance")
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out["errors"].append(event["error"])
                for choice in event.get("choices", []):
                    first.set()
                    out["finish"] = choice.get("finish_reason") or out.get("finish")
    except Exception as exc:  # reported through out
        out["errors"].append(repr(exc))
    finally:
        first.set()


def test_the_page_replays_a_simulated_256_instance_cluster(cluster, sim_run, tmp_path):
    run = sim_run()
    with headless_chromium(tmp_path) as browser:
        browser.open(f"{cluster['gw'].url}/dashboard?replay")
        browser.js("const s = document.getElementById('speed'); s.value = '5';"  # 5 simulated seconds a second
                   "s.dispatchEvent(new Event('change'));")
        browser.driver.find_element("id", "replay-file").send_keys(str(run))
        browser.wait(lambda d: len(d.find_elements("css selector", "#instances.compact .tile")) == 256, 30,
                     "256 instance tiles")
        flip = browser.wait(lambda _d: _event(browser, "role_flip_started"), 60, "a replayed role flip")
        assert "→" in flip.text and flip.get_attribute("data-instance").startswith("e")
        browser.wait(lambda d: d.find_elements("css selector", '.tile[data-flipping="true"]'), 30,
                     "an instance tile flipping")
        state = browser.js("return {frame: window.xllmReplay.frame, shown: window.xllmReplay.shownEvents}")
        assert state["frame"] > 0 and state["shown"] >= 1
        browser.screenshot("dashboard-replay-256")
        assert browser.errors() == []


class Timelines:
    """A test double of the tracing's ``RequestTimelines`` (xllm.gateway.dashboard.hub): two requests of
    three spans, one nested two deep, one failed."""

    def recent(self, limit: int = 50) -> list[dict]:
        def spans(t0: float) -> list[dict]:
            return [{"name": "POST /v1/completions", "span_id": "a", "parent_id": None, "start_unix": t0,
                     "end_unix": t0 + 0.5, "attributes": {"http.status_code": 200}},
                    {"name": "engine.generate", "span_id": "b", "parent_id": "a", "start_unix": t0 + 0.05,
                     "end_unix": t0 + 0.45, "attributes": {"instance": "e0"}},
                    {"name": "engine.prefill", "span_id": "c", "parent_id": "b", "start_unix": t0 + 0.06,
                     "end_unix": t0 + 0.1, "attributes": {"tokens": 12}, "error": True}]
        return [{"trace_id": f"t{i}", "request_id": f"cmpl-{i}", "name": "POST /v1/completions",
                 "start_unix": 1000.0 + i, "duration_s": 0.5, "status": "ok", "spans": spans(1000.0 + i)}
                for i in range(2)][:limit]


def test_the_page_draws_request_timelines_nested_by_parent(tmp_path, smollm2_tokenizer):
    """The requests panel over a test double of the tracing's timelines (the live cluster's gateway traces
    nothing: its panel says how to turn tracing on, checked above)."""
    import uvicorn
    from fastapi import FastAPI

    from xllm.gateway.app import GatewayState
    from xllm.gateway.dashboard import add_dashboard_routes
    from xllm.gateway.metrics import EngineMetrics
    from xllm.gateway.registry import EmbeddedRegistry
    from xllm.testing.fakes import FAKE_MAX_LEN, FAKE_MODEL, FakeEngineClient, make_info
    from xllm.testing.processes import serving_in_thread

    registry = EmbeddedRegistry()
    registry.register(FakeEngineClient(smollm2_tokenizer, [1, 2, 3], make_info("e0")))
    state = GatewayState(registry=registry, tokenizer=smollm2_tokenizer, metrics=EngineMetrics(),
                         default_model=FAKE_MODEL, max_model_len=FAKE_MAX_LEN)
    app = FastAPI()
    add_dashboard_routes(app, state, timelines=Timelines())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    with serving_in_thread(server, 20) as port, headless_chromium(tmp_path) as browser:
        browser.open(f"http://127.0.0.1:{port}/dashboard")
        browser.wait(lambda d: len(d.find_elements("css selector", '.req[data-trace="t1"] .span')) == 3, 15,
                     "a request's three spans")
        rows = browser.js("return [...document.querySelectorAll('.req[data-trace=t0] .span')]"
                          ".map((s) => [Number(s.dataset.depth), s.textContent])")
        assert [(depth, text.split(" ")[-3]) for depth, text in rows] == [
            (0, "/v1/completions"), (1, "engine.generate"), (2, "engine.prefill")], rows
        assert len(browser.driver.find_elements("css selector", '.req[data-trace="t0"] .span.error')) == 1
        browser.js("document.getElementById('requests').scrollIntoView()")
        browser.screenshot("dashboard-requests")
        assert browser.errors() == []


def test_the_page_draws_a_real_traced_request(tmp_path, tiny_model_dir):
    """With tracing on (``xllm serve --otlp-traces-endpoint``, one process), a request's real spans reach the
    requests panel: the gateway's root, its phases and its instance call, the engine's request under that
    call and its prefill and decode under it (depths 0 to 3), as the OTLP receiver also got them."""
    import torch
    import uvicorn

    from xllm.core import EngineConfig
    from xllm.engine_api.tracing import TracingOptions
    from xllm.gateway.embedded import ServeOptions, build_embedded
    from xllm.testing.otlp import OTLPReceiver
    from xllm.testing.processes import serving_in_thread

    cfg = EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05, max_model_len=256, num_threads=1)
    with OTLPReceiver() as receiver:
        app = build_embedded(ServeOptions(model=str(tiny_model_dir), served_model_name=MODEL, engine=cfg,
                                          progress=False, tracing=TracingOptions(receiver.grpc_endpoint)))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        with serving_in_thread(server, 60) as port, headless_chromium(tmp_path) as browser:
            base = f"http://127.0.0.1:{port}"
            r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hello there", "max_tokens": 6},
                           timeout=60, trust_env=False)
            assert r.status_code == 200, r.text
            trace = receiver.wait_for(lambda got: any(s.name == "engine.decode" for s in got))[0].trace_id
            browser.open(f"{base}/dashboard")
            sel = f'.req[data-trace="{trace}"] .span'
            browser.wait(lambda d: len(d.find_elements("css selector", sel)) >= 8, 20, "the request's spans")
            rows = browser.js(f"return [...document.querySelectorAll('{sel}')]"
                              ".map((s) => [Number(s.dataset.depth), s.textContent])")
            depth = {text.split(" ")[-3]: d for d, text in rows}
            assert depth["/v1/completions"] == 0 and depth["route"] == depth["engine.generate"] == 1, rows
            assert (depth["engine.request"], depth["engine.prefill"], depth["engine.decode"]) == (2, 3, 3), rows
            got = {s.name for s in receiver.trace(trace)}
            assert {n for n in depth if not n.startswith("/")} <= got  # the page shows what was exported
            browser.js("document.getElementById('requests').scrollIntoView()")
            browser.screenshot("dashboard-requests-traced")
            assert browser.errors() == []
