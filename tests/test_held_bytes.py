"""Experts are charged what they really hold: a view keeps its whole base alive, pinned memory is rounded.

On a GPU an expert in torch's CPU int4 layout is re-packed on arrival, and its scales stayed a view of the uploaded
blob: the blob stayed alive beside the re-packed codes (~8.9 MB held for 4.6 MB charged at Qwen1.5-MoE's shapes).
The same re-pack runs on this CPU for a store packed in the other ISA's block order, which shows it here."""

import torch
from fate_edge.quant.linear import host_int4_block_rows

from fate_edge import GenerateConfig
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.format.store import ExpertStore, decode_expert
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.held_bytes import held_bytes, own_storage, pinned_held_bytes


def test_held_bytes_counts_a_views_whole_base_once():
    base = torch.zeros(1000, dtype=torch.uint8)
    assert held_bytes([base[:10], base[500:], {"x": base}]) == 1000
    assert held_bytes((base[:10].clone(), torch.zeros(3, dtype=torch.float32))) == 10 + 12
    assert held_bytes(own_storage(base[:10])) == 10 and own_storage(base) is base


def test_pinned_staging_is_charged_as_the_allocator_rounds_it():
    assert pinned_held_bytes(4_600_000 + 4096) == 8 << 20
    assert pinned_held_bytes(8 << 20) == 8 << 20 and pinned_held_bytes(1) == 1 and pinned_held_bytes(0) == 0


def _other_order_store(tmp_path, bundled_dir, monkeypatch):
    from fate_edge.format import convert as convert_module

    other = 32 if host_int4_block_rows() == 64 else 64
    monkeypatch.setattr(convert_module, "host_int4_block_rows", lambda: other)
    out = tmp_path / "other"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, keep_bf16=False, layout="cpu-int4"), progress=False)
    monkeypatch.undo()
    return out


def test_a_repacked_expert_does_not_keep_its_blob_alive(tmp_path, bundled_dir, monkeypatch):
    path = _other_order_store(tmp_path, bundled_dir, monkeypatch)
    store = ExpertStore(path)
    ref = store.ref(0, 3, 4)
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        blob = torch.frombuffer(bytearray(f.read(ref.length)), dtype=torch.uint8)
    expert = decode_expert(blob, store.precisions[4], torch.float32)
    assert held_bytes(expert) == expert.nbytes  # codes and scales of its own, the blob free to go


def test_the_cache_charges_what_its_experts_hold(tmp_path, bundled_dir, monkeypatch):
    path = _other_order_store(tmp_path, bundled_dir, monkeypatch)
    with Engine(EngineConfig(path, "3MB", "lru", max_batch=1)) as e:
        assert not e.scheduler.zero_copy  # re-packed on arrival: copied out of the read buffer
        e.generate_text("def f(x):", GenerateConfig(max_tokens=4, ignore_eos=True))
        entries = list(e.cache.entries.values())
        assert entries and all(entry.nbytes >= held_bytes(entry.expert) for entry in entries)
        assert e.plan.entry_bytes >= held_bytes(entries[0].expert)  # the plan's size is what an entry holds
