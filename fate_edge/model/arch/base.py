"""The normalised model configuration every architecture file fills in.

Each architecture family (one file in this package) parses its Hugging Face ``config.json`` into a
subclass of :class:`ModelConfig`. The forward pass only reads the normalised fields below, so the
differences between families live in their parsers, not in branches scattered over the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fate_edge.errors import ModelFormatError

_MISSING = object()


def pick(d: dict[str, Any], *names: str, default: Any = _MISSING) -> Any:
    """The first of ``names`` present in ``d`` (and not None): configs spell the same field differently."""
    for n in names:
        if d.get(n) is not None:
            return d[n]
    if default is _MISSING:
        raise ModelFormatError(
            f"config.json: missing key {' / '.join(repr(n) for n in names)}; add it (see the model's original config)"
        )
    return default


@dataclass
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | dynamic | yarn
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # YaRN
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0
    interleaved: bool = False  # DeepSeek rotates adjacent pairs (x0,x1),(x2,x3),... instead of halves
    float32: bool = False  # rotate in float32 whatever the model dtype (DeepSeek-V2's complex-number reference)

    @classmethod
    def from_hf(cls, d: dict[str, Any], max_position_embeddings: int) -> RopeConfig:
        # transformers 5 nests everything in rope_parameters; older configs use rope_theta + rope_scaling.
        params = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling") or {}
        merged = {**scaling, **params}
        rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
        if rope_type not in ("default", "linear", "dynamic", "yarn"):
            raise ModelFormatError(
                f"config.json: rope type '{rope_type}' is not supported (supported: default, linear, dynamic, yarn)"
            )
        theta = merged.get("rope_theta", d.get("rope_theta", 10000.0))
        original = merged.get("original_max_position_embeddings") or max_position_embeddings
        factor = merged.get("factor")
        if factor is None and rope_type == "yarn":
            factor = max_position_embeddings / original  # transformers' fallback: the context extension ratio
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(factor or 1.0),
            original_max_position_embeddings=original,
            beta_fast=float(merged.get("beta_fast") or 32.0),
            beta_slow=float(merged.get("beta_slow") or 1.0),
            mscale=merged.get("mscale"),
            mscale_all_dim=merged.get("mscale_all_dim"),
            attention_factor=merged.get("attention_factor"),
            truncate=bool(merged.get("truncate", True)),
            partial_rotary_factor=float(merged.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))),
        )


@dataclass
class MLAConfig:
    """DeepSeek multi-head latent attention dimensions."""

    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


# The RMSNorms that ModelConfig.norm_offset shifts (not a DeltaNet layer's gated output norm)
OFFSET_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "model.norm.weight",
    "q_norm.weight",
    "k_norm.weight",
)


@dataclass
class DeltaNetConfig:
    """Gated DeltaNet head counts and widths (Qwen3-Next's ``linear_attention`` layers)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    # Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; Qwen3-Next: in_proj_qkvz, in_proj_ba (by key head)
    split_proj: bool = False

    @property
    def conv_channels(self) -> int:  # the convolution runs over q, k and v together
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # q/k/v head width (for MLA: the rope part, as transformers sets it)
    intermediate_size: int  # width of dense MLP layers
    moe_intermediate_size: int  # width of one routed expert
    num_experts: int
    num_experts_per_tok: int
    max_position_embeddings: int
    rope: RopeConfig
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v
    o_proj_bias: bool = False
    qk_norm: str = "none"  # none | head (Qwen3: per-head RMSNorm) | full (OLMoE: over all heads)
    clip_qkv: float | None = None  # OLMoE clamps q/k/v
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] = ()
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in each softmax's denominator (self_attn.sinks)
    # Router
    router: str = "softmax"  # softmax | deepseek_v2 | deepseek_v3 | topk_softmax (gpt-oss: top-k logits, softmax)
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"  # DeepSeek-V2: greedy | group_limited_greedy
    n_group: int = 1
    topk_group: int = 1
    # Shared experts
    shared_expert_intermediate_size: int = 0  # 0: none
    shared_expert_gated: bool = False  # Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared(x)
    dense_layers: tuple[int, ...] = ()  # layers whose MLP is dense instead of MoE
    # Routed experts of gpt-oss: biases on both matmuls and a clamped SwiGLU, (clamp(up) + 1) * g * sigmoid(alpha g)
    # with g = gate clamped above at the limit; checkpoint rows [E, H, 2I] with gate and up alternating columns
    expert_bias: bool = False
    swiglu_limit: float | None = None  # None: the plain silu(gate) * up
    swiglu_alpha: float = 1.702
    experts_interleaved: bool = False
    mla: MLAConfig | None = None
    # Token mixer per layer (empty: attention everywhere): "attention", "conv" (LFM2's gated short convolution)
    # or "linear_attention" (Qwen3-Next's gated DeltaNet); see fate_edge.model.recurrent
    layer_types: tuple[str, ...] = ()
    conv_kernel: int = 0  # the recurrent layers' causal convolution width (LFM2's L_cache)
    conv_bias: bool = False
    delta: DeltaNetConfig | None = None  # "linear_attention" layers' heads
    attn_output_gate: bool = False  # Qwen3-Next: q_proj gives each head's query then its gate, sigmoid(gate) * out
    norm_offset: float = 0.0  # Qwen3-Next's RMSNorms scale by 1 + weight (added to the weights at load)
    topk_norm_eps: float = 1e-20  # added to the top-k sum when renormalising sigmoid weights (LFM2: 1e-6)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """The normalised config of a Hugging Face ``config.json`` dict: each architecture's subclass reads its own."""
        raise NotImplementedError(f"{cls.__name__} does not read Hugging Face configs")

    def mixer(self, layer: int) -> str:
        """Layer ``layer``'s token mixer: "attention", "conv" or "linear_attention"."""
        return self.layer_types[layer] if self.layer_types else "attention"

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a recurrent state (not a KV cache)."""
        return any(t != "attention" for t in self.layer_types)

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down matrices; gpt-oss's biases too)."""
        bias = 2 * self.moe_intermediate_size + self.hidden_size if self.expert_bias else 0
        return 3 * self.hidden_size * self.moe_intermediate_size + bias


def common_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Fields every family spells the same way (or in the few ways listed here)."""
    hidden = pick(d, "hidden_size", "d_model")
    heads = pick(d, "num_attention_heads", "n_head")
    max_pos = pick(d, "max_position_embeddings", "max_seq_len", default=4096)
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return dict(
        model_type=d["model_type"],
        vocab_size=pick(d, "vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=pick(d, "num_hidden_layers", "n_layer", "num_layers"),
        num_attention_heads=heads,
        num_key_value_heads=pick(d, "num_key_value_heads", "num_kv_heads", default=heads),
        head_dim=pick(d, "head_dim", default=hidden // heads),
        max_position_embeddings=max_pos,
        rope=RopeConfig.from_hf(d, max_pos),
        rms_norm_eps=float(pick(d, "rms_norm_eps", "layer_norm_eps", default=1e-6)),
        hidden_act=pick(d, "hidden_act", "activation_function", default="silu"),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        num_experts=pick(d, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"),
        num_experts_per_tok=pick(d, "num_experts_per_tok", "moe_topk", "top_k", "moe_k"),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=str(pick(d, "dtype", "torch_dtype", default="float32")),
        raw=d,
    )
