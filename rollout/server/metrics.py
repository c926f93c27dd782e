"""/metrics in Prometheus text format, read from the engine at scrape time.

Names follow SGLang's (`sglang:num_running_reqs`, `sglang:generation_tokens_total`, ...) so dashboards
built for SGLang read this server unchanged. Each app gets its own CollectorRegistry (two servers in one
process do not share counters). Values are the engine's own counters (Engine.get_server_info) and KV
pool occupancy, taken under the engine lock in a worker thread, never on the event loop.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from rollout.server.common import run_blocking

router = APIRouter()


class EngineCollector:
    """A custom collector: one engine snapshot per scrape, so all values agree with each other."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

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
        yield gauge("sglang:num_used_tokens", "KV cache token slots in use (incl. prefix cache)",
                    snap["num_used_tokens"])
        yield gauge("sglang:token_usage", "Fraction of KV cache token slots in use", snap["num_used_tokens"] / max_tokens)
        yield gauge("sglang:cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens",
                    info["cache_hit_rate"])
        yield counter("sglang:prompt_tokens", "Prompt tokens received", info["num_prompt_tokens"])
        yield counter("sglang:generation_tokens", "Tokens generated", info["num_generated_tokens"])
        yield counter("sglang:cached_tokens", "Prompt tokens served from the prefix cache", info["num_cached_tokens"])
        yield counter("sglang:num_retractions", "Requests retracted under KV pressure", info["num_retractions"])
        wv = InfoMetricFamily("sglang:weight_version", "Version of the weights being served", labels=labels)
        wv.add_metric(lv, {"weight_version": str(info["weight_version"])})
        yield wv


def make_registry(engine, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry


@router.get("/metrics")
async def metrics(request: Request):
    body = await run_blocking(request, generate_latest, request.app.state.metrics_registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
