"""``policy="auto"``: the planner picks the policy for this host, budget and link before the engine opens
(``Engine.load`` asks it; the package registers :func:`plan_engine` with the runtime at import)."""

from __future__ import annotations

from fate_edge.errors import FateEdgeError
from fate_edge.format.checkpoint_layout import DTYPES
from fate_edge.format.store import is_store
from fate_edge.planning.planner import Plan, auto_plan
from fate_edge.runtime.budget import parse_bytes
from fate_edge.runtime.engine_config import EngineConfig


def plan_engine(config: EngineConfig) -> Plan:
    """The planner's pick for ``config``: it probes the engine on ``config.plan_sample`` (text or token ids) when
    given, else on its own sample text; one request's speed depends on its text (docs/planner.md), so the prediction
    is for text like the sample."""
    if not is_store(config.store_dir):
        raise FateEdgeError(f"{config.store_dir}: not an expert store; create one with `fate-edge convert MODEL OUT`")
    ids = None
    if config.plan_sample is not None:
        from fate_edge.tokenizer import Tokenizer

        sample = config.plan_sample
        ids = Tokenizer(config.store_dir).encode(sample) if isinstance(sample, str) else sample
        if not ids:
            raise FateEdgeError("plan_sample is empty: give a prompt like the ones this engine will serve")
    return auto_plan(
        config.store_dir,
        parse_bytes(config.memory_budget),
        config.link.spec if config.link else None,
        dtype=DTYPES[config.dtype] if isinstance(config.dtype, str) else config.dtype,
        workers=config.workers,
        token_ids=ids,
        prompt_tokens=len(ids) if ids else 64,
    )
