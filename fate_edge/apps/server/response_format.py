"""OpenAI ``response_format`` (chat and completions): ``text``, ``json_object`` or ``json_schema``, the JSON kinds
enforced by grammar-constrained sampling (runtime.structured)."""

from __future__ import annotations

from typing import Any

from fate_edge.apps.server.errors import invalid
from fate_edge.errors import GrammarError
from fate_edge.runtime.structured import json_schema_grammar

PARAM = "response_format"


def response_format_grammar(body: dict[str, Any]) -> str | None:
    """The grammar ``response_format`` asks for (None: free text); a 400 naming ``response_format`` if it is
    malformed or its schema is one the grammar library refuses."""
    fmt = body.get(PARAM)
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise invalid('\'response_format\' must be an object like {"type": "json_object"}', PARAM)
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar(None)
    if kind != "json_schema":
        raise invalid(
            f"'response_format.type' must be 'text', 'json_object' or 'json_schema'; got '{kind}'",
            f"{PARAM}.type",
            "invalid_value",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise invalid(
            '\'response_format.json_schema\' must be an object like {"name": ..., "schema": {...}}',
            f"{PARAM}.json_schema",
        )
    try:
        return json_schema_grammar(spec.get("schema", {}))
    except GrammarError as exc:
        raise invalid(
            f"'response_format.json_schema.schema' is not a schema the grammar library accepts: {exc}",
            f"{PARAM}.json_schema.schema",
            "invalid_value",
        ) from None
