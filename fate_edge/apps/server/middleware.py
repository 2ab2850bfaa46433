"""ASGI middleware: request metrics, and the guard that keeps web pages away from a loopback daemon."""

from __future__ import annotations

import ipaddress
import time

from starlette.datastructures import Headers

from fate_edge.apps.server.errors import APIError
from fate_edge.apps.server.metrics import Metrics
from fate_edge.apps.server.state import LOOPBACK_HOSTS, ServerSettings

ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/debug/fault-injection"}


class Observe:
    """Request counts by endpoint and status, and latency (to the last byte sent)."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500

        async def send_wrap(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrap)
        finally:
            path = scope.get("path", "")
            endpoint = path if path in ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")
            self.metrics.request(endpoint, status, time.perf_counter() - start)


def host_name(value: str) -> str:
    """``Host``-header form of a host: lower case, port dropped, IPv6 in brackets (``[::1]``)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    if value.count(":") > 1:  # a bare IPv6 address, as given to --host
        return f"[{value}]"
    return value.split(":")[0].rstrip(".")


def allowed_hosts(settings: ServerSettings) -> set[str] | None:
    """Host names a request may address (None: any): loopback names, the bound address, ``--allowed-hosts``."""
    if "*" in settings.allowed_hosts:
        return None
    hosts = {*LOOPBACK_HOSTS, *(host_name(h) for h in settings.allowed_hosts)}
    try:
        unspecified = ipaddress.ip_address(settings.host).is_unspecified  # 0.0.0.0 never appears in a Host
    except ValueError:
        unspecified = False
    if not unspecified:
        hosts.add(host_name(settings.host))
    return hosts


def allowed_origins(settings: ServerSettings) -> set[str] | None:
    """Browser origins allowed to call the API (None: any). Without ``--cors-origins``, none is."""
    if "*" in settings.cors_origins:
        return None
    return {o.strip().rstrip("/").lower() for o in settings.cors_origins}


class BrowserGuard:
    """Rejects a ``Host`` that does not name this server and an ``Origin`` not in ``--cors-origins``.

    Without them any web page the user opens could drive the daemon: by DNS rebinding (its own name
    resolving to 127.0.0.1, so the Host is the page's name) or by a plain cross-origin POST. Ollama
    guards its loopback API the same way. Requests without the headers (non-browser clients) pass.
    """

    def __init__(self, app, settings: ServerSettings):
        self.app = app
        self.hosts = allowed_hosts(settings)
        self.origins = allowed_origins(settings)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            host, origin = headers.get("host"), headers.get("origin")
            error = None
            if host is not None and self.hosts is not None and host_name(host) not in self.hosts:
                error = APIError(
                    403,
                    f"the Host header {host!r} does not name this server; if clients reach it by "
                    "that name, start it with --allowed-hosts NAME",
                    "permission_error",
                    None,
                    "host_not_allowed",
                )
            elif origin is not None and self.origins is not None and origin.rstrip("/").lower() not in self.origins:
                error = APIError(
                    403,
                    f"cross-origin requests from {origin!r} are not allowed; to let that web page "
                    "use the API, start the server with --cors-origins ORIGIN",
                    "permission_error",
                    None,
                    "origin_not_allowed",
                )
            if error is not None:
                if scope["path"].startswith("/api/"):  # Ollama's routes: Ollama's error shape
                    from fate_edge.apps.server.ollama_routes import ollama_error

                    return await ollama_error(error)(scope, receive, send)
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)
