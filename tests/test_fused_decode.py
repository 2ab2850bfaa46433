"""Fused weights and the decode fast path on the bundled model: same memory, same answers, edits honoured."""

import pytest
import torch

from fate_edge import load_model
from fate_edge.model.experts import InMemoryExpertProvider, QuantizedExpert
from fate_edge.runtime.loader import expert_spec

PROMPT = torch.tensor([[5, 300, 17, 2048, 99, 1000, 7, 64]])


def storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def test_fused_matrices_are_shared_not_copied(bundled_dir):
    model = load_model(bundled_dir)
    plan = model.plan()
    a = model.names[0].attn
    qkv = plan[0].qkv.weight
    assert qkv.shape[0] == sum(model.w[f"{a}.{n}_proj.weight"].shape[0] for n in "qkv")
    for n in "qkv":
        assert model.w[f"{a}.{n}_proj.weight"].untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    # every resident byte is held once: the fused tensors are the only storage behind the names
    assert storage_bytes(model.w.values()) == sum(t.numel() * t.element_size() for t in model.w.values())


def test_editing_a_weight_after_load_reaches_the_forward_pass(bundled_dir, one_thread):
    model = load_model(bundled_dir)
    before = model(PROMPT, model.new_cache())
    name = f"{model.names[3].attn}.k_proj.weight"
    saved = model.w[name].clone()
    model.w[name] = torch.zeros_like(saved)
    assert not torch.equal(model(PROMPT, model.new_cache()), before)
    model.w[name] = saved
    assert torch.equal(model(PROMPT, model.new_cache()), before)


def test_decode_steps_match_a_full_forward(bundled_dir, one_thread):
    """Prefill then one-token steps (cache written in place, rope from the table) vs one pass over it all."""
    model = load_model(bundled_dir)
    full = model(PROMPT, model.new_cache())
    cache = model.new_cache()
    steps = [model(PROMPT[:, :4], cache)] + [model(PROMPT[:, i : i + 1], cache) for i in range(4, PROMPT.shape[1])]
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-4
    assert cache.length == PROMPT.shape[1]


@pytest.mark.parametrize("kernel", ["torch-int4", "ort-int4"])
def test_int4_resident_experts_track_the_float_model(bundled_dir, one_thread, kernel):
    ref = load_model(bundled_dir)
    model = load_model(bundled_dir)
    model.experts = InMemoryExpertProvider.quantized(ref.experts, expert_spec(ref.config, 4), kernel=kernel)
    expert = model.experts.get(0, 0)
    assert isinstance(expert, QuantizedExpert) and expert.kernel == kernel and expert.gate_up is not None
    want, got = ref(PROMPT, ref.new_cache()), model(PROMPT, model.new_cache())
    assert ((got - want).norm() / want.norm()) < 0.1
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


def test_load_model_bits_quantizes_memory_experts(bundled_dir, one_thread):
    model = load_model(bundled_dir, bits=4, resident_bits=8)
    e = model.experts.get(1, 3)
    assert isinstance(e, QuantizedExpert) and e.kernel in ("torch-int4", "ort-int4")
    kernels = model.kernels()
    assert kernels["qkv"] == kernels["lm_head"] == ["torch-int8"] and kernels["experts"] == [e.kernel]
    assert load_model(bundled_dir).kernels()["qkv"] == ["dense-float32"]
    f = load_model(bundled_dir).experts.get(1, 3)
    # 4-bit codes plus group scales vs fp32; onnxruntime, picked where it timed fastest (the choice is timed, so a
    # loaded host can make it), keeps its prepacked copy beside them (~1.8x the int4 bytes)
    assert e.nbytes < f.nbytes / (6 if e.kernel == "torch-int4" else 3)


@pytest.mark.parametrize(("bits", "max_rel"), [(8, 0.02), (4, 0.15)])
def test_resident_bits_quantize_the_resident_linears(bundled_dir, one_thread, bits, max_rel):
    ref = load_model(bundled_dir)
    model = load_model(bundled_dir, resident_bits=bits)
    a = model.names[0].attn
    assert f"{a}.q_proj.weight" not in model.w and "lm_head.weight" not in model.w  # the float copies are gone
    assert model.plan()[0].qkv.weight.kernel == ("torch-int8" if bits == 8 else "torch-int4")
    resident = sum(t.numel() * t.element_size() for t in model.w.values())
    assert resident < 0.5 * sum(t.numel() * t.element_size() for t in ref.w.values())
    want, got = ref(PROMPT, ref.new_cache()), model(PROMPT, model.new_cache())
    assert ((got - want).norm() / want.norm()) < max_rel
    cache = model.new_cache()
    model(PROMPT[:, :4], cache)
    step = model(PROMPT[:, 4:5], cache)  # decode runs on the quantized linears too (biases added after them)
    assert ((step[0, 0] - want[0, 4]).norm() / want[0, 4].norm()) < max_rel


def test_resident_bits_rejects_other_widths(bundled_dir):
    with pytest.raises(ValueError, match="resident_bits must be 8 or 4"):
        load_model(bundled_dir, resident_bits=3)


def test_resident_bits_quantize_each_group_as_it_is_read(bundled_dir, monkeypatch):
    """Loading with resident_bits never holds more float linears than one fused group: the whole model's
    float copies at once would exceed the memory a real-size model's int4 resident weights are given."""
    import weakref

    from fate_edge.format.checkpoint import CheckpointReader

    read, most_alive = [], [0]
    linears = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
    original = CheckpointReader.get

    def get(self, name, *args, **kwargs):
        t = original(self, name, *args, **kwargs)
        routed = ".experts." in name  # routed experts are not resident weights
        if name.endswith(".weight") and not routed and any(f"{p}." in name or name.startswith(p) for p in linears):
            read.append(weakref.ref(t))
            most_alive[0] = max(most_alive[0], sum(r() is not None for r in read))
        return t

    monkeypatch.setattr(CheckpointReader, "get", get)
    model = load_model(bundled_dir, resident_bits=4)
    assert len(read) >= 4 * model.config.num_hidden_layers + 1  # q, k, v, o per layer and lm_head were read
    assert most_alive[0] <= 3  # q, k and v of one layer (or one MLP's gate and up), never the whole model


def test_int4_resident_pads_qwens_shared_expert_group_instead_of_falling_back_to_int8(tmp_path, one_thread):
    """Qwen's shared expert fuses gate + up + a 1-row gate (65 rows here, 11265 in Qwen1.5-MoE): torch's int4
    packer wants rows % 16 == 0, so the group ran in int8 (2x the bytes, 27% of decode at real size). Zero rows
    pad it to the kernel and are cut off the output; memory_need counts the padded bytes."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _tiny_moe import build_tiny_moe

    from fate_edge.format.convert import ConvertOptions, convert
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig
    from fate_edge.runtime.footprint import memory_need

    model_dir = build_tiny_moe(tmp_path / "tiny", expert_dim=32)
    ref = load_model(model_dir)
    model = load_model(model_dir, resident_bits=4)
    shared = [lp.mlp for i, lp in enumerate(model.plan()) if model.config.is_moe_layer(i)]
    assert shared and all(f.weight.kernel == "torch-int4" and sum(f.sizes) == 65 for f in shared)
    want, got = ref(PROMPT % 200, ref.new_cache()), model(PROMPT % 200, model.new_cache())
    assert ((got - want).norm() / want.norm()) < 0.15
    cache = model.new_cache()
    model(PROMPT[:, :4] % 200, cache)
    step = model(PROMPT[:, 4:5] % 200, cache)  # the decode fast path through the trimmed linear
    assert ((step[0, 0] - want[0, 4]).norm() / want[0, 4].norm()) < 0.15
    store = convert(model_dir, tmp_path / "store", ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    with Engine(EngineConfig(store, 3_000_000, "lru", dtype="float32", resident_bits=4)) as engine:
        loaded = sum(t.numel() * t.element_size() for t in engine.model.w.values())
    assert memory_need(store, 3_000_000, "float32", resident_bits=4).resident_bytes == loaded
