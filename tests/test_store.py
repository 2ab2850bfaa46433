import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from _corrupt import flip_byte

from fate_edge import FateEdgeError, ModelFormatError, load_model
from fate_edge.errors import CorruptBlobError
from fate_edge.fetch.store_provider import StoreExpertProvider
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.store import ExpertStore, Part, Precision, is_store, part_views


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, bundled_dir):
    out = tmp_path_factory.mktemp("stores") / "tiny-int4"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, cold_bits=2), progress=False)
    return out


@pytest.fixture()
def store_copy(tmp_path, store_dir):
    import shutil

    dst = tmp_path / "store"
    shutil.copytree(store_dir, dst)
    return dst


def _tokens(bundled_model):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, bundled_model.config.vocab_size, (1, 48), generator=g)


def test_store_layout(store_dir, bundled_model):
    store = ExpertStore(store_dir)
    cfg = bundled_model.config
    assert store.bits_available == [2, 4, 16]
    for bits in (2, 4, 16):
        refs = [r for r in store.refs.values() if r.bits == bits]
        assert len(refs) == len(cfg.moe_layers) * cfg.num_experts
        assert all(r.offset % 4096 == 0 for r in refs)
    # int4 blob ≈ 4.5 bits/weight (codes + fp16 scale and zero per 64), int2 ≈ 3 bits/weight (group 32)
    n = cfg.expert_params
    assert store.expert_bytes(16) == 2 * n
    assert abs(store.expert_bytes(4) - n * 4.5 / 8) < 1024
    assert abs(store.expert_bytes(2) - n * 3 / 8) < 1024


def test_bf16_store_matches_resident_model_exactly(store_dir, bundled_model, one_thread):
    # One thread: at two, torch's split of a reduction depends on the operand's layout, and the store's
    # experts (read from blobs) and the resident model's differ in layout, not in value (1e-5 apart).
    ids = _tokens(bundled_model)
    ref = bundled_model(ids, bundled_model.new_cache())
    m = load_model(store_dir, bits=16)
    out = m(ids, m.new_cache())
    assert torch.equal(out, ref)
    assert m.experts.stats.reads > 0 and m.experts.engine.direct_io_note


def test_int4_store_is_close(store_dir, bundled_model):
    ids = _tokens(bundled_model)
    ref = bundled_model(ids, bundled_model.new_cache())[0]
    out = load_model(store_dir, bits=4)(ids, load_model(store_dir, bits=4).new_cache())[0]
    cos = torch.nn.functional.cosine_similarity(out, ref, dim=-1)
    assert cos.min() > 0.98
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_flipped_byte_names_layer_and_expert(store_copy):
    store = ExpertStore(store_copy)
    ref = store.ref(3, 7, 4)
    flip_byte(ref.path, ref.offset + 100, 0x01)
    provider = StoreExpertProvider(store, bits=4)
    with pytest.raises(CorruptBlobError, match=r"layer 3 expert 7 \(int4\)"):
        provider.get(3, 7)
    provider.get(3, 6)  # neighbours are intact and still served
    provider.close()


def test_store_verify_checks_every_blob_and_names_the_bad_one(store_copy):
    store = ExpertStore(store_copy)
    n4 = sum(1 for r in store.refs.values() if r.bits == 4)
    assert store.verify([4]) == n4 * store.expert_bytes(4)
    ref = store.ref(5, 2, 2)
    flip_byte(ref.path, ref.offset + 3, 0x10)
    with pytest.raises(CorruptBlobError, match=r"layer 5 expert 2 \(int2\)"):
        ExpertStore(store_copy).verify()


def test_truncated_expert_file_names_layer_and_expert(store_copy):
    path = store_copy / "experts-4.bin"
    store = ExpertStore(store_copy)
    last = max((r for r in store.refs.values() if r.bits == 4), key=lambda r: r.offset)
    os.truncate(path, last.offset + 10)
    with pytest.raises(ModelFormatError, match=rf"truncated.*layer {last.layer} expert {last.expert}"):
        ExpertStore(store_copy)


def test_wrong_format_version_is_refused(store_copy):
    index = json.loads((store_copy / "store.json").read_text())
    index["format_version"] = 99
    (store_copy / "store.json").write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match="re-run fate-edge convert"):
        ExpertStore(store_copy)


def test_existing_destination_needs_force(tmp_path, bundled_dir):
    out = tmp_path / "s"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    with pytest.raises(FateEdgeError, match="--force"):
        convert(bundled_dir, out, ConvertOptions.full(bits=2, keep_bf16=False), progress=False)
    convert(bundled_dir, out, ConvertOptions.full(bits=2, keep_bf16=False, force=True), progress=False)
    assert ExpertStore(out).bits_available == [2]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers


def test_interrupted_convert_leaves_nothing(tmp_path, bundled_dir, monkeypatch):
    import fate_edge.format.convert as conv

    calls = {"n": 0}
    real = conv.encode_expert

    def failing(w, p, *args):
        calls["n"] += 1
        if calls["n"] == 50:
            raise KeyboardInterrupt
        return real(w, p, *args)

    monkeypatch.setattr(conv, "encode_expert", failing)
    out = tmp_path / "store"
    with pytest.raises(KeyboardInterrupt):
        convert(bundled_dir, out, progress=False)
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_killed_convert_leaves_no_valid_looking_store(tmp_path, bundled_dir):
    out = tmp_path / "store"
    script = (
        "import time, fate_edge.format.convert as c\n"
        "real = c.encode_expert\n"
        "c.encode_expert = lambda w, p, *a: (time.sleep(0.01), real(w, p, *a))[1]\n"
        f"c.convert({str(bundled_dir)!r}, {str(out)!r}, progress=False)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    partial = []
    deadline = time.time() + 60
    while time.time() < deadline and not partial:
        partial = [p for p in tmp_path.iterdir() if p.name.startswith(".store.partial")]
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert partial, "convert never started writing"
    assert not out.exists()
    assert not any(is_store(p) for p in tmp_path.iterdir())


def test_cpu_kernel_layout_decodes_to_the_same_expert_without_repacking(
    tmp_path, bundled_dir, bundled_model, monkeypatch
):
    # portable codes on torch's kernel too
    monkeypatch.setattr("fate_edge.quant.linear.native_is_default", lambda: False)
    portable = convert(
        bundled_dir, tmp_path / "p", ConvertOptions.full(bits=4, keep_bf16=False, layout="portable"), progress=False
    )
    native = convert(
        bundled_dir, tmp_path / "n", ConvertOptions.full(bits=4, keep_bf16=False, layout="auto"), progress=False
    )
    assert ExpertStore(native).precisions[4].layout == "cpu-int4"  # auto picks it where torch's CPU kernel applies
    assert ExpertStore(native).expert_bytes(4) == ExpertStore(portable).expert_bytes(4)  # same bytes on the link
    ids = _tokens(bundled_model)
    a, b = load_model(portable), load_model(native)
    assert torch.equal(a(ids, a.new_cache()), b(ids, b.new_cache()))
    # On another device the CPU layout is re-packed for that device's kernel (tests/test_device_placement.py).


def _sliced_views(blob: torch.Tensor, parts) -> dict[str, torch.Tensor]:
    dtypes = {"uint8": torch.uint8, "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    return {p.name: blob[p.offset : p.offset + p.nbytes].view(dtypes[p.dtype]).reshape(p.shape) for p in parts}


def test_part_views_are_views_of_the_blob_equal_to_sliced_ones(store_dir):
    store = ExpertStore(store_dir)
    for bits in store.bits_available:  # int2 and int4 (fp16 scales), bf16 weights
        prec = store.precisions[bits]
        ref = store.ref(1, 3, bits)
        with open(ref.path, "rb") as f:
            f.seek(ref.offset)
            raw = torch.frombuffer(bytearray(f.read(ref.length)), dtype=torch.uint8)
        blob = torch.zeros(ref.length + 64, dtype=torch.uint8)[32 : 32 + ref.length]  # not at its storage's start
        blob.copy_(raw)
        views = part_views(blob, prec)
        for name, want in _sliced_views(blob, prec.parts).items():
            got = views[name]
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
            assert got.is_contiguous() and got.data_ptr() == want.data_ptr(), name  # the blob's bytes, no copy
        # a view, not a copy: a write to the blob shows in the parts
        blob.fill_(0)
        assert all(not v.any() for v in views.values())


def test_part_views_refuse_a_short_blob_and_a_part_that_is_not_its_shape():
    def precision(*parts: Part) -> Precision:
        return Precision(4, "experts-4.bin", 80, list(parts), None)

    codes, scale = Part("a.codes", 0, 64, "uint8", (4, 16)), Part("a.scale", 64, 16, "float16", (4, 2))
    blob = torch.arange(80, dtype=torch.uint8)
    views = part_views(blob, precision(codes, scale))
    assert views["a.codes"].shape == (4, 16) and views["a.scale"].shape == (4, 2)
    with pytest.raises(ModelFormatError, match="shorter than its parts"):
        part_views(blob[:70], precision(codes, scale))
    with pytest.raises(ModelFormatError, match="not a whole float16 array"):
        part_views(blob, precision(Part("a.scale", 64, 12, "float16", (4, 2))))  # 12 bytes for 8 fp16 values
    with pytest.raises(ModelFormatError, match="not a whole float16 array"):
        part_views(blob, precision(Part("a.scale", 63, 16, "float16", (4, 2))))  # an odd byte offset
