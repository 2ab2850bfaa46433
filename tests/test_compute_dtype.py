"""``--dtype auto``: float32 on a CPU without bf16 instructions, the measured faster dtype on one with them (probed
once per host and cached), bfloat16 on CUDA; FATE_EDGE_DTYPE overrides."""

from __future__ import annotations

import json

import pytest
import torch

from fate_edge.runtime.compute_dtype import (
    _host_key,
    cpu_flags,
    cpu_has_bf16,
    cpu_runs_native_kernels,
    native_dtype,
    probed_cpu_dtype,
    resolve_dtype,
)

NO_BF16 = {"fpu", "avx2", "avx512f", "avx512_vnni"}
ZEN4 = NO_BF16 | {"avx512_bf16"}
SAPPHIRE = NO_BF16 | {"amx_tile", "amx_bf16"}


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv("FATE_EDGE_DTYPE", raising=False)


def _never() -> str:
    raise AssertionError("a CPU without bf16 instructions is not probed")


def test_a_cpu_without_bf16_instructions_computes_in_float32_unprobed():
    assert native_dtype("cpu", NO_BF16, probe=_never) == "float32"


@pytest.mark.parametrize("flags", [ZEN4, SAPPHIRE])
def test_a_cpu_with_avx512_bf16_or_amx_takes_what_the_probe_measured(flags):
    assert native_dtype("cpu", flags, probe=lambda: "bfloat16") == "bfloat16"
    assert native_dtype("cpu", flags, probe=lambda: "float32") == "float32"


def test_the_probe_keeps_the_faster_dtype_and_runs_once_per_host(tmp_path):
    path, calls = tmp_path / "compute-dtype.json", []

    def probe(speeds):
        def run():
            calls.append(1)
            return speeds

        return run

    assert probed_cpu_dtype(probe({"float32": 170.0, "bfloat16": 116.0}), path) == "float32"
    assert probed_cpu_dtype(probe({"float32": 1.0, "bfloat16": 999.0}), path) == "float32"  # cached: not probed
    assert len(calls) == 1
    cached = json.loads(path.read_text())
    assert cached["host"] == _host_key() and cached["decode_tok_s"]["bfloat16"] == 116.0
    path.write_text(json.dumps(cached | {"host": "another CPU"}))  # another host (or torch): probed again
    assert probed_cpu_dtype(probe({"float32": 100.0, "bfloat16": 120.0}), path) == "bfloat16"
    assert len(calls) == 2


def test_the_environment_overrides_and_explicit_dtypes_pass_through(monkeypatch):
    monkeypatch.setenv("FATE_EDGE_DTYPE", "bfloat16")
    assert native_dtype("cpu", NO_BF16, probe=_never) == "bfloat16"
    assert resolve_dtype("float32", "cpu") == "float32"
    assert resolve_dtype(torch.float32, "cpu") is torch.float32
    assert resolve_dtype("auto", "cpu") == "bfloat16"


def test_cuda_takes_bfloat16_where_the_gpu_has_it():
    want = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    assert native_dtype("cuda", NO_BF16, probe=_never) == want


def test_this_hosts_flags_are_read():
    flags = cpu_flags()
    assert not flags or "fpu" in flags  # /proc/cpuinfo's x86 flags line, where there is one


def test_the_probe_measures_the_bundled_model_in_both_dtypes(tmp_path):
    """The real probe: decode speed of the bundled model's default store in each dtype, both positive."""
    from fate_edge.runtime.compute_dtype import probe_decode_speed

    speeds = probe_decode_speed()
    assert set(speeds) == {"float32", "bfloat16"} and min(speeds.values()) > 0


def _store(folder, hidden: int, bits: tuple[str, ...] = ("4",)):
    folder.mkdir()
    (folder / "store.json").write_text(json.dumps({"hidden_size": hidden, "precisions": {b: {} for b in bits}}))
    return folder


@pytest.mark.parametrize("flags", [ZEN4, SAPPHIRE])
def test_a_wide_int4_store_is_served_in_bfloat16_unprobed_on_a_bf16_cpu(tmp_path, flags):
    """The probe's bundled model is 256 wide; a real model's int4 store (hidden 1024 or more) decodes faster in bf16
    on such a CPU whatever that probe says, so it is not asked; narrower stores, float stores and model folders are."""
    wide, narrow = _store(tmp_path / "wide", 2048), _store(tmp_path / "narrow", 256)
    floats = _store(tmp_path / "floats", 2048, ("16",))
    assert native_dtype("cpu", flags, probe=_never, store=wide) == "bfloat16"
    for other in (narrow, floats, tmp_path / "not-a-store", None):
        assert native_dtype("cpu", flags, probe=lambda: "float32", store=other) == "float32"
    assert native_dtype("cpu", NO_BF16 - {"avx2"}, probe=_never, store=wide) == "float32"  # no native kernels


def test_a_wide_int4_store_is_served_in_bfloat16_where_avx2_runs_the_native_kernels(tmp_path):
    """A CPU without bf16 instructions but with AVX2 and FMA (an AMD Zen 3): the native kernels read and write bf16
    rows themselves, so a real model's int4 store decodes in bfloat16 there too; anything else stays float32."""
    zen3 = {"fpu", "avx2", "fma", "f16c"}
    wide, narrow = _store(tmp_path / "wide", 2048), _store(tmp_path / "narrow", 256)
    assert native_dtype("cpu", zen3, probe=_never, store=wide) == "bfloat16"
    for other in (narrow, _store(tmp_path / "floats", 2048, ("16",)), tmp_path / "not-a-store", None):
        assert native_dtype("cpu", zen3, probe=_never, store=other) == "float32"
    assert native_dtype("cpu", {"fpu", "avx2"}, probe=_never, store=wide) == "float32"  # no FMA: no native kernels


def test_auto_resolves_for_the_store_it_serves_and_the_environment_still_wins(tmp_path, monkeypatch):
    wide = _store(tmp_path / "wide", 2048)
    native = cpu_has_bf16() or cpu_runs_native_kernels()
    assert resolve_dtype("auto", "cpu", wide) == ("bfloat16" if native else "float32")
    monkeypatch.setenv("FATE_EDGE_DTYPE", "float32")
    assert resolve_dtype("auto", "cpu", wide) == "float32"
