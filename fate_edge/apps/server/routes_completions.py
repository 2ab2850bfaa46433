"""``POST /v1/completions``: OpenAI text completions (JSON or SSE)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from fate_edge.apps.server.generation import generate

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    return await generate(request, "completion")
