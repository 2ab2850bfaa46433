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

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",  # GLM-4.5's name for the norm before the MLP
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
}
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_LAYER_NUMBER = re.compile(r"^blk\.(\d+)\.")


def expert_tensor(layer: int, matrix: str) -> str:
    """GGUF name of layer ``layer``'s stacked ``matrix`` ("gate", "up", "down") experts."""
    return f"blk.{layer}.ffn_{matrix}_exps.weight"


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
            if part.endswith("_shexp") and part != "ffn_gate_inp_shexp":
                hf = f"mlp.{shared}.{part.removeprefix('ffn_').removesuffix('_shexp')}_proj"
            elif part in _LAYER:
                hf = _LAYER[part]
            else:
                raise ModelFormatError(
                    f"{g.path}: tensor '{name}' has no counterpart in fate-edge's "
                    f"{cfg.model_type} model; the GGUF holds parts fate-edge does not run"
                )
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
        if len(src) == 2:  # kv_b_proj from k_b [H, rank, nope] and v_b [H, v, rank]
            (h, rank, nope), (_, v, _) = self.g.info(src[0]).shape, self.g.info(src[1]).shape
            return [h * (nope + v), rank]
        shape = list(self.g.info(src[0]).shape)
        if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
            shape = [1, shape[0]]
        return shape

    def dtype_name(self, name: str) -> str:
        return {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[self._dtype(name)]

    def _dtype(self, name: str) -> torch.dtype:
        # routers and DeepSeek's selection bias stay in fp32, as the loader keeps them
        return torch.float32 if name.endswith((".gate.weight", ".e_score_correction_bias")) else self.dtype

    def nbytes(self, name: str) -> int:
        n = 1
        for d in self.shape(name):
            n *= d
        return n * torch.empty(0, dtype=self._dtype(name)).element_size()

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        src, dtype = self._gguf(name), dtype or self._dtype(name)
        # dequantized straight into ``dtype`` (the same numbers as float32 then .to(dtype)): no float32 copy
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

    def _permuted(self, name: str) -> bool:
        return self.g.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight"))

    def _unpermute(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Undo llama.cpp's ``LlamaModel.permute`` of q/k rows (its rotary layout pairs neighbours, HF's halves)."""
        if not self._permuted(name):
            return t
        heads = self.cfg.num_attention_heads if name.endswith("q_proj.weight") else self.cfg.num_key_value_heads
        rows = t.shape[0]
        return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
