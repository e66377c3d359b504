"""``hf-paged serve``'s ``/metrics`` (Prometheus' text format, written by ``prometheus_client``)
and what ``/health`` reads: the hf_paged engines transformers' server has loaded.

Everything is read when a scrape asks (a collector, no background thread): the engine's
``stats()`` for the gauges and counters, and the continuous-batching loop's ``RequestTimes``
for tokens and the latency histograms. The names (``hf_paged_`` prefix; ``model`` label: the
model id as transformers serve names it):

- ``hf_paged_requests_running``, ``hf_paged_requests_waiting``: sequences the scheduler runs
  or queues (a request with ``n`` choices counts ``n``);
- ``hf_paged_kv_blocks_total``, ``hf_paged_kv_blocks_used``, ``hf_paged_kv_blocks_cached``:
  the KV cache's blocks, those held by sequences, those free but holding a reusable prefix;
- ``hf_paged_prefix_cache_queries_total``, ``hf_paged_prefix_cache_hits_total`` (blocks looked
  up and found), ``hf_paged_prefix_cache_hit_rate`` (their ratio since start);
- ``hf_paged_preemptions_total``;
- ``hf_paged_engine_healthy``: 0 once a tensor-parallel worker died (``/health`` says why);
- ``hf_paged_lora_adapters``: LoRA adapters loaded (``--lora``);
- continuous batching only (``--continuous-batching``: the loop that measures them):
  ``hf_paged_generation_tokens_total``, ``hf_paged_generation_tokens_per_second`` (since the
  previous scrape), ``hf_paged_requests_finished_total``,
  ``hf_paged_time_to_first_token_seconds`` and ``hf_paged_time_per_output_token_seconds``
  (histograms; a request's TPOT is its time after the first token over the tokens after it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from hf_paged.integrations.request_times import Histogram


class Served:
    """What transformers' server holds of hf_paged: its loaded engines (in this process or an
    engine process: the same ``stats()``, ``broken`` and ``times``) and, with continuous
    batching, the manager's loop."""

    def __init__(self, model_manager, generation_state):
        self.model_manager = model_manager
        self.generation_state = generation_state

    def engines(self) -> list[tuple[str, object]]:
        """(model id, engine) of each loaded hf_paged model that is not closed."""
        from hf_paged.integrations.causal_lm import PagedCausalLM
        from hf_paged.integrations.remote_manager import RemoteModel

        out = []
        for model_id, timed in list(self.model_manager.loaded_models.items()):
            model = getattr(timed, "model", None)
            if isinstance(model, (PagedCausalLM, RemoteModel)) and not model.engine.closed:
                out.append((model_id, model.engine))
        return out

    def loop(self) -> tuple[str, object] | None:
        """(model id, ``EngineLoop``) of the running continuous-batching manager, if any."""
        state = self.generation_state
        manager = getattr(getattr(state, "_cb_manager", None), "_cb", None)
        loop = getattr(manager, "batch_processor", None)
        if loop is None or not hasattr(loop, "times"):  # not hf_paged's manager
            return None
        return state._cb_model_id, loop

    def unhealthy(self) -> tuple[str | None, str | None]:
        """(reason, error) when the server cannot generate: an engine broken (a worker died)
        or the continuous-batching loop stopped by an error; (None, None) when healthy."""
        for model_id, engine in self.engines():
            if engine.broken:
                return "engine_broken", f"{model_id}: {engine.broken}"
        if not self.generation_state.is_cb_alive():
            manager = self.generation_state._cb_manager._cb
            return "cb_worker_dead", str(manager.background_thread_status.fatal_error)
        return None, None


class Collector:
    """A ``prometheus_client`` collector of ``Served``'s state, read at each scrape."""

    def __init__(self, served: Served):
        self.served = served
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}  # model -> (time, tokens) at last scrape

    def collect(self) -> Iterator:
        gauges = {name: GaugeMetricFamily(f"hf_paged_{name}", text, labels=["model"])
                  for name, text in _GAUGES.items()}
        counters = {name: CounterMetricFamily(f"hf_paged_{name}", text, labels=["model"])
                    for name, text in _COUNTERS.items()}
        for model_id, engine in self.served.engines():
            stats = engine.stats()
            total, free = stats["num_blocks"], stats["num_free_blocks"]
            queries, hits = stats["prefix_cache_queries"], stats["prefix_cache_hits"]
            for name, value in (
                    ("requests_running", stats["num_running"]),
                    ("requests_waiting", stats["num_waiting"]),
                    ("kv_blocks_total", total), ("kv_blocks_used", total - free),
                    ("kv_blocks_cached", stats["num_cached_blocks"]),
                    ("prefix_cache_hit_rate", hits / queries if queries else 0.0),
                    ("engine_healthy", 0 if engine.broken else 1),
                    ("lora_adapters", stats["num_loras"])):
                gauges[name].add_metric([model_id], value)
            for name, value in (("prefix_cache_queries", queries), ("prefix_cache_hits", hits),
                                ("preemptions", stats["num_preemptions"])):
                counters[name].add_metric([model_id], value)
        yield from gauges.values()
        yield from counters.values()
        yield from self._loop_metrics()

    def _loop_metrics(self) -> Iterator:
        found = self.served.loop()
        if found is None:
            return
        model_id, loop = found
        times = loop.times
        tokens = times.tokens
        now = time.monotonic()
        with self._lock:
            then, before = self._last.get(model_id, (now, tokens))
            self._last[model_id] = (now, tokens)
        rate = (tokens - before) / (now - then) if now > then and tokens >= before else 0.0
        for name, text, value, kind in (
                ("generation_tokens", "tokens generated", tokens, CounterMetricFamily),
                ("requests_finished", "requests finished (or failed, or cancelled)",
                 times.finished, CounterMetricFamily),
                ("generation_tokens_per_second", "tokens generated per second since the "
                 "previous scrape", rate, GaugeMetricFamily)):
            family = kind(f"hf_paged_{name}", text, labels=["model"])
            family.add_metric([model_id], value)
            yield family
        for name, text, histogram in (
                ("time_to_first_token_seconds", "from a request's arrival to its first token",
                 times.ttft),
                ("time_per_output_token_seconds", "a request's time after its first token "
                 "over the tokens after it", times.tpot)):
            family = HistogramMetricFamily(f"hf_paged_{name}", text, labels=["model"])
            family.add_metric([model_id], _buckets(histogram), histogram.total)
            yield family


_GAUGES = {
    "requests_running": "sequences the scheduler runs",
    "requests_waiting": "sequences waiting to be admitted",
    "kv_blocks_total": "KV cache blocks",
    "kv_blocks_used": "KV cache blocks held by sequences",
    "kv_blocks_cached": "free KV cache blocks holding a reusable prefix",
    "prefix_cache_hit_rate": "prefix-cache blocks found over blocks looked up, since start",
    "engine_healthy": "1 while the engine can generate, 0 once a worker died",
    "lora_adapters": "LoRA adapters loaded",
}
_COUNTERS = {
    "prefix_cache_queries": "prefix-cache blocks looked up",
    "prefix_cache_hits": "prefix-cache blocks found",
    "preemptions": "sequences preempted for lack of KV blocks",
}


def _buckets(histogram: Histogram) -> list[tuple[str, float]]:
    """Prometheus' cumulative ``(le, count)`` pairs, ending with ``+Inf``."""
    out, running = [], 0
    for bound, count in zip((*histogram.bounds, float("inf")), histogram.counts):
        running += count
        out.append(("+Inf" if bound == float("inf") else repr(bound), running))
    return out


def endpoint(served: Served):
    """The ``/metrics`` route's handler: one registry per app, holding its collector."""
    from fastapi import Response

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector(served))

    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return metrics
