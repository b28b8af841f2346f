"""``xllm-sim``: simulate an xLLM cluster on a trace, with the real ``xllm.sched`` policies.

    xllm-sim run --instances 200 --requests 100000 --trace gamma --rate 150 --cv 4 --json out.json
    xllm-sim run --prefill-instances 60 --decode-instances 140 --pd-policy dynamic \\
        --slo-ttft-ms 2000 --slo-tpot-ms 100 --trace gamma --rate 150 --cv 4 --requests 100000
    xllm-sim run --prefill-instances 100 --decode-instances 100 --pd-policy dynamic --trace phases \
        --phase-s 60,60 --rate 80 --slo-ttft-ms 3000 --slo-tpot-ms 150 --requests 100000
    xllm-sim run --instances 4 --trace azure_conv_2023.csv --rate 8 --requests 5000
    xllm-sim epd --total-instances 4 --prompt-len 256 --output-len 64 --image-fraction 0.5 \
        --encode-image-ms 300 --rate 2 --slo-ttft-ms 2000 --slo-tpot-ms 100   # EPD: the profiler's pick, simulated
    xllm-sim policies                     # the policy names each flag takes
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from xllm.common.argtypes import fraction, non_negative_float, non_negative_int, positive_float, positive_int
from xllm.sched import BATCH_POLICIES, DEFAULT_OFFLINE_SLO_FRACTION, ROUTING_POLICIES
from xllm.sched.encode import DEFAULT_MAX_ENCODE_IMAGES
from xllm.sched.registry import EPD_STRATEGIES, PD_POLICIES
from xllm.sim.cluster import Cluster
from xllm.sim.config import DEFAULT_KV_BLOCKS, SMOLLM2_BLOCK_SIZE, SMOLLM2_KV_BYTES_PER_TOKEN, SimConfig
from xllm.sim.profile import DEFAULT_PROFILE, is_provisional, load_model
from xllm.sim.trace import (
    ARRIVALS,
    DECODE_HEAVY,
    PREFILL_HEAVY,
    LengthDist,
    RequestSpec,
    TraceError,
    Workload,
    decorate,
    load_trace,
    synthetic,
)


def _canonical(table):
    def parse(text: str) -> str:
        try:
            return table.canonical(text)
        except ValueError:
            return text  # argparse names the choices
    return parse


def phase_seconds(text: str) -> tuple[float, float]:
    """``--phase-s``: ``S`` (both phases S seconds) or ``P,D`` (prefill-heavy P, decode-heavy D)."""
    parts = [x.strip() for x in text.split(",")]
    try:
        values = [float(x) for x in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected S or P,D (seconds > 0), got {text!r}")
    return (values[0], values[-1])


def length_mix(text: str) -> tuple[str, str]:
    """``--prefill-mix`` / ``--decode-mix``: ``PROMPT,OUTPUT`` length specs."""
    parts = [x.strip() for x in text.split(",")]
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected PROMPT,OUTPUT (two length specs), got {text!r}")
    for spec in parts:
        try:
            LengthDist.parse(spec)
        except TraceError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return (parts[0], parts[1])


def add_run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--instances", type=positive_int, default=2,
                   help="mixed instances (each prefills and decodes); ignored in PD mode (default 2)")
    g.add_argument("--prefill-instances", type=int, default=0,
                   help="PD mode: prefill instances at the start (with --decode-instances)")
    g.add_argument("--decode-instances", type=int, default=0,
                   help="PD mode: decode instances at the start (with --prefill-instances)")
    g.add_argument("--policy", "--routing", dest="routing", default="kv_aware", choices=ROUTING_POLICIES.names(),
                   type=_canonical(ROUTING_POLICIES),
                   help="gateway routing policy (xllm.sched.ROUTING_POLICIES); in PD mode it ranks the prefill "
                        "instances and PDPlacement picks the decode one (default kv_aware)")
    g.add_argument("--batch-policy", default="decode_first", choices=BATCH_POLICIES.choices(),
                   help="engine batch policy (xllm.sched.BATCH_POLICIES): decode_first, or colocation (offline "
                        "requests fill what online ones leave within --slo-tpot-ms) (default decode_first)")
    g.add_argument("--offline-slo-fraction", type=fraction, default=DEFAULT_OFFLINE_SLO_FRACTION, metavar="F",
                   help="colocation: offline work joins steps only as far as the average predicted step online "
                        "decodes see stays within F x --slo-tpot-ms (the engine's flag of the same name; default "
                        "%(default)s)")
    g.add_argument("--pd-policy", default="static", choices=PD_POLICIES.choices(),
                   help="PD role policy (xllm.sched.PD_POLICIES): static, or dynamic (role flips by SLO headroom; "
                        "needs both SLOs) (default static)")
    g.add_argument("--pd-interval-s", type=positive_float, default=0.5,
                   help="seconds between role-flip decisions (default 0.5, the gateway's)")
    g.add_argument("--drain-moves", default="auto", choices=["auto", "migrate", "recompute", "off"],
                   help="how a decode instance flipping to prefill sheds its requests: by predicted cost "
                        "(xllm.sched.move_cost), always migrate, always recompute, or off (they finish there) "
                        "(default auto)")
    g.add_argument("--pd-flip-window", type=non_negative_float, default=5.0, metavar="SECONDS",
                   help="dynamic: how long a pressure must hold before it flips (default 5, the gateway's)")
    g.add_argument("--pd-flip-cooldown", type=non_negative_float, default=30.0, metavar="SECONDS",
                   help="dynamic: an instance flips at most once per this (default 30, the gateway's)")
    g.add_argument("--pd-cluster-cooldown", type=non_negative_float, default=10.0, metavar="SECONDS",
                   help="dynamic: seconds between two flip decisions of the cluster (default 10, the gateway's)")
    g.add_argument("--pd-max-in-progress", type=positive_int, default=None, metavar="N",
                   help="dynamic: flips under way at once (default: a tenth of the instances, at least 1, as the "
                        "gateway's --pd-max-flips)")
    g.add_argument("--pd-max-flips", type=positive_int, default=None, metavar="N",
                   help="dynamic: instances one decision may flip together, as the pressure needs and the other "
                        "side can spare (at most --pd-max-in-progress under way; default: a tenth of the "
                        "instances, at least 1, the gateway's)")
    g.add_argument("--epd-strategy", default="ep+d", type=str.lower, choices=EPD_STRATEGIES.choices(),
                   help="PD mode, requests with images: encode them where the prompt is prefilled (ep+d), on "
                        "--encode-instances encode-only instances (e+p+d) or on the decode instances (ed+p), as "
                        "the gateway's flag of the same name (default ep+d)")
    g.add_argument("--encode-instances", type=non_negative_int, default=0,
                   help="e+p+d: instances that only encode images (default 0)")
    g.add_argument("--embedding-transfer-ms", type=non_negative_float, default=0.0,
                   help="e+p+d, ed+p: one request's embeddings from the encoding instance to the prefill "
                        "placement, ms (default 0)")
    g.add_argument("--pd-prefill-overflow", action=argparse.BooleanOptionalAction, default=True,
                   help="PD mode with --slo-ttft-ms: a request every prefill instance is predicted to miss the "
                        "TTFT objective on runs whole on a decode instance that meets it (no hand-off; the "
                        "gateway's flag of the same name) (default on)")
    g = p.add_argument_group("engine (each instance)")
    g.add_argument("--profile", type=Path, default=None,
                   help=f"step-time profile written by `xllm profile` (default: the shipped {DEFAULT_PROFILE.name})")
    g.add_argument("--speed", type=positive_float, default=1.0,
                   help="instances are this many times faster than the profile (default 1)")
    g.add_argument("--step-noise", type=non_negative_float, default=0.0, metavar="SIGMA",
                   help="each step takes the model's time times a lognormal factor of mean 1 and log-deviation "
                        "SIGMA (about 1.25x the mean relative error of the engine's step predictions, "
                        "xllm:step_time_prediction_error_recent); the policies still predict the model's "
                        "(default 0: exactly the model's)")
    g.add_argument("--max-num-seqs", type=positive_int, default=64, help="sequences per step (default 64)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=512,
                   help="token budget per step (default 512, the engine's)")
    g.add_argument("--no-chunked-prefill", action="store_true", help="a prompt must fit one step's budget")
    g.add_argument("--block-size", type=positive_int, default=SMOLLM2_BLOCK_SIZE,
                   help=f"KV block size in tokens (default {SMOLLM2_BLOCK_SIZE}: xTensor's for SmolLM2)")
    g.add_argument("--kv-blocks", type=positive_int, default=DEFAULT_KV_BLOCKS,
                   help=f"KV capacity per instance in blocks (default {DEFAULT_KV_BLOCKS}: 2 GiB of SmolLM2 bf16)")
    g.add_argument("--max-model-len", type=int, default=0, help="longest sequence in tokens (default 0: unbounded)")
    g.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    g.add_argument("--max-encode-images", type=non_negative_int, default=DEFAULT_MAX_ENCODE_IMAGES,
                   help="images one step encodes in the encode phase of image requests (the engine's flag; 0: "
                        f"each image in its request's first prefill step; default {DEFAULT_MAX_ENCODE_IMAGES})")
    g.add_argument("--encode-image-ms", type=non_negative_float, default=20.0,
                   help="encode time of one image, ms (the engine logs its profile's times; default 20)")
    g = p.add_argument_group("costs")
    g.add_argument("--kv-bytes-per-token", type=positive_int, default=SMOLLM2_KV_BYTES_PER_TOKEN,
                   help=f"KV bytes per token (default {SMOLLM2_KV_BYTES_PER_TOKEN}: SmolLM2 bf16)")
    g.add_argument("--kv-bandwidth-gbs", type=positive_float, default=1.0,
                   help="KV transfer bandwidth into an instance, GB/s (PD hand-offs, migrations; default 1)")
    g.add_argument("--transfer-latency-ms", type=non_negative_float, default=0.0,
                   help="fixed cost of each KV transfer, ms (default 0)")
    g.add_argument("--gateway-overhead-ms", type=non_negative_float, default=0.0,
                   help="gateway time before a request is dispatched, ms (default 0)")
    g.add_argument("--heartbeat-s", type=non_negative_float, default=0.5,
                   help="load reports reach the gateway this often; 0 = policies see live state (default 0.5)")
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default="poisson",
                   help="poisson, gamma, phases (Gamma arrivals, prefill-heavy and decode-heavy periods "
                        "alternating: --phase-s, --prefill-mix, --decode-mix), or a CSV file: Azure LLM inference "
                        "trace (TIMESTAMP,ContextTokens,GeneratedTokens) or arrival,prompt_len,output_len "
                        "(default poisson)")
    g.add_argument("--requests", type=positive_int, default=1000,
                   help="requests to simulate (a trace file: its first R; default 1000)")
    g.add_argument("--rate", type=positive_float, default=None,
                   help="arrival rate, req/s (poisson/gamma: default 1; a trace file: rescale its timestamps to "
                        "this mean rate; default: as recorded)")
    g.add_argument("--cv", type=positive_float, default=4.0,
                   help="gamma, phases: coefficient of variation of the gaps (> 1 is bursty; default 4)")
    g.add_argument("--phase-s", type=phase_seconds, default=(60.0, 60.0), metavar="P[,D]",
                   help="phases: seconds of each prefill-heavy period and of each decode-heavy one (one value: "
                        "both); the trace starts prefill-heavy (default 60,60)")
    g.add_argument("--prefill-mix", type=length_mix, default=PREFILL_HEAVY, metavar="PROMPT,OUTPUT",
                   help="phases: prompt and output length specs of prefill-heavy periods "
                        f"(default {','.join(PREFILL_HEAVY)})")
    g.add_argument("--decode-mix", type=length_mix, default=DECODE_HEAVY, metavar="PROMPT,OUTPUT",
                   help="phases: prompt and output length specs of decode-heavy periods "
                        f"(default {','.join(DECODE_HEAVY)})")
    g.add_argument("--prompt-len", default="lognormal:512:0.6:2048",
                   help="poisson, gamma: prompt tokens: N, uniform:LO:HI or lognormal:MEAN:SIGMA[:MAX] "
                        "(default lognormal:512:0.6:2048)")
    g.add_argument("--output-len", default="lognormal:128:0.6:512",
                   help="output tokens, same syntax (default lognormal:128:0.6:512)")
    g.add_argument("--prefix-groups", type=int, default=0,
                   help="shared system prompts (Zipf popularity); 0 = none (default 0)")
    g.add_argument("--prefix-len", type=int, default=0, help="tokens of each shared system prompt (default 0)")
    g.add_argument("--offline-fraction", type=float, default=0.0,
                   help="fraction of requests that are offline (service_tier flex) (default 0)")
    g.add_argument("--image-fraction", type=float, default=0.0,
                   help="fraction of requests that carry images (their image tokens are part of the prompt "
                        "length) (default 0)")
    g.add_argument("--images-per-request", type=positive_int, default=1,
                   help="images of each request that has images (default 1)")
    g.add_argument("--seed", type=int, default=0, help="random seed of the workload (default 0)")
    g = p.add_argument_group("objectives and output")
    g.add_argument("--slo-ttft-ms", type=positive_float, default=None,
                   help="online TTFT objective, ms: SLO attainment, goodput, dynamic PD")
    g.add_argument("--slo-tpot-ms", type=positive_float, default=None,
                   help="online TPOT objective, ms: SLO attainment, goodput, dynamic PD, co-location")
    g.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the report as JSON to OUT")
    g.add_argument("--records", type=Path, default=None, metavar="FILE",
                   help="write one JSON line per request (times, instances) to FILE")
    g.add_argument("--timeline", type=positive_float, default=None, metavar="SECONDS",
                   help="with --json: add a timeline to the report, a frame every SECONDS simulated (each "
                        "instance's role, load and KV use) and the role flips and moves as they happen, which "
                        "the gateway's live cluster page replays (/dashboard?replay); the JSON is then written compact "
                        "(default: none)")
    g.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xllm-sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="simulate a cluster on a trace", description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(run)
    epd = sub.add_parser("epd", help="rank EPD layouts for a workload and check the pick by simulation",
                         description=epd_doc(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(epd)
    epd.add_argument("--total-instances", type=positive_int, default=4,
                     help="instances to split between encode, prefill and decode (default 4)")
    epd.add_argument("--simulate", choices=["best", "all"], default="best",
                     help="simulate the best-ranked layout of each strategy, or every layout (default best)")
    sub.add_parser("policies", help="list the policy names of --policy, --batch-policy, --pd-policy and "
                                    "--epd-strategy")
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        instances=args.instances, prefill_instances=args.prefill_instances, decode_instances=args.decode_instances,
        routing=ROUTING_POLICIES.canonical(args.routing), batch_policy=BATCH_POLICIES.canonical(args.batch_policy),
        pd_policy=PD_POLICIES.canonical(args.pd_policy), max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, chunked_prefill=not args.no_chunked_prefill,
        block_size=args.block_size, kv_blocks=args.kv_blocks, max_model_len=args.max_model_len,
        prefix_cache=not args.no_prefix_cache, kv_bytes_per_token=args.kv_bytes_per_token,
        kv_bandwidth=args.kv_bandwidth_gbs * 1e9, transfer_latency_s=args.transfer_latency_ms / 1e3,
        gateway_overhead_s=args.gateway_overhead_ms / 1e3, speed=args.speed, step_noise=args.step_noise,
        heartbeat_s=args.heartbeat_s,
        pd_interval_s=args.pd_interval_s, drain_moves=args.drain_moves, pd_window_s=args.pd_flip_window,
        pd_cooldown_s=args.pd_flip_cooldown, pd_cluster_cooldown_s=args.pd_cluster_cooldown,
        pd_max_in_progress=args.pd_max_in_progress, pd_max_flips=args.pd_max_flips,
        pd_overflow=args.pd_prefill_overflow,
        slo_ttft_s=None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1e3,
        slo_tpot_s=None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1e3,
        offline_slo_fraction=args.offline_slo_fraction, max_encode_images=args.max_encode_images,
        encode_image_s=args.encode_image_ms / 1e3, epd_strategy=args.epd_strategy,
        encode_instances=args.encode_instances, embedding_transfer_s=args.embedding_transfer_ms / 1e3)


def workload_from_args(args: argparse.Namespace) -> list[RequestSpec] | Workload:
    """A :class:`Workload` for poisson/gamma/phases, or the requests of a trace file."""
    w = Workload(arrivals=args.trace if args.trace in ARRIVALS else "poisson",
                 rate=args.rate or 1.0, cv=args.cv, prompt=args.prompt_len, output=args.output_len,
                 prefix_groups=args.prefix_groups, prefix_len=args.prefix_len, offline_fraction=args.offline_fraction,
                 image_fraction=args.image_fraction, images_per_request=args.images_per_request,
                 phase_s=args.phase_s, prefill_mix=args.prefill_mix, decode_mix=args.decode_mix)
    w.check()
    if args.trace in ARRIVALS:
        return w
    specs = load_trace(args.trace, args.requests)
    if args.rate:
        span = specs[-1].arrival
        if span > 0 and len(specs) > 1:
            k = (len(specs) - 1) / span / args.rate  # recorded mean rate over the wanted one
            specs = [RequestSpec(s.rid, s.arrival * k, s.prompt_len, s.output_len) for s in specs]
    return decorate(specs, w, args.seed)


class ProgressLine:
    """``done/total requests`` on stderr, rewritten in place."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.t0 = time.monotonic()

    def __call__(self, done: int, arrived: int, now: float) -> None:
        wall = time.monotonic() - self.t0
        end = "\n" if done >= self.total else ""
        sys.stderr.write(f"\r[xllm-sim] {done}/{self.total} requests finished ({arrived} arrived), "
                         f"{now:.1f} s simulated, {wall:.1f} s wall{end}")
        sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        cfg.check()
        model, profile = load_model(args.profile)
        work = workload_from_args(args)
    except (TraceError, ValueError, OSError) as exc:
        print(f"xllm-sim: error: {exc}", file=sys.stderr)
        return 2
    specs = synthetic(work, args.requests, args.seed) if isinstance(work, Workload) else work
    total = args.requests if isinstance(work, Workload) else len(work)
    try:
        cluster = Cluster(cfg, model)
    except ValueError as exc:  # a policy refusing its settings (dynamic PD without SLOs ...)
        print(f"xllm-sim: error: {exc}", file=sys.stderr)
        return 2
    if args.timeline is not None:
        cluster.record_timeline(args.timeline)
    t0 = time.monotonic()
    cluster.run(specs, None if args.no_progress else ProgressLine(total))
    wall = time.monotonic() - t0
    result = cluster.report()
    result["wall_seconds"] = wall
    result["config"] = {k: v for k, v in vars(cfg).items()}
    result["workload"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                          if k in ("trace", "requests", "rate", "cv", "prompt_len", "output_len", "prefix_groups",
                                   "prefix_len", "offline_fraction", "image_fraction", "images_per_request", "seed")
                          or (args.trace == "phases" and k in ("phase_s", "prefill_mix", "decode_mix"))}
    result["profile"] = {"path": str(args.profile or DEFAULT_PROFILE), "model": profile.model,
                         "machine": profile.machine, "provisional": is_provisional(args.profile),
                         "coefficients": model.to_dict()}
    if cluster.timeline is not None:
        result["timeline"] = cluster.timeline.to_dict(cluster.requests)
    if args.json is not None:
        indent = 1 if cluster.timeline is None else None  # a timeline's frames are long lists of numbers
        args.json.write_text(json.dumps(result, indent=indent, default=float))
    if args.records is not None:
        with args.records.open("w") as f:
            for r in cluster.requests:
                f.write(json.dumps(r.to_dict()) + "\n")
    print(headline(result))
    return 0


def epd_doc() -> str:
    from xllm.sim import epd

    return epd.__doc__ or ""


def run_epd(args: argparse.Namespace) -> int:
    """``xllm-sim epd`` (:mod:`xllm.sim.epd`)."""
    from xllm.sim.epd import run_epd as rank_and_simulate

    try:
        cfg = config_from_args(args)
        model, _ = load_model(args.profile)
        work = workload_from_args(args)
        specs = list(synthetic(work, args.requests, args.seed)) if isinstance(work, Workload) else work
        rank_and_simulate(cfg, model, specs, args.total_instances, args.simulate == "all",
                          args.embedding_transfer_ms / 1e3, args.json)
    except (TraceError, ValueError, OSError) as exc:
        print(f"xllm-sim: error: {exc}", file=sys.stderr)
        return 2
    return 0


def headline(r: dict) -> str:
    """A few lines a person reads."""
    lines = [f"{r['completed']}/{r['requests']} requests in {r['duration_s']:.1f} s simulated "
             f"({r['wall_seconds']:.1f} s wall, {r['events']} events): {r['request_throughput']:.2f} req/s, "
             f"{r['output_throughput']:.0f} output tok/s",
             "TTFT ms p50/p90/p99 {p50:.0f}/{p90:.0f}/{p99:.0f}".format(**r["ttft_ms"]) +
             "; TPOT ms {p50:.1f}/{p90:.1f}/{p99:.1f}".format(**r["tpot_ms"]) +
             "; E2E ms {p50:.0f}/{p90:.0f}/{p99:.0f}".format(**r["e2e_ms"]),
             f"SLO attainment {r['slo_attainment']:.1%}, goodput {r['goodput']:.2f} req/s; offline "
             f"{r['offline']['output_throughput']:.0f} tok/s; role flips {r['role_flips']}; preemptions "
             f"{r['preemptions']}; utilisation mean {r['utilisation']['mean']:.0%}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "policies":
        for flag, table in (("--policy", ROUTING_POLICIES), ("--batch-policy", BATCH_POLICIES),
                            ("--pd-policy", PD_POLICIES), ("--epd-strategy", EPD_STRATEGIES)):
            print(f"{flag}: {', '.join(table.names())}")
        return 0
    return run_epd(args) if args.command == "epd" else run(args)


if __name__ == "__main__":
    sys.exit(main())
