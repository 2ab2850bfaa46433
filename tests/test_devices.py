"""devices/: shipped profiles load and are sourced; host detection reports this machine."""

import dataclasses
import os

import psutil
import pytest
import torch
from fate_edge.devices import DeviceProfile, ProfileError, detect, list_profiles, load_profile, matching_profile
from fate_edge.devices.detect import read_board_model

SHIPPED = {
    "jetson-orin-nano-8gb",
    "jetson-orin-nx-16gb",
    "jetson-agx-orin-64gb",
    "raspberry-pi-5-8gb",
    "laptop-rtx4060-8gb",
    "desktop-rtx4090",
}


def test_all_profiles_are_shipped_as_package_data():
    assert SHIPPED <= set(list_profiles())


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_profile_loads_with_a_source_per_figure(name: str):
    p = load_profile(name)
    assert isinstance(p, DeviceProfile) and p.name == name
    assert p.ram_bytes >= 4 << 30 and p.cpu_cores >= 4
    assert 0 < p.storage_read_gbps < p.memory_bandwidth_gbps
    assert p.storage_latency_us > 0
    for figure in p.figures:
        assert p.sources.get(figure), f"{name}: {figure} has no source"
    assert set(p.sources) <= {f.name for f in dataclasses.fields(DeviceProfile)}
    if p.unified_memory:
        assert p.host_link_gbps is None and p.accelerator_memory_bytes is None
    else:
        assert p.host_link_gbps is not None and p.accelerator_memory_bytes is not None
        assert p.host_link_gbps < p.accelerator_bandwidth_gbps


def test_published_figures():
    assert load_profile("jetson-orin-nano-8gb").memory_bandwidth_gbps == 68.0
    assert "datasheet" in load_profile("jetson-orin-nano-8gb").sources["memory_bandwidth_gbps"]
    assert load_profile("desktop-rtx4090").accelerator_memory_bytes == 24 << 30
    assert load_profile("raspberry-pi-5-8gb").gpu_tflops_fp32 is None


def test_load_profile_from_a_path_and_errors(tmp_path):
    p = tmp_path / "mine.toml"
    p.write_text(
        'description = "x"\nunified_memory = true\nram_bytes = 1\nmemory_bandwidth_gbps = 1.0\n'
        "storage_read_gbps = 0.5\nstorage_latency_us = 9.0\ncpu_cores = 1\ncpu_gflops_fp32 = 1.0\n"
        "[sources]\nram_bytes='a'\nmemory_bandwidth_gbps='a'\nstorage_read_gbps='a'\n"
        "storage_latency_us='a'\ncpu_cores='a'\n"
    )
    with pytest.raises(ProfileError, match="cpu_gflops_fp32"):  # a figure with no source
        load_profile(p)
    p.write_text(p.read_text() + "cpu_gflops_fp32='measured'\n")
    assert load_profile(p).name == "mine"
    with pytest.raises(ProfileError, match="shipped profiles"):
        load_profile("no-such-device")
    p.write_text(p.read_text().replace("unified_memory = true", "unified_memory = false"))
    with pytest.raises(ProfileError, match="host_link_gbps"):
        load_profile(p)


def test_detect_reports_this_host():
    host = detect()
    assert host.ram_bytes == psutil.virtual_memory().total
    assert host.cpu_threads == os.cpu_count()
    assert 1 <= host.cpu_cores <= host.cpu_threads
    assert host.cuda == torch.cuda.is_available()
    assert (host.cuda_device is not None) == host.cuda


def test_detect_reads_a_jetson_board_model(tmp_path):
    model = tmp_path / "model"
    model.write_bytes(b"NVIDIA Jetson Orin Nano Developer Kit\x00")
    assert read_board_model(model) == "NVIDIA Jetson Orin Nano Developer Kit"
    host = detect(device_tree_model=model)
    assert host.is_jetson
    assert read_board_model(tmp_path / "absent") is None


def test_matching_profile():
    gib = 1 << 30
    assert matching_profile("NVIDIA Jetson Orin Nano Developer Kit", int(7.4 * gib)) == "jetson-orin-nano-8gb"
    assert matching_profile("NVIDIA Jetson Orin Nano Developer Kit", int(3.5 * gib)) is None  # the 4GB variant
    assert matching_profile("NVIDIA Jetson AGX Orin Developer Kit", 62 * gib) == "jetson-agx-orin-64gb"
    assert matching_profile("Raspberry Pi 5 Model B Rev 1.0", int(7.9 * gib)) == "raspberry-pi-5-8gb"
    assert matching_profile(None, 64 * gib, "NVIDIA GeForce RTX 4090") == "desktop-rtx4090"
    assert matching_profile(None, 16 * gib, None) is None
