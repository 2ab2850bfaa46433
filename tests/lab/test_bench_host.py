"""What the benchmarks record about their host: the CPU's instruction sets beside its model name."""

from pathlib import Path

from fate_edge_lab.bench import host

# /proc/cpuinfo of the 2-vCPU AMD EPYC (Zen 4) the Qwen1.5-MoE slice was measured on (abridged: one core)
EPYC_ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu vme sse sse2 ssse3 fma cx16 pcid sse4_1 sse4_2 avx f16c avx2 avx512f avx512dq avx512ifma avx512cd \
sha_ni avx512bw avx512vl avx512_bf16 avx512vbmi umip avx512_vbmi2 gfni vaes avx512_vnni avx512_bitalg
"""


def test_cpu_flags_lists_the_kernel_relevant_instruction_sets_in_a_fixed_order():
    assert host.cpu_flags(EPYC_ZEN4) == [
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512_vnni",
        "avx512_bf16",
        "avx512vbmi",
    ]
    # an AVX2-only host names no AVX-512 set; a flag name that merely contains another's is not taken for it
    assert host.cpu_flags("flags : sse avx avx2 fma f16c avx512_vbmi2") == ["avx2", "fma", "f16c"]
    assert host.cpu_flags("model name : no flags line") == []


def test_cpu_label_is_the_model_name_and_this_hosts_flags():
    label = host.cpu_label()
    assert label.startswith(host.cpu_model() or "unknown CPU")
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    for flag in host.cpu_flags(text):
        assert f" {flag}" in label or f"({flag}" in label


def test_built_features_lists_what_llama_cpps_system_info_marks_on():
    info = "CPU : SSE3 = 1 | AVX_VNNI = 1 | AVX2 = 1 | AVX512 = 0 | AVX512_VNNI = 0 | REPACK = 1 | "
    assert host.built_features(info) == "SSE3 AVX_VNNI AVX2 REPACK"
    assert host.built_features("") == ""


def test_kernel_paths_name_fate_edges_int4_path_and_llama_cpps_build():
    from fate_edge.quant.native import native_isa, native_status

    paths = host.kernel_paths()
    assert paths["fate-edge"] == (native_isa() or native_status()[1])
    try:
        import llama_cpp
    except ImportError:
        assert paths["llama.cpp"] == ""
    else:
        assert paths["llama.cpp"] == host.built_features(llama_cpp.llama_print_system_info().decode())
