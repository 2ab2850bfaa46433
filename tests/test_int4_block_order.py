"""Stores in torch's CPU int4 layout record the CPU block order they were packed in, and a CPU of the other order
re-packs (tested on this CPU by writing the other ISA's order: 32 rows where this one packs 64, or the reverse).

torch's packer lays codes out in blocks of 64 rows with AVX-512 and 32 with AVX2 and ARM; a store converted on one
and read on the other decoded wrong while every checksum passed."""

import json

import pytest
import torch
from fate_edge.quant.linear import QuantizedLinear, host_int4_block_rows

from fate_edge.errors import ModelFormatError
from fate_edge.format import convert as convert_module
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.relayout import relayout_store
from fate_edge.format.store import ExpertStore, decode_expert, decodes_to_views
from fate_edge.format.store_files import STORE_FILE

HOST = host_int4_block_rows()
OTHER = 32 if HOST == 64 else 64


def _blob(store: ExpertStore, layer: int, expert: int, bits: int = 4) -> torch.Tensor:
    ref = store.ref(layer, expert, bits)
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        return torch.frombuffer(bytearray(f.read(ref.length)), dtype=torch.uint8)


@pytest.fixture(scope="module")
def stores(tmp_path_factory, bundled_dir):
    """The bundled model in cpu-int4 packed by this CPU, and packed as a CPU of the other order would."""
    root = tmp_path_factory.mktemp("order")
    opts = ConvertOptions.full(bits=4, keep_bf16=False, layout="cpu-int4")
    convert(bundled_dir, root / "here", opts, progress=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(convert_module, "host_int4_block_rows", lambda: OTHER)
        convert(bundled_dir, root / "other", opts, progress=False)
    return root / "here", root / "other"


def test_the_store_records_the_block_order_it_was_packed_in(stores):
    here, other = (ExpertStore(s) for s in stores)
    assert here.precisions[4].block_rows == HOST and other.precisions[4].block_rows == OTHER
    layer = here.precisions[4]
    # the same codes, in another order: the bytes differ (the blobs' sizes and scales do not)
    assert not torch.equal(_blob(here, 1, 3), _blob(other, 1, 3))
    assert decodes_to_views(layer) and not decodes_to_views(other.precisions[4])  # the other order is re-packed


def test_a_store_packed_in_the_other_order_computes_what_this_cpus_does(stores):
    here, other = (ExpertStore(s) for s in stores)
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(0))
    for layer, expert in [(0, 0), (1, 5), (7, 15)]:
        want = decode_expert(_blob(here, layer, expert), here.precisions[4], torch.float32)(x)
        got = decode_expert(_blob(other, layer, expert), other.precisions[4], torch.float32)(x)
        assert torch.equal(got, want), (layer, expert)


def test_the_dequantizing_path_unpacks_in_the_recorded_order(stores):
    """What CUDA does with the bytes (unpack, then its own kernel's layout), here through the dequant kernel."""
    here, other = (ExpertStore(s) for s in stores)
    from fate_edge.format.store import part_views

    a = part_views(_blob(here, 2, 7), here.precisions[4])
    b = part_views(_blob(other, 2, 7), other.precisions[4])
    spec = here.precisions[4].spec
    x = torch.randn(2, 192, generator=torch.Generator().manual_seed(1))
    want = QuantizedLinear.from_cpu_kernel_layout(a["gate.packed"], a["gate.scale_zero"], spec, "cpu", "dequant", HOST)
    got = QuantizedLinear.from_cpu_kernel_layout(b["gate.packed"], b["gate.scale_zero"], spec, "cpu", "dequant", OTHER)
    assert torch.equal(got(x), want(x))


def test_relayout_reads_the_recorded_order(stores, tmp_path):
    a, b = (ExpertStore(relayout_store(s, tmp_path / s.name, progress=False)) for s in stores)
    assert torch.equal(_blob(a, 3, 9), _blob(b, 3, 9))


def test_a_store_without_the_record_is_refused_with_the_fix(stores, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(stores[0], old)
    index = json.loads((old / STORE_FILE).read_text())
    del index["precisions"]["4"]["int4_block_rows"]
    (old / STORE_FILE).write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match="block order.*re-run fate-edge convert"):
        ExpertStore(old)
    index["precisions"]["4"]["int4_block_rows"] = 48
    (old / STORE_FILE).write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match="int4_block_rows is 48, not 64 or 32"):
        ExpertStore(old)


def test_resident_weights_in_torchs_layout_record_their_order_too(monkeypatch):
    """Resident linears pre-quantized at convert in torch's CPU layout (where fate-edge's own kernel does not run)
    carry the same record: packed in the other order they compute what this CPU's packing does; without it they are
    refused."""
    from fate_edge.quant.linear import pack_int4_cpu, unpack_int4_cpu

    from fate_edge.model import layer

    monkeypatch.setattr(layer, "_native_kernel", lambda *a: False)  # torch's layout, as on a CPU without AVX2
    w = layer.Weights()
    dict.__setitem__(w, "a.weight", torch.randn(128, 256, generator=torch.Generator().manual_seed(2)))
    layer.quantize_group(w, ["a"], 4)
    assert int(w["a.int4_block_rows"]) == HOST
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3))
    want = layer._quantized(w, "a")[0](x)
    dict.__setitem__(w, "a.int4", pack_int4_cpu(unpack_int4_cpu(w["a.int4"]), OTHER))
    dict.__setitem__(w, "a.int4_block_rows", torch.tensor(OTHER))
    assert torch.equal(layer._quantized(w, "a")[0](x), want)
    dict.__delitem__(w, "a.int4_block_rows")
    with pytest.raises(ModelFormatError, match="block order.*re-run fate-edge convert"):
        layer._quantized(w, "a")


def test_the_store_cache_keeps_one_torch_layout_store_and_converts_a_stale_one_again(
    monkeypatch, bundled_dir, tmp_path
):
    """On a host computing on torch's kernel the cached store is in its CPU layout, which records its block order:
    a CPU of the other order finds the same store (and re-packs), and a store cached before the record is converted
    again in place (format.store_age), not refused at every run."""
    import shutil

    from fate_edge.quant import linear

    from fate_edge.format import converted_stores
    from fate_edge.format.store_age import predates_block_order

    monkeypatch.setattr(converted_stores, "native_is_default", lambda: False)
    monkeypatch.setattr(convert_module, "default_kernel", lambda *a, **k: "torch-int4")  # auto: torch's layout
    src = shutil.copytree(bundled_dir, tmp_path / "tiny")  # its own cache key: the shared cached store stays
    native_path = converted_stores.cached_store_path(bundled_dir)
    store = converted_stores.ensure_store(src, progress=False)
    precision = ExpertStore(store).precisions[4]
    assert precision.layout == "cpu-int4" and precision.block_rows == HOST
    assert store != native_path  # the other kernel's preference keeps its own store
    with monkeypatch.context() as mp:
        mp.setattr(linear, "_block_rows", lambda n, k: OTHER)  # a CPU of the other order
        assert host_int4_block_rows() == OTHER
        written = (store / STORE_FILE).stat().st_mtime_ns
        assert converted_stores.ensure_store(src, progress=False) == store
        assert (store / STORE_FILE).stat().st_mtime_ns == written  # taken as it is, not converted again
    index = json.loads((store / STORE_FILE).read_text())
    del index["precisions"]["4"]["int4_block_rows"]  # as fate-edge wrote it before the record
    (store / STORE_FILE).write_text(json.dumps(index))
    assert predates_block_order(store)
    assert converted_stores.ensure_store(src, progress=False) == store and not predates_block_order(store)
    assert ExpertStore(store).precisions[4].block_rows == HOST


def test_convert_refuses_torchs_layout_where_its_order_is_unknown(monkeypatch, bundled_dir, tmp_path):
    from fate_edge.errors import FateEdgeError

    monkeypatch.setattr(convert_module, "host_int4_block_rows", lambda: 0)  # a packer matching neither order
    opts = ConvertOptions.full(bits=4, keep_bf16=False, layout="cpu-int4")
    with pytest.raises(FateEdgeError, match="neither block order.*--layout portable"):
        convert(bundled_dir, tmp_path / "s", opts, progress=False)
    assert not (tmp_path / "s").exists()
