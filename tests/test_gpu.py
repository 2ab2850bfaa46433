"""CUDA path: run only where torch sees a GPU (scripts/gpu_check.sh runs them on a lent machine)."""

import pytest
import torch

from fate_edge import GenerateConfig, load_model
from fate_edge.format.convert import ConvertOptions, convert
from fate_edge.runtime.engine import Engine
from fate_edge.runtime.engine_config import EngineConfig
from fate_edge.runtime.generate import generate_from_model

pytestmark = pytest.mark.gpu  # skipped where torch sees no CUDA GPU (conftest.py)


@pytest.fixture(scope="module", params=["auto", "cpu-int4"])
def store(request, tmp_path_factory, bundled_dir):
    """Converted with the defaults on this machine (torch's CPU int4 layout unless the CPU has AVX512-VNNI), and in
    torch's CPU layout whatever the CPU: the same store runs on the CPU and on CUDA."""
    out = tmp_path_factory.mktemp("gpu") / "s"
    convert(bundled_dir, out, ConvertOptions.full(bits=4, cold_bits=2, layout=request.param), progress=False)
    return out


def test_resident_logits_match_cpu(bundled_dir, bundled_model):
    ids = torch.randint(0, bundled_model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    ref = bundled_model(ids, bundled_model.new_cache())
    gpu = load_model(bundled_dir, device="cuda")
    out = gpu(ids, gpu.new_cache()).cpu()  # CPU ids, as a user passes them: the model moves them
    assert (out - ref).abs().max() < 1e-3  # TF32/kernel differences only


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generate_on_gpu_gives_the_cpu_tokens(bundled_dir, bundled_tokenizer, dtype):
    cfg = GenerateConfig(max_tokens=32, ignore_eos=True)
    ref = generate_from_model(load_model(bundled_dir, dtype=dtype), bundled_tokenizer, "def main():", cfg)[0]
    gpu = load_model(bundled_dir, dtype=dtype, device="cuda")
    text = generate_from_model(gpu, bundled_tokenizer, "def main():", cfg)[0]  # the first request captures the graph
    again = generate_from_model(gpu, bundled_tokenizer, "def main():", cfg)[0]  # ... the second replays it
    assert gpu.graph_off is None and gpu.graphed is not None and gpu.graphed.captures >= 1
    gpu.cuda_graphs = False
    eager = generate_from_model(gpu, bundled_tokenizer, "def main():", cfg)[0]
    same = sum(a == b for a, b in zip(text, ref)) / max(len(ref), 1)
    assert again == text and (text == ref if dtype == "float32" else same > 0.8), (text, eager, ref)
    assert dtype != "float32" or eager == ref


def test_resident_int4_store_on_gpu_captures_the_graph(store, bundled_tokenizer):
    from fate_edge_lab.bench.sidebyside import resident_int4

    cfg = GenerateConfig(max_tokens=24, ignore_eos=True)
    cpu = load_model(store, dtype="bfloat16", experts=resident_int4(store))
    gpu = load_model(store, dtype="bfloat16", experts=resident_int4(store, "cuda"), device="cuda")
    ref = generate_from_model(cpu, bundled_tokenizer, "import os\n", cfg)[0]
    text = generate_from_model(gpu, bundled_tokenizer, "import os\n", cfg)[0]
    assert gpu.graph_off is None, gpu.graph_off
    same = sum(a == b for a, b in zip(text, ref)) / max(len(ref), 1)
    assert same > 0.8, (text, ref)


def test_cli_run_on_gpu(bundled_dir):
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "fate_edge",
            "run",
            "def main():",
            "--model",
            str(bundled_dir),
            "--device",
            "cuda",
            "--max-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip()


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
    with Engine(EngineConfig(store, "2MB", "fate-edge", device="cpu")) as cpu:
        ref = cpu.generate_text(prompt, cfg)[0]
    with Engine(EngineConfig(store, "2MB", "fate-edge", device="cuda")) as gpu:
        text = gpu.generate_text(prompt, cfg)[0]
        assert gpu.scheduler.copier.uploads > 0
        gpu.scheduler.copier.drain()
        assert gpu.fetch.pool.available == gpu.fetch.pool.count
    # Different int4 kernels (CPU vs CUDA tinygemm) may round differently; most tokens must agree.
    same = sum(a == b for a, b in zip(text, ref)) / max(len(ref), 1)
    assert same > 0.8, (text, ref)


def test_copy_streams_and_events():
    from fate_edge.fetch.transfer import CUDACopier

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
    text, last = generate_from_model(
        m, bundled_tokenizer, "import os\n", GenerateConfig(max_tokens=16, ignore_eos=True)
    )
    assert last.generation_tokens == 16 and text


def test_batched_engine_on_gpu_gives_each_request_its_alone_text(store):
    """Continuous batching on CUDA: four concurrent requests (joining a running batch) get the text each gets
    alone on the same GPU engine settings, at fp32, and really share steps."""
    import threading

    prompts = ["def parse(argv):\n    ", "import os\n", "class Point:\n    def __init__(self, x", "for i in"]
    cfg = GenerateConfig(max_tokens=16, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32")
    with Engine(EngineConfig(store, "2MB", "fate-edge", max_batch=1, **kw)) as alone:
        expected = [alone.generate_text(p, cfg)[0] for p in prompts]
    with Engine(EngineConfig(store, "2MB", "fate-edge", max_batch=4, **kw)) as batched:
        texts = [""] * len(prompts)

        def serve(i: int) -> None:
            texts[i] = "".join(step.text for step in batched.stream(prompts[i], cfg))

        threads = [threading.Thread(target=serve, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = batched.batcher.stats
        assert stats.sequences_stepped > stats.steps  # the requests ran together
    assert texts == expected
