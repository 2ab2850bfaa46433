import json

import pytest
from safetensors.torch import load_file, save_file

from fate_edge import load_model
from fate_edge.errors import (
    CorruptCheckpointError,
    MissingTensorError,
    ModelFormatError,
    UnsupportedArchitectureError,
)


def test_missing_config(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(ModelFormatError, match=r"config\.json: not found"):
        load_model(model_copy)


def test_unsupported_model_type_lists_supported(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["model_type"] = "llama"
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError) as info:
        load_model(model_copy)
    msg = str(info.value)
    assert "'llama'" in msg
    for arch in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3"):
        assert arch in msg


def test_missing_config_key_is_named(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    del cfg["moe_intermediate_size"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match="moe_intermediate_size"):
        load_model(model_copy)


@pytest.mark.parametrize(
    "tensor",
    ["model.layers.3.self_attn.q_proj.weight", "model.layers.1.mlp.gate.weight", "model.norm.weight"],
)
def test_missing_tensor_is_named(model_copy, tensor):
    path = model_copy / "model.safetensors"
    weights = load_file(path)
    del weights[tensor]
    save_file(weights, path, metadata={"format": "pt"})
    with pytest.raises(MissingTensorError, match=tensor.replace(".", r"\.")):
        load_model(model_copy)


def test_missing_expert_is_named(model_copy):
    path = model_copy / "model.safetensors"
    weights = load_file(path)
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(weights, path, metadata={"format": "pt"})
    with pytest.raises(MissingTensorError, match=r"experts\.5\.up_proj"):
        load_model(model_copy)


def test_truncated_safetensors(model_copy):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        load_model(model_copy)


def test_garbage_header(model_copy):
    path = model_copy / "model.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CorruptCheckpointError, match="header"):
        load_model(model_copy)


def test_sharded_checkpoint_and_missing_shard(model_copy):
    path = model_copy / "model.safetensors"
    weights = load_file(path)
    path.unlink()
    names = sorted(weights)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, model_copy / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_model(model_copy)  # sharded loads
    assert model.config.num_hidden_layers > 0
    (model_copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="00002-of-00002.*missing"):
        load_model(model_copy)
