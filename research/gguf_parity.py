"""A GGUF made by llama.cpp against the safetensors checkpoint it came from, on a synthetic real-shape model.

    python research/gguf_parity.py MODEL_DIR [--rounds 5] [--results]

MODEL_DIR is a checkpoint from ``fate-edge synth`` (the issue's: ``--like qwen1.5-moe-a2.7b
--layers 2``). Its q4_0 GGUF is made by llama.cpp's own converter (bf16) and quantizer (``fate_edge_lab.bench.gguf``),
then, each in a fresh process:

1. convert: ``fate-edge convert MODEL.gguf`` and ``fate-edge convert MODEL_DIR --bits 4 --group 32 --layout
   portable`` (the GGUF's group and layout, so the two stores hold the same kind of int4), both ``--no-bf16``;
   wall time and the child's peak RSS (``/usr/bin/time``), rounds interleaved;
2. logits: llama.cpp on the q4_0 GGUF and fate-edge on the GGUF-derived store (its int4 experts) on the same ids,
   cosine per position; llama.cpp's ids against the store tokenizer's on held-out stdlib text;
3. decode: tok/s and peak RSS (VmHWM) of the two stores under the same policy and budgets, rounds interleaved
   (the order of the two stores alternating), medians.

Writes the ``qwen1.5-moe-2l`` entry of docs/results/gguf.json and, with --results, the table between the
``gguf_parity`` markers of docs/results/gguf_parity.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fate_edge_lab.bench.host import cpu_model, load_average

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
KEY = "qwen1.5-moe-2l"


def timed(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    """Run ``cmd`` under /usr/bin/time: wall seconds, the child's peak RSS in MB, and the load average before."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as tf:
        before = load_average()
        t0 = time.perf_counter()
        proc = subprocess.run(
            ["/usr/bin/time", "-f", "%M", "-o", tf.name, *cmd], capture_output=True, text=True, env=env
        )
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        rss_kb = int(tf.read().strip().splitlines()[-1])
    return {"wall_s": round(wall, 2), "rss_mb": round(rss_kb / 1024, 1), "loadavg": before, "stdout": proc.stdout}


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    return env


# ---------------------------------------------------------------------------------------------------- convert
def convert_cmd(src: Path, out: Path, threads: int, gguf: bool) -> list[str]:
    cmd = [
        PY,
        "-m",
        "fate_edge",
        "convert",
        str(src),
        str(out),
        "--no-bf16",
        "--force",
        "--quiet",
        "--threads",
        str(threads),
    ]
    return cmd if gguf else [*cmd, "--bits", "4", "--group", "32", "--layout", "portable"]


# ---------------------------------------------------------------------------------------------------- logits
_LLAMA = """
import json, sys
import numpy as np
from llama_cpp import Llama
path, text_file, ids_file, out, threads = sys.argv[1:6]
llm = Llama(model_path=path, n_ctx=512, n_threads=int(threads), n_threads_batch=int(threads), logits_all=True,
            verbose=False)
ids = json.load(open(ids_file))
toks = llm.tokenize(open(text_file, encoding="utf-8").read().encode(), add_bos=False, special=False)
llm.eval(ids)
np.save(out + ".npy", np.array(llm.scores[: len(ids)], dtype=np.float32))
json.dump(toks, open(out + ".json", "w"))
"""

_OURS = """
import json, sys
import numpy as np, torch
from fate_edge import Tokenizer
from fate_edge.runtime.loader import load_model
store, text_file, prompt, out, threads = sys.argv[1:6]
torch.set_num_threads(int(threads))
tok = Tokenizer(store)
ids = tok.encode(prompt)
json.dump({"ids": ids, "text_ids": tok.encode(open(text_file, encoding="utf-8").read())}, open(out + ".json", "w"))
model = load_model(store, torch.float32, bits=4)
with torch.no_grad():
    logits = model.forward(torch.tensor([ids]), model.new_cache())[0].float().numpy()
np.save(out + ".npy", logits)
"""

PROMPT = "import os\n\ndef main(argv):\n    for name in os.listdir(argv[1]):\n        print(name)\n"


def logits_vs_llama(gguf: Path, store: Path, work: Path, threads: int, heldout_chars: int) -> dict:
    import numpy as np

    from fate_edge.corpus import heldout_source
    from fate_edge_lab.bench.llamacpp import llama_child

    text, _ = heldout_source(heldout_chars)
    (work / "text.txt").write_text(text, encoding="utf-8")
    env = child_env(threads)
    subprocess.run(
        [PY, "-c", _OURS, str(store), str(work / "text.txt"), PROMPT, str(work / "ours"), str(threads)],
        check=True,
        env=env,
    )
    mine = json.loads((work / "ours.json").read_text())
    (work / "ids.json").write_text(json.dumps(mine["ids"]))
    subprocess.run(
        [
            PY,
            "-c",
            llama_child(_LLAMA),
            str(gguf),
            str(work / "text.txt"),
            str(work / "ids.json"),
            str(work / "llama"),
            str(threads),
        ],
        check=True,
        env=env,
    )
    ours, theirs = np.load(work / "ours.npy"), np.load(work / "llama.npy")
    their_ids = json.loads((work / "llama.json").read_text())
    cos = [float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b))) for a, b in zip(ours, theirs)]
    top1 = float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))
    return {
        "cos_first": round(cos[0], 7),
        "cos_min": round(min(cos), 7),
        "positions": len(cos),
        "top1_agree": round(top1, 4),
        "max_abs_diff_first": round(float(np.abs(ours[0] - theirs[0]).max()), 5),
        "tokens_equal": mine["text_ids"] == their_ids,
        "heldout_chars": len(text),
        "heldout_tokens": len(their_ids),
    }


# ---------------------------------------------------------------------------------------------------- decode
def decode_worker(argv: list[str]) -> None:
    """In a fresh process: load ``store`` under ``policy`` and ``budget``, decode, print one JSON line."""
    store, budget, policy, threads, prompt_tokens, max_tokens = argv
    import torch

    torch.set_num_threads(int(threads))
    from fate_edge import GenerateConfig
    from fate_edge.process_memory import peak_rss_bytes
    from fate_edge.runtime.engine import Engine
    from fate_edge.runtime.engine_config import EngineConfig

    t0 = time.perf_counter()
    engine = Engine(EngineConfig(store, budget, policy))
    load_s = time.perf_counter() - t0
    vocab = engine.model.config.vocab_size
    prompt = [(17 + 31 * i) % min(vocab, 8000) for i in range(int(prompt_tokens))]
    _, last = engine.generate_text(prompt, GenerateConfig(max_tokens=int(max_tokens), ignore_eos=True))
    engine.close()
    print(
        json.dumps(
            {
                "tok_s": last.generation_tps,
                "prefill_tok_s": last.prompt_tps,
                "load_s": load_s,
                "peak_rss_mb": peak_rss_bytes() / 2**20,
                "tokens": last.generation_tokens,
            }
        )
    )


def decode_round(store: Path, budget: str, policy: str, threads: int, prompt_tokens: int, max_tokens: int) -> dict:
    r = timed(
        [
            PY,
            __file__,
            "--decode-worker",
            str(store),
            budget,
            policy,
            str(threads),
            str(prompt_tokens),
            str(max_tokens),
        ],
        child_env(threads),
    )
    out = json.loads(r["stdout"].strip().splitlines()[-1])
    out["loadavg"] = r["loadavg"]
    return out


def med(xs: list[float], nd: int = 2) -> float:
    return round(statistics.median(xs), nd)


# ---------------------------------------------------------------------------------------------------- table
def table(res: dict) -> str:
    c, lg = res["convert"], res["logits"]
    lines = [
        f"Synthetic Qwen1.5-MoE slice (2 layers at the real shape: 60 experts of 2048x1408, vocab 151,936); "
        f"{res['cpu']}, {res['threads']} threads; load average {res['loadavg_start']} at the start, "
        f"{res['loadavg_end']} at the end (2 cores shared with other engineers' jobs). Medians of "
        f"{res['rounds']} interleaved rounds, each in a fresh process.",
        "",
        f"q4_0 GGUF by llama.cpp (converter bf16, `llama_model_quantize` q4_0), converted by `fate-edge convert`: "
        f"first-position cosine against llama.cpp on the same {lg['positions']} ids **{lg['cos_first']:.5f}** "
        f"(lowest over the positions {lg['cos_min']:.5f}, top-1 agreement {lg['top1_agree']:.2f}); "
        f"tokenizer ids equal to llama.cpp's on {lg['heldout_chars']:,} characters of held-out stdlib text "
        f"({lg['heldout_tokens']:,} tokens): **{'yes' if lg['tokens_equal'] else 'no'}**.",
        "",
        "| convert (int4 only, `--no-bf16`) | time s | ratio | peak RSS MB | ratio |",
        "|---|---:|---:|---:|---:|",
        f"| safetensors (`--bits 4 --group 32 --layout portable`) | {c['safetensors']['wall_s']} | 1.00 | "
        f"{c['safetensors']['rss_mb']} | 1.00 |",
        f"| q4_0 GGUF | {c['gguf']['wall_s']} | {c['gguf']['wall_s'] / c['safetensors']['wall_s']:.2f} | "
        f"{c['gguf']['rss_mb']} | {c['gguf']['rss_mb'] / c['safetensors']['rss_mb']:.2f} |",
        "",
        "| decode | store | tok/s | ratio | spread | peak RSS MB | ratio |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for name, d in res["decode"].items():
        st, gg = d["safetensors"], d["gguf"]
        lines.append(
            f"| {name} | safetensors | {st['tok_s']} | 1.00 | {st['tok_s_min']}-{st['tok_s_max']} | "
            f"{st['peak_rss_mb']:.0f} | 1.00 |"
        )
        lines.append(
            f"| | q4_0 GGUF | {gg['tok_s']} | {gg['tok_s'] / st['tok_s']:.2f} | "
            f"{gg['tok_s_min']}-{gg['tok_s_max']} | {gg['peak_rss_mb']:.0f} | "
            f"{gg['peak_rss_mb'] / st['peak_rss_mb']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--decode-worker"]:
        decode_worker(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--work", default=None, help="where the stores go (default: a temporary directory)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--convert-rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--policy", default="fate-edge")
    ap.add_argument(
        "--budgets", default="partial=250MB,all-resident=1GB", help="NAME=BUDGET,...: expert budgets the decode runs at"
    )
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--heldout-chars", type=int, default=400_000)
    ap.add_argument("--json", default=str(ROOT / "docs" / "results" / "gguf.json"))
    ap.add_argument("--results", action="store_true", help="write the table into docs/results/gguf_parity.md")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from fate_edge_lab.bench.gguf import ensure_ggufs

    model = Path(args.model).resolve()
    work = Path(args.work or tempfile.mkdtemp(prefix="gguf-parity-"))
    work.mkdir(parents=True, exist_ok=True)
    synth = model / "synthetic.json"
    res: dict = {
        "model": f"{model.name}: fate-edge synth "
        f"{json.loads(synth.read_text())['options'] if synth.exists() else '(not synthetic)'}",
        "cpu": f"{cpu_model()} ({os.cpu_count()} cores, shared)",
        "threads": args.threads,
        "rounds": args.rounds,
        "policy": args.policy,
        "loadavg_start": load_average(),
    }
    gguf = ensure_ggufs(model, ("bf16", "q4_0"), quiet=True)["q4_0"]
    res["gguf_bytes"] = gguf.stat().st_size
    stores = {"safetensors": work / "store-safetensors", "gguf": work / "store-gguf"}
    srcs = {"safetensors": model, "gguf": gguf}
    runs: dict[str, list[dict]] = {k: [] for k in stores}
    for r in range(args.convert_rounds):
        for kind in ("safetensors", "gguf") if r % 2 == 0 else ("gguf", "safetensors"):
            one = timed(convert_cmd(srcs[kind], stores[kind], args.threads, kind == "gguf"), child_env(args.threads))
            one.pop("stdout")
            runs[kind].append(one)
            print(f"convert {kind} round {r}: {one}", flush=True)
    res["convert"] = {
        k: {"wall_s": med([x["wall_s"] for x in v]), "rss_mb": med([x["rss_mb"] for x in v], 1), "runs": v}
        for k, v in runs.items()
    }
    res["logits"] = logits_vs_llama(gguf, stores["gguf"], work, args.threads, args.heldout_chars)
    print(f"logits: {res['logits']}", flush=True)
    budgets = dict(b.split("=") for b in args.budgets.split(","))
    dec: dict[str, dict[str, list[dict]]] = {n: {k: [] for k in stores} for n in budgets}
    for r in range(args.rounds):
        for name, budget in budgets.items():
            for kind in ("safetensors", "gguf") if r % 2 == 0 else ("gguf", "safetensors"):
                one = decode_round(stores[kind], budget, args.policy, args.threads, args.prompt_tokens, args.max_tokens)
                dec[name][kind].append(one)
                print(f"decode {name} {kind} round {r}: {one}", flush=True)
    res["decode"] = {}
    for name, by in dec.items():
        res["decode"][f"{args.policy} {budgets[name]} ({name})"] = {
            k: {
                "tok_s": med([x["tok_s"] for x in v]),
                "tok_s_min": round(min(x["tok_s"] for x in v), 2),
                "tok_s_max": round(max(x["tok_s"] for x in v), 2),
                "peak_rss_mb": med([x["peak_rss_mb"] for x in v], 1),
                "runs": v,
            }
            for k, v in by.items()
        }
    res["loadavg_end"] = load_average()
    path = Path(args.json)
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc[KEY] = res
    text = table(res)
    from fate_edge_lab.bench.publish import publish, results_file

    publish(doc, path, text, results_file("gguf_parity") if args.results else None, "gguf_parity")


if __name__ == "__main__":
    main()
