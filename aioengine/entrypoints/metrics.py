"""``GET /metrics``: the one ``EngineStats`` snapshot in Prometheus text format.

Metric names follow vLLM's where one exists (``vllm:num_requests_running`` is
``aioengine:num_requests_running`` here) so existing dashboards map over.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily

from aioengine.engine.core import EngineStats

# (EngineStats field, metric name, help, is_counter)
_METRICS = [
    ("num_running", "num_requests_running", "Requests in the running batch.", False),
    ("num_waiting", "num_requests_waiting", "Requests waiting to be scheduled.", False),
    ("kv_cache_usage", "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", False),
    ("num_kv_blocks_used", "num_kv_blocks_used", "KV blocks held by requests.", False),
    ("num_kv_blocks_total", "num_kv_blocks_total", "KV blocks in the cache.", False),
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up.", True),
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
]


class _StatsCollector:
    def __init__(self, stats: EngineStats) -> None:
        self.stats = stats

    def collect(self):
        for field, name, help_text, is_counter in _METRICS:
            family = CounterMetricFamily if is_counter else GaugeMetricFamily
            yield family(f"aioengine:{name}", help_text, value=getattr(self.stats, field))


def render_metrics(stats: EngineStats) -> tuple[bytes, str]:
    """``(body, content_type)`` of a scrape of ``stats``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats))
    return generate_latest(registry), CONTENT_TYPE_LATEST
