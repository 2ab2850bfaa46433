"""The daemon's settings and its one explicit state object, stored on the app as ``app.state.fate_edge``.

Routes read everything they need from :class:`ServerState` (through :func:`state_of`), never from
closures, so each route module stands alone and a test can build the state it needs.
"""

from __future__ import annotations

import errno
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import Request

from fate_edge.apps.engine_args import EngineOptions
from fate_edge.apps.server.metrics import Metrics
from fate_edge.apps.server.runner import Runner
from fate_edge.format.convert_progress import LoadStatus

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


@dataclass
class ServerSettings:
    engine: EngineOptions = field(default_factory=EngineOptions)  # the same options as run/chat/demo
    api_key: str | None = None
    max_queue: int = 16
    max_body_bytes: int = 1_000_000
    default_max_tokens: int | None = None  # a request without max_tokens: None = until end of text or context
    model_alias: str | None = None
    enable_fault_injection: bool = False
    host: str = "127.0.0.1"  # the bound address: a Host header naming it is accepted besides the loopback names
    allowed_hosts: list[str] = field(default_factory=list)  # more Host names to accept; "*" accepts any
    cors_origins: list[str] = field(default_factory=list)  # browser origins allowed to call the API; "*": any
    header_timeout: float = 10.0  # seconds a connection may take to send a request's line and headers
    body_timeout: float = 60.0  # seconds a request may take to send its body
    max_connections: int = 64  # open connections at once; past it uvicorn answers 503


@dataclass
class ServerState:
    """Everything the routes share: settings, the engine once loaded, the job runner, metrics, lifecycle."""

    settings: ServerSettings
    model_id: str
    engine: Any = None  # set last by ready(): /health turns 200 only when everything is in place
    runner: Runner | None = None
    load_error: BaseException | None = None
    status: LoadStatus = field(default_factory=LoadStatus)  # the loading stage /health reports until ready
    metrics: Metrics = field(default_factory=Metrics)
    started: int = field(default_factory=lambda: int(time.time()))
    closing: bool = False  # set when the server shuts down: the runner drains, then the engine closes
    fail_reads: int = 0  # fault injection: demand reads still to fail
    fault_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def create(cls, settings: ServerSettings) -> ServerState:
        from fate_edge.bundled import bundled_model_dir

        model = settings.engine.model
        if model and not Path(model).exists():  # a Hugging Face id or Ollama name: its own id
            model_id = settings.model_alias or model
        else:
            model_id = settings.model_alias or Path(model or bundled_model_dir()).resolve().name
        return cls(settings, model_id)

    def ready(self, engine: Any) -> None:
        if self.settings.enable_fault_injection:
            engine.fetch.fault_injector = self._inject
        self.runner = Runner(engine, self.settings.max_queue, on_finish=self.metrics.job_finished)
        self.engine = engine

    def _inject(self, ref: Any) -> None:
        from fate_edge.fetch.fetch_engine import Priority

        with self.fault_lock:
            if self.fail_reads <= 0:
                return
            req = self.engine.fetch._pending.get(ref.key)
            if req is None or req.priority != Priority.DEMAND:
                return  # only reads a request waits for: a failed prefetch could be dropped unseen
            self.fail_reads -= 1
        raise OSError(errno.EIO, "injected read error (fault injection)")


def state_of(request: Request) -> ServerState:
    return request.app.state.fate_edge
