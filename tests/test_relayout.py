"""Re-laying out a cpu-int4 store as portable (``fate_edge.format.relayout``): the same codes, the scales and zeros to
bf16 precision, every blob checked, the model's outputs kept; refusals that name the problem."""

from __future__ import annotations

import pytest
import torch
from _corrupt import flip_byte

from fate_edge import FateEdgeError, load_model
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.relayout import relayout_store
from fate_edge.format.store import ExpertStore


def _parts(store: ExpertStore, layer: int, expert: int, bits: int = 4) -> dict[str, torch.Tensor]:
    ref, prec = store.ref(layer, expert, bits), store.precisions[bits]
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        blob = torch.frombuffer(bytearray(f.read(ref.length)), dtype=torch.uint8)
    dtypes = {"uint8": torch.uint8, "float16": torch.float16, "bfloat16": torch.bfloat16}
    return {p.name: blob[p.offset : p.offset + p.nbytes].view(dtypes[p.dtype]).reshape(p.shape) for p in prec.parts}


@pytest.fixture(scope="module")
def stores(tmp_path_factory, bundled_dir):
    tmp = tmp_path_factory.mktemp("relayout")
    opts = dict(bits=4, keep_bf16=False, cold_bits=2)
    kernel = convert(bundled_dir, tmp / "cpu", ConvertOptions.full(**opts, layout="cpu-int4"), progress=False)
    portable = convert(bundled_dir, tmp / "portable", ConvertOptions.full(**opts, layout="portable"), progress=False)
    return kernel, portable, relayout_store(kernel, tmp / "relaid", progress=False)


def test_relayout_gives_the_portable_store_codes(stores):
    kernel, portable, relaid = stores
    a, b = ExpertStore(portable), ExpertStore(relaid)
    assert ExpertStore(kernel).precisions[4].layout == "cpu-int4"
    assert b.precisions[4].layout == "portable" and b.precisions[4].parts == a.precisions[4].parts
    assert b.precisions[2].layout == "portable"  # the cold int2 copy was portable already: copied as is
    assert b.verify() > 0  # every blob's CRC was recomputed
    for layer, expert in [(0, 0), (1, 5), (3, 7)]:
        pa, pb = _parts(a, layer, expert), _parts(b, layer, expert)
        for m in ("gate", "up", "down"):
            assert torch.equal(pa[f"{m}.codes"], pb[f"{m}.codes"])
            # The kernel layout held scale and zero' = zero + 8 * scale in bf16 (relative rounding <= 2**-9 each)
            sa, sb = pa[f"{m}.scale"].float(), pb[f"{m}.scale"].float()
            za, zb = pa[f"{m}.zero"].float(), pb[f"{m}.zero"].float()
            assert torch.all((sb - sa).abs() <= 2**-8 * sa.abs())
            assert torch.all((zb - za).abs() <= 2**-8 * (za.abs() + 16 * sa))


def test_relayout_keeps_the_model_outputs(stores, bundled_model):
    kernel, _, relaid = stores
    ids = torch.tensor([[1, 5, 9, 200, 33, 7]])
    a, b = load_model(kernel), load_model(relaid)
    la, lb = a(ids, a.new_cache()), b(ids, b.new_cache())
    assert (la - lb).pow(2).mean().sqrt() < 0.02 * la.pow(2).mean().sqrt()
    assert torch.equal(la[0, -1].topk(5).indices, lb[0, -1].topk(5).indices)


def test_relayout_refuses_a_portable_store_and_an_existing_destination(stores, tmp_path):
    kernel, portable, relaid = stores
    with pytest.raises(FateEdgeError, match="already portable"):
        relayout_store(portable, tmp_path / "x", progress=False)
    with pytest.raises(FateEdgeError, match="already exists"):
        relayout_store(kernel, relaid, progress=False)


def test_relayout_names_a_corrupted_blob_and_leaves_nothing(stores, tmp_path):
    import shutil

    kernel = shutil.copytree(stores[0], tmp_path / "cpu")
    ref = ExpertStore(kernel).ref(2, 3, 4)
    flip_byte(ref.path, ref.offset + 100)
    with pytest.raises(FateEdgeError, match="layer 2 expert 3 fails its CRC"):
        relayout_store(kernel, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu"]


def test_fate_edge_relayout_writes_the_store_and_reports_a_refusal_in_one_line(stores, tmp_path, capsys):
    from fate_edge.apps.cli import main

    kernel, portable, _ = stores
    assert main(["relayout", str(kernel), str(tmp_path / "out")]) == 0
    assert ExpertStore(tmp_path / "out").precisions[4].layout == "portable"
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'out'} in ")
    assert main(["relayout", str(portable), str(tmp_path / "again")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("fate-edge: error: ") and "already portable" in line
