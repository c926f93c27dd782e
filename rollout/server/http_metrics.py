"""SGLang's HTTP-layer metrics: requests, responses and requests in flight per endpoint, and routing keys.

`HttpMetricsMiddleware` (pure ASGI, so streaming bodies pass through untouched) counts each HTTP request as
it arrives and its response status as it starts, and holds the request "active" until the app has sent the
whole body (a stream counts as active while it streams). `HttpMetrics` is the registry collector that
exposes them under SGLang's names:
- `sglang:http_requests_total{endpoint, method}`, `sglang:http_responses_total{endpoint, method,
  status_code}`, `sglang:http_requests_active{endpoint, method}`;
- from sglang-router's `x-smg-routing-key` header: `sglang:routing_keys_active` (distinct keys with a
  request in flight), `sglang:num_unique_running_routing_keys` (the same count: this layer sees requests in
  flight, not which of them the scheduler runs), and the gauge histograms
  `sglang:routing_key_running_req_count` / `sglang:routing_key_all_req_count` (how many keys have how many
  requests in flight; both from the in-flight counts, for the same reason).

The endpoint label is the request path when it is one of the app's routes, else "other", so a client
cannot grow the label set. What it does not do: time requests (the engine's finish observer does, in
rollout/server/metrics.py) or read bodies.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter

from prometheus_client.core import CounterMetricFamily, GaugeHistogramMetricFamily, GaugeMetricFamily

ROUTING_KEY_HEADER = b"x-smg-routing-key"
ROUTING_KEY_REQ_COUNT_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # requests per routing key


class HttpMetrics:
    """The counts (updated by the middleware on the event loop, read by a scrape in a worker thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: Counter = Counter()  # (endpoint, method) -> requests received
        self.responses: Counter = Counter()  # (endpoint, method, status) -> responses started
        self.active: Counter = Counter()  # (endpoint, method) -> requests in flight
        self.keys: Counter = Counter()  # routing key -> requests in flight

    def collect(self):
        with self.lock:
            requests, responses = dict(self.requests), dict(self.responses)
            active, keys = dict(self.active), [n for n in self.keys.values() if n > 0]
        fam = CounterMetricFamily("sglang:http_requests", "HTTP requests received", labels=["endpoint", "method"])
        for (endpoint, method), n in sorted(requests.items()):
            fam.add_metric([endpoint, method], n)
        yield fam
        fam = CounterMetricFamily("sglang:http_responses", "HTTP responses started",
                                  labels=["endpoint", "method", "status_code"])
        for (endpoint, method, status), n in sorted(responses.items()):
            fam.add_metric([endpoint, method, str(status)], n)
        yield fam
        fam = GaugeMetricFamily("sglang:http_requests_active", "HTTP requests in flight",
                                labels=["endpoint", "method"])
        for (endpoint, method), n in sorted(active.items()):
            fam.add_metric([endpoint, method], n)
        yield fam
        yield GaugeMetricFamily("sglang:routing_keys_active", "Routing keys with a request in flight",
                                value=len(keys))
        yield GaugeMetricFamily("sglang:num_unique_running_routing_keys",
                                "Routing keys with a request in flight (this layer does not see the running set)",
                                value=len(keys))
        buckets = _cumulative(keys)
        for name in ("sglang:routing_key_running_req_count", "sglang:routing_key_all_req_count"):
            yield GaugeHistogramMetricFamily(name, "Routing keys by their number of requests in flight",
                                             buckets=buckets, gsum_value=float(sum(keys)))


def _cumulative(counts: list[int]) -> list[tuple[str, float]]:
    """Prometheus buckets (upper bound, keys at or below it) over the per-key request counts."""
    per = [0] * (len(ROUTING_KEY_REQ_COUNT_BOUNDS) + 1)
    for n in counts:
        per[bisect.bisect_left(ROUTING_KEY_REQ_COUNT_BOUNDS, n)] += 1
    out, total = [], 0
    for bound, n in zip([*map(str, ROUTING_KEY_REQ_COUNT_BOUNDS), "+Inf"], per):
        total += n
        out.append((bound, float(total)))
    return out


def route_paths(app) -> set[str]:
    """The paths of every route `app` serves (FastAPI >= 0.16x keeps an included router as one entry whose
    routes are its effective contexts; older ones list the routes themselves)."""
    paths = set()
    for route in app.routes:
        entries = route.effective_route_contexts() if hasattr(route, "effective_route_contexts") else [route]
        paths.update(p for p in (getattr(e, "path", None) for e in entries) if p is not None)
    return paths


class HttpMetricsMiddleware:
    def __init__(self, app, metrics: HttpMetrics, route_paths) -> None:
        self.app = app
        self.metrics = metrics
        self.route_paths = frozenset(route_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        m = self.metrics
        path = scope["path"]
        key = (path if path in self.route_paths else "other", scope["method"])
        routing_key = None
        for name, value in scope["headers"]:
            if name == ROUTING_KEY_HEADER:
                routing_key = value.decode("latin-1")
                break
        with m.lock:
            m.requests[key] += 1
            m.active[key] += 1
            if routing_key is not None:
                m.keys[routing_key] += 1

        def counting_send(message):  # returns send's awaitable: no coroutine frame of its own per body chunk
            if message["type"] == "http.response.start":
                with m.lock:
                    m.responses[(*key, message["status"])] += 1
            return send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            with m.lock:
                m.active[key] -= 1
                if routing_key is not None:
                    m.keys[routing_key] -= 1
                    if not m.keys[routing_key]:
                        del m.keys[routing_key]
