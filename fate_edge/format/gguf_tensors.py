"""A GGUF file's tensors under the Hugging Face names fate-edge's loader reads, as a read-only checkpoint.

:class:`GGUFCheckpoint` answers the calls convert makes of a ``CheckpointReader`` (``keys``, ``get``, ``get_rows``,
``shape``, ``dtype_name``, ``nbytes``) for every tensor but the routed experts: each is dequantized as the ``gguf``
package does (``GGUFFile.dequantize``) into the store's dtype and put back into the checkpoint's layout (llama.cpp's
converter permutes Mixtral's q/k rows for its rotary layout and splits DeepSeek's ``kv_b_proj``; both are undone
here). The stacked experts (``blk.N.ffn_{gate,up,down}_exps``) are read block by block by ``gguf_convert``.
"""

from __future__ import annotations

import re

import torch

from fate_edge.errors import ModelFormatError
from fate_edge.format.gguf_reader import GGUFFile
from fate_edge.model.arch import ModelConfig
from fate_edge.model.arch.base import OFFSET_NORMS

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "token_embd_norm.weight": "model.norm.weight",  # LFM2's final norm (llama.cpp keeps its HF name's slot)
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",  # GLM-4.5's and Qwen3-Next's name for the norm before the MLP
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "shortconv.conv": "conv.conv",  # LFM2's short convolution, its weight [H, L] in the GGUF
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
    # Qwen3-Next (its in_proj_qkvz is rebuilt from attn_qkv and attn_gate: _QKVZ)
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# llama.cpp's Qwen3-Next tensors without a .weight/.bias HF counterpart: GGUF part -> HF name under the layer
_BARE = {"ssm_a": "linear_attn.A_log", "ssm_dt": "linear_attn.dt_bias"}
# Qwen3.5's DeltaNet projections apart (attn_qkv and attn_gate are Qwen3-Next's in_proj_qkvz halves instead)
_SPLIT = {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
}
# Qwen3.5 tensors whose value heads llama.cpp reorders from grouped by key head to tiled (conversion/qwen.py,
# _LinearAttentionVReorderBase): HF suffix -> (axis, width of one head: "v" value_dim or 1, leading q/k channels kept)
_TILED = {
    ".linear_attn.in_proj_qkv.weight": (0, "v", True),
    ".linear_attn.in_proj_z.weight": (0, "v", False),
    ".linear_attn.in_proj_b.weight": (0, 1, False),
    ".linear_attn.in_proj_a.weight": (0, 1, False),
    ".linear_attn.A_log": (0, 1, False),
    ".linear_attn.dt_bias": (0, 1, False),
    ".linear_attn.conv1d.weight": (0, "v", True),
    ".linear_attn.out_proj.weight": (1, "v", False),
}
# gpt-oss (llama.cpp's arch gpt-oss) names three parts its own way; its expert biases are ffn_*_exps.bias
_GPT_OSS = {
    "ffn_gate_inp": "{base}.mlp.router.{kind}",
    "attn_sinks": "{base}.self_attn.sinks",
    "post_attention_norm": "{base}.post_attention_layernorm.{kind}",
}
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_NAME = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+(?:\.(?!(?:weight|bias)$)[a-z_]+)?)(?:\.(weight|bias))?$")
_LAYER_NUMBER = re.compile(r"^blk\.(\d+)\.")


def expert_tensor(layer: int, matrix: str, kind: str = "weight") -> str:
    """GGUF name of layer ``layer``'s stacked ``matrix`` ("gate", "up", "down") experts (``kind`` "bias": gpt-oss's
    stacked expert biases [E, rows])."""
    return f"blk.{layer}.ffn_{matrix}_exps.{kind}"


class GGUFCheckpoint:
    """Resident tensors of ``g`` by Hugging Face name, dequantized to ``dtype``."""

    def __init__(self, g: GGUFFile, cfg: ModelConfig, dtype: torch.dtype):
        self.g, self.cfg, self.dtype = g, cfg, dtype
        self.model_dir = g.path
        self.sources: dict[str, tuple[str, ...]] = {}  # HF name -> GGUF tensors it is made of
        shared = "shared_expert" if cfg.shared_expert_gated else "shared_experts"
        for name in g.tensors:
            if name in _TOP:
                self.sources[_TOP[name]] = (name,)
                continue
            n = _LAYER_NUMBER.match(name)
            if n is not None and int(n.group(1)) >= cfg.num_hidden_layers:
                continue  # GLM-4.5's NextN (MTP) layers (blk.N.nextn.*) and their decoder layer: not run
            m = _NAME.match(name)
            if m is None:
                raise ModelFormatError(
                    f"{g.path}: tensor '{name}' has no counterpart in fate-edge's "
                    f"{cfg.model_type} model; the GGUF holds parts fate-edge does not run"
                )
            layer, part, kind = int(m.group(1)), m.group(2), m.group(3)
            if part in EXPERT_TENSORS or layer >= cfg.num_hidden_layers:
                continue
            base = f"model.layers.{layer}"
            if part in ("attn_k_b", "attn_v_b"):
                if part == "attn_k_b":
                    self.sources[f"{base}.self_attn.kv_b_proj.weight"] = (name, name.replace("attn_k_b", "attn_v_b"))
                continue
            if part == "exp_probs_b":
                self.sources[f"{base}.mlp.gate.e_score_correction_bias"] = (name,)
                continue
            if cfg.model_type == "gpt_oss" and part in _GPT_OSS:  # its router, sinks and post-attention norm
                hf = _GPT_OSS[part]
                self.sources[hf.format(base=base, kind=kind)] = (name,)
                continue
            if part in _BARE:
                self.sources[f"{base}.{_BARE[part]}"] = (name,)
                continue
            if part in _SPLIT and cfg.delta is not None and cfg.delta.split_proj:
                self.sources[f"{base}.{_SPLIT[part]}.weight"] = (name,)
                continue
            if part == "attn_qkv" and cfg.delta is not None:  # with attn_gate: Qwen3-Next's in_proj_qkvz
                self.sources[f"{base}.linear_attn.in_proj_qkvz.weight"] = (name, name.replace("attn_qkv", "attn_gate"))
                continue
            if part == "attn_gate" and cfg.delta is not None:
                continue
            if kind is None or (part not in _LAYER and not part.endswith("_shexp")):
                raise ModelFormatError(
                    f"{g.path}: tensor '{name}' has no counterpart in fate-edge's "
                    f"{cfg.model_type} model; the GGUF holds parts fate-edge does not run"
                )
            if part.endswith("_shexp") and part != "ffn_gate_inp_shexp":
                hf = f"mlp.{shared}.{part.removeprefix('ffn_').removesuffix('_shexp')}_proj"
            else:
                hf = _LAYER[part]
            self.sources[f"{base}.{hf}.{kind}"] = (name,)
        if cfg.tie_word_embeddings:
            self.sources.pop("lm_head.weight", None)

    # ------------------------------------------------- the CheckpointReader calls convert makes
    def keys(self) -> list[str]:
        return list(self.sources)

    def __contains__(self, name: str) -> bool:
        return name in self.sources

    def _gguf(self, name: str) -> tuple[str, ...]:
        if name not in self.sources:
            raise ModelFormatError(
                f"{self.g.path}: no tensor for '{name}' in the GGUF; the file is incomplete or "
                "was converted for another architecture"
            )
        return self.sources[name]

    def shape(self, name: str) -> list[int]:
        src = self._gguf(name)
        if name.endswith(".in_proj_qkvz.weight"):  # Qwen3-Next: [q; k; v] and z rows together
            qkv, z = self.g.info(src[0]).shape, self.g.info(src[1]).shape
            return [qkv[0] + z[0], qkv[1]]
        if len(src) == 2:  # kv_b_proj from k_b [H, rank, nope] and v_b [H, v, rank]
            (h, rank, nope), (_, v, _) = self.g.info(src[0]).shape, self.g.info(src[1]).shape
            return [h * (nope + v), rank]
        shape = list(self.g.info(src[0]).shape)
        if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
            shape = [1, shape[0]]
        if name.endswith((".conv.conv.weight", ".conv1d.weight")) and len(shape) == 2:  # depthwise: [C, 1, L]
            shape = [shape[0], 1, shape[1]]
        return shape

    def dtype_name(self, name: str) -> str:
        return {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[self._dtype(name)]

    def _dtype(self, name: str) -> torch.dtype:
        # routers and DeepSeek's selection bias stay in fp32, as the loader keeps them
        routers = (".gate.weight", ".e_score_correction_bias", ".mlp.router.weight", ".mlp.router.bias")
        return torch.float32 if name.endswith(routers) else self.dtype

    def nbytes(self, name: str) -> int:
        n = 1
        for d in self.shape(name):
            n *= d
        return n * torch.empty(0, dtype=self._dtype(name)).element_size()

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        src, dtype = self._gguf(name), dtype or self._dtype(name)
        # dequantized straight into ``dtype`` (the same numbers as float32 then .to(dtype)): no float32 copy
        if name.endswith(".in_proj_qkvz.weight"):
            return self._qkvz(*(self.g.dequantize(s, dtype=dtype) for s in src))
        if name.endswith(".A_log") or (self.cfg.norm_offset and name.endswith(OFFSET_NORMS)):
            t = self.g.dequantize(src[0], dtype=torch.float32).reshape(self.shape(name))
            # llama.cpp stores -exp(A_log), and Qwen3-Next's norms with their 1 added: undone in float32
            t = torch.log(-t) if name.endswith(".A_log") else t - self.cfg.norm_offset
            return self._unpermute(name, t.to(dtype))
        if len(src) == 2:
            k_b, v_b = (self.g.dequantize(s, dtype=dtype) for s in src)
            t = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(self.shape(name))
        else:
            t = self.g.dequantize(src[0], dtype=dtype).reshape(self.shape(name))
            t = self._unpermute(name, t)
        return t

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        src = self._gguf(name)
        if len(src) == 1 and not self._permuted(name) and len(self.shape(name)) == 2:
            stop = min(stop, self.shape(name)[0])
            return self.g.dequantize(src[0], start, max(stop - start, 0), self._dtype(name))
        return self.get(name)[start:stop]

    def _qkvz(self, qkv: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Qwen3-Next's in_proj_qkvz from llama.cpp's regrouped halves: ``qkv`` [q of every key head; k ...; v ...]
        and ``z`` [every head's z], back to the checkpoint's [q, k, v, z] per key head."""
        d = self.cfg.delta
        assert d is not None
        n, h = d.key_heads, qkv.shape[1]
        q, k, v = qkv.split([n * d.key_dim, n * d.key_dim, d.value_heads * d.value_dim])
        parts = [q.view(n, -1, h), k.view(n, -1, h), v.view(n, -1, h), z.view(n, -1, h)]
        return torch.cat(parts, dim=1).reshape(-1, h)

    def _permuted(self, name: str) -> bool:
        if self._tiled(name) is not None:
            return True
        return self.g.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight"))

    def _tiled(self, name: str) -> tuple[int, int, int] | None:
        """(axis, head width, leading channels kept) where llama.cpp tiled ``name``'s value heads, else None."""
        d = self.cfg.delta
        if d is None or not d.split_proj or d.value_heads == d.key_heads:
            return None
        for suffix, (axis, width, skip_qk) in _TILED.items():
            if name.endswith(suffix):
                return axis, d.value_dim if width == "v" else 1, 2 * d.key_heads * d.key_dim if skip_qk else 0
        return None

    def _unpermute(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Undo llama.cpp's ``LlamaModel.permute`` of q/k rows (its rotary layout pairs neighbours, HF's halves), and
        Qwen3.5's tiling of value heads ([head j of every key group], j = 0 .. r-1) back to grouped by key head."""
        tiled = self._tiled(name)
        if tiled is not None:
            axis, width, skip = tiled
            d = self.cfg.delta
            assert d is not None
            r = d.value_heads // d.key_heads
            x = t.movedim(axis, 0)
            head, rest = x[:skip], x[skip:]
            rest = rest.reshape(r, d.key_heads, width, *rest.shape[1:]).transpose(0, 1).reshape(rest.shape)
            return torch.cat([head, rest]).movedim(0, axis).contiguous()
        if not self._permuted(name):
            return t
        heads = self.cfg.num_attention_heads if name.endswith("q_proj.weight") else self.cfg.num_key_value_heads
        rows = t.shape[0]
        return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
