"""Expected next use: a causal estimate of what Belady-MIN knows.

Belady evicts the resident needed farthest in the future. Decode visits the MoE layers in order, once per token,
so the next use of expert e of layer l is at the layer's next call (d layers from now) with probability p_next,
else some tokens later: about 1 / p_token tokens at its running use rate. This policy evicts the largest

    d + (1 - p_next) · L / p_token

with, per request (statistics reset per sequence, as LCU's):

- p_token: the expert's per-token use rate, counted with a per-token decay and seeded by its calibration share
  (``fate-edge calibrate``'s popularity: top_k x its share of the layer's routed tokens), worth ``prior_tokens``
  tokens of evidence;
- p_next: the inter-token routing correlation of the layer, learned online from this request: of the tokens on
  which expert a was used at layer l, the share whose next call of layer l used e (an E x E table per layer), with
  ``transition_prior`` pseudo-counts at p_token; averaged over the experts of the layer's latest call.

A miss expected back later than the victim is not cached (``bypass``, as MIN with bypass does; at most one per
layer call). How it compares with LCU and Belady: docs/device-presets.md.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fate_edge.runtime.cache.eviction import AccessInfo, EvictionPolicy, Key


@dataclass(frozen=True)
class NextUseConfig:
    decay: float = 0.98  # per token: evidence a token old weighs this much
    prior_tokens: float = 8.0  # the calibration share counts as this many tokens of evidence
    transition_prior: float = 1.0  # pseudo-counts of each transition row at the expert's p_token
    top_k: int = 2  # experts per token per layer (turns a calibration share into a per-token rate)
    # Decline to cache a miss expected back later than the victim (at most one per layer call: the budget holds
    # one expert being computed outside the cache).
    bypass: bool = True


class NextUse(EvictionPolicy):
    """Evict the resident with the largest expected distance (in layers) to its next use."""

    name = "next-use"

    def __init__(
        self, config: NextUseConfig | None = None, seed_share: dict[Key, float] | None = None, num_experts: int = 0
    ):
        """``seed_share``: per key, its share of its layer's routed tokens (calibration); without it every expert
        of a layer starts at 1 / ``num_experts`` (or 1 / the experts seen, when that is 0 too)."""
        self.cfg = config or NextUseConfig()
        self.seed = dict(seed_share or {})
        self.num_experts = num_experts
        self.new_sequence()

    def new_sequence(self) -> None:
        self.t = 0  # tokens (forward passes) of this sequence
        self.last_layer = -1
        self.layer_now = 0
        self.num_layers = 1
        self.count: dict[Key, float] = {}  # decayed uses, as of token stamp[key]
        self.stamp: dict[Key, int] = {}
        self.latest: dict[int, set[int]] = {}  # layer → experts of its latest call (being built: this layer's)
        self.before: dict[int, set[int]] = {}  # layer → experts of the call before its latest
        self.trans: dict[int, dict[int, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
        self.rows: dict[int, dict[int, float]] = defaultdict(dict)  # layer → a → calls of a followed by a call
        self.call = 0  # layer calls seen (numbers the current one)
        self.bypassed_in = -1  # the call in which an insert was last declined

    def on_access(self, key: Key, hit: bool, info: AccessInfo) -> None:
        layer, e = key
        if info.layer_now < self.last_layer:  # wrapped to the first layer: a new token
            self.t += 1
        call = self.latest.get(layer)
        if info.layer_now != self.last_layer or call is None or e in call:  # the layer's next call starts
            self._learn(layer, call)
            call = self.latest[layer] = set()
            self.call += 1
        call.add(e)
        self.last_layer = self.layer_now = info.layer_now
        self.num_layers = max(1, info.num_layers)
        self.count[key] = self._decayed(key) + 1.0
        self.stamp[key] = self.t

    def _learn(self, layer: int, done: set[int] | None) -> None:
        """The layer's call ``done`` has ended: count each a of the call before it → each b of ``done``."""
        if done is None:
            return
        before = self.before.get(layer)
        if before is not None:
            for a in before:
                self.rows[layer][a] = self.rows[layer].get(a, 0.0) + 1.0
                row = self.trans[layer][a]
                for b in done:
                    row[b] = row.get(b, 0.0) + 1.0
        self.before[layer] = done

    def _decayed(self, key: Key) -> float:
        return self.count.get(key, 0.0) * self.cfg.decay ** (self.t - self.stamp.get(key, self.t))

    def _share(self, key: Key) -> float:
        if key in self.seed:
            return self.seed[key]
        n = self.num_experts or max(1, len(self.latest.get(key[0], ())))
        return 1.0 / n

    def p_token(self, key: Key) -> float:
        d, w = self.cfg.decay, self.cfg.prior_tokens
        tokens = (1 - d ** (self.t + 1)) / (1 - d) if d < 1 else self.t + 1.0
        prior = min(1.0, self.cfg.top_k * self._share(key))
        return min(1.0, (self._decayed(key) + w * prior) / (tokens + w)) + 1e-3

    def p_next(self, key: Key) -> float:
        layer, e = key
        src = self.latest.get(layer)  # the layer's latest call (the one being served: its experts so far)
        p = self.p_token(key)
        if not src:
            return min(1.0, p)
        w = self.cfg.transition_prior
        vals = [(self.trans[layer][a].get(e, 0.0) + w * p) / (self.rows[layer].get(a, 0.0) + w) for a in src]
        return min(1.0, sum(vals) / len(vals))

    def next_use(self, key: Key) -> float:
        """Expected layers from now to the key's next use."""
        n = self.num_layers
        d = (key[0] - self.layer_now) % n or n
        return d + (1.0 - self.p_next(key)) * n / self.p_token(key)

    def victim(self, candidates: Sequence[Key], incoming: Key | None = None) -> Key:
        return max(candidates, key=lambda k: (self.next_use(k), k))

    def admit(self, incoming: Key, victim: Key) -> bool:
        if not self.cfg.bypass or self.bypassed_in == self.call or self.next_use(incoming) <= self.next_use(victim):
            return True
        self.bypassed_in = self.call
        return False


def seed_shares(popularity: Mapping[int, Sequence[int]]) -> dict[Key, float]:
    """Calibration counts → each expert's share of its layer's routed tokens."""
    return {(layer, e): c / max(1, sum(counts)) for layer, counts in popularity.items() for e, c in enumerate(counts)}
