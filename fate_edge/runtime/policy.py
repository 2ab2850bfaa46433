"""Policy configurations and the named presets the engine runs (baselines and our own).

A policy is data: which predictor, which cache allocation and eviction, which precisions, how wide
to prefetch. The scheduler and cache read it; baselines and fate-edge differ only here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TypeGuard

from fate_edge.errors import PolicyError

# The values each field accepts (the cache, scheduler and engine dispatch on these names).
ALLOCATIONS = ("uniform", "shallow", "cost-aware", "global")
EVICTIONS = ("lru", "lfu", "arc", "popularity", "lcu", "belady", "next-use")
PREDICTORS = (
    None,
    "cross-layer",
    "cross-layer-norm",
    "learned",
    "learned-onnx",
    "best-available",
    "activation-path",
    "oracle",
)
PREFETCH_WIDTHS = ("fate", "mass")  # or an int >= 0
BITS = (2, 3, 4, 8, 16)
COLD_BITS = (None, 2, 3, 4, 8)
MISS_COMPUTE = ("device", "hybrid")


@dataclass(frozen=True)
class PolicyConfig:
    name: str
    cache: bool = True  # False: load-on-demand, nothing kept beyond the layer being computed
    allocation: str = "uniform"  # uniform | shallow (Fate) | cost-aware | global (one partition)
    eviction: str = "lru"  # lru | lfu | arc | popularity | lcu | belady | next-use (cache/next_use.py)
    # None | cross-layer | cross-layer-norm | learned | learned-onnx | best-available | activation-path | oracle
    predictor: str | None = None
    lookahead: int = 1  # MoE layers ahead to prefetch
    prefetch_width: int | str = "fate"  # int, "fate" (reads that fit in one layer's compute), or "mass"
    prefetch_mass: float = 0.9  # "mass": smallest set whose predicted probability reaches this
    max_prefetch_width: int = 8
    min_prefetch_width: int = 1  # 0: with "fate" width, prefetch nothing when one read outlasts a layer's compute
    # Prefetch only the prediction ranks whose measured hit rate pays for the reader CPU a read takes from
    # compute; while that is none, run the predictor on one layer call in 8 only (see Scheduler._gated).
    prefetch_gate: bool = False
    bits: int = 4  # precision of cached / demand-fetched experts (16 = bf16)
    cold_bits: int | None = None  # prefill: the least popular experts travel in this precision (Fate: 2)
    # Share of prefill expert assignments that may travel as cold_bits; None: the model's own (Fate: 0.5 for
    # DeepSeek models, 0.3 otherwise), resolved by the engine at load (for_model).
    cold_tail_mass: float | None = 0.3
    precision_on_miss: bool = False  # HOBBIT/MoE-APEX: low precision for low-weight misses in decode
    t1: float = 0.6  # cumulative-weight threshold: above it a miss loads low precision
    t2: float = 0.9  # above it a miss may be skipped (only with skip_past_t2)
    skip_past_t2: bool = False  # opt-in: changes answers
    full_layers: int = 4  # Fate's shallow-favoring: layers kept whole once the budget allows
    # Fate: the first MoE layer's experts resident in full precision (int4 when the budget cannot hold that),
    # loaded at start, never predicted nor evicted; their bytes come out of the cache's share of the budget.
    resident_first: bool = False
    preload: bool = False  # Fate: fill the cache at load (whole layers, then popular or low-numbered experts)
    skip_full: bool = False  # Fate: no prediction when every layer it would target is fully cached
    # Prefill reads enter the cache only into free room, so what the cache was filled with at load survives the
    # prompt (a global cache otherwise evicts deep layers' preloaded experts for shallow layers' prompt reads).
    keep_preloaded: bool = False
    # Where a miss is computed on a discrete GPU: "device" (copied there), or "hybrid": on the CPU where the measured
    # link and CPU speeds say it is cheaper (planning/miss_placement.py). One memory (CPU, Jetson): always "device".
    miss_compute: str = "device"

    def __post_init__(self) -> None:
        _validate(self)

    def with_(self, **kw) -> PolicyConfig:
        return replace(self, **kw)


def _bad(field: str, value: object, valid: str) -> PolicyError:
    return PolicyError(f"policy field {field}={value!r} is not valid; use {valid}")


def _one_of(field: str, value: object, valid: tuple) -> None:
    if not any(value == v and type(value) is type(v) for v in valid):  # 4.0 or True is not 4 or 1
        raise _bad(field, value, "one of: " + ", ".join(map(str, valid)))


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _validate(p: PolicyConfig) -> None:
    """Reject misspelt names and out-of-range numbers at construction: the cache and scheduler would otherwise
    fall back silently (an unknown allocation ran as uniform)."""
    if not isinstance(p.name, str) or not p.name:
        raise _bad("name", p.name, "a non-empty string")
    for f in fields(p):
        if f.type == "bool" and not isinstance(getattr(p, f.name), bool):
            raise _bad(f.name, getattr(p, f.name), "True or False")
    _one_of("allocation", p.allocation, ALLOCATIONS)
    _one_of("eviction", p.eviction, EVICTIONS)
    _one_of("predictor", p.predictor, PREDICTORS)
    _one_of("bits", p.bits, BITS)
    _one_of("cold_bits", p.cold_bits, COLD_BITS)
    _one_of("miss_compute", p.miss_compute, MISS_COMPUTE)
    if not (_is_int(p.prefetch_width) and p.prefetch_width >= 0 or p.prefetch_width in PREFETCH_WIDTHS):
        raise _bad("prefetch_width", p.prefetch_width, "an integer >= 0 or one of: " + ", ".join(PREFETCH_WIDTHS))
    for name, low in (("lookahead", 1), ("max_prefetch_width", 1), ("min_prefetch_width", 0), ("full_layers", 0)):
        value = getattr(p, name)
        if not _is_int(value) or value < low:
            raise _bad(name, value, f"an integer >= {low}")
    if p.min_prefetch_width > p.max_prefetch_width:
        raise _bad("min_prefetch_width", p.min_prefetch_width, f"at most max_prefetch_width ({p.max_prefetch_width})")
    for name, low_open in (("prefetch_mass", True), ("cold_tail_mass", False), ("t1", False), ("t2", False)):
        value = getattr(p, name)
        if name == "cold_tail_mass" and value is None:
            continue  # the model's own, resolved at load
        ok = (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and (0 < value <= 1 if low_open else 0 <= value <= 1)
        )
        if not ok:
            raise _bad(name, value, "a number in (0, 1]" if low_open else "a number in [0, 1]")
    if p.t1 > p.t2:
        raise _bad("t1", p.t1, f"at most t2 ({p.t2})")


PRESETS: dict[str, PolicyConfig] = {
    # Every expert read from storage when routed; nothing cached, nothing predicted.
    "load-on-demand": PolicyConfig("load-on-demand", cache=False, predictor=None, bits=16),
    "load-on-demand-int4": PolicyConfig("load-on-demand-int4", cache=False, predictor=None, bits=4),
    # mixtral-offloading: per-layer LRU, no prefetch.
    "lru": PolicyConfig("lru", allocation="uniform", eviction="lru", predictor=None),
    # MoE-Infinity-like: prefetch by this request's activation history, cache by activation frequency.
    "activation-path": PolicyConfig(
        "activation-path",
        allocation="uniform",
        eviction="lfu",
        predictor="activation-path",
        lookahead=2,
        prefetch_width="fate",
    ),
    # Fate (WWW'26, authors' code FFFzy/Fate_open) as published: the cross-layer gate one layer ahead, skipped
    # when the next layer is fully cached; the first MoE layer resident in full precision (never predicted);
    # shallow-favoring ARC caches filled at load; int4 reads, except the predicted prefill tail (the least
    # popular experts, 0.5 of the assignments on DeepSeek models, 0.3 otherwise), which is prefetched as int2.
    "fate": PolicyConfig(
        "fate",
        allocation="shallow",
        eviction="arc",
        predictor="cross-layer",
        lookahead=1,
        prefetch_width="fate",
        cold_bits=2,
        cold_tail_mass=None,
        resident_first=True,
        preload=True,
        skip_full=True,
    ),
    # Clairvoyant bound: Belady-MIN over one pool, following the recorded request call by call (cache/belady.py),
    # and the true experts of the next layer (past the last one, the next token's first) read ahead in order of
    # next use (prefetch_choice.plan_oracle_prefetches); the width only sizes its read buffers. Its cached experts
    # are copied out of their read buffers (scheduler.hands_off): each charged its own bytes, as many as fit.
    # Like fate, it fills its cache at load: with the request's first-used experts (preload.first_used).
    "oracle": PolicyConfig(
        "oracle",
        allocation="global",
        eviction="belady",
        predictor="oracle",
        lookahead=1,
        prefetch_width=64,
        preload=True,
    ),
    # Ours, chosen from measurements (docs/performance.md): a uniform per-layer cache (Fate's shallow-favoring
    # split starves deep layers at small budgets) with MoE-APEX's LCU eviction (the planner's pick at most
    # budgets; higher hit rates than LRU in the quick benchmark), the learned predictor when the model was
    # calibrated (else the cross-layer gate) one layer ahead, and Fate's width rule measured at run time but
    # allowed to reach 0 (when one read outlasts a layer's compute, a prefetch cannot arrive in time and only
    # takes the link from demand reads), behind the prefetch gate (prefetch_gate.py): a rank is read ahead only
    # when its measured hit rate pays for the reader CPU the read takes from compute.
    "fate-edge": PolicyConfig(
        "fate-edge",
        allocation="uniform",
        eviction="lcu",
        predictor="best-available",
        lookahead=1,
        prefetch_width="fate",
        min_prefetch_width=0,
        max_prefetch_width=2,
        prefetch_gate=True,
    ),
}


# Fate's prefill tail share per model_type (the authors' int2_rate); other models: DEFAULT_TAIL_MASS.
TAIL_MASS_BY_MODEL = {"deepseek_v2": 0.5, "deepseek_v3": 0.5}
DEFAULT_TAIL_MASS = 0.3


def for_model(policy: PolicyConfig, model_type: str) -> PolicyConfig:
    """``policy`` with what it leaves to the model filled in: the prefill tail share (``cold_tail_mass=None``)."""
    if policy.cold_tail_mass is not None:
        return policy
    return policy.with_(cold_tail_mass=TAIL_MASS_BY_MODEL.get(model_type, DEFAULT_TAIL_MASS))


# What --policy accepts: every preset, and "auto" (the planner picks for this host, budget and link).
POLICY_CHOICES: tuple[str, ...] = (*PRESETS, "auto")


def get_policy(policy: str | PolicyConfig) -> PolicyConfig:
    if isinstance(policy, PolicyConfig):
        return policy
    if policy not in PRESETS:
        raise PolicyError(f"unknown policy '{policy}'; presets: {', '.join(PRESETS)}, or auto (the planner)")
    return PRESETS[policy]
