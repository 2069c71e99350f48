"""Prometheus metrics (one registry per app) and the rolling window behind
``hydractl status``'s rates and percentiles."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from hydrad.cluster.usage import ProcessUsage
from hydrad.engine.inputs import EngineStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                    0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0)
STAGES = ("encode", "prefill", "decode")


class TokenHistogram:
    """A histogram updated once per streamed token, on the event loop only: a bisect and two
    additions, without the locks and the bucket scan of ``prometheus_client.Histogram``
    (which cost more than the rest of a token's bookkeeping). Exported through ``TokenMetrics``."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]):
        self.name, self.documentation = name, documentation
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, model: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip([*map(floatToGoString, self.bounds), "+Inf"], self.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric([model], buckets, self.sum)
        return family


class TokenMetrics(Collector):
    """The per-token metrics: TTFT, inter-token latency and the generated-token counter."""

    def __init__(self, model: str):
        self.model = model
        self.ttft = TokenHistogram("hydrad_time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = TokenHistogram("hydrad_inter_token_latency_seconds", "Time between consecutive output tokens.",
                                  _LATENCY_BUCKETS)
        self.generation_tokens = 0

    def collect(self):
        yield self.ttft.family(self.model)
        yield self.itl.family(self.model)
        counter = CounterMetricFamily("hydrad_generation_tokens", "Generated tokens.", labels=["model_name"])
        counter.add_metric([self.model], self.generation_tokens)
        yield counter


class DeploymentMetrics(Collector):
    """The deployment served and how it changed, as the supervisor and the re-planner keep it
    (``Metrics.set_deployment``, at each scrape): empty families in a process without them."""

    # What can ask for a redeploy (``supervisor.Deployment.trigger``).
    TRIGGERS = ("admin", "auto")

    def __init__(self, model: str):
        self.model = model
        self.deploy: str | None = None
        self.redeploys: dict[str, int] = {}
        self.redeploy_seconds: dict[str, float] = {}
        self.failed_redeploys = 0
        self.decisions: dict[str, int] = {}

    def collect(self):
        info = GaugeMetricFamily("hydrad_deployment_info", "The deployment being served (1, by its spec).",
                                 labels=["model_name", "deploy"])
        redeploys = CounterMetricFamily("hydrad_redeploys", "Completed live redeploys, by trigger (admin: "
                                        "hydractl redeploy or the admin API; auto: the re-planner).",
                                        labels=["model_name", "trigger"])
        seconds = CounterMetricFamily("hydrad_redeploy_seconds", "Time the completed live redeploys took, by "
                                      "trigger.", labels=["model_name", "trigger"])
        failed = CounterMetricFamily("hydrad_redeploy_failures", "Live redeploys that could not complete (the "
                                     "deployment stayed as it was).", labels=["model_name"])
        decisions = CounterMetricFamily("hydrad_replan_decisions", "The re-planner's decisions ([planner] auto), "
                                        "by action: keep, redeploy, skip, failed.", labels=["model_name", "action"])
        if self.deploy is not None:
            info.add_metric([self.model, self.deploy], 1)
            for trigger in self.TRIGGERS:
                redeploys.add_metric([self.model, trigger], self.redeploys.get(trigger, 0))
                seconds.add_metric([self.model, trigger], self.redeploy_seconds.get(trigger, 0.0))
            failed.add_metric([self.model], self.failed_redeploys)
            for action, count in sorted(self.decisions.items()):
                decisions.add_metric([self.model, action], count)
        yield from (info, redeploys, seconds, failed, decisions)


class WorkerFailures(Collector):
    """Workers restarted and what became of the requests they held, as the supervisor and
    the request table count them (``Metrics.set_failures``, at each scrape): empty families
    in a process without them."""

    def __init__(self, model: str):
        self.model = model
        self.restarts: dict[int, int] | None = None
        self.lost = self.run_again = self.kept_image_bytes = self.quarantined = self.refused = 0

    def collect(self):
        restarts = CounterMetricFamily("hydrad_worker_restarts", "Times the instance's worker was restarted after "
                                       "it died.", labels=["model_name", "instance"])
        lost = CounterMetricFamily("hydrad_requests_lost", "Requests that failed because the worker holding them "
                                   "died (they lost their instance a second time, or streamed with images "
                                   "past server.rerun_image_mb).",
                                   labels=["model_name"])
        run_again = CounterMetricFamily("hydrad_requests_run_again", "Requests whose worker died, run again on a "
                                        "live or restarted one from the tokens they had.",
                                        labels=["model_name"])
        kept = GaugeMetricFamily("hydrad_rerun_image_bytes", "Preprocessed images the daemon keeps to run "
                                 "requests again should their worker die (at most server.rerun_image_mb).",
                                 labels=["model_name"])
        quarantined = GaugeMetricFamily("hydrad_quarantined_requests", "Contents (prompt tokens and images) of "
                                        "requests that lost two workers, refused for server.quarantine_seconds.",
                                        labels=["model_name"])
        refused = CounterMetricFamily("hydrad_requests_refused_quarantined", "Requests refused (400) because the "
                                      "same request lost two workers not long before.", labels=["model_name"])
        if self.restarts is not None:
            for instance, count in sorted(self.restarts.items()):
                restarts.add_metric([self.model, str(instance)], count)
            lost.add_metric([self.model], self.lost)
            run_again.add_metric([self.model], self.run_again)
            kept.add_metric([self.model], self.kept_image_bytes)
            quarantined.add_metric([self.model], self.quarantined)
            refused.add_metric([self.model], self.refused)
        yield from (restarts, lost, run_again, kept, quarantined, refused)


class EngineCounters(Collector):
    """Each instance's running totals as its engine counts them (``Metrics.set_instance``):
    prefix caching's lookups and hits, preemptions, steps built past their bound, steps that
    held new prompts for hand-overs, and guarded steps."""

    def __init__(self, model: str):
        self.model = model
        # instance -> (queries, hits, images, preemptions, overrun steps, slack steps, held steps,
        # guarded steps)
        self.totals: dict[str, tuple[int, ...]] = {}

    def collect(self):
        families = (
            CounterMetricFamily("hydrad_prefix_cache_queries", "Tokens of the requests that looked for a cached "
                                "prefix on the instance.", labels=["model_name", "instance"]),
            CounterMetricFamily("hydrad_prefix_cache_hits", "Tokens found cached: their prefill was skipped.",
                                labels=["model_name", "instance"]),
            CounterMetricFamily("hydrad_prefix_cache_images", "Images not encoded again: inside a cached prefix, "
                                "or found in the image cache.", labels=["model_name", "instance"]),
            CounterMetricFamily("hydrad_preemptions", "Requests preempted on the instance for KV room (their KV "
                                "freed, recomputed when they run again).", labels=["model_name", "instance"]),
            CounterMetricFamily("hydrad_steps_over_bound", "Steps built past their latency bound for images too long "
                                "to fit beside their decodes (one in 16 steps at most).",
                                labels=["model_name", "instance"]),
            CounterMetricFamily("hydrad_steps_on_tbt_slack", "Steps with decodes built past the TBT bound for long "
                                "prompts, every stream in them able to take one gap past the TBT within its p90.",
                                labels=["model_name", "instance"]),
            CounterMetricFamily("hydrad_steps_holding_prompts", "Steps that admitted no new prompt while a first "
                                "token handed over to another instance waited past the TBT to be taken.",
                                labels=["model_name", "instance"]),
            CounterMetricFamily("hydrad_steps_guarded", "Steps with decodes whose prompt work was filled by a higher "
                                "quantile of the steps' measured / predicted time, a stream in them with no gap past "
                                "the TBT bound left to spend within its p90.", labels=["model_name", "instance"]),
        )
        for instance, values in sorted(self.totals.items()):
            for family, value in zip(families, values):
                family.add_metric([self.model, instance], value)
        yield from families


class WorkerUsage(Collector):
    """Each worker process's CPU time and resident memory, as the daemon last read them from
    ``/proc`` (``Metrics.set_worker_usage``); a restarted worker starts its count again."""

    def __init__(self, model: str):
        self.model = model
        self.usage: dict[int, ProcessUsage] = {}

    def collect(self):
        cpu = CounterMetricFamily("hydrad_worker_cpu_seconds", "CPU time (user and system) of the instance's worker "
                                  "process.", labels=["model_name", "instance"])
        rss = GaugeMetricFamily("hydrad_worker_resident_memory_bytes", "Resident memory of the instance's worker "
                                "process (its weights, cache pools and runtime).", labels=["model_name", "instance"])
        shared = GaugeMetricFamily("hydrad_worker_shared_memory_bytes", "Of the worker's resident memory, shared "
                                   "memory (cache pools in /dev/shm), which every process mapping it counts.",
                                   labels=["model_name", "instance"])
        for instance, usage in sorted(self.usage.items()):
            cpu.add_metric([self.model, str(instance)], usage.cpu_seconds)
            rss.add_metric([self.model, str(instance)], usage.rss_bytes)
            if usage.shared_bytes is not None:
                shared.add_metric([self.model, str(instance)], usage.shared_bytes)
        yield from (cpu, rss, shared)


class ProcessedImageMetrics(Collector):
    """The Request Processor's cache of preprocessed images (``hydrad.processed_images``),
    read at scrape time."""

    def __init__(self, model: str, cache):
        self.model, self.cache = model, cache

    def collect(self):
        cache = self.cache
        looked = CounterMetricFamily("hydrad_processed_image_lookups", "Images sent as files, looked up in the "
                                     "Request Processor's cache of preprocessed images: found (not decoded nor "
                                     "processed again) or not.", labels=["model_name", "found"])
        looked.add_metric([self.model, "true"], cache.num_found)
        looked.add_metric([self.model, "false"], cache.num_missed)
        kept = GaugeMetricFamily("hydrad_processed_image_cache_bytes", "Pixels the Request Processor keeps "
                                 "preprocessed (server.processed_image_cache_mb).", labels=["model_name"])
        kept.add_metric([self.model], cache.num_bytes)
        yield from (looked, kept)


class AdmissionMetrics(Collector):
    """What the request path's memory budgets hold now (``server.admission``), read at scrape time."""

    def __init__(self, model: str, admission):
        self.model, self.admission = model, admission

    def collect(self):
        bodies = GaugeMetricFamily("hydrad_request_body_bytes_in_use", "Bytes of request bodies held, from before "
                                   "a body is read until its request is processed (a kept response's input until "
                                   "its answer ends); at most server.max_inflight_body_mb per process.",
                                   labels=["model_name"])
        bodies.add_metric([self.model], self.admission.bodies.in_use)
        images = GaugeMetricFamily("hydrad_decoded_image_bytes_in_use", "Decoded images' bytes held while their "
                                   "requests are processed (estimated from their headers); at most "
                                   "server.max_inflight_image_mb per process.", labels=["model_name"])
        images.add_metric([self.model], self.admission.images.in_use)
        yield from (bodies, images)


class KeptResponseMetrics(Collector):
    """The daemon's kept responses of /v1/responses (``server.response_store``), read at scrape time."""

    def __init__(self, model: str, store):
        self.model, self.store = model, store

    def collect(self):
        count = GaugeMetricFamily("hydrad_responses_kept", "Responses of /v1/responses kept for "
                                  "previous_response_id and retrieval.", labels=["model_name"])
        count.add_metric([self.model], len(self.store))
        size = GaugeMetricFamily("hydrad_responses_kept_bytes", "Their size as JSON, which "
                                 "server.responses_store_mb bounds.", labels=["model_name"])
        size.add_metric([self.model], self.store.nbytes)
        running = GaugeMetricFamily("hydrad_responses_background_running", "Background responses of "
                                    "/v1/responses queued or generating.", labels=["model_name"])
        running.add_metric([self.model], self.store.num_running)
        yield from (count, size, running)


class Metrics:
    def __init__(self, model_name: str, processed_images=None, kept_responses=None):
        """``processed_images``: the Request Processor's cache (``ProcessedImages``), and
        ``kept_responses`` the daemon's ``ResponseStore``, exported."""
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self._model = model_name
        self.tokens = TokenMetrics(model_name)
        r.register(self.tokens)
        if processed_images is not None:
            r.register(ProcessedImageMetrics(model_name, processed_images))
        if kept_responses is not None:
            r.register(KeptResponseMetrics(model_name, kept_responses))
        self.deployment = DeploymentMetrics(model_name)
        self.failures = WorkerFailures(model_name)
        r.register(self.deployment)
        r.register(self.failures)
        self.engine_counters = EngineCounters(model_name)
        r.register(self.engine_counters)
        self.worker_usage = WorkerUsage(model_name)
        r.register(self.worker_usage)
        self.e2e = Histogram("hydrad_e2e_request_latency_seconds", "Arrival to last token.", m,
                             buckets=_E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("hydrad_stage_queue_time_seconds", "Time waiting for a stage, per request.",
                                    m + ["stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.exec_time = Histogram("hydrad_stage_exec_time_seconds", "Time executing a stage, per request.",
                                   m + ["stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.migration_time = Histogram("hydrad_migration_time_seconds", "Time moving a request between instances.",
                                        m + ["edge"], buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("hydrad_requests_finished", "Finished requests by finish reason.",
                                m + ["finish_reason"], registry=r)
        self.rejected = Counter("hydrad_requests_rejected", "Requests answered with an error (4xx, 5xx) instead of a "
                                "completion, by HTTP status and error code.", m + ["status", "code"], registry=r)
        self.prompt_tokens = Counter("hydrad_prompt_tokens", "Prompt tokens of finished requests.", m, registry=r)
        self.images = Counter("hydrad_images", "Images of finished requests.", m, registry=r)
        labels = m + ["instance", "device", "role"]
        self.up = Gauge("hydrad_instance_up", "1 while the instance's worker is alive.", labels, registry=r)
        self.running = Gauge("hydrad_num_requests_running", "Requests running on the instance.", labels, registry=r)
        self.waiting = Gauge("hydrad_num_requests_waiting", "Requests waiting on the instance.", labels, registry=r)
        self.kv_usage = Gauge("hydrad_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use.", labels, registry=r)
        self.calibration = Gauge(
            "hydrad_step_calibration_ratio", "How much longer than predicted the instance's recent steps with "
            "decodes ran (their 90th percentile); their bound is divided by it.", labels, registry=r)
        self.live_speed = Gauge(
            "hydrad_step_speed_ratio", "Median measured / predicted seconds of the instance's recent steps of one "
            "kind of work (images, prefills, decodes): the machine's speed under load against the latency model.",
            m + ["instance", "kind"], registry=r)
        self.image_usage = Gauge("hydrad_image_cache_usage_ratio", "Fraction of image-cache blocks in use.", labels,
                                 registry=r)
        step_labels = m + ["instance", "stage"]
        self.step_time = Histogram("hydrad_step_seconds", "Measured time of an engine step's work, per stage "
                                   "(vision: encode, language: prefill and decode).", step_labels,
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.step_prediction = Histogram(
            "hydrad_step_prediction_ratio", "Latency-model prediction of a step's time divided by its measured "
            "time (1 is exact), per instance and stage.", step_labels, buckets=_RATIO_BUCKETS, registry=r)
        self._step_children: dict[tuple[int, str], tuple] = {}
        # The children a finished request updates, looked up once (``labels`` takes a lock and
        # builds a key each call): by finish reason, and by stage-time key (None: not exported).
        self._finished_children: dict[str, object] = {}
        self._stage_children: dict[str, object | None] = {}
        self._e2e = self.e2e.labels(model_name)
        self._prompt_tokens = self.prompt_tokens.labels(model_name)
        self._images = self.images.labels(model_name)
        # The daemon process itself (the front end): process_cpu_seconds_total,
        # process_resident_memory_bytes, ... and what it costs per token.
        ProcessCollector(registry=r)
        self.cpu_per_token = Gauge(
            "hydrad_daemon_cpu_seconds_per_token", "CPU time of the daemon process (HTTP, request processing, "
            "detokenization, streaming; not its workers) per output token, over the last 10 s.", m, registry=r)
        self.loop_lag = Histogram("hydrad_event_loop_lag_seconds", "How late the daemon's event loop ran a "
                                  "timer (sampled every 0.1 s).", m, buckets=_LAG_BUCKETS, registry=r)
        self.output_delay = Histogram(
            "hydrad_step_output_delay_seconds", "From a worker sending a step's output to the daemon reading it "
            "(step outputs waiting to be read).", m + ["instance"], buckets=_LAG_BUCKETS, registry=r)
        self.link_unread = Gauge("hydrad_worker_link_unread_bytes", "Bytes a worker sent that the daemon has not "
                                 "read yet.", m + ["instance"], registry=r)
        self.window = RollingWindow()

    def watch_admission(self, admission) -> None:
        """Export what ``admission``'s memory budgets hold."""
        self.registry.register(AdmissionMetrics(self._model, admission))

    def observe_rejected(self, status: int, code: str | None) -> None:
        self.rejected.labels(self._model, str(status), code or "").inc()

    @property
    def num_generation_tokens(self) -> int:
        return self.tokens.generation_tokens

    def observe_first_token(self, ttft: float, num_tokens: int, now: float | None = None) -> None:
        tokens = self.tokens
        tokens.generation_tokens += num_tokens
        tokens.ttft.observe(ttft)
        self.window.add_ttft(ttft, now)

    def observe_next_tokens(self, gap: float, num_tokens: int, now: float | None = None) -> None:
        """``now``: time.monotonic() of the token, when the caller has it."""
        tokens = self.tokens
        tokens.generation_tokens += num_tokens
        tokens.itl.observe(gap)
        self.window.add_tbt(gap, now)

    def observe_loop_lag(self, lag: float) -> None:
        self.loop_lag.labels(self._model).observe(lag)

    def set_cpu_per_token(self, seconds: float) -> None:
        self.cpu_per_token.labels(self._model).set(seconds)

    def observe_finished(self, finish_reason: str, e2e: float, num_prompt_tokens: int, num_images: int,
                         stage_times: dict[str, float] | None) -> None:
        finished = self._finished_children.get(finish_reason)
        if finished is None:
            finished = self._finished_children[finish_reason] = self.finished.labels(self._model, finish_reason)
        finished.inc()
        self._e2e.observe(e2e)
        self._prompt_tokens.inc(num_prompt_tokens)
        self._images.inc(num_images)
        self.window.add_finished()
        children = self._stage_children
        for key, seconds in (stage_times or {}).items():
            if key not in children:
                children[key] = self._stage_child(key)
            child = children[key]
            if child is not None:
                child.observe(seconds)

    def _stage_child(self, key: str):
        """The histogram child a ``stage_times`` key is observed into (None: not exported)."""
        if key.endswith("_migration"):
            return self.migration_time.labels(self._model, key.removesuffix("_migration"))
        stage, _, kind = key.rpartition("_")
        if stage in STAGES and kind == "queue":
            return self.queue_time.labels(self._model, stage)
        if stage in STAGES and kind == "exec":
            return self.exec_time.labels(self._model, stage)
        return None

    def observe_step(self, instance_id: int, timing, delay: float | None) -> None:
        """One step's output read ``delay`` seconds after its worker sent it; its measured times
        and, when the instance has a latency model, its predictions."""
        if delay is not None:
            children = self._step_children.get((instance_id, "delay"))
            if children is None:
                children = self._step_children[instance_id, "delay"] = (
                    self.output_delay.labels(self._model, str(instance_id)),)
            children[0].observe(delay)
        if timing is None:
            return
        for stage, measured, predicted in (("vision", timing.vision, timing.predicted_vision),
                                           ("language", timing.language, timing.predicted_language)):
            if measured <= 0:
                continue
            key = (instance_id, stage)
            children = self._step_children.get(key)
            if children is None:
                labels = (self._model, str(instance_id), stage)
                children = self._step_children[key] = (self.step_time.labels(*labels),
                                                       self.step_prediction.labels(*labels))
            children[0].observe(measured)
            if predicted > 0:
                children[1].observe(predicted / measured)

    def set_instance(self, instance_id: int, device: str, role: str, alive: bool,
                     stats: EngineStats | None, unread_bytes: int = 0) -> None:
        """``stats`` None: the worker did not answer in time (down, or busy in a long step)."""
        labels = (self._model, str(instance_id), device, role)
        self.up.labels(*labels).set(alive)
        self.link_unread.labels(self._model, str(instance_id)).set(unread_bytes)
        if stats is None:
            return
        self.running.labels(*labels).set(stats.num_running)
        self.waiting.labels(*labels).set(stats.num_waiting)
        self.kv_usage.labels(*labels).set(stats.kv_usage)
        self.calibration.labels(*labels).set(stats.latency_calibration)
        for kind, factor in stats.live_speed.items():
            self.live_speed.labels(self._model, str(instance_id), kind).set(factor)
        self.image_usage.labels(*labels).set(stats.image_usage)
        self.engine_counters.totals[str(instance_id)] = (stats.prefix_cache_queries, stats.prefix_cache_hits,
                                                         stats.images_cached, stats.num_preemptions,
                                                         stats.num_overrun_steps, stats.num_slack_steps,
                                                         stats.num_held_steps, stats.num_guarded_steps)

    def set_worker_usage(self, usage: dict[int, ProcessUsage]) -> None:
        """instance -> its worker process's CPU time and memory (instances without a live
        worker are left out)."""
        self.worker_usage.usage = dict(usage)

    def set_failures(self, restarts: dict[int, int], lost: int, run_again: int, kept_image_bytes: int = 0,
                     quarantined: int = 0, refused: int = 0) -> None:
        """Each instance's worker restarts, the requests lost with a worker or run again, the
        pixels kept to run requests again, and the quarantined contents and the requests
        refused for them."""
        f = self.failures
        f.restarts, f.lost, f.run_again, f.kept_image_bytes = dict(restarts), lost, run_again, kept_image_bytes
        f.quarantined, f.refused = quarantined, refused

    def set_deployment(self, deploy: str, history, failed_redeploys: int, decisions: dict[str, int] | None) -> None:
        """The deployment served now; ``history``: every deployment since start (the
        supervisor's ``Deployment`` records, the first the start); ``decisions``: the
        re-planner's count of each action (None: not re-planning)."""
        d = self.deployment
        d.deploy, d.failed_redeploys = deploy, failed_redeploys
        d.redeploys, d.redeploy_seconds = {}, {}
        for change in history[1:]:
            d.redeploys[change.trigger] = d.redeploys.get(change.trigger, 0) + 1
            d.redeploy_seconds[change.trigger] = d.redeploy_seconds.get(change.trigger, 0.0) + (change.seconds or 0.0)
        d.decisions = dict(decisions or {})


class MergedRegistry:
    """Metric families of several processes as one registry for ``generate_latest``: samples
    with the same name and labels add up (counters, histograms, the process's memory and
    descriptors), except creation and start times (the earliest) and descriptor limits (the
    largest); ``override`` sets single-sample gauges that do not add up (CPU per token)."""

    def __init__(self, groups: list[list[Metric]], override: dict[str, float | None] | None = None):
        self.groups = groups
        self.override = override or {}

    def collect(self) -> list[Metric]:
        merged: dict[str, Metric] = {}
        index: dict[str, dict[tuple, int]] = {}
        for families in self.groups:
            for family in families:
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                    index[family.name] = {}
                positions = index[family.name]
                for sample in family.samples:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    at = positions.get(key)
                    if at is None:
                        positions[key] = len(into.samples)
                        into.samples.append(sample)
                    else:
                        old = into.samples[at]
                        into.samples[at] = old._replace(value=_combine(sample.name, old.value, sample.value))
        for name, value in self.override.items():
            family = merged.get(name)
            if family is not None:
                family.samples = [s._replace(value=value) for s in family.samples] if value is not None else []
        return list(merged.values())


def _combine(name: str, a: float, b: float) -> float:
    if name.endswith("_created") or name == "process_start_time_seconds":
        return min(a, b)
    if name == "process_max_fds":
        return max(a, b)
    return a + b


class RollingWindow:
    """Recent finishes, TTFTs and TBTs (the last ``seconds``), for rates and percentiles."""

    def __init__(self, seconds: float = 60.0, max_samples: int = 20_000):
        self.seconds = seconds
        self._finished: deque[float] = deque(maxlen=max_samples)
        self._ttft: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._tbt: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add_finished(self) -> None:
        self._finished.append(time.monotonic())

    def add_ttft(self, value: float, now: float | None = None) -> None:
        self._ttft.append((time.monotonic() if now is None else now, value))

    def add_tbt(self, value: float, now: float | None = None) -> None:
        self._tbt.append((time.monotonic() if now is None else now, value))

    def recent(self) -> dict:
        """The window's samples: finishes counted, TTFTs and TBTs (for merging windows)."""
        since = time.monotonic() - self.seconds
        return {"finished": sum(1 for t in self._finished if t >= since),
                "ttft": [v for t, v in self._ttft if t >= since], "tbt": [v for t, v in self._tbt if t >= since]}

    def summary(self, others: list[dict] = ()) -> dict[str, float | None]:
        """Rates and percentiles over the window; ``others``: ``recent()`` of more windows
        (other front-end processes) counted with this one."""
        windows = [self.recent(), *others]
        ttft = sorted(v for w in windows for v in w["ttft"])
        tbt = sorted(v for w in windows for v in w["tbt"])
        return {
            "window_seconds": self.seconds,
            "request_rate": sum(w["finished"] for w in windows) / self.seconds,
            "ttft_p50": percentile(ttft, 50),
            "ttft_p90": percentile(ttft, 90),
            "tbt_p50": percentile(tbt, 50),
            "tbt_p90": percentile(tbt, 90),
        }


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of already sorted values; None when there are none."""
    if not sorted_values:
        return None
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[int(rank) - 1]
