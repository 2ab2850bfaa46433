import importlib.util
from pathlib import Path

import torch

from fate_edge import load_model

_spec = importlib.util.spec_from_file_location("make_inflated_model", Path(__file__).parents[1] / "scripts" /
                                               "make_inflated_model.py")
inflated = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(inflated)


def test_inflated_model_has_the_same_outputs(tmp_path, bundled_dir, bundled_model):
    out = inflated.inflate(bundled_dir, tmp_path / "inflated", intermediate=512)
    big = load_model(out)
    assert big.config.moe_intermediate_size == 512
    ids = torch.randint(0, big.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    ref = bundled_model(ids, bundled_model.new_cache())
    got = big(ids, big.new_cache())
    assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()
    # The inert units really compute: the expert matrices are 4x larger.
    e = big.experts.get(big.config.moe_layers[0], 0)
    assert e.gate.shape == (512, big.config.hidden_size) and e.down[:, 128:].abs().max() == 0


def test_int4_store_of_inflated_model_matches_int4_store_of_original(tmp_path, bundled_dir):
    from fate_edge.convert import ConvertOptions, convert

    out = inflated.inflate(bundled_dir, tmp_path / "inflated", intermediate=256)
    a = convert(bundled_dir, tmp_path / "a", ConvertOptions(bits=4, keep_bf16=False), progress=False)
    b = convert(out, tmp_path / "b", ConvertOptions(bits=4, keep_bf16=False), progress=False)
    ids = torch.randint(0, 4000, (1, 24), generator=torch.Generator().manual_seed(1))
    ma, mb = load_model(a), load_model(b)
    # Inert groups quantize to exact zeros, so the quantized models agree too.
    assert torch.allclose(ma(ids, ma.new_cache()), mb(ids, mb.new_cache()), atol=1e-3, rtol=0)


def test_default_size_is_realistic():
    assert 1.5e6 < 3 * 192 * inflated.inflated_size(192, 2.0) * 4.5 / 8 < 2.5e6
