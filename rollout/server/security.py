"""Who may talk to the server: Host and Origin checks, POST-with-JSON for state changes, the API key.

A server on loopback with no key is still reachable from every web page the user's browser opens: a
page can send "simple" cross-site requests (a `text/plain` POST, an image GET) and, by DNS rebinding, make
its own name resolve to 127.0.0.1. `RequestGuard` closes those doors before any route runs:

- Host: the `Host` header must name the bound address. A server bound to one address accepts that
  address and the loopback aliases (127.0.0.1, localhost, [::1]); one bound to every interface
  (0.0.0.0 or ::) accepts any name, since it cannot know which names point at it (it needs `--api-key`
  then; `warn_if_exposed` says so at start-up). `--allowed-hosts` adds names ('*' = any); on a server
  bound to every interface it replaces "any" with loopback plus those names.
- Origin: a browser names the page that sent a request. It is accepted when it is the server's own
  origin (its host and port equal the `Host` header) or listed in `--allowed-origins` ('*' = any);
  clients that send no Origin (curl, httpx, the openai client, sglang-router) are unaffected.
- Method and body: every route that changes state answers POST only (a GET is 405; /flush_cache keeps
  SGLang's GET, see POST_ONLY_PATHS), and every POST or
  PUT with a body must say `Content-Type: application/json` (else 415), which a browser cannot send
  cross-site without a CORS preflight that this server never grants. An empty POST (SGLang clients
  post `/pause_generation` with no body) stays allowed; the Origin check covers the browser case.

Starlette's TrustedHostMiddleware checks names only and answers in plain text; this guard checks the
Origin too and answers in the server's error shape. `APIKeyMiddleware` requires
`Authorization: Bearer <key>` on every path but /health, /health_generate and /metrics (SGLang's). Neither buffers bodies, so streaming and
disconnect detection are untouched.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from urllib.parse import urlsplit

from rollout.server.args import API_KEY_ENV
from rollout.server.common import error_response

logger = logging.getLogger("rollout.server")
# As SGLang's API-key middleware: health probes and the Prometheus scrape need no key (a router's or a
# scraper's prober does not send one); every other path does.
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")

# Routes that change the engine's state (SGLang's paths) answer POST only. Reads (/get_*, /health*,
# /metrics, /v1/models) and generation are not here; generation is still POST/PUT with JSON like every
# body-carrying route. /flush_cache keeps SGLang's GET: slime calls it that way, it succeeds only when
# nothing runs, and all it can cost is recomputing cached prefixes.
POST_ONLY_PATHS = frozenset({
    "/pause_generation", "/continue_generation", "/abort_request",
    "/release_memory_occupation", "/resume_memory_occupation",
    "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed",
    "/init_weights_update_group", "/destroy_weights_update_group", "/update_weight_version",
    "/start_expert_distribution_record", "/stop_expert_distribution_record", "/dump_expert_distribution_record",
    "/post_process_weights", "/weights_checker", "/start_profile", "/stop_profile",
})


def _host_name(netloc: str) -> str | None:
    """'Example.com:80' -> 'example.com'; '[::1]:8000' -> '::1'; None when unparsable."""
    try:
        name = urlsplit("//" + netloc).hostname
    except ValueError:
        return None
    return name.lower() if name else None


def is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(bound_host: str, extra: list[str] | None) -> list[str]:
    """The loopback aliases and the bound address, plus `extra` (--allowed-hosts); any name ('*') for a
    server bound to every interface unless --allowed-hosts narrows it."""
    if bound_host in WILDCARD_HOSTS and not extra:
        return ["*"]
    bound = [] if bound_host in WILDCARD_HOSTS else [bound_host.strip("[]").lower()]
    return list(dict.fromkeys([*LOOPBACK_NAMES, *bound, *(extra or [])]))


class RequestGuard:
    """Pure ASGI middleware: Host, Origin, method and content-type checks (see the module docstring)."""

    def __init__(self, app, allowed_hosts: list[str], allowed_origins: list[str]) -> None:
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.hosts = frozenset(h.strip("[]").lower() for h in allowed_hosts)
        self.any_origin = "*" in allowed_origins
        self.origins = frozenset(o.rstrip("/").lower() for o in allowed_origins)

    def _refusal(self, scope) -> tuple[str, int] | None:
        headers = {k: v for k, v in scope["headers"]}
        host = headers.get(b"host", b"").decode("latin-1")
        if host and not self.any_host and _host_name(host) not in self.hosts:
            return (f"Host header {host[:100]!r} does not name this server (allowed: {sorted(self.hosts)}); "
                    f"start it with --allowed-hosts to serve other names", 403)
        origin = headers.get(b"origin")
        if origin is not None and not self.any_origin:
            origin_s = origin.decode("latin-1").rstrip("/").lower()
            same_origin = bool(host) and urlsplit(origin_s).netloc == host.lower()
            if not same_origin and origin_s not in self.origins:
                return (f"cross-origin request from Origin {origin_s[:100]!r} refused; start the server with "
                        f"--allowed-origins to allow it", 403)
        method, path = scope["method"], scope["path"]
        if path in POST_ONLY_PATHS and method != "POST":
            return f"{method} {path}: this route changes the server's state and answers POST only", 405
        if method in ("POST", "PUT"):
            has_body = headers.get(b"content-length", b"0") not in (b"0", b"") or b"transfer-encoding" in headers
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if has_body and ctype != b"application/json":
                return (f"{method} {path}: the body must be JSON sent with Content-Type: application/json, "
                        f"got {ctype.decode('latin-1')[:100] or 'no Content-Type'!r}", 415)
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                resp = error_response(refusal[0], refusal[1])
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


class APIKeyMiddleware:
    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        message = "missing Authorization header" if not given else "invalid API key"
        resp = error_response(f"Unauthorized: {message}; send 'Authorization: Bearer <key>'", 401)
        await resp(scope, receive, send)


def warn_if_exposed(host: str, api_key: str | None) -> bool:
    """Log a warning when the server listens beyond loopback without a key; True if it warned."""
    name = host.strip("[]").lower()
    if api_key or (name not in WILDCARD_HOSTS and is_loopback(name)):
        return False
    logger.warning("the server listens on %s, beyond loopback, without an API key: anyone who can reach it can "
                   "generate, pause, release memory and replace the weights. Pass --api-key (or set %s).",
                   host or "every interface", API_KEY_ENV)
    return True


def disk_path_refusal(model_path: str, allowed_roots: list[str] | None) -> str | None:
    """With --allowed-disk-roots, a path outside every root is refused without looking at it, so the
    answer says nothing about what exists there. Symlinks are resolved first (a link inside a root
    that points outside it is outside)."""
    if not allowed_roots:
        return None
    real = os.path.realpath(model_path)
    for root in allowed_roots:
        root_real = os.path.realpath(root)
        if real == root_real or real.startswith(root_real.rstrip(os.sep) + os.sep):
            return None
    return (f"update_weights_from_disk refused: model_path is not under --allowed-disk-roots "
            f"{list(allowed_roots)}")
