"""The tiers on a real GPU (issue 59): the pinned host tier, misses computed on the CPU, uploads as reads land. Run
only where torch sees a GPU (scripts/gpu_check.sh); the same logic runs on the CPU in test_host_tier.py,
test_cpu_miss.py and test_land_early.py."""

import pytest
import torch

from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.generate import GenerateConfig
from fate_edge.runtime.held_bytes import pinned_held_bytes
from fate_edge.runtime.host_tier import HostTier
from fate_edge.runtime.policy import get_policy

pytestmark = pytest.mark.gpu  # skipped where torch sees no CUDA GPU (conftest.py)


@pytest.fixture(scope="module")
def store(tmp_path_factory, bundled_dir):
    out = tmp_path_factory.mktemp("gpu-tiers") / "s"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    return out


def test_the_host_tier_is_one_pinned_slab_charged_as_held():
    tier = HostTier(10 * 4096, 4096, get_policy("lru"), [0], 4, pinned=True)
    assert tier.slab.is_pinned()
    # registered in place: exactly its bytes; through torch's pinned allocator, 40 KB rounded up to 64 KB
    assert tier.held_bytes == (10 * 4096 if tier.registered else pinned_held_bytes(10 * 4096))
    tier.admit((0, 1), memoryview(b"z" * 4000), 4)
    dst = torch.empty(4000, dtype=torch.uint8, device="cuda")
    dst.copy_(torch.frombuffer(tier.blob((0, 1)), dtype=torch.uint8), non_blocking=True)
    torch.cuda.synchronize()
    assert bool((dst == ord("z")).all())
    tier.close()


def _run(store, host_memory, policy="lru", dtype="bfloat16"):
    cfg = GenerateConfig(max_tokens=16, ignore_eos=True, logprobs=5)
    with Engine(EngineConfig(store, "1MB", policy, dtype=dtype, device="cuda", host_memory=host_memory)) as e:
        reads: list[bool] = []
        tier = e.host_tier
        key_at = {e.store.ref(layer, x, 4).offset: (layer, x) for layer in e.model.config.moe_layers for x in range(16)}
        e.fetch.fault_injector = lambda ref: reads.append(tier is not None and key_at[ref.offset] in tier)
        steps = [(r.token, r.logprob) for p in ("def fib(n):", "import os\n") for r in e.stream(p, cfg)]
        assert e.scheduler.land_early  # the GPU's default
        return steps, reads, e.request_stats, tier


def test_a_gpu_miss_the_host_tier_holds_is_copied_from_it(store):
    steps, reads, stats, tier = _run(store, "16MB")
    assert tier is not None and tier.slab.is_pinned() and not any(reads) and stats.host_hits > 0
    base, base_reads, _, none = _run(store, 0)
    assert none is None and len(base_reads) > len(reads)
    assert [t for t, _ in steps] == [t for t, _ in base]  # the same bits copied from the tier or from the store


def test_hybrid_misses_on_the_cpu_stay_within_the_bf16_tolerance(store):
    hybrid, _, stats, _ = _run(store, "16MB", get_policy("lru").with_(miss_compute="hybrid"))
    device, _, base, _ = _run(store, "16MB")
    assert stats.cpu_computed > 0 and base.cpu_computed == 0
    assert hybrid[0][0] == device[0][0]  # the prompt's token: its misses are copied up on both
    (_, a), (_, b) = hybrid[1], device[1]  # the first token decoded with misses on the CPU, from the same input
    assert a is not None and b is not None and abs(a.top[0][1] - b.top[0][1]) < 2e-2  # the likeliest's
    same = sum(x[0] == y[0] for x, y in zip(hybrid, device)) / len(device)
    assert same > 0.8, (hybrid, device)
