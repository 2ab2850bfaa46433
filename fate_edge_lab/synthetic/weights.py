"""Seeded initial values for every tensor of a synthetic checkpoint, produced in small blocks of rows.

Random weights alone route uniformly and decorrelate layers; trained MoE models do neither. Two knobs
give the routers a trained model's structure (see :class:`RouterStructure`):

* **popularity skew**: like the "massive activations" of trained LLMs (Sun et al., arXiv 2402.17762), one
  hidden coordinate (``ANCHOR_DIM``) holds the same value for every token: the embeddings set it, no
  attention or MLP output writes to it (their row is zero), and each post-attention norm weight there
  undoes the residual stream's growth. Every gate input thus carries the constant ``m`` there, and router
  column ``ANCHOR_DIM`` turns it into a per-expert bias b_e = β·z_e, z_e ~ N(0, 1). β is solved per layer
  (by a seeded Monte-Carlo of the router) so the expert-usage entropy hits a target fraction of log E.
* **cross-layer correlation**: every sublayer (attention, MoE) adds an update whose rms is
  ``update_ratio`` times the token-specific part of the residual stream, so consecutive gate inputs stay
  close and layer i+1's router applied to layer i's gate input finds most of layer i+1's experts (the
  cross-layer gate of Fate, arXiv 2502.12224).

Each tensor is generated in blocks of whole rows of ~2^20 values, each block from its own generator
seeded by (seed, tensor name, block index): any tensor can be regenerated alone, in any order, and
the writer never holds more than one block.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from fate_edge.model.arch import ModelConfig, config_from_dict
from fate_edge.model.router import route
from fate_edge_lab.synthetic.layout import TensorSpec

BLOCK_VALUES = 1 << 20  # values per random block (4 MB in fp32): the unit of determinism and of memory
# E[silu(g)^2] and E[sigmoid(g)^2] for g ~ N(0, 1): the rms an MLP's activations / a sigmoid gate scale by.
SILU_MS = 0.3558
SIGMOID_MS = 0.2935
_MC_TOKENS = 8192  # Monte-Carlo tokens for the router calibration
ANCHOR_DIM = 0  # the hidden coordinate every token shares (the routers' bias input)
ANCHOR = 0.3  # its value in a normalised gate input, in units of sqrt(hidden_size)


@dataclass(frozen=True)
class RouterStructure:
    """How trained-like the synthetic model's routing is; defaults land in the bundled model's bands."""

    update_ratio: float = 0.28  # rms of each sublayer's residual update / rms of the residual stream it joins
    entropy: tuple[float, float] = (0.72, 0.86)  # target expert-usage entropy / log E, spread over the layers
    router_logit_std: float = 1.0  # std of the token-specific part of a gate logit
    embed_std: float = 1.0
    norm_jitter: float = 0.1  # norm weights uniform in 1 ± this
    bias_std: float = 0.1


def _seed(*parts: Any) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _gen(*parts: Any) -> torch.Generator:
    return torch.Generator().manual_seed(_seed(*parts))


def usage_entropy(ids: torch.Tensor, num_experts: int) -> float:
    """Entropy of the expert-usage histogram of ``ids`` [N, k], / log E (1 = balanced)."""
    p = torch.bincount(ids.flatten(), minlength=num_experts).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum()) / math.log(num_experts)


@dataclass
class LayerRouting:
    """One MoE layer's router design: per-expert logit bias and the mean Σ w² of its routing weights."""

    bias: torch.Tensor  # [E] what the anchor coordinate adds to each expert's gate logit
    weight_ms: float  # E[Σ_k w_k^2] over tokens: how much the routed experts' outputs are shrunk by their weights
    entropy: float  # Monte-Carlo usage entropy / log E


def design_router(
    cfg: ModelConfig, z: torch.Tensor, target: float, noise: torch.Tensor, logit_std: float
) -> LayerRouting:
    """Solve for the skew β (bias_e = β·z_e) whose top-k usage entropy is ``target``; token-specific logits
    are ``logit_std`` · ``noise`` [N, E]."""
    e = cfg.num_experts

    def simulate(beta: float) -> tuple[float, torch.Tensor]:
        logits = noise * logit_std + beta * z  # [N, E]
        _, ids = route(cfg, logits)
        return usage_entropy(ids, e), logits

    lo, hi = 0.0, 8.0 * logit_std
    for _ in range(30):  # entropy falls as β grows
        mid = (lo + hi) / 2
        if simulate(mid)[0] > target:
            lo = mid
        else:
            hi = mid
    beta = (lo + hi) / 2
    entropy, logits = simulate(beta)
    weights, _ = route(cfg, logits)
    return LayerRouting(beta * z, float(weights.pow(2).sum(-1).mean()), entropy)


class WeightInit:
    """Initial values of every tensor of one synthetic checkpoint (``config``: the config.json dict)."""

    def __init__(self, config: dict[str, Any], seed: int = 0, structure: RouterStructure | None = None):
        self.cfg = config_from_dict(dict(config))
        self.seed = seed
        self.structure = structure or RouterStructure()
        self._routing: dict[int, LayerRouting] = {}

    # -------------------------------------------------------------------------------------- router design
    def routing(self, layer: int) -> LayerRouting:
        if layer not in self._routing:
            lo, hi = self.structure.entropy
            u = float(torch.rand((), generator=_gen(self.seed, "entropy", layer)))
            z = torch.randn(self.cfg.num_experts, generator=_gen(self.seed, "skew", layer))
            self._routing[layer] = design_router(
                self.cfg, z, lo + (hi - lo) * u, self._mc_noise, self.structure.router_logit_std
            )
        return self._routing[layer]

    @cached_property
    def _mc_noise(self) -> torch.Tensor:
        return torch.randn(_MC_TOKENS, self.cfg.num_experts, generator=_gen("router-monte-carlo"))

    # ---------------------------------------------------------------------------------------- scales
    def token_rms(self, sublayer: int) -> float:
        """Rms of the token-specific part of the residual stream before ``sublayer`` (2·layer, +1 for the
        MLP): each sublayer adds update_ratio² of its variance."""
        r = self.structure.update_ratio
        return self.structure.embed_std * math.sqrt(1 + r * r) ** sublayer

    def update_rms(self, layer: int, sublayer: int) -> float:
        """Target rms of sublayer (0 attention, 1 MLP) of ``layer``'s residual update."""
        return self.structure.update_ratio * self.token_rms(2 * layer + sublayer)

    @property
    def anchor_value(self) -> float:
        """The anchor coordinate of every embedding: ANCHOR·sqrt(H) after normalisation at layer 0."""
        return self.structure.embed_std * ANCHOR * math.sqrt(self.cfg.hidden_size)

    def anchor_norm(self, layer: int) -> float:
        """Post-attention norm weight at the anchor: keeps the gate input there at ANCHOR·sqrt(H) while the
        stream (and so its rms) grows."""
        h = self.cfg.hidden_size
        rms = math.sqrt(self.token_rms(2 * layer + 1) ** 2 * (h - 1) / h + self.anchor_value**2 / h)
        return ANCHOR * math.sqrt(h) * rms / self.anchor_value

    def std(self, spec: TensorSpec) -> float:
        fan_in = spec.shape[-2] if spec.out_last else spec.shape[-1]
        if spec.role == "embed":
            return self.structure.embed_std
        if spec.role in ("lm_head", "proj_in", "shared_gate"):
            return fan_in**-0.5  # unit-rms outputs from unit-rms (normalised) inputs
        if spec.role in ("bias", "out_bias"):
            return self.structure.bias_std
        if spec.role == "score_bias":  # a tenth of the scores' spread: it moves some choices, not the design
            sigmoid = self.cfg.router == "deepseek_v3"
            return 0.1 * (0.25 * self.structure.router_logit_std if sigmoid else 1 / self.cfg.num_experts)
        if spec.role == "attn_out":
            return self.update_rms(spec.layer, 0) * fan_in**-0.5
        if spec.role == "mlp_out":
            return self.update_rms(spec.layer, 1) * self._mlp_share(spec) * (fan_in * SILU_MS) ** -0.5
        raise ValueError(f"{spec.name}: role {spec.role} has no single std")

    def _mlp_share(self, spec: TensorSpec) -> float:
        """Scale so the MoE block's total output (weighted routed experts + shared expert) has the target rms."""
        if spec.kind == "dense":
            return 1.0
        shared = self.cfg.shared_expert_intermediate_size > 0
        half = 0.5**0.5 if shared else 1.0  # routed and shared parts each carry half the variance
        if spec.kind == "shared":
            return half * (SIGMOID_MS**-0.5 if self.cfg.shared_expert_gated else 1.0)
        return half * self.routing(spec.layer).weight_ms ** -0.5

    # ---------------------------------------------------------------------------------------- values
    def blocks(self, spec: TensorSpec) -> Iterator[torch.Tensor]:
        """The tensor's values as fp32 blocks of whole rows, in order (concatenated: the tensor)."""
        cols = spec.shape[-1]
        rows = spec.numel // cols
        step = max(1, BLOCK_VALUES // cols)
        for b, start in enumerate(range(0, rows, step)):
            n = min(step, rows - start)
            g = _gen(self.seed, spec.name, b)
            if spec.role == "norm":
                block = 1.0 + self.structure.norm_jitter * (2 * torch.rand(n, cols, generator=g) - 1)
                if spec.name.endswith(("post_attention_layernorm.weight", "ffn_norm.weight")):
                    block[:, ANCHOR_DIM] = self.anchor_norm(spec.layer)
                block -= spec.offset
            elif spec.role == "router":
                block = torch.randn(n, cols, generator=g)
                block *= self.structure.router_logit_std / block.norm(dim=1, keepdim=True)  # unit-rms h: N(0, std²)
                m = ANCHOR * math.sqrt(cols)  # the anchor's value in the gate input
                block[:, ANCHOR_DIM] = self.routing(spec.layer).bias[start : start + n] / m
            else:
                block = torch.randn(n, cols, generator=g) * self.std(spec)
                if spec.role == "embed":
                    block[:, ANCHOR_DIM] = self.anchor_value
                elif spec.role == "out_bias" or (
                    spec.out_last and spec.role == "mlp_out"
                ):  # [..., H]: the anchor is a column
                    block[:, ANCHOR_DIM] = 0.0
                elif spec.role in ("attn_out", "mlp_out") and start == 0:
                    block[ANCHOR_DIM] = 0.0  # nothing writes to the anchor: it stays the same for every token
            yield block

    def tensor(self, spec: TensorSpec, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The whole tensor at once (for tests and small tensors)."""
        return torch.cat([b.to(dtype) for b in self.blocks(spec)]).reshape(spec.shape)
