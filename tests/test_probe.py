from fate_edge.devices.link import storage_link
from fate_edge.devices.probe import probe, to_toml
from fate_edge.devices.profile import load_profile


def test_probe_measures_and_round_trips_as_a_profile(tmp_path):
    p = probe(tmp_path, storage_mb=8, memory_mb=16)
    assert p.ram_bytes > 2**30 and p.cpu_cores >= 1
    assert p.memory_bandwidth_gbps > 0.1 and p.cpu_gflops_fp32 > 0.1
    assert p.storage_read_gbps > 0.001 and p.storage_latency_us > 0
    assert all("measured by fate-edge probe" in p.sources[k] for k in p.figures)
    path = tmp_path / "host.toml"
    path.write_text(to_toml(p))
    again = load_profile(path)
    assert again.figures == p.figures and again.sources == p.sources
    assert storage_link(again).bandwidth_bytes_per_s == p.storage_read_gbps * 1e9
    assert not list(tmp_path.glob(".fate-probe-*"))  # the probe file is removed
