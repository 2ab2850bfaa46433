import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fate_edge import load_model
from fate_edge.errors import FateEdgeError
from fate_edge_lab.synthetic import inflate as inflated

SCRIPT = Path(__file__).resolve().parents[2] / "research" / "make_inflated_model.py"


@pytest.mark.slow
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
    from fate_edge.format.convert import ConvertOptions, convert

    out = inflated.inflate(bundled_dir, tmp_path / "inflated", intermediate=256)
    a = convert(bundled_dir, tmp_path / "a", ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    b = convert(out, tmp_path / "b", ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    ids = torch.randint(0, 4000, (1, 24), generator=torch.Generator().manual_seed(1))
    ma, mb = load_model(a), load_model(b)
    # Inert groups quantize to exact zeros, so the quantized models agree too.
    assert torch.allclose(ma(ids, ma.new_cache()), mb(ids, mb.new_cache()), atol=1e-3, rtol=0)


def test_default_size_is_realistic():
    assert 1.5e6 < 3 * 192 * inflated.inflated_size(192, 2.0) * 4.5 / 8 < 2.5e6


@pytest.mark.slow
def test_script_is_a_thin_wrapper_writing_the_librarys_model(tmp_path, bundled_dir):
    # Run from outside the checkout with no PYTHONPATH: the script imports the installed library.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "script"), "--intermediate", "256"],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
    )
    lib = inflated.inflate(bundled_dir, tmp_path / "lib", intermediate=256)
    assert sorted(p.name for p in (tmp_path / "script").iterdir()) == sorted(p.name for p in lib.iterdir())
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "script" / name).read_bytes() == (lib / name).read_bytes(), name


def test_inflating_to_a_smaller_size_names_the_fix(tmp_path, bundled_dir):
    with pytest.raises(FateEdgeError, match="must exceed"):
        inflated.inflate(bundled_dir, tmp_path / "x", intermediate=64)
