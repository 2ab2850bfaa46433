"""Operations: ``GET /health`` (503 while the model loads, like llama-server), ``GET /metrics`` (Prometheus
text) and, only when the server was started with ``--enable-fault-injection``, ``POST /debug/fault-injection``.

Fault injection (testing only): ``POST /debug/fault-injection {"reads": 1}`` makes the next ``reads``
demand reads of expert bytes (reads a running request waits for) fail with an I/O error, so the request
that needs them fails with a 500 ``server_error`` and the next one is served normally.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from fate_edge.apps.server.errors import APIError, invalid
from fate_edge.apps.server.request_helpers import check_auth, read_json, ready_engine
from fate_edge.apps.server.state import state_of

log = logging.getLogger("fate_edge.apps.server")

router = APIRouter()
fault_router = APIRouter()


@router.get("/health")
async def health(request: Request):
    state = state_of(request)
    if state.engine is not None:
        return {"status": "ok"}
    if state.load_error is not None:
        return JSONResponse(
            {
                "status": "error",
                **APIError(500, f"the model failed to load: {state.load_error}", "server_error").body(),
            },
            status_code=500,
        )
    return JSONResponse(
        {"status": "loading", **state.status.snapshot(), **APIError(503, "Loading model", "unavailable_error").body()},
        status_code=503,
        headers={"Retry-After": "1"},
    )


@router.get("/metrics")
async def metrics(request: Request):
    check_auth(request)
    state = state_of(request)
    text = state.metrics.render(
        state.engine, state.runner, state.engine is not None, state.model_id, str(state.settings.engine.policy)
    )
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@fault_router.post("/debug/fault-injection")
async def fault_injection(request: Request):
    check_auth(request)
    ready_engine(request)
    body = await read_json(request)
    reads = body.get("reads", 1)
    if isinstance(reads, bool) or not isinstance(reads, int) or not 0 <= reads <= 1000:
        raise invalid("'reads' must be an integer in [0, 1000]", "reads")
    state = state_of(request)
    with state.fault_lock:
        state.fail_reads = reads
    log.warning("fault injection armed: the next %d demand read(s) will fail", reads)
    return {"armed_reads": reads}
