"""Scenarios: which systems run what, in what order, and the figures each run leaves in the results.

Servers (xLLM, vLLM, llama.cpp) are started once per (system, dtype), warmed up, run through every online
scenario requested, and stopped by PID before the next system starts, so systems never compete for the
cores. Offline systems (xLLM's engine, HF generate) run as worker processes one after another.

Scenarios:
- ``batch1``: requests one at a time (32-token prompts, 128 output tokens by default), bf16 and fp32;
- ``concurrency``: 16 and 64 requests sent at once (servers) / batched (offline);
- ``sweep``: Poisson (or Gamma) arrivals at searched rates; the highest rate meeting the SLO attainment;
- ``online``: one run at a given rate / arrival process / trace file;
- ``offline``: N requests with length distributions, offline systems only.
"""

from __future__ import annotations

import json
import math
import pathlib
import time
import traceback
from dataclasses import asdict, dataclass, field

from benchmarks import client, offline, workload
from benchmarks.roofline import MachineLimits, ModelShape
from benchmarks.stats import SLO, RequestRecord, serving_summary
from benchmarks.sweep import find_max_rate

SERVER_SYSTEMS = ("xllm", "vllm", "llamacpp")
OFFLINE_SYSTEMS = ("xllm-offline", "hf")
ALL_SYSTEMS = ("xllm", "xllm-offline", "vllm", "llamacpp", "hf")
DISPLAY = {"xllm": "xLLM", "xllm-offline": "xLLM offline", "vllm": "vLLM", "llamacpp": "llama.cpp", "hf": "HF"}
# which systems take part in which scenario (llama.cpp's server serialises requests: batch 1 only)
SCENARIO_SYSTEMS = {
    "batch1": ALL_SYSTEMS,
    "concurrency": ("xllm", "xllm-offline", "vllm", "hf"),
    "sweep": ("xllm", "vllm"),
    "online": ("xllm", "vllm"),
    "offline": OFFLINE_SYSTEMS,
}
DEFAULT_DTYPES = {"batch1": ["bfloat16", "float32"]}
SCENARIOS = ("roofline", "batch1", "concurrency", "sweep", "online", "offline")
ALL = ("roofline", "batch1", "concurrency", "sweep")


@dataclass
class Settings:
    model_dir: pathlib.Path
    out_dir: pathlib.Path
    systems: list[str] = field(default_factory=lambda: list(ALL_SYSTEMS))
    dtypes: list[str] | None = None          # None: each scenario's default (bf16; batch1 bf16 + fp32)
    threads: int = 2
    seed: int = 0
    prompt_len: int = 32
    output_len: int = 128
    batch1_requests: int = 8
    concurrency: list[int] = field(default_factory=lambda: [16, 64])
    rounds: int = 1                          # requests per concurrency level = level x rounds
    slo_tpot_ms: float | None = 100.0
    slo_ttft_ms: float | None = None
    slo_target: float = 0.9
    sweep_requests: int = 64                 # most requests per sweep point
    sweep_point_seconds: float = 60.0        # ... fewer at low rates: about rate x this many (at least 16)
    sweep_start_rate: float = 1.0
    sweep_max_evals: int = 7
    sweep_rel_tol: float = 0.15
    arrival: str = "poisson"                 # poisson | gamma (sweep and online)
    cv: float = 2.0                          # Gamma's coefficient of variation of inter-arrival gaps
    rate: float = 1.0                        # online
    online_requests: int = 64
    trace: pathlib.Path | None = None        # online: replay this trace instead
    trace_speedup: float = 1.0
    offline_requests: int = 64
    offline_prompt_len: str = "uniform:16:256"
    offline_output_len: str = "uniform:32:256"
    offline_batch: int = 64
    vllm_eager: bool = True
    xllm_args: list[str] = field(default_factory=list)  # extra `xllm serve` flags (ablations)
    progress: bool = True

    @property
    def slo(self) -> SLO:
        return SLO(ttft_ms=self.slo_ttft_ms, tpot_ms=self.slo_tpot_ms)

    def dtypes_for(self, scenario: str) -> list[str]:
        return self.dtypes or DEFAULT_DTYPES.get(scenario, ["bfloat16"])

    def to_dict(self) -> dict:
        d = asdict(self)
        return {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in d.items()}


def _compact(records: list[RequestRecord]) -> list[dict]:
    return [{"prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens, "ok": r.success,
             "ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e, "start": r.start} for r in records]


class Bench:
    """One benchmark run: settings in, ``results`` (a JSON-able dict) out, saved after every step."""

    def __init__(self, settings: Settings, results: dict) -> None:
        from benchmarks.prompts import PromptBank

        self.s = settings
        self.results = results
        self.results.setdefault("runs", [])
        self.results.setdefault("sweeps", [])
        self.results.setdefault("errors", [])
        self.results.setdefault("servers", [])
        self.shape = ModelShape.from_dir(settings.model_dir)
        self.bank = PromptBank(settings.model_dir)
        self.limits: MachineLimits | None = None
        self.logs = settings.out_dir / "logs"

    # ---- bookkeeping --------------------------------------------------------------------------
    def save(self) -> None:
        path = self.s.out_dir / "results.json"
        path.write_text(json.dumps(self.results, indent=1, default=_json_default, allow_nan=True))

    def error(self, system: str, what: str, exc: BaseException) -> None:
        msg = f"{DISPLAY.get(system, system)}: {what}: {type(exc).__name__}: {exc}"
        print(f"[bench] ERROR {msg}", flush=True)
        self.results["errors"].append({"system": system, "what": what, "error": str(exc)[:2000],
                                       "traceback": traceback.format_exc()[-3000:]})
        self.save()

    # ---- roofline -------------------------------------------------------------------------------
    def roofline(self) -> MachineLimits:
        from benchmarks.roofline import model_ceilings, probe

        if self.limits is None:
            print("[bench] roofline probe (bandwidth, matmul) ...", flush=True)
            self.limits = probe(self.s.threads)
            self.results["roofline"] = {
                "limits": self.limits.to_dict(),
                "model": {**asdict(self.shape), "params": self.shape.params, "matmul_params": self.shape.matmul_params},
                "ceilings": {dt: model_ceilings(self.shape, self.limits, dt, self.s.prompt_len, self.s.output_len)
                             for dt in ("bfloat16", "float32")},
            }
            self.save()
        return self.limits

    def _fractions(self, summary: dict, dtype: str, batch: int, prompt_len: float, output_len: float) -> dict:
        lim = self.roofline()
        bw, fl = lim.bandwidth, lim.flops(dtype)
        p, o = max(1, round(prompt_len)), max(1, round(output_len))
        ceil_out = self.shape.scenario_ceiling(batch, p, o, dtype, bw, fl)
        ceil_dec = self.shape.decode_ceiling(1, p + o / 2, dtype, bw, fl)
        out = {"batch": batch, "ceiling_output_tok_s": ceil_out,
               "output_fraction": summary.get("output_throughput", math.nan) / ceil_out}
        if batch == 1:
            dec = summary.get("decode_tok_s_per_request", math.nan)
            out.update({"ceiling_decode_tok_s": ceil_dec, "decode_fraction": dec / ceil_dec})
        return out

    # ---- workloads ------------------------------------------------------------------------------
    def fixed_specs(self, n: int, seed: int, arrivals: list[float] | None = None) -> list[client.RequestSpec]:
        prompts = self.bank.prompts([self.s.prompt_len] * n, seed)
        arrivals = arrivals or [0.0] * n
        return [client.RequestSpec(p.ids, p.text, self.s.output_len, a) for p, a in zip(prompts, arrivals)]

    def arrivals(self, rate: float, n: int, seed: int) -> list[float]:
        if self.s.arrival == "gamma":
            return workload.gamma_arrivals(rate, self.s.cv, n, seed)
        if self.s.arrival == "poisson":
            return workload.poisson_arrivals(rate, n, seed)
        raise ValueError(f"unknown arrival process {self.s.arrival!r} (poisson or gamma)")

    # ---- servers --------------------------------------------------------------------------------
    def server_for(self, system: str, dtype: str):
        from benchmarks.peers import llamacpp, vllm, xllm

        if system == "xllm":
            return xllm.server(self.s.model_dir, dtype, self.s.threads, self.logs,
                               extra_args=self.s.xllm_args)
        if system == "vllm":
            return vllm.server(self.s.model_dir, dtype, self.s.threads, self.logs, eager=self.s.vllm_eager)
        if system == "llamacpp":
            return llamacpp.server(self.s.model_dir, dtype, self.s.threads, self.logs)
        raise ValueError(system)

    def profile_for(self, system: str) -> client.EndpointProfile:
        if system == "llamacpp":
            from benchmarks.peers import llamacpp

            return llamacpp.profile(self.s.model_dir)
        return client.EndpointProfile()

    def run_server(self, system: str, dtype: str, scenarios: list[str]) -> None:
        try:
            srv = self.server_for(system, dtype)
            print(f"[bench] starting {DISPLAY[system]} {dtype} server ...", flush=True)
            srv.start()
        except Exception as exc:
            self.error(system, f"install/start ({dtype})", exc)
            return
        try:
            print(f"[bench] {DISPLAY[system]} up in {srv.startup_seconds:.1f}s (pid {srv.pid}) at {srv.base_url}",
                  flush=True)
            self.results["servers"].append({"system": system, "dtype": dtype, "startup_s": srv.startup_seconds,
                                            "cmd": srv.cmd})
            try:
                model = client.served_model(srv.base_url)
                profile = self.profile_for(system)
                self._warmup(srv.base_url, model, profile)
            except Exception as exc:
                self.error(system, f"warm-up ({dtype})", exc)
                return
            for sc in scenarios:
                try:
                    getattr(self, f"_{sc}_server")(system, dtype, srv.base_url, model, profile)
                except Exception as exc:
                    self.error(system, f"{sc} ({dtype})", exc)
                self.save()
        finally:
            srv.stop()

    def _warmup(self, base_url: str, model: str, profile: client.EndpointProfile) -> None:
        prompts = self.bank.prompts([16] * 4, seed=12345)
        specs = [client.RequestSpec(p.ids, p.text, 8) for p in prompts]
        records, _ = client.run(base_url, model, specs, profile, 4)
        bad = [r.error for r in records if not r.success]
        if bad:
            raise RuntimeError(f"warm-up requests failed: {bad[0]}")

    def _record(self, scenario: str, system: str, dtype: str, params: dict, summary: dict, records, fractions=None,
                label: str | None = None) -> dict:
        entry = {"scenario": scenario, "label": label or scenario, "system": system, "dtype": dtype,
                 "kind": "offline" if system in OFFLINE_SYSTEMS else "server", "params": params, "summary": summary,
                 "roofline": fractions or {}, "records": _compact(records)}
        self.results["runs"].append(entry)
        self.save()
        return entry

    def _say(self, system: str, label: str, dtype: str, summary: dict) -> None:
        print(f"[bench] {DISPLAY[system]:>12} {label:<16} {dtype:<8} out {summary['output_throughput']:8.1f} tok/s"
              f"  TTFT p50 {summary['ttft_ms']['p50']:8.1f} ms"
              f"  decode/req {summary.get('decode_tok_s_per_request', math.nan):6.1f} tok/s", flush=True)

    def _batch1_server(self, system, dtype, base_url, model, profile) -> None:
        specs = self.fixed_specs(self.s.batch1_requests, seed=self.s.seed + 1)
        records, dur = client.run(base_url, model, specs, profile, 1, self._desc(system, "batch-1", dtype))
        summary = serving_summary(records, dur)
        self._check_lengths(system, records)
        fr = self._fractions(summary, dtype, 1, self.s.prompt_len, self.s.output_len)
        self._record("batch1", system, dtype, {"requests": len(specs), "concurrency": 1,
                                               "prompt_len": self.s.prompt_len, "output_len": self.s.output_len},
                     summary, records, fr)
        self._say(system, "batch-1", dtype, summary)

    def _concurrency_server(self, system, dtype, base_url, model, profile) -> None:
        for level in self.s.concurrency:
            specs = self.fixed_specs(level * self.s.rounds, seed=self.s.seed + 100 + level)
            records, dur = client.run(base_url, model, specs, profile, level,
                                      self._desc(system, f"{level} concurrent", dtype))
            summary = serving_summary(records, dur)
            self._check_lengths(system, records)
            fr = self._fractions(summary, dtype, level, self.s.prompt_len, self.s.output_len)
            self._record("concurrency", system, dtype, {"requests": len(specs), "concurrency": level,
                                                        "prompt_len": self.s.prompt_len,
                                                        "output_len": self.s.output_len},
                         summary, records, fr, label=f"concurrency-{level}")
            self._say(system, f"{level} concurrent", dtype, summary)

    def _sweep_server(self, system, dtype, base_url, model, profile) -> None:
        slo = self.s.slo
        points: list[dict] = []

        def evaluate(rate: float) -> float:
            n = sweep_point_requests(rate, self.s.sweep_requests, self.s.sweep_point_seconds)
            specs = self.fixed_specs(n, seed=self.s.seed + 7, arrivals=self.arrivals(rate, n, self.s.seed + 7))
            records, dur = client.run(base_url, model, specs, profile, None,
                                      self._desc(system, f"sweep {rate:.2f}/s", dtype))
            summary = serving_summary(records, dur, slo)
            points.append({"rate": rate, "requests": n, "attainment": summary["slo_attainment"], "summary": summary,
                           "records": _compact(records)})
            print(f"[bench] {DISPLAY[system]:>12} sweep rate {rate:6.2f}/s: attainment {summary['slo_attainment']:.2f}"
                  f" (TPOT p50 {summary['tpot_ms']['p50']:.0f} ms, p90 {summary['tpot_ms']['p90']:.0f} ms;"
                  f" TTFT p50 {summary['ttft_ms']['p50']:.0f} ms), goodput {summary['goodput']:.2f} req/s", flush=True)
            return summary["slo_attainment"]

        res = find_max_rate(evaluate, self.s.slo_target, self.s.sweep_start_rate, max_evals=self.s.sweep_max_evals,
                            rel_tol=self.s.sweep_rel_tol)
        best = next((p for p in points if p["rate"] == res.best_rate), None)
        self.results["sweeps"].append({
            "system": system, "dtype": dtype, "arrival": self.s.arrival,
            "cv": self.s.cv if self.s.arrival == "gamma" else 1.0, "slo": asdict(slo),
            "slo_text": slo.describe(), "target": self.s.slo_target, "best_rate": res.best_rate,
            "first_failing_rate": res.first_failing_rate,
            "goodput_at_best": best["summary"]["goodput"] if best else None,
            "points": sorted(points, key=lambda p: p["rate"])})
        self.save()
        print(f"[bench] {DISPLAY[system]:>12} sweep: highest rate with >= {self.s.slo_target:.0%} of requests meeting "
              f"{slo.describe()}: {res.best_rate} req/s", flush=True)

    def _online_server(self, system, dtype, base_url, model, profile) -> None:
        if self.s.trace is not None:
            entries = workload.scale_trace(workload.load_trace(self.s.trace), self.s.trace_speedup)
            prompts = self.bank.prompts([e.prompt_len for e in entries], self.s.seed + 3)
            specs = [client.RequestSpec(p.ids, p.text, e.output_len, e.arrival) for p, e in zip(prompts, entries)]
            label = f"trace {self.s.trace.name} x{self.s.trace_speedup:g}"
        else:
            n = self.s.online_requests
            specs = self.fixed_specs(n, self.s.seed + 5, self.arrivals(self.s.rate, n, self.s.seed + 5))
            label = f"{self.s.arrival} {self.s.rate:g}/s" + (f" cv {self.s.cv:g}" if self.s.arrival == "gamma" else "")
        records, dur = client.run(base_url, model, specs, profile, None, self._desc(system, label, dtype))
        summary = serving_summary(records, dur, self.s.slo)
        self._record("online", system, dtype, {"requests": len(specs), "workload": label}, summary, records,
                     label=f"online {label}")
        self._say(system, "online", dtype, summary)

    def _check_lengths(self, system: str, records: list[RequestRecord]) -> None:
        short = [r for r in records if r.success and r.output_tokens != self.s.output_len]
        if short:
            print(f"[bench] WARNING {DISPLAY[system]}: {len(short)} responses had {short[0].output_tokens} tokens "
                  f"instead of {self.s.output_len}", flush=True)

    def _desc(self, system: str, what: str, dtype: str) -> str | None:
        return f"{DISPLAY[system]} {what} {dtype}" if self.s.progress else None

    # ---- offline --------------------------------------------------------------------------------
    def run_offline(self, system: str, dtype: str, scenarios: list[str]) -> None:
        from benchmarks.peers import hf, xllm

        try:
            if system == "hf":
                python, worker = hf.python(), hf.WORKER
            else:
                python, worker = xllm.python(), xllm.WORKER
        except Exception as exc:
            self.error(system, "install", exc)
            return
        for sc in scenarios:
            for label, prompts, out_lens, batch in self._offline_jobs(sc):
                try:
                    job = offline.job(self.s.model_dir, dtype, self.s.threads, [p.ids for p in prompts], out_lens,
                                      batch, self._desc(system, label, dtype) or "")
                    res = offline.run_worker(python, worker, job, self.logs / f"{system}-worker-{dtype}.log")
                    summary = offline.summarize_worker(res)
                    mean_p = sum(len(p.ids) for p in prompts) / len(prompts)
                    mean_o = sum(out_lens) / len(out_lens)
                    fr = self._fractions(summary, dtype, min(batch, len(prompts)), mean_p, mean_o)
                    self.results.setdefault("worker_versions", {})[system] = res.get("versions", {})
                    self._record(sc, system, dtype, {"requests": len(prompts), "batch": batch,
                                                     "prompt_len": mean_p, "output_len": mean_o},
                                 summary, offline.records_of(res), fr, label=label)
                    self._say(system, label, dtype, summary)
                except Exception as exc:
                    self.error(system, f"{label} ({dtype})", exc)

    def _offline_jobs(self, scenario: str):
        s = self.s
        if scenario == "batch1":
            ps = self.bank.prompts([s.prompt_len] * s.batch1_requests, s.seed + 1)
            yield "batch1", ps, [s.output_len] * len(ps), 1
        elif scenario == "concurrency":
            for level in s.concurrency:
                ps = self.bank.prompts([s.prompt_len] * (level * s.rounds), s.seed + 100 + level)
                yield f"concurrency-{level}", ps, [s.output_len] * len(ps), level
        elif scenario == "offline":
            rng_seed = s.seed + 11
            plens = workload.LengthDist.parse(s.offline_prompt_len).sample(s.offline_requests, rng_seed)
            olens = workload.LengthDist.parse(s.offline_output_len).sample(s.offline_requests, rng_seed + 1)
            ps = self.bank.prompts(plens, rng_seed)
            yield f"offline {s.offline_prompt_len} -> {s.offline_output_len}", ps, olens, s.offline_batch


def sweep_point_requests(rate: float, most: int, seconds: float, least: int = 16) -> int:
    """Requests for one sweep point: about ``rate x seconds`` of arrivals, within [min(least, most), most]."""
    return max(min(least, most), min(most, math.ceil(rate * seconds)))


def _json_default(obj):
    if isinstance(obj, pathlib.Path):
        return str(obj)
    raise TypeError(f"not JSON-serialisable: {type(obj).__name__}")


def plan(scenarios: list[str], settings: Settings) -> list[tuple[str, str, list[str]]]:
    """``(system, dtype, [scenarios])`` in run order: each server started once per dtype."""
    out = []
    for system in ALL_SYSTEMS:
        if system not in settings.systems:
            continue
        by_dtype: dict[str, list[str]] = {}
        for sc in scenarios:
            if sc == "roofline" or system not in SCENARIO_SYSTEMS.get(sc, ()):
                continue
            for dt in settings.dtypes_for(sc):
                by_dtype.setdefault(dt, []).append(sc)
        out.extend((system, dt, scs) for dt, scs in by_dtype.items())
    return out


def run_all(scenarios: list[str], settings: Settings, meta: dict) -> dict:
    """Run ``scenarios`` for ``settings.systems``; returns (and keeps saving) the results dict."""
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"meta": meta}
    bench = Bench(settings, results)
    bench.save()
    bench.roofline()
    steps = plan(scenarios, settings)
    t0 = time.time()
    for i, (system, dtype, scs) in enumerate(steps, 1):
        print(f"[bench] ({i}/{len(steps)}) {DISPLAY[system]} {dtype}: {', '.join(scs)}", flush=True)
        if system in SERVER_SYSTEMS:
            bench.run_server(system, dtype, scs)
        else:
            bench.run_offline(system, dtype, scs)
    results["meta"]["elapsed_s"] = time.time() - t0
    bench.save()
    return results


__all__ = ["ALL", "ALL_SYSTEMS", "DISPLAY", "SCENARIOS", "Bench", "Settings", "plan", "run_all"]
