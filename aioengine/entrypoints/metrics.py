"""``GET /metrics``: the engine in Prometheus text format.

Two sources, one registry per server:

- the engine's one ``EngineStats`` snapshot, read at scrape time (gauges and
  counters: requests running and waiting, KV cache usage, prefix-cache
  queries and hits, preemptions, prompt and generation tokens, ...);
- latency histograms fed by the engine's step loop through
  ``AsyncEngine.latency_observer``: time to first token, inter-token
  latency, end-to-end latency and queue time.

Names follow vLLM's (``vllm:num_requests_running`` is
``aioengine:num_requests_running`` here, with the same ``model_name`` label
and the same histogram buckets) so existing dashboards map over. Counters get
prometheus_client's ``_total`` suffix, as vLLM's do. With API keys, per-key
counters (``aioengine:api_key_*``) are labelled by the key's name from
``--api-keys-file`` (``default`` for ``--api-key``), never by the key.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, Histogram, generate_latest
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)

from aioengine.engine.async_engine import AsyncEngine
from aioengine.engine.data_parallel import DPAsyncEngine
from aioengine.entrypoints.quotas import QuotaManager

# (EngineStats field, metric name, help, is_counter)
_STATS_METRICS = [
    ("num_running", "num_requests_running", "Requests in the running batch.", False),
    ("num_waiting", "num_requests_waiting", "Requests waiting to be scheduled.", False),
    ("kv_cache_usage", "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", False),
    ("num_kv_blocks_used", "num_kv_blocks_used", "KV blocks held by requests.", False),
    ("num_kv_blocks_total", "num_kv_blocks_total", "KV blocks in the cache.", False),
    ("num_kv_blocks_shared", "num_kv_blocks_shared",
     "KV blocks held by more than one request (forks, prefix-cache hits).", False),
    ("num_cow_copies", "kv_cow_copies",
     "KV blocks copied on write (forks: beam search, n > 1 samples).", True),
    ("prefix_cache_queries", "prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache.", True),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache.", True),
    ("num_preemptions", "num_preemptions", "Requests preempted for lack of KV blocks.", True),
    ("num_steps", "num_steps", "Engine steps run.", True),
    ("num_multi_request_steps", "num_multi_request_steps", "Steps batching 2+ requests.",
     True),
    ("max_reqs_in_step", "max_reqs_in_step", "Most requests batched in one step.", False),
    ("num_reqs_last_step", "num_reqs_last_step", "Requests in the last step.", False),
    ("num_tokens_last_step", "num_tokens_last_step", "Tokens in the last step.", False),
    ("num_prompt_tokens", "prompt_tokens", "Prompt tokens computed.", True),
    ("num_generation_tokens", "generation_tokens", "Tokens generated.", True),
    ("num_requests_finished", "request_success", "Requests finished.", True),
    ("last_step_time", "last_step_seconds", "Wall time of the last step (seconds).", False),
    ("last_forward_time", "last_forward_seconds", "Forward + sampling of the last step (s).",
     False),
    ("worker_idle_time", "worker_idle_seconds",
     "Worker time between a step's end and the next step's start (s).", True),
    ("worker_busy_time", "worker_busy_seconds", "Worker forward + sampling time (s).", True),
    # Speculative decoding (vLLM's spec_decode names; zero while it is off).
    ("spec_decode_num_drafts", "spec_decode_num_drafts",
     "Verifications of at least one draft token.", True),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens verified.",
     True),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
     "Draft tokens accepted.", True),
    ("spec_decode_acceptance_rate", "spec_decode_draft_acceptance_rate",
     "Accepted / verified draft tokens (0..1).", False),
    ("spec_decode_mean_acceptance_length", "spec_decode_mean_acceptance_length",
     "Tokens emitted per verification: 1 + accepted / drafts.", False),
]

# vLLM's buckets (vllm/v1/metrics/loggers.py), seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def replicas_of(engine: AsyncEngine | DPAsyncEngine) -> list[AsyncEngine]:
    """The engine's replicas in rank order: itself, or a ``DPAsyncEngine``'s."""
    return engine.replicas if isinstance(engine, DPAsyncEngine) else [engine]


class _StatsCollector:
    """Reads each replica's ``stats()`` at every scrape (never a stale copy); every
    series has an ``engine`` label, the replica's rank (vLLM's label for data
    parallelism; ``"0"`` with one engine), so ``sum by (model_name)`` is the total."""

    def __init__(self, engine: AsyncEngine | DPAsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        replicas = replicas_of(self.engine)
        if isinstance(self.engine, DPAsyncEngine):
            per_replica = self.engine.replica_stats()
        else:
            per_replica = [self.engine.stats()]
        labels = [[self.model_name, str(rank)] for rank in range(len(replicas))]
        for field, name, help_text, is_counter in _STATS_METRICS:
            family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(
                f"aioengine:{name}", help_text, labels=["model_name", "engine"])
            for label, stats in zip(labels, per_replica, strict=True):
                family.add_metric(label, getattr(stats, field))
            yield family
        per_pos = CounterMetricFamily("aioengine:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=["model_name", "engine", "position"])
        for label, stats in zip(labels, per_replica, strict=True):
            for pos, n in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([*label, str(pos)], n)
        yield per_pos
        healthy = GaugeMetricFamily("aioengine:engine_healthy",
                                    "1 while the engine serves requests, 0 while its worker "
                                    "restarts or the server drains.",
                                    labels=["model_name", "engine"])
        restarts = CounterMetricFamily("aioengine:worker_restarts",
                                       "Times the model worker died and was restarted.",
                                       labels=["model_name", "engine"])
        for label, replica in zip(labels, replicas, strict=True):
            healthy.add_metric(label, float(replica.healthy and not replica.draining))
            restarts.add_metric(label, replica.num_worker_restarts)
        yield healthy
        yield restarts


class _QuotaCollector:
    """Per-API-key counters, labelled by the key's ``name`` (never the key)."""

    def __init__(self, quotas: QuotaManager) -> None:
        self.quotas = quotas

    def collect(self) -> Iterator[Metric]:
        labels = ["key_name"]
        requests = CounterMetricFamily("aioengine:api_key_requests",
                                       "Requests admitted for the API key.", labels=labels)
        prompt = CounterMetricFamily("aioengine:api_key_prompt_tokens",
                                     "Prompt tokens of the key's admitted requests.",
                                     labels=labels)
        generation = CounterMetricFamily("aioengine:api_key_generation_tokens",
                                         "Tokens generated for the key's requests.",
                                         labels=labels)
        running = GaugeMetricFamily("aioengine:api_key_requests_running",
                                    "The key's requests in flight.", labels=labels)
        rejected = CounterMetricFamily(
            "aioengine:api_key_rejected_requests",
            "Requests refused for the key: reason requests / tokens (per-minute limits, "
            "429), concurrency (429), model (not allowed, 404).",
            labels=[*labels, "reason"])
        for state in self.quotas.keys:
            requests.add_metric([state.name], state.num_requests)
            prompt.add_metric([state.name], state.num_prompt_tokens)
            generation.add_metric([state.name], state.num_generation_tokens)
            running.add_metric([state.name], state.running)
            for reason in ("requests", "tokens", "concurrency", "model"):
                rejected.add_metric([state.name, reason], state.num_rejected.get(reason, 0))
        yield from (requests, prompt, generation, running, rejected)


class ReplicaLatency:
    """One replica's ``LatencyObserver``: the latency histograms' samples under
    its ``engine`` label."""

    def __init__(self, ttft, itl, e2e, queue) -> None:
        self._ttft, self._itl, self._e2e, self._queue = ttft, itl, e2e, queue

    def observe_queue_time(self, seconds: float) -> None:
        self._queue.observe(seconds)

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self._e2e.observe(seconds)


class EngineMetrics:
    """The Prometheus registry of one server; it observes latencies as replica 0
    (``replica_observers``: each replica's ``LatencyObserver``).

    Args:
        engine: a started ``AsyncEngine`` or ``DPAsyncEngine``; each replica's
            ``latency_observer`` becomes its ``ReplicaLatency``.
        quotas: the server's API keys, for the per-key counters (``api_key_*``).
    """

    def __init__(self, engine: AsyncEngine | DPAsyncEngine, quotas: QuotaManager | None = None
                 ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        model_name = engine.served_model_name
        self.registry.register(_StatsCollector(engine, model_name))
        if quotas is not None:
            self.registry.register(_QuotaCollector(quotas))

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"aioengine:{name}", help_text, ["model_name", "engine"],
                             buckets=buckets, registry=self.registry)

        ttft = histogram("time_to_first_token_seconds",
                         "Time from arrival to the first generated token.", TTFT_BUCKETS)
        itl = histogram("inter_token_latency_seconds",
                        "Time between two steps that gave a request tokens.", ITL_BUCKETS)
        e2e = histogram("e2e_request_latency_seconds",
                        "Time from arrival to finish of requests that finished normally.",
                        REQUEST_LATENCY_BUCKETS)
        queue = histogram("request_queue_time_seconds",
                          "Time from arrival to first being scheduled.", REQUEST_LATENCY_BUCKETS)
        # One observer per replica, its histograms under its own ``engine`` label
        # like every other series; this object observes as replica 0.
        self.replica_observers = []
        for rank, replica in enumerate(replicas_of(engine)):
            label = (model_name, str(rank))
            observer = ReplicaLatency(ttft.labels(*label), itl.labels(*label),
                                      e2e.labels(*label), queue.labels(*label))
            replica.latency_observer = observer
            self.replica_observers.append(observer)
        first = self.replica_observers[0]
        self.observe_queue_time = first.observe_queue_time
        self.observe_ttft = first.observe_ttft
        self.observe_itl = first.observe_itl
        self.observe_e2e = first.observe_e2e

    # -- scrape ------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """``(body, content_type)`` of one scrape."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
