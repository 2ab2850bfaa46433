"""``fate_edge.Engine``: the runtime's engine, with ``policy="auto"`` (or ``plan="auto"``) chosen by the planner
for this host, budget and link before the engine opens."""

from __future__ import annotations

import inspect
from typing import Any

from fate_edge.errors import FateEdgeError
from fate_edge.format.checkpoint_layout import DTYPES
from fate_edge.format.store import is_store
from fate_edge.planning.planner import auto_plan
from fate_edge.runtime import engine as runtime_engine
from fate_edge.runtime.load_threads import in_own_thread

_PARAMS = inspect.signature(runtime_engine.Engine.__init__)


class Engine(runtime_engine.Engine):
    """A model store served under a memory budget (:class:`fate_edge.runtime.engine.Engine`), whose policy may be
    left to the planner."""

    def __init__(self, *args: Any, plan: str | None = None, plan_sample: str | list[int] | None = None, **kwargs: Any):
        """The arguments of :class:`fate_edge.runtime.engine.Engine`; ``policy="auto"`` or ``plan="auto"``: the
        planner picks the policy (its choice, prediction included, is ``self.planned``). ``plan_sample``: a prompt
        like the ones this engine will serve (text or token ids), which the planner probes instead of its own sample
        text: one request's speed depends on its text (docs/planner.md), so the prediction is for text like it."""
        if plan not in (None, "auto"):
            raise FateEdgeError(f"plan must be 'auto' or None, not {plan!r}")
        given = _PARAMS.bind(self, *args, **kwargs)
        given.apply_defaults()
        a = dict(given.arguments)
        del a["self"]
        planned = None
        if plan == "auto" or a["policy"] == "auto":
            if not is_store(a["store_dir"]):
                raise FateEdgeError(
                    f"{a['store_dir']}: not an expert store; create one with `fate-edge convert MODEL OUT`"
                )
            from fate_edge.runtime.auto_budget import resolve_budget
            from fate_edge.runtime.compute_dtype import resolve_dtype
            from fate_edge.runtime.engine import resolve_device

            device = resolve_device(a["device"])
            dtype, link = resolve_dtype(a["dtype"], device), a["link"]
            a["dtype"] = dtype
            # "auto": chosen once here, so the planner and the engine plan for the same budget
            a["memory_budget"] = resolve_budget(
                a["store_dir"],
                a["memory_budget"],
                dtype,
                a["context_tokens"],
                a["resident_bits"],
                a["embedding_bits"],
                device,
            )
            ids = None
            if plan_sample is not None:
                from fate_edge.tokenizer import Tokenizer

                ids = Tokenizer(a["store_dir"]).encode(plan_sample) if isinstance(plan_sample, str) else plan_sample
                if not ids:
                    raise FateEdgeError("plan_sample is empty: give a prompt like the ones this engine will serve")
            # the probes run torch on a thread of their own: its OpenMP helpers end with it (runtime.load_threads)
            planned = in_own_thread(
                lambda: auto_plan(
                    a["store_dir"],
                    a["memory_budget"],
                    link.spec if link else None,
                    dtype=DTYPES[dtype] if isinstance(dtype, str) else dtype,
                    workers=a["workers"],
                    token_ids=ids,
                    prompt_tokens=len(ids) if ids else 64,
                )
            )
            a["policy"] = planned.policy
        super().__init__(**a)
        self.planned = planned
