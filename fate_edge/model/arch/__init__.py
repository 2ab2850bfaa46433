"""Architecture registry: ``config.json`` → the normalised :class:`ModelConfig` of its family."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fate_edge.errors import ModelFormatError, UnsupportedArchitectureError
from fate_edge.model.arch.base import MLAConfig, ModelConfig, RopeConfig
from fate_edge.model.arch.deepseek import DeepseekV2Config, DeepseekV3Config
from fate_edge.model.arch.ernie4_5_moe import Ernie45MoeConfig
from fate_edge.model.arch.glm4_moe import Glm4MoeConfig
from fate_edge.model.arch.gpt_oss import GptOssConfig
from fate_edge.model.arch.lfm2_moe import Lfm2MoeConfig
from fate_edge.model.arch.limits import check_config, check_raw_config
from fate_edge.model.arch.minimax_m2 import MiniMaxM2Config
from fate_edge.model.arch.mixtral import MixtralConfig
from fate_edge.model.arch.olmoe import OlmoeConfig
from fate_edge.model.arch.qwen2_moe import Qwen2MoeConfig
from fate_edge.model.arch.qwen3_moe import Qwen3MoeConfig
from fate_edge.model.arch.qwen3_next import Qwen3NextConfig, Qwen35MoeConfig
from fate_edge.small_files import CONFIG_MAX_BYTES, read_small_text

ARCHITECTURES: dict[str, type[ModelConfig]] = {
    "mixtral": MixtralConfig,
    "qwen2_moe": Qwen2MoeConfig,
    "qwen3_moe": Qwen3MoeConfig,
    "olmoe": OlmoeConfig,
    "deepseek_v2": DeepseekV2Config,
    "deepseek_v3": DeepseekV3Config,
    "glm4_moe": Glm4MoeConfig,
    "minimax_m2": MiniMaxM2Config,
    "ernie4_5_moe": Ernie45MoeConfig,
    "gpt_oss": GptOssConfig,
    "lfm2_moe": Lfm2MoeConfig,
    "qwen3_next": Qwen3NextConfig,
    "qwen3_5_moe": Qwen35MoeConfig,
    "qwen3_5_moe_text": Qwen35MoeConfig,
}

__all__ = ["ARCHITECTURES", "MLAConfig", "ModelConfig", "RopeConfig", "config_from_dict", "load_config"]


def config_from_dict(d: dict[str, Any], source: str = "config.json") -> ModelConfig:
    if not isinstance(d, dict):
        raise ModelFormatError(f"{source}: a JSON {type(d).__name__}, not an object; this is not a Hugging Face config")
    model_type = d.get("model_type")
    if model_type is None:
        raise ModelFormatError(f"{source}: no 'model_type' key; this does not look like a Hugging Face config")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{source}: model_type '{model_type}' is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    if isinstance(d.get("text_config"), dict) and "hidden_size" not in d:
        d = {**d["text_config"], "model_type": model_type}
    check_raw_config(d, source)
    try:
        cfg = ARCHITECTURES[model_type].from_hf(d)
    except ModelFormatError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as exc:  # a value of the wrong kind
        raise ModelFormatError(f"{source}: malformed {model_type} config ({type(exc).__name__}: {exc})") from None
    check_config(cfg, source)
    return cfg


def load_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    if model_dir.is_file():
        raise ModelFormatError(
            f"{model_dir}: a file of {model_dir.stat().st_size} bytes that is not a GGUF (no GGUF magic at its "
            "start); pass a .gguf file, a Hugging Face model directory or an expert store"
        )
    path = model_dir / "config.json"
    if not path.exists():
        raise ModelFormatError(
            f"{path}: not found; pass a Hugging Face model directory (config.json, *.safetensors, tokenizer.json)"
        )
    text = read_small_text(path, CONFIG_MAX_BYTES)
    try:
        d = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{path}: invalid JSON ({exc})") from exc
    return config_from_dict(d, str(path))
