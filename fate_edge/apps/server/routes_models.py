"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one model this server serves."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from fate_edge.apps.server.errors import APIError
from fate_edge.apps.server.request_helpers import check_auth
from fate_edge.apps.server.state import ServerState, state_of

router = APIRouter()


def model_card(state: ServerState) -> dict[str, Any]:
    card: dict[str, Any] = {"id": state.model_id, "object": "model", "created": state.started, "owned_by": "fate-edge"}
    eng = state.engine
    if eng is not None:
        card["meta"] = {
            "context_length": eng.model.config.max_position_embeddings,
            "policy": eng.policy.name,
            "memory_budget_bytes": eng.budget,
            "device": eng.device,
        }
    return card


@router.get("/v1/models")
async def models(request: Request):
    check_auth(request)
    return {"object": "list", "data": [model_card(state_of(request))]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    check_auth(request)
    state = state_of(request)
    if model_id != state.model_id:
        raise APIError(
            404,
            f"model '{model_id}' not found; this server serves '{state.model_id}'",
            "not_found_error",
            "model",
            "model_not_found",
        )
    return model_card(state)
