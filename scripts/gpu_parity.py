"""GPU vs CPU on the bundled model: last-position logits difference, greedy agreement and decode tok/s.

python scripts/gpu_parity.py --json out/parity.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fate_edge import GenerateConfig, Tokenizer, bundled_model_dir, load_model
from fate_edge.runtime.generate import generate_from_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(bundled_model_dir()))
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_parity: torch sees no CUDA GPU; run this on a GPU machine")
    tok = Tokenizer(args.model)
    ids = torch.randint(0, 4000, (1, 128), generator=torch.Generator().manual_seed(0))
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for dtype in ("float32", "bfloat16"):
        cpu, gpu = load_model(args.model, dtype=dtype), load_model(args.model, dtype=dtype, device="cuda")
        a = cpu(ids, cpu.new_cache())[0, -1].float()
        b = gpu(ids.cuda(), gpu.new_cache())[0, -1].float().cpu()
        cfg = GenerateConfig(max_tokens=64, ignore_eos=True)
        ta, _ = generate_from_model(cpu, tok, "def main():", cfg)
        first, _ = generate_from_model(
            gpu, tok, "def main():", cfg
        )  # warm-up: kernel loads, cuBLAS handles, graph capture
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tb, last = generate_from_model(gpu, tok, "def main():", cfg)
        torch.cuda.synchronize()
        gpu.cuda_graphs = False
        eager = generate_from_model(gpu, tok, "def main():", cfg)[1]
        result[dtype] = {
            "max_abs_diff_last_logits": float((a - b).abs().max()),
            "greedy_text_equal": ta == tb,
            "first_request_equal": first == tb,
            "graph": gpu.graph_off or "captured",
            "gpu_decode_tps": last.generation_tps,
            "gpu_eager_decode_tps": eager.generation_tps,
            "gpu_wall_s": time.perf_counter() - t0,
        }
        print(dtype, result[dtype], flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
