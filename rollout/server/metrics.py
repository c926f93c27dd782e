"""/metrics in Prometheus text format, read from the engine at scrape time.

Names follow SGLang's (`sglang:num_running_reqs`, `sglang:generation_tokens_total`,
`sglang:time_to_first_token_seconds`, ...) so dashboards built for SGLang read this server unchanged.
Each app gets its own CollectorRegistry (two servers in one process do not share counters). Gauges and
token counters are the engine's own (Engine.get_server_info) and KV pool occupancy, taken under the
engine lock in a worker thread, never on the event loop.

Per-request latencies come from the engine's finish observer (Engine.add_finish_observer), once per
finished request, whoever sent it (HTTP or in-process on the same engine): time to first token,
end-to-end latency, and inter-token latency, each request's n-1 gaps counted at their mean gap (so
its sum and count are exact, its buckets are per-request means; one O(1) update per request); and
finished requests counted by finish reason (stop, length, abort).
"""

from __future__ import annotations

import bisect
import threading
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)

from rollout.server.common import run_blocking

router = APIRouter()


class EngineCollector:
    """A custom collector: one engine snapshot per scrape, so all values agree with each other."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self._last_rate: tuple[float, int] | None = None  # (time, generated tokens) at the previous scrape
        self._rate_lock = threading.Lock()  # two scrapes at once: one window each, not a torn one

    def _gen_throughput(self, generated: int) -> float:
        """Tokens generated per second since the previous scrape (SGLang's gen_throughput, whose window is its
        log interval); 0 at the first scrape."""
        now = time.monotonic()
        with self._rate_lock:
            last, self._last_rate = self._last_rate, (now, generated)
        if last is None or now <= last[0]:
            return 0.0
        return max(0, generated - last[1]) / (now - last[0])

    def collect(self):
        from rollout.server.native import load_snapshot

        snap = load_snapshot(self.engine)
        info = snap["info"]
        labels = ["model_name"]
        lv = [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(lv, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(lv, value)
            return c

        max_tokens = info["max_total_num_tokens"] or 1
        yield gauge("sglang:num_running_reqs", "Requests admitted and generating", snap["num_running"])
        yield gauge("sglang:num_queue_reqs", "Requests waiting to be admitted", snap["num_waiting"])
        yield gauge("sglang:num_used_tokens",
                    "KV cache token slots held by requests (evictable prefix-cache entries count as free)",
                    snap["num_used_tokens"])
        yield gauge("sglang:token_usage", "Fraction of KV cache token slots in use", snap["num_used_tokens"] / max_tokens)
        yield gauge("sglang:cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens",
                    info["cache_hit_rate"])
        yield counter("sglang:prompt_tokens", "Prompt tokens received", info["num_prompt_tokens"])
        yield counter("sglang:generation_tokens", "Tokens generated", info["num_generated_tokens"])
        yield counter("sglang:cached_tokens", "Prompt tokens served from the prefix cache", info["num_cached_tokens"])
        yield counter("sglang:num_retractions", "Requests retracted under KV pressure", info["num_retractions"])
        yield gauge("sglang:gen_throughput", "Tokens generated per second since the previous scrape",
                    self._gen_throughput(info["num_generated_tokens"]))
        # SGLang's gauges of features not served here, at the values they have without them
        yield gauge("sglang:num_grammar_queue_reqs", "Requests waiting for a grammar (no constrained decoding: 0)", 0)
        yield gauge("sglang:spec_accept_length", "Mean accepted draft length (no speculative decoding: 0)", 0)
        wv = InfoMetricFamily("sglang:weight_version", "Version of the weights being served", labels=labels)
        wv.add_metric(lv, {"weight_version": str(info["weight_version"])})
        yield wv


_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class _Histogram:
    """A Prometheus histogram that takes a count with each value: one request's n-1 inter-token gaps are
    one call (a bisect and two adds), not n-1 observes on the scheduler thread."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.lock = threading.Lock()

    def observe(self, value: float, count: int = 1) -> None:
        i = bisect.bisect_left(self.bounds, value)  # Prometheus buckets are "<= bound"
        with self.lock:
            self.counts[i] += count
            self.sum += value * count

    def family(self, name: str, doc: str, labels: list[str], values: list[str]) -> HistogramMetricFamily:
        with self.lock:
            counts, total = list(self.counts), self.sum
        cumulative, running = [], 0
        for bound, c in zip([*map(str, self.bounds), "+Inf"], counts):
            running += c
            cumulative.append((bound, running))
        fam = HistogramMetricFamily(name, doc, labels=labels)
        fam.add_metric(values, cumulative, sum_value=total)
        return fam


_FINISH_REASONS = ("stop", "length", "abort")  # each has a sample from the start, 0 until one finishes so


class RequestMetrics:
    """Latency histograms and finish-reason counts, fed by the engine as each request finishes; a
    collector of the app's registry."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.ttft = _Histogram(_LATENCY_BUCKETS)
        self.itl = _Histogram(_ITL_BUCKETS)
        self.e2e = _Histogram(_LATENCY_BUCKETS)
        self.finished: dict[str, int] = {}
        self.lock = threading.Lock()

    def __call__(self, req) -> None:  # runs on the scheduler thread: O(1) per request
        reason = req.finished_reason.type if req.finished_reason is not None else "unknown"
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
        if req.created_time and req.finished_time:
            self.e2e.observe(max(0.0, req.finished_time - req.created_time))
        n = len(req.output_ids)
        if n and req.first_token_time:
            self.ttft.observe(max(0.0, req.first_token_time - req.created_time))
            if n > 1:
                self.itl.observe(max(0.0, req.last_token_time - req.first_token_time) / (n - 1), count=n - 1)

    def collect(self):
        labels, values = ["model_name"], [self.model_name]
        yield self.ttft.family("sglang:time_to_first_token_seconds", "Submission to first output token", labels,
                               values)
        yield self.itl.family("sglang:inter_token_latency_seconds", "Gap between consecutive output tokens "
                              "(each request's gaps at their mean)", labels, values)
        yield self.e2e.family("sglang:e2e_request_latency_seconds", "Submission to final output", labels, values)
        with self.lock:
            finished = dict(self.finished)
        # SGLang's two counters, by model name only and present from the start: sglang-router merges the
        # workers' /metrics and fails while one worker lacks a sample another has, or labels it differently.
        total = CounterMetricFamily("sglang:num_requests", "Finished requests", labels=labels)
        total.add_metric(values, sum(finished.values()))
        yield total
        aborted = CounterMetricFamily("sglang:num_aborted_requests", "Requests finished as abort", labels=labels)
        aborted.add_metric(values, finished.get("abort", 0))
        yield aborted
        by_reason = CounterMetricFamily("rollout:finished_requests", "Finished requests by finish reason",
                                        labels=["model_name", "finish_reason"])
        for reason in sorted(set(finished) | set(_FINISH_REASONS)):
            by_reason.add_metric([self.model_name, reason], finished.get(reason, 0))
        yield by_reason


def make_registry(engine, model_name: str) -> tuple[CollectorRegistry, RequestMetrics]:
    """The app's registry and its request observer (the caller registers it with the engine)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    requests = RequestMetrics(model_name)
    registry.register(requests)
    return registry, requests


@router.get("/metrics")
async def metrics(request: Request):
    body = await run_blocking(request, generate_latest, request.app.state.metrics_registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
