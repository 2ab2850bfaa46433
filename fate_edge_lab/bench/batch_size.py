"""Batch size for throughput under the budget: a roofline over compute, memory and I/O per step, after MoE-Lightning's
hierarchical roofline (HRM), calibrated by one measured single-sequence run of the engine.

A batched decode step of B sequences computes, per MoE layer, the union of the experts its B tokens route to, and
reads the ones the cache does not hold. With p_e the share of tokens that route to expert e (the store's calibration
counts, else uniform: k / E each), the expected union is ``U(B) = sum_e 1 - (1 - p_e)^B`` and the expected cached
part of it ``sum over the cached e`` of the same (the cache holds the most popular experts). A step then costs

    step(B) = max(rest, B * rest_flops / peak)           resident weights, attention, norms, head, overhead
            + sum over the union of max(c1, rows_e * expert_flops / peak)   each expert once, a GEMM on its rows
            + reads(B) * r                                each read's cost to the step

where ``c1`` (one expert on one row), ``r`` (what one read costs a step: the slope of the single-sequence tokens' times
over their reads, which holds what a read slows around it besides its own decode) and ``rest`` (everything else of a
step) come from the engine's statistics of one sequence decoding alone, and ``peak`` from the model's own output
layer on B rows (:func:`measure_head_rate`).
Throughput is ``B / step(B)``; :func:`choose_batch` takes the B that maximises it with ``step(B)`` at most
``latency_cap`` times the single step. ``fate-edge``'s bench prints the prediction beside the measurement
(``python -m fate_edge_lab.bench.throughput --sweep``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch


@dataclass
class StepCosts:
    """One sequence decoding alone, measured (seconds), and the model's shape."""

    step_s: float  # one decode step alone
    expert_s: float  # one expert computed on one row (the scheduler's ``expert_s / experts_timed``)
    read_s: float  # what one read costs a step (step_costs: fitted on the tokens' times, at least its consume_s)
    reads_per_step: float  # reads one step made alone
    experts_per_layer: list[list[float]]  # per MoE layer: p_e, the share of tokens routing to each expert
    cached: list[list[int]]  # per MoE layer: the experts the cache holds (the most popular)
    expert_flops: float  # one expert on one row
    rest_flops: float  # one token's resident work (attention, shared experts, lm_head)
    peak_flops: float  # this host's measured rate on the resident work (measure_head_rate)
    # What a step of two or more sequences costs beyond this model of it: the general batched path's own work
    # (grouping rows by expert, the slab attention), which one sequence's fused step does not do. 0: not measured
    # (with_pair_probe sets it from a two-sequence step)
    batch_path_s: float = 0.0

    @property
    def top_k(self) -> float:
        return sum(self.experts_per_layer[0]) if self.experts_per_layer else 0.0


@dataclass
class StepPrediction:
    batch: int
    union: float  # experts computed per step, all layers
    reads: float  # experts read per step, all layers
    step_s: float
    tokens_per_s: float
    terms: dict[str, float] = field(default_factory=dict)  # seconds: rest, experts, reads
    bound: str = ""  # the largest term


def union_size(p: list[float], batch: int) -> float:
    """Expected distinct experts of ``batch`` tokens, each expert e routed to by a token with probability p_e."""
    return sum(1 - (1 - min(1.0, q)) ** batch for q in p)


def predict(c: StepCosts, batch: int) -> StepPrediction:
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    union = reads = experts_s = 0.0
    for p, cached in zip(c.experts_per_layer, c.cached):
        held = set(cached)
        for e, q in enumerate(p):
            used = 1 - (1 - min(1.0, q)) ** batch  # the chance e is in the step's union
            rows = batch * q / used if used > 0 else 0.0  # its expected rows when it is
            union += used
            reads += used * (e not in held)
            experts_s += used * max(c.expert_s, rows * c.expert_flops / c.peak_flops)
    # The alone run's reads calibrate the read model: the cache and prefetch beat the popularity-ordered bound
    # by this factor at one sequence, and are taken to keep it.
    at_one = _reads(c, 1)
    reads *= c.reads_per_step / at_one if at_one > 0 else 1.0
    rest = max(_rest_s(c), batch * c.rest_flops / c.peak_flops)
    terms = {"rest": rest, "experts": experts_s, "reads": reads * c.read_s}
    if batch > 1 and c.batch_path_s > 0:
        terms["batch path"] = c.batch_path_s
    step = sum(terms.values())
    return StepPrediction(batch, union, reads, step, batch / step, terms, max(terms, key=terms.__getitem__))


def _reads(c: StepCosts, batch: int) -> float:
    return sum(
        (1 - (1 - min(1.0, q)) ** batch)
        for p, cached in zip(c.experts_per_layer, c.cached)
        for e, q in enumerate(p)
        if e not in set(cached)
    )


def _rest_s(c: StepCosts) -> float:
    """Everything of a single step but its experts and reads (at least a tenth of it: never negative)."""
    layers_k = c.top_k * len(c.experts_per_layer)
    return max(0.1 * c.step_s, c.step_s - layers_k * c.expert_s - c.reads_per_step * c.read_s)


def with_pair_probe(c: StepCosts, pair_step_s: float) -> StepCosts:
    """``c`` with :attr:`StepCosts.batch_path_s` from a measured step of two sequences (seconds): what it took beyond
    this model's prediction of it (never negative). On the bundled model a step of two cost 7.5 ms where the model
    of single steps predicted 4.9: the general batched path's own work, a quarter of its step, that no calibration
    on single-sequence steps sees. Taken as fixed in B, which it is not quite: there the steps of 4 and 8 ran
    1.5-1.8 ms past the prediction."""
    base = replace(c, batch_path_s=0.0)
    return replace(c, batch_path_s=max(0.0, pair_step_s - predict(base, 2).step_s))


def choose_batch(c: StepCosts, max_batch: int, latency_cap: float = 2.0) -> tuple[int, list[StepPrediction]]:
    """The batch size (1..``max_batch``) of the most tokens/s whose step is at most ``latency_cap`` single steps."""
    preds = [predict(c, b) for b in range(1, max_batch + 1)]
    single = preds[0].step_s
    ok = [p for p in preds if p.step_s <= latency_cap * single] or preds[:1]
    return max(ok, key=lambda p: p.tokens_per_s).batch, preds


def read_cost(token_s: list[float], token_stats: list) -> float | None:
    """What one read costs a single-sequence step, from its tokens' times (seconds) and statistics: the slope of a
    least-squares line through (reads, time), over tokens that read different counts. Besides the read's own CPU
    (``consume_s``) it holds what the read makes slower around it: on a 2-vCPU VM ~250 us a read of the bundled
    model against ~60 us of consume (docs/batching.md). None where the counts do not vary or the slope is not
    positive (no evidence)."""
    pairs = [(t.misses + t.prefetch_hits, s) for s, t in zip(token_s, token_stats)]
    if len(pairs) < 3:
        return None
    mx = sum(r for r, _ in pairs) / len(pairs)
    my = sum(s for _, s in pairs) / len(pairs)
    var = sum((r - mx) ** 2 for r, _ in pairs)
    if var <= 0:
        return None
    slope = sum((r - mx) * (s - my) for r, s in pairs) / var
    return slope if slope > 0 else None


def measure_head_rate(model, rows: int = 8, repeats: int = 5) -> float:
    """This host's rate (FLOP/s) on the model's own output layer at ``rows`` rows, in its precision and on its kernel
    (best of ``repeats``): the compute roof of a batch's resident work. A dense fp32 probe misplaces it for int4
    resident weights, whose kernel multiplies int8 products at several times the fp32 rate: on the Qwen1.5-MoE slice
    it put the 8-row roof at 23.5 ms of resident work where the step's measured total was 41 ms."""
    from fate_edge.model.layer import apply_linear

    head = model.head
    x = torch.randn(rows, model.config.hidden_size, dtype=model.dtype, device=model.device)
    cuda = x.device.type == "cuda"
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first call warms the kernel
            t0 = time.perf_counter()
            y = apply_linear(x, head)
            if cuda:
                torch.cuda.synchronize(x.device)
            best = min(best, time.perf_counter() - t0)
    return 2 * rows * y.shape[-1] * model.config.hidden_size / best


def step_costs(
    engine, step_s: float, token_stats: list, peak_flops: float, token_s: list[float] | None = None
) -> StepCosts:
    """:class:`StepCosts` from ``engine`` (its model, cache and store's popularity) and the per-token statistics
    ``token_stats`` (``Engine.token_stats``) of single-sequence decode steps of ``step_s`` each; with ``token_s``
    (each of those tokens' times), a read costs what :func:`read_cost` finds, else its ``consume_s``."""
    cfg = engine.model.config
    k, num_e = cfg.num_experts_per_tok, cfg.num_experts
    pop = engine.popularity or {}
    shares = []
    for layer in cfg.moe_layers:
        counts = pop.get(layer)
        total = sum(counts) if counts else 0
        shares.append([k * n / total for n in counts] if counts and total else [k / num_e] * num_e)
    cached = []
    for layer in cfg.moe_layers:
        held = [e for (lay, e) in (engine.cache.entries if engine.cache is not None else {}) if lay == layer]
        cached.append(held)
    steps = max(1, len(token_stats))
    reads = sum(t.misses + t.prefetch_hits for t in token_stats)
    consume = sum(t.consume_s for t in token_stats)
    timed = sum(t.experts_timed for t in token_stats)
    expert = sum(t.expert_s for t in token_stats) / timed if timed else 0.0
    h = cfg.hidden_size
    expert_flops = 2 * cfg.expert_params
    resident = sum(
        t.numel()
        for t in engine.model.w.values()
        if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] != cfg.vocab_size
    )
    rest_flops = 2 * (resident + h * cfg.vocab_size)  # the embedding is a lookup; lm_head a matmul
    fitted = read_cost(token_s, token_stats) if token_s is not None else None
    per_read = consume / reads if reads else 0.0
    return StepCosts(
        step_s,
        expert,
        max(per_read, fitted) if fitted is not None else per_read,
        reads / steps,
        shares,
        cached,
        expert_flops,
        rest_flops,
        peak_flops,
    )
