"""``POST /v1/chat/completions``: OpenAI chat completions through the model's chat template (JSON or SSE)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from fate_edge.apps.server.generation import generate

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await generate(request, "chat")
