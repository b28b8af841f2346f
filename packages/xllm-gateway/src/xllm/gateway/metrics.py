"""Prometheus metrics with vLLM's metric names under the ``xllm:`` prefix.

Each app owns its :class:`~prometheus_client.CollectorRegistry` (no global
state). Per instance (label ``instance``):

- in-process engines feed :class:`EngineMetrics` through its
  :class:`~xllm.core.StatsObserver` (the engine thread calls ``on_step`` after every step), their step
  distributions (TTFT, ITL, batch sizes: :class:`~xllm.engine_api.metrics.StepHistograms`) included;
- remote engines report cumulative counters and load in their registry heartbeats, which
  :meth:`EngineMetrics.set_counters` / :meth:`EngineMetrics.set_load` turn into the same series; their
  step distributions are on their own ``/metrics`` (``xllm engine --metrics-port``), not here.

Aggregated over a model's instances: ``xllm:cluster_*`` gauges (:meth:`EngineMetrics.set_cluster`).
Routing (gateway side): ``xllm:router_*`` series of :class:`RouterMetrics`; the etcd registry's
watch: ``xllm:registry_watch_*`` of :class:`RegistryMetrics`.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from xllm.engine_api.metrics import LATENCY_BUCKETS, StepHistograms
from xllm.engine_api.stats import StepStats
from xllm.proto.enums import ROLE_NAMES
from xllm.proto.registry.v1 import instance_pb2

_HANDOFF_OUTCOMES = (("sent", "kv_handoffs_sent"), ("installed", "kv_handoffs_installed"),
                     ("failed", "kv_handoff_failures"), ("timeout", "kv_handoff_timeouts"),
                     ("expired", "kv_reservations_expired"))
_MIGRATION_OUTCOMES = (("sent", "kv_migrations_sent"), ("installed", "kv_migrations_installed"),
                       ("failed", "kv_migration_failures"))
_OFFLINE_PREEMPTION_REASONS = (("kv", "offline_preemptions_kv"), ("batch_full", "offline_preemptions_batch_full"),
                               ("slo", "offline_preemptions_slo"))


class EngineMetrics:
    """Metrics of one or more engine instances, labelled by model and instance."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["model_name", "instance"]
        self.running = Gauge("xllm:num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.waiting = Gauge("xllm:num_requests_waiting", "Requests waiting to be scheduled.", labels, registry=r)
        self.kv_usage = Gauge("xllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", labels,
                              registry=r)
        self.prompt_tokens = Counter("xllm:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("xllm:generation_tokens", "Tokens generated.", labels, registry=r)
        self.prefix_queries = Counter("xllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      labels, registry=r)
        self.prefix_hits = Counter("xllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels,
                                   registry=r)
        self.preemptions = Counter("xllm:num_preemptions", "Sequences preempted for KV memory.", labels, registry=r)
        self.steps = StepHistograms(r)  # distributions of in-process engines' steps (xllm.engine_api.metrics)
        self.step_prediction_error_recent = Gauge(
            "xllm:step_time_prediction_error_recent", "Exponentially weighted mean of the step-time prediction's "
            "relative error over recent steps, as the instance reports it (0: no prediction yet).", labels,
            registry=r)
        self.step_time_correction = Gauge(
            "xllm:step_time_correction_factor", "Measured over predicted step time of the instance's step-time "
            "model (online correction; 1 = none).", labels, registry=r)
        self.step_measured_seconds = Counter(
            "xllm:step_time_measured_seconds", "Measured seconds of the steps the instance had a step-time "
            "prediction for (its increase over xllm:step_time_predicted_seconds' in the same window: the window's "
            "correction factor).", labels, registry=r)
        self.step_predicted_seconds = Counter(
            "xllm:step_time_predicted_seconds", "Seconds the instance's uncorrected step-time model (profile or "
            "self-fit) predicted for those steps.", labels, registry=r)

        self.instance_role = Gauge("xllm:instance_role", "1 for the role each instance serves (mixed, prefill, "
                                   "decode).", [*labels, "role"], registry=r)
        self.kv_handoffs = Counter("xllm:kv_handoffs", "KV hand-offs by outcome, counted by the instances: sent "
                                   "(prefill side), installed or failed (decode side), timeout (the decode side never "
                                   "confirmed), expired (a reservation nobody filled).", [*labels, "outcome"],
                                   registry=r)
        self.kv_migrations = Counter("xllm:kv_migrations", "Running requests moved off draining instances with their "
                                     "KV, counted by the instances: sent (source), installed (destination), failed "
                                     "(source: resumed by recompute instead; destination: recomputed there).",
                                     [*labels, "outcome"], registry=r)
        self.kv_handoff_store_blocks = Counter(
            "xllm:kv_handoff_store_blocks", "KV blocks prefill instances handed off through the cluster KV store "
            "(--kv-transfer mooncake): published there under their hashes, read by the decode instance, kept as "
            "T3 blocks.", labels, registry=r)
        self.kv_handoff_store_fallbacks = Counter(
            "xllm:kv_handoff_store_fallbacks", "Hand-offs through the KV store whose blocks went as pages instead "
            "(the store was down or full, or the decode instance could not read them there).", labels, registry=r)
        # online/offline co-location (xllm.sched.colocation)
        self.offline_requests = Counter("xllm:offline_requests", "Offline (service_tier flex) requests finished.",
                                        labels, registry=r)
        self.offline_prompt_tokens = Counter("xllm:offline_prompt_tokens", "Prompt tokens of offline requests.",
                                             labels, registry=r)
        self.offline_generation_tokens = Counter("xllm:offline_generation_tokens",
                                                 "Tokens generated for offline requests.", labels, registry=r)
        self.offline_preemptions = Counter(
            "xllm:offline_preemptions", "Offline sequences preempted for online work, by reason: kv (KV memory), "
            "batch_full (a sequence slot an online request needed), slo (held out of a step for online work, "
            "KV kept: an interruption at a chunk boundary).", [*labels, "reason"], registry=r)
        self.offline_longest_wait = Gauge(
            "xllm:offline_longest_wait_seconds", "The longest an offline request in the queues has gone without "
            "being scheduled (starvation; bounded by --offline-starvation-s unless online work holds the whole "
            "engine).", labels, registry=r)
        # speculative decoding (xllm.core.spec), vLLM's names
        self.spec_drafts = Counter("xllm:spec_decode_num_drafts", "Speculative verify runs (one sequence's drafts "
                                   "in one step).", labels, registry=r)
        self.spec_draft_tokens = Counter("xllm:spec_decode_num_draft_tokens", "Draft tokens verified.", labels,
                                         registry=r)
        self.spec_accepted_tokens = Counter("xllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                            labels, registry=r)
        self.spec_accepted_per_pos = Counter(
            "xllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted by position in their run "
            "(0: the first draft).", [*labels, "position"], registry=r)
        # beam search (xllm.core.beam): embedded engines (their step observer), remote ones (heartbeats)
        self.beam_steps = Counter("xllm:beam_steps", "Beam-group decode steps (one per request per step).", labels,
                                  registry=r)
        self.beam_rows = Counter("xllm:beam_rows", "Beam rows computed (live beams summed over steps).", labels,
                                 registry=r)
        self.beam_candidates_scanned = Counter(
            "xllm:beam_candidates_scanned", "Candidates a heap scan of the per-beam sorted lists examines before "
            "every beam stops (early termination; divide by xllm:beam_steps for the per-step figure).", labels,
            registry=r)
        self.beam_early_terminations = Counter(
            "xllm:beam_early_terminations", "Beam searches that ended before max_tokens (early_stopping, or no "
            "running beam could beat the finished ones).", labels, registry=r)
        self.images_encoded = Counter(
            "xllm:images_encoded", "Images the vision tower encoded (in the encode phase or a prefill chunk).", labels,
            registry=r)
        self.image_cache_hits = Counter(
            "xllm:image_encoder_cache_hits", "Images found in the encoder cache by content hash (not encoded again).",
            labels, registry=r)
        self.image_encode_seconds = Counter(
            "xllm:image_encode_seconds", "Seconds the vision tower spent encoding images.", labels, registry=r)
        self._last_counters: dict[tuple[str, str], instance_pb2.EngineCounters] = {}
        self._last_step_totals: dict[tuple[str, str], tuple[float, float]] = {}  # StepTimePredictor's totals
        cl = ["model_name"]
        self.cluster_instances = Gauge("xllm:cluster_instances", "Live engine instances.", cl, registry=r)
        self.cluster_running = Gauge("xllm:cluster_num_requests_running", "Running requests, all instances.", cl,
                                     registry=r)
        self.cluster_waiting = Gauge("xllm:cluster_num_requests_waiting", "Waiting requests, all instances.", cl,
                                     registry=r)
        self.cluster_kv_usage = Gauge("xllm:cluster_kv_cache_usage_perc", "Mean KV cache usage of the instances.",
                                      cl, registry=r)
        self.cluster_kv_blocks = Gauge("xllm:cluster_kv_index_blocks",
                                       "Distinct prefix blocks in the global KV index.", registry=r)

    def observer(self, model_name: str, instance: str) -> _InstanceObserver:
        """A StatsObserver that records one instance's steps."""
        return _InstanceObserver(self, model_name, instance)

    def set_load(self, model_name: str, instance: str, report: instance_pb2.LoadReport) -> None:
        """Refresh the gauges from an instance's live load report (done at scrape time).

        The per-step observer alone leaves them stale whenever the engine goes idle
        without a step, e.g. after the last running request was aborted.
        """
        lb = (model_name, instance)
        self.running.labels(*lb).set(report.num_running)
        self.waiting.labels(*lb).set(report.num_waiting)
        self.kv_usage.labels(*lb).set(report.kv_usage)
        self.offline_longest_wait.labels(*lb).set(report.offline_longest_wait)
        predictor = report.step_predictor
        if predictor.coefficients:  # the instance has a step-time model
            self.step_time_correction.labels(*lb).set(predictor.correction)
            self.step_prediction_error_recent.labels(*lb).set(predictor.prediction_error)
        totals = (predictor.measured_seconds, predictor.predicted_seconds)
        last = self._last_step_totals.get(lb, (0.0, 0.0))
        if totals[0] < last[0] or totals[1] < last[1]:  # the instance restarted
            last = (0.0, 0.0)
        for counter, now, before in ((self.step_measured_seconds, totals[0], last[0]),
                                     (self.step_predicted_seconds, totals[1], last[1])):
            if now > before:
                counter.labels(*lb).inc(now - before)
        self._last_step_totals[lb] = totals

    def set_counters(self, model_name: str, instance: str, counters: instance_pb2.EngineCounters) -> None:
        """Advance the counters of a remote instance to its reported cumulative totals."""
        lb = (model_name, instance)
        last = self._last_counters.get(lb) or instance_pb2.EngineCounters()
        restarted = counters.steps < last.steps or counters.prompt_tokens < last.prompt_tokens
        if restarted:
            last = instance_pb2.EngineCounters()
        series = [(self.prompt_tokens, (), "prompt_tokens"), (self.generation_tokens, (), "generation_tokens"),
                  (self.prefix_queries, (), "prefix_cache_queries"), (self.prefix_hits, (), "prefix_cache_hits"),
                  (self.preemptions, (), "preemptions"),
                  *((self.kv_handoffs, (outcome,), field) for outcome, field in _HANDOFF_OUTCOMES),
                  *((self.kv_migrations, (outcome,), field) for outcome, field in _MIGRATION_OUTCOMES),
                  (self.kv_handoff_store_blocks, (), "kv_handoff_store_blocks"),
                  (self.kv_handoff_store_fallbacks, (), "kv_handoff_store_fallbacks"),
                  (self.offline_requests, (), "offline_requests"),
                  (self.offline_prompt_tokens, (), "offline_prompt_tokens"),
                  (self.offline_generation_tokens, (), "offline_generation_tokens"),
                  *((self.offline_preemptions, (reason,), field) for reason, field in _OFFLINE_PREEMPTION_REASONS),
                  (self.spec_drafts, (), "spec_decode_num_drafts"),
                  (self.spec_draft_tokens, (), "spec_decode_num_draft_tokens"),
                  (self.spec_accepted_tokens, (), "spec_decode_num_accepted_tokens"),
                  (self.beam_steps, (), "beam_steps"), (self.beam_rows, (), "beam_rows"),
                  (self.beam_candidates_scanned, (), "beam_candidates_scanned"),
                  (self.beam_early_terminations, (), "beam_early_terminations"),
                  (self.images_encoded, (), "images_encoded"), (self.image_cache_hits, (), "image_cache_hits"),
                  (self.image_encode_seconds, (), "image_encode_seconds")]
        for counter, extra, field in series:
            delta = getattr(counters, field) - getattr(last, field)
            if delta > 0:  # a series appears with its first count
                counter.labels(*lb, *extra).inc(delta)
        before = list(last.spec_decode_num_accepted_tokens_per_pos)
        for j, n in enumerate(counters.spec_decode_num_accepted_tokens_per_pos):
            delta = n - (before[j] if j < len(before) else 0)
            if delta > 0:
                self.spec_accepted_per_pos.labels(*lb, str(j)).inc(delta)
        self._last_counters[lb] = counters

    def set_cluster(self, model_name: str, loads: list[instance_pb2.LoadReport], kv_blocks: int) -> None:
        self.cluster_instances.labels(model_name).set(len(loads))
        self.cluster_running.labels(model_name).set(sum(r.num_running for r in loads))
        self.cluster_waiting.labels(model_name).set(sum(r.num_waiting for r in loads))
        self.cluster_kv_usage.labels(model_name).set(sum(r.kv_usage for r in loads) / len(loads) if loads else 0.0)
        self.cluster_kv_blocks.set(kv_blocks)

    def set_role(self, model_name: str, instance: str, role: str) -> None:
        """``role`` is the instance's role now (registered, or flipped by dynamic PD): its series is 1,
        the other roles' series of the instance are dropped."""
        for other in ROLE_NAMES.values():
            if other != role:
                with contextlib.suppress(KeyError):
                    self.instance_role.remove(model_name, instance, other)
        self.instance_role.labels(model_name, instance, role).set(1)

    def forget(self, model_name: str, instance: str) -> None:
        """Drop an instance's gauges (it left the cluster); counters stay, as Prometheus expects."""
        lb = (model_name, instance)
        for gauge in (self.running, self.waiting, self.kv_usage, self.offline_longest_wait, self.step_time_correction,
                      self.step_prediction_error_recent):
            with contextlib.suppress(KeyError):
                gauge.remove(*lb)
        for role in ROLE_NAMES.values():
            with contextlib.suppress(KeyError):
                self.instance_role.remove(*lb, role)
        self._last_counters.pop(lb, None)
        self._last_step_totals.pop(lb, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _InstanceObserver:
    def __init__(self, m: EngineMetrics, model_name: str, instance: str) -> None:
        self.m = m
        self.labels = (model_name, instance)

    def on_step(self, s: StepStats) -> None:
        m, lb = self.m, self.labels
        m.running.labels(*lb).set(s.num_running)
        m.waiting.labels(*lb).set(s.num_waiting)
        m.kv_usage.labels(*lb).set(s.kv_usage)
        m.steps.observe(*lb, s)
        if s.num_preempted:
            m.preemptions.labels(*lb).inc(s.num_preempted)
        gen = len(s.ttfts) + len(s.inter_token_latencies)
        if gen:
            m.generation_tokens.labels(*lb).inc(gen)
        if s.prompt_tokens:
            m.prompt_tokens.labels(*lb).inc(s.prompt_tokens)
        if s.prefix_cache_queries:
            m.prefix_queries.labels(*lb).inc(s.prefix_cache_queries)
            m.prefix_hits.labels(*lb).inc(s.prefix_cache_hits)
        if s.spec_num_drafts:
            m.spec_drafts.labels(*lb).inc(s.spec_num_drafts)
            m.spec_draft_tokens.labels(*lb).inc(s.spec_draft_tokens)
            m.spec_accepted_tokens.labels(*lb).inc(s.spec_accepted_tokens)
            for j, n in enumerate(s.spec_accepted_per_pos):
                if n:
                    m.spec_accepted_per_pos.labels(*lb, str(j)).inc(n)
        for counter, n in ((m.beam_steps, s.beam_steps), (m.beam_rows, s.beam_rows),
                           (m.beam_candidates_scanned, s.beam_candidates_scanned),
                           (m.beam_early_terminations, s.beam_early_terminations),
                           (m.images_encoded, s.images_encoded), (m.image_cache_hits, s.image_cache_hits),
                           (m.image_encode_seconds, s.image_encode_seconds)):
            if n:  # a series appears with its first count
                counter.labels(*lb).inc(n)
        self._offline(s)

    def _offline(self, s: StepStats) -> None:
        m, lb, o = self.m, self.labels, s.offline
        if s.batch_size:  # a step (aborts report outside steps, without a wait)
            m.offline_longest_wait.labels(*lb).set(o.longest_wait)
        for counter, n in ((m.offline_requests, o.finished), (m.offline_prompt_tokens, o.prompt_tokens),
                           (m.offline_generation_tokens, o.generation_tokens)):
            if n:
                counter.labels(*lb).inc(n)
        for reason, n in o.preempted.items():
            m.offline_preemptions.labels(*lb, reason).inc(n)


class RouterMetrics:
    """What the gateway's router did, per instance: requests routed (by reason), prompt tokens and
    how many of them the global KV index expected to be cached there, failures and resumed requests;
    and what the clients saw, measured by the gateway in every mode (embedded or cluster, PD or not):
    time to first token, time per output token, end-to-end latency and finished requests by reason,
    labelled with the instance that streamed them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r, labels = registry, ["model_name", "instance"]
        self.request_count = Counter("xllm:router_requests", "Requests routed to an instance, by reason.",
                                [*labels, "reason"], registry=r)
        self.prompt_token_count = Counter("xllm:router_prompt_tokens", "Prompt tokens routed to an instance.", labels,
                                     registry=r)
        self.matched_token_count = Counter("xllm:router_matched_prefix_tokens",
                                      "Prompt tokens the global KV index expected cached on the chosen instance.",
                                      labels, registry=r)
        self.ttft_seconds = Histogram("xllm:router_time_to_first_token_seconds",
                              "Time from routing to the first chunk, seen by the gateway.", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot_seconds = Histogram("xllm:router_time_per_output_token_seconds",
                                      "Gap between a request's chunks per token, from its third chunk with tokens on, "
                                      "seen by the gateway.", labels, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e_seconds = Histogram("xllm:router_request_latency_seconds",
                                     "Time from a request's arrival at the gateway to its last chunk (across "
                                     "failovers and moves), by the instance that finished it.", labels,
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.finished_count = Counter("xllm:router_finished_requests", "Requests streamed to their end, by the "
                                      "instance that finished them and finish reason.", [*labels, "finished_reason"],
                                      registry=r)
        self.failure_count = Counter("xllm:router_instance_failures",
                                "Requests an instance could not take or broke off (unreachable, draining).", labels,
                                registry=r)
        self.resumed_count = Counter("xllm:router_resumed_requests", "Requests resumed on another instance.", labels,
                               registry=r)
        self.poisoned_count = Counter("xllm:router_failed_after_crashes",
                                      "Requests failed instead of replayed: they were running when "
                                      "several instances failed.", ["model_name"], registry=r)

    def routed(self, model: str, instance: str, reason: str, prompt_tokens: int, matched_tokens: int,
               num_requests: int) -> None:
        self.request_count.labels(model, instance, reason).inc(num_requests)
        self.prompt_token_count.labels(model, instance).inc(prompt_tokens * num_requests)
        if matched_tokens:
            self.matched_token_count.labels(model, instance).inc(matched_tokens * num_requests)

    def first_token(self, model: str, instance: str, seconds: float) -> None:
        self.ttft_seconds.labels(model, instance).observe(seconds)

    def time_per_output_token(self, model: str, instance: str, seconds: float) -> None:
        self.tpot_seconds.labels(model, instance).observe(seconds)

    def finished(self, model: str, instance: str, reason: str, seconds: float) -> None:
        self.finished_count.labels(model, instance, reason).inc()
        self.e2e_seconds.labels(model, instance).observe(seconds)

    def failure(self, model: str, instance: str) -> None:
        self.failure_count.labels(model, instance).inc()

    def resumed(self, model: str, instance: str) -> None:
        self.resumed_count.labels(model, instance).inc()

    def poisoned(self, model: str) -> None:
        self.poisoned_count.labels(model).inc()


class MoveMetrics:
    """Running requests this gateway moved off draining instances: how (``migrated`` with their KV,
    ``recomputed`` elsewhere, ``migration_failed`` and recomputed instead, ``stayed`` for want of
    another instance) and the pause their streams showed (last chunk from the source to the first
    from the destination)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.moves = Counter("xllm:request_moves", "Running requests moved off draining instances, by how.",
                             ["model_name", "how"], registry=r)
        self.pause = Histogram("xllm:request_move_pause_seconds", "Gap in a moved request's stream: its last chunk "
                               "from the source instance to its first from the destination.", ["model_name", "how"],
                               buckets=LATENCY_BUCKETS, registry=r)

    def moved(self, model: str, how: str) -> None:
        self.moves.labels(model, how).inc()

    def paused(self, model: str, how: str, seconds: float) -> None:
        self.pause.labels(model, how).observe(seconds)


class RegistryMetrics:
    """The gateway's etcd watch (:class:`~xllm.gateway.registry.EtcdRegistry`): how often it was
    restarted, by reason (``timeout``: silent for the watch timeout; ``error``: broken;
    ``compacted``), and whether one is established now."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.restarts = Counter("xllm:registry_watch_restarts", "Registry watches that ended and were restarted "
                                "from a fresh read, by reason (timeout, error, compacted).", ["reason"],
                                registry=registry)
        self.up = Gauge("xllm:registry_watch_up", "1 while the registry watch is established, 0 while the "
                        "gateway is re-reading or waiting for etcd (it routes on its last view meanwhile).",
                        registry=registry)
        self.refused = Counter("xllm:registry_refused_records", "Instance records refused by the registry view "
                               "(with a cluster token), by reason: unsigned, bad_signature (another credential "
                               "or altered), wrong_lease (a stale record written again), stale (too old); "
                               "heartbeats not applied: heartbeat_unsigned, heartbeat_bad_signature, "
                               "heartbeat_wrong_lease, heartbeat_replayed (an old seq written again).",
                               ["reason"], registry=registry)

    def record_refused(self, reason: str) -> None:
        self.refused.labels(reason).inc()

    def watch_restarted(self, reason: str) -> None:
        self.restarts.labels(reason).inc()

    def set_watch_up(self, up: bool) -> None:
        self.up.set(1 if up else 0)


class HttpMetrics:
    """The HTTP front's connection bounds (:mod:`xllm.gateway.http_guard`): connections and requests
    it refused or cut, by reason, and the connections open now."""

    REASONS = ("header_timeout", "body_timeout", "client_cap", "total_cap")

    def __init__(self, registry: CollectorRegistry) -> None:
        self.refused = Counter("xllm:http_refused", "HTTP connections or requests the server refused or cut, by "
                               "reason: header_timeout (request head not complete in time: 408), body_timeout "
                               "(request body not complete in time: 408), client_cap (--max-connections-per-client: "
                               "429), total_cap (--max-connections: 503).", ["reason"], registry=registry)
        for reason in self.REASONS:
            self.refused.labels(reason)
        self.open = Gauge("xllm:http_connections_open", "HTTP connections open and admitted (within the caps).",
                          registry=registry)

    def refuse(self, reason: str) -> None:
        self.refused.labels(reason).inc()


class PDMetrics:
    """Prefill/decode hand-offs seen by the gateway (per model and KV transport): bytes moved and
    transfer time as the decode instances measured them, transfers that failed (the decode side
    recomputed), the TTFT breakdown, prefill retries, hand-offs lost with their prefill instance,
    and requests cancelled mid-way."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        tl = ["model_name", "transport"]
        self.transfer_bytes = Counter("xllm:kv_transfer_bytes", "KV bytes handed from prefill to decode instances.",
                                      tl, registry=r)
        self.transfer_seconds = Histogram(
            "xllm:kv_transfer_seconds", "KV hand-off time, measured on the decode side (first byte to KV checked; "
            "with grpc it overlaps the prefill).", tl, buckets=LATENCY_BUCKETS, registry=r)
        self.transfer_failures = Counter("xllm:kv_transfer_failures",
                                         "KV hand-offs that failed (the decode instance recomputed the prompt).", tl,
                                         registry=r)
        self.ttft_phase = Histogram("xllm:pd_ttft_breakdown_seconds",
                                    "Where PD requests' time went: queue and prefill on the prefill instance, KV "
                                    "transfer (the part the prefill did not hide), first decode step.",
                                    ["model_name", "phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_retries = Counter("xllm:pd_prefill_retries", "Prefills retried on another prefill instance.",
                                       ["model_name", "instance"], registry=r)
        self.handoffs_lost = Counter("xllm:pd_handoffs_lost",
                                     "Requests whose prefill instance failed after the first token without the "
                                     "decode side getting the KV (resumed elsewhere).", ["model_name"], registry=r)
        self.cancelled = Counter("xllm:pd_cancelled", "PD requests the client left before they finished.",
                                 ["model_name"], registry=r)
        self.overflows = Counter("xllm:pd_prefill_overflows",
                                 "Requests run whole on a decode instance because every prefill instance was "
                                 "predicted to miss the TTFT objective (--pd-prefill-overflow).", ["model_name"],
                                 registry=r)

    def overflowed(self, model: str) -> None:
        self.overflows.labels(model).inc()

    def handoff(self, model: str, transport: str, stats) -> None:
        if stats.recomputed:
            self.transfer_failures.labels(model, transport).inc()
            return
        self.transfer_bytes.labels(model, transport).inc(stats.transfer_bytes)
        self.transfer_seconds.labels(model, transport).observe(stats.transfer_seconds)

    def ttft_breakdown(self, model: str, times) -> None:
        for phase, value in (("queue", times.queue), ("prefill", times.prefill), ("transfer", times.transfer),
                             ("first_decode", times.first_decode or 0.0)):
            self.ttft_phase.labels(model, phase).observe(value)

    def prefill_retry(self, model: str, instance: str) -> None:
        self.prefill_retries.labels(model, instance).inc()

    def handoff_lost(self, model: str) -> None:
        self.handoffs_lost.labels(model).inc()

    def cancelled_request(self, model: str) -> None:
        self.cancelled.labels(model).inc()


class PDRoleMetrics:
    """Dynamic PD roles (:mod:`xllm.gateway.roles`): completed role flips by direction and trigger
    (``ttft_pressure``, ``tpot_pressure``, ``prefill_idle``, ``manual``), how long each took (decided
    to done: the hand-over of what the instance held), and the instances in each pool (``prefill``,
    ``decode``, and ``decode_to_prefill`` / ``prefill_to_decode`` while they flip)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.flips = Counter("xllm:pd_role_flips", "Completed PD role flips, by direction and trigger.",
                             ["model_name", "from_role", "to_role", "reason"], registry=r)
        self.flip_seconds = Histogram("xllm:pd_role_flip_seconds", "Time from a role flip's decision to its end "
                                      "(the instance handed over what it held of its old role).",
                                      ["model_name", "from_role", "to_role"], buckets=LATENCY_BUCKETS, registry=r)
        self.instances = Gauge("xllm:pd_instances", "PD instances per pool: prefill, decode, and the ones flipping "
                               "(decode_to_prefill, prefill_to_decode).", ["model_name", "role"], registry=r)

    def flipped(self, model: str, from_role: str, to_role: str, trigger: str, seconds: float) -> None:
        self.flips.labels(model, from_role, to_role, trigger).inc()
        self.flip_seconds.labels(model, from_role, to_role).observe(seconds)

    def set_pools(self, model: str, counts: dict[str, int]) -> None:
        for pool, n in counts.items():
            self.instances.labels(model, pool).set(n)
