"""The logit cost of GGUF expert types fate-edge cannot take as they are (q5_K, q6_K): dequantized by the gguf
package and quantized again to int4 group 32.

    python research/gguf_requant.py MODEL_DIR [--results]

MODEL_DIR is a bf16 checkpoint (the synthetic Qwen1.5-MoE slice). Its bf16 GGUF (llama.cpp's converter) is
quantized by ``llama_model_quantize`` to q5_K_M and q6_K (and q4_0 for comparison); each is converted by
``fate-edge convert`` (int4 experts plus the bf16 copy). Logits on the same ids against the checkpoint's own
(fate-edge in float32 on the bf16 weights: the "f32 model"):

- the store's bf16 experts: the GGUF's own rounding (dequantized, held in bf16);
- the store's int4 experts: that plus re-quantizing (q4_0: the blocks' codes as they are);
- llama.cpp on the same GGUF, for scale.

Writes the ``requant`` entry of docs/results/gguf.json and, with --results, the ``gguf_requant`` table of
docs/results/gguf_requant.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fate_edge import Tokenizer  # noqa: E402
from fate_edge.format.convert import ConvertOptions  # noqa: E402
from fate_edge.format.gguf_convert import convert_gguf, expert_types  # noqa: E402
from fate_edge.format.gguf_reader import GGUFFile  # noqa: E402
from fate_edge.runtime.loader import load_model  # noqa: E402
from fate_edge_lab.bench.gguf import ensure_ggufs  # noqa: E402
from fate_edge_lab.bench.llamacpp import llama_child  # noqa: E402

PROMPT = "import os\n\ndef main(argv):\n    for name in os.listdir(argv[1]):\n        print(name)\n"
FTYPES = {"q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}

_QUANT = """
import sys, llama_cpp
src, dst, ftype = sys.argv[1:4]
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, ftype)
p.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p))
"""

_LLAMA = """
import json, sys
import numpy as np
from llama_cpp import Llama
path, ids_file, out = sys.argv[1:4]
llm = Llama(model_path=path, n_ctx=256, n_threads=2, n_threads_batch=2, logits_all=True, verbose=False)
ids = json.load(open(ids_file))
llm.eval(ids)
np.save(out, np.array(llm.scores[: len(ids)], dtype=np.float32))
"""


def forward(store_or_dir: Path, ids: list[int], bits: int | None) -> np.ndarray:
    model = load_model(store_or_dir, torch.float32, **({} if bits is None else {"bits": bits}))
    with torch.no_grad():
        out = model.forward(torch.tensor([ids]), model.new_cache())[0].float().numpy()
    if hasattr(model.experts, "close"):
        model.experts.close()
    return out


def compare(x: np.ndarray, ref: np.ndarray) -> dict:
    cos = (x * ref).sum(-1) / np.linalg.norm(x, axis=-1) / np.linalg.norm(ref, axis=-1)

    def logp(a):
        a = a - a.max(-1, keepdims=True)
        return a - np.log(np.exp(a).sum(-1, keepdims=True))

    lp, lq = logp(ref.astype(np.float64)), logp(x.astype(np.float64))
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return {
        "max_abs_first": round(float(np.abs(x[0] - ref[0]).max()), 5),
        "max_abs_all": round(float(np.abs(x - ref).max()), 5),
        "cos_first": round(float(cos[0]), 7),
        "cos_min": round(float(cos.min()), 7),
        "kl_mean": float(f"{kl.mean():.3g}"),
        "kl_max": float(f"{kl.max():.3g}"),
        "top1_agree": round(float((x.argmax(-1) == ref.argmax(-1)).mean()), 4),
    }


def table(res: dict) -> str:
    lines = [
        f"{res['model']}; the first {res['positions']} positions of one prompt against the checkpoint's "
        f"logits (fate-edge, float32). {res['cpu']}, load average {res['loadavg']}.",
        "",
        "| GGUF (llama.cpp quantizer) | expert tensors | run by | max abs Δ, first position | lowest cosine | "
        "mean KL | top-1 agreement |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for kind, r in res["ggufs"].items():
        for label, key in (
            ("fate-edge, bf16 experts (dequantized)", "bf16"),
            ("fate-edge, int4 experts", "int4"),
            ("llama.cpp", "llama"),
        ):
            m = r[key]
            lines.append(
                f"| {kind} | {r['expert_types']} | {label} | {m['max_abs_first']} | {m['cos_min']:.5f} | "
                f"{m['kl_mean']:.2e} | {m['top1_agree']:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--work", default="/tmp/gguf-requant")
    ap.add_argument("--types", default="q5_K_M,q6_K,q4_0")
    ap.add_argument("--json", default=str(ROOT / "docs" / "results" / "gguf.json"))
    ap.add_argument("--results", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model_dir = Path(args.model).resolve()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    bf16 = ensure_ggufs(model_dir, ("bf16",))["bf16"]
    ids = Tokenizer(model_dir).encode(PROMPT)
    (work / "ids.json").write_text(json.dumps(ids))
    ref = forward(model_dir, ids, None)
    res: dict = {
        "model": f"{model_dir.name} (bf16 checkpoint; its bf16 GGUF by llama.cpp's converter)",
        "positions": len(ids),
        "ggufs": {},
    }
    for kind in args.types.split(","):
        path = work / f"model-{kind}.gguf"
        if not path.exists():
            subprocess.run([sys.executable, "-c", llama_child(_QUANT), str(bf16), str(path), FTYPES[kind]], check=True)
        g = GGUFFile(path)
        from fate_edge.format.gguf_config import hf_config
        from fate_edge.model.arch import config_from_dict

        cfg = config_from_dict(hf_config(g, "bfloat16"), str(path))
        types = expert_types(g, cfg.moe_layers)
        store = convert_gguf(path, work / f"store-{kind}", ConvertOptions(bits=4, force=True), progress=True)
        subprocess.run(
            [
                sys.executable,
                "-c",
                llama_child(_LLAMA),
                str(path),
                str(work / "ids.json"),
                str(work / f"llama-{kind}.npy"),
            ],
            check=True,
        )
        res["ggufs"][kind] = {
            "expert_types": ", ".join(f"{n} x{c}" for n, c in sorted(types.items())),
            "bf16": compare(forward(store, ids, 16), ref),
            "int4": compare(forward(store, ids, 4), ref),
            "llama": compare(np.load(work / f"llama-{kind}.npy"), ref),
        }
        print(kind, json.dumps(res["ggufs"][kind]), flush=True)
    res["cpu"] = "AMD EPYC (2 cores, shared)"
    res["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    path = Path(args.json)
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc["requant"] = res
    from fate_edge_lab.bench.publish import publish, results_file

    publish(doc, path, table(res), results_file("gguf_requant") if args.results else None, "gguf_requant")


if __name__ == "__main__":
    main()
