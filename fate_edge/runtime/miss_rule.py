"""Per-miss placement under ``miss_compute="hybrid"``: a miss the host tier holds is computed on the CPU or copied
up, decided for each miss from the costs the run measures as it goes (planning.miss_placement chose ``hybrid``).

The rule, for one missed expert needed by ``rows`` rows of this layer call:

    cpu  = cpu_fixed + rows · cpu_row + 2 · (latency + rows · hidden_bytes · link_per_byte)
    copy = latency + expert_bytes · link_per_byte + device_expert
    on the CPU  iff  cpu · (1 + reuse) < copy

``cpu`` is computing it where it lies (decode the blob on the CPU, send the rows across and the output back); ``copy``
is copying it up once. A copy stays in the device cache and serves the expert's next uses; a CPU miss is paid again
at each. ``reuse`` is how many more uses a copy is expected to serve: the expert's per-token use rate in its layer
(decayed per token, the popularity the eviction policies count; ``top_k / num_experts`` before any evidence) times
the tokens a copy stays cached (the device cache's entries per MoE layer over ``top_k``: each token brings at most
``top_k`` new experts to a layer). So a miss many rows need (a prompt, a batch) or a popular expert goes up, and a
one-row decode miss of a cold expert runs on the CPU.

Costs are exponentially weighted averages (``learn``: the weight of each new measurement), seeded by the planner's
measured figures (:meth:`MissRule.seed`, from ``planning.miss_placement.MissCosts``): the CPU's time per expert per row
(timed around each CPU-computed miss), the decode of a blob on the CPU, and the link's time per byte (each upload's
copy, timed by the copier). A side not yet measured nor seeded is tried so it gets measured: a one-row decode miss
goes to the CPU while the CPU's time is unknown, anything else is copied while the link's is.

The planner's choice of ``hybrid`` (``planning.miss_placement``) is this rule's special case: its measured figures
seeded into a rule, for one row of a decode miss with no decode cost and no reuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# A host → GPU copy's fixed cost (a launch and a DMA setup) where nothing measured it (docs/measured-choices.md)
DEFAULT_LINK_LATENCY_S = 10e-6
Key = tuple[int, int]
CPU, COPY = "cpu", "copy"


def place(cpu_s: float, copy_s: float, reuse: float) -> str:
    """``"cpu"`` where computing every expected use on the CPU (this one and ``reuse`` more) costs less than one
    copy, else ``"copy"``."""
    return CPU if cpu_s * (1.0 + max(0.0, reuse)) < copy_s else COPY


@dataclass
class MissRule:
    top_k: int = 2
    num_experts: int = 0
    horizon_tokens: float = 0.0  # tokens a copy stays in the device cache (0: it is not kept)
    learn: float = 0.2  # weight of each new measurement (0: the seeds are kept)
    decay: float = 0.9  # per token: the use-rate evidence a token old weighs this much
    cpu_row_s: float = 0.0  # the CPU's compute of one expert for one row (0: unknown)
    cpu_fixed_s: float = 0.0  # decoding a blob on the CPU, per miss
    link_s_per_byte: float = 0.0  # host → device copy time per byte (0: unknown)
    link_latency_s: float = DEFAULT_LINK_LATENCY_S
    device_expert_s: float = 0.0  # the device's compute of a copied expert (seeded only: 0 where nothing said)
    # per-token use rate of an expert in its layer as (rate, the layer's token count when it was set): decayed
    # lazily, so a token costs its top_k experts, not every expert
    rate: dict[Key, tuple[float, int]] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)  # decode tokens seen per layer

    def seed(self, costs: Any) -> None:
        """Start from the planner's measured figures (``planning.miss_placement.MissCosts``: one expert of one token
        on the CPU, the link's speed and latency, the device's compute of an expert)."""
        self.cpu_row_s = costs.cpu_expert_s
        self.link_s_per_byte = 1.0 / costs.link_bytes_per_s
        self.link_latency_s = costs.link_latency_s
        self.device_expert_s = costs.device_expert_s

    def _mix(self, old: float, new: float) -> float:
        return new if old == 0 else (1 - self.learn) * old + self.learn * new

    def cpu_measured(self, seconds: float, rows: int) -> None:
        if rows > 0 and seconds > 0:
            self.cpu_row_s = self._mix(self.cpu_row_s, seconds / rows)

    def decode_measured(self, seconds: float) -> None:
        if seconds > 0:
            self.cpu_fixed_s = self._mix(self.cpu_fixed_s, seconds)

    def link_measured(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.link_s_per_byte = self._mix(self.link_s_per_byte, seconds / nbytes)

    def observe(self, layer: int, used: list[int]) -> None:
        """One decode token's experts at ``layer``: every expert's use rate there decays, the used ones gain."""
        now = self.tokens[layer] = self.tokens.get(layer, 0) + 1
        for e in used:
            self.rate[(layer, e)] = (self._rate((layer, e)) + (1 - self.decay), now)

    def _prior(self) -> float:
        return min(1.0, self.top_k / self.num_experts) if self.num_experts else 0.0

    def _rate(self, key: Key) -> float:
        rate, at = self.rate.get(key, (self._prior(), 0))
        return rate * self.decay ** (self.tokens.get(key[0], 0) - at)

    def reuse(self, key: Key) -> float:
        """Further uses a copy of ``key`` is expected to serve while it stays cached."""
        return self._rate(key) * self.horizon_tokens

    def cpu_s(self, rows: int, hidden_bytes: int) -> float:
        """Compute the miss on the CPU: decode its blob, its ``rows`` rows sent across, computed, sent back."""
        link = 2 * (self.link_latency_s + rows * hidden_bytes * self.link_s_per_byte)
        return self.cpu_fixed_s + rows * self.cpu_row_s + link

    def copy_s(self, expert_bytes: int) -> float:
        """Copy the expert up once and compute it on the device."""
        return self.link_latency_s + expert_bytes * self.link_s_per_byte + self.device_expert_s

    def choose(self, key: Key, rows: int, expert_bytes: int, hidden_bytes: int, prompt: bool) -> str:
        """Where the miss of ``key`` for ``rows`` rows runs: ``"cpu"`` or ``"copy"``."""
        if self.cpu_row_s == 0:  # unknown: a one-row decode miss on the CPU measures it
            return CPU if rows == 1 and not prompt else COPY
        if self.link_s_per_byte == 0:  # unknown: a copy measures it
            return COPY
        return place(self.cpu_s(rows, hidden_bytes), self.copy_s(expert_bytes), self.reuse(key))
