"""The store a q4_K_M-style GGUF converts to with no flags, against the GGUF's size (docs/quantization.md).

Builds a synthetic checkpoint (`fate-edge synth --like olmoe-1b-7b --scale 4 --layers 2`: hidden 512, expert
width 256, whole q4_K super-blocks), writes it as a GGUF with the `gguf` package the way llama.cpp's Q4_K_M lays
it out (q4_K for experts, attention and the embedding table; routers and norms F32) with the output matrix in
q8_0 (llama.cpp: q6_K, which gguf-py cannot write) or in q4_K, converts each with no flags and prints the sizes.

    .venv/bin/python scripts/gguf_store_ratio.py /tmp/gguf-ratio
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the gguf-py writer the tests use


def size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(work: Path) -> None:
    from _gguf_writer import write_gguf
    from safetensors.torch import load_file, save_file

    from fate_edge.format.converted_stores import ensure_store
    from fate_edge.format.store import ExpertStore

    work.mkdir(parents=True, exist_ok=True)
    model = work / "olmoe-s4"
    if not model.exists():
        fe = Path(sys.executable).parent / "fate-edge"
        subprocess.run([fe, "synth", "--like", "olmoe-1b-7b", "--scale", "4", "--layers", "2", str(model)], check=True)
        shards = sorted(model.glob("*.safetensors"))
        if len(shards) > 1 or shards[0].name != "model.safetensors":  # the writer reads one file
            merged = {}
            for s in shards:
                merged |= load_file(str(s))
                s.unlink()
            (model / "model.safetensors.index.json").unlink(missing_ok=True)
            save_file(merged, str(model / "model.safetensors"), {"format": "pt"})
    print(f"checkpoint {model}: {size(model) / 1e6:.1f} MB bf16")
    for label, output in (("q4_K_M-style, output q8_0", "Q8_0"), ("all q4_K, output q4_K", "Q4_K")):
        gguf = work / f"olmoe-s4-{output.lower()}.gguf"
        if not gguf.exists():
            write_gguf(model, gguf, "Q4_K", "Q4_K", output)
        store = ensure_store(gguf, progress=False)
        s = ExpertStore(store)
        print(
            f"{label}: GGUF {size(gguf) / 1e6:.1f} MB -> store {size(store) / 1e6:.1f} MB "
            f"({size(store) / size(gguf):.2f}x; precisions {sorted(s.precisions)}, resident "
            f"{(store / 'resident.safetensors').stat().st_size / 1e6:.1f} MB)"
        )
        shutil.rmtree(store)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gguf-ratio"))
