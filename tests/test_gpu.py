"""CUDA path: run only where torch sees a GPU (scripts/gpu_check.sh runs them on a lent machine)."""

import pytest
import torch

from fate_edge import GenerateConfig, generate, load_model
from fate_edge.convert import ConvertOptions, convert
from fate_edge.engine import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none here)")


@pytest.fixture(scope="module")
def store(tmp_path_factory, bundled_dir):
    out = tmp_path_factory.mktemp("gpu") / "s"
    convert(bundled_dir, out, ConvertOptions(bits=4, cold_bits=2), progress=False)
    return out


def test_resident_logits_match_cpu(bundled_dir, bundled_model):
    ids = torch.randint(0, bundled_model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    ref = bundled_model(ids, bundled_model.new_cache())
    gpu = load_model(bundled_dir, device="cuda")
    out = gpu(ids.cuda(), gpu.new_cache()).cpu()
    assert (out - ref).abs().max() < 1e-3  # TF32/kernel differences only


def test_quantized_kernel_on_gpu_matches_dequant():
    from fate_edge.quant import QuantSpec, quantize
    from fate_edge.quant.linear import KERNEL_CHOICES, QuantizedLinear

    spec = QuantSpec(4, 64)
    w = torch.randn(256, 512) * 0.05
    q = quantize(w, spec)
    fast = QuantizedLinear.from_quantized(q, spec, "cuda")
    slow = QuantizedLinear.from_quantized(q, spec, "cuda", kernel="dequant")
    x = torch.randn(4, 512, device="cuda")
    assert (fast(x) - slow(x)).abs().max() < 5e-2
    assert KERNEL_CHOICES[(4, (256, 512), "cuda")] in ("torch-int4", "dequant")


def test_engine_on_gpu_gives_the_cpu_engine_answer(store):
    prompt, cfg = "def parse(argv):\n    ", GenerateConfig(max_tokens=24, ignore_eos=True)
    with Engine(store, "2MB", "fate-edge", device="cpu") as cpu:
        ref = cpu.generate(prompt, cfg)[0]
    with Engine(store, "2MB", "fate-edge", device="cuda") as gpu:
        text = gpu.generate(prompt, cfg)[0]
        assert gpu.scheduler.copier.uploads > 0
        gpu.scheduler.copier.drain()
        assert gpu.fetch.pool.available == gpu.fetch.pool.count
    # Different int4 kernels (CPU vs CUDA tinygemm) may round differently; most tokens must agree.
    same = sum(a == b for a, b in zip(text, ref)) / max(len(ref), 1)
    assert same > 0.8, (text, ref)


def test_copy_streams_and_events():
    from fate_edge.transfer import CUDACopier

    c = CUDACopier()
    lo, hi = torch.cuda.Stream.priority_range()
    assert c.demand_stream.priority == hi and c.prefetch_stream.priority == lo
    staging = torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8).pin_memory()
    released = []
    t, ev = c.upload(memoryview(staging.numpy()), demand=False)
    c.release_after(ev, lambda: released.append(1))
    torch.cuda.synchronize()
    c.poll()
    assert released == [1] and torch.equal(t.cpu(), staging)


def test_bf16_generation_on_gpu(bundled_dir, bundled_tokenizer):
    m = load_model(bundled_dir, dtype="bfloat16", device="cuda")
    text, last = generate(m, bundled_tokenizer, "import os\n", GenerateConfig(max_tokens=16, ignore_eos=True))
    assert last.generation_tokens == 16 and text
