"""GGUF convert against safetensors convert at the full Qwen1.5-MoE-A2.7B shape (24 layers), and whether it is
disk-bound.

    python research/gguf_full_shape.py SLICE.gguf CHECKPOINT --work DIR [--results]
    python research/gguf_full_shape.py SLICE.gguf --only gguf --work DIR [--rounds N]

SLICE.gguf: a q4_0 GGUF of the 2-layer synthetic slice made by llama.cpp's own converter and quantizer (the one
``research/gguf_parity.py`` makes, under ~/.cache/fate-edge-peers/gguf). Its layers are repeated into a
24-layer file (``{arch}.block_count`` set to 24; every other key and tensor as llama.cpp wrote it, q4_0 experts and
the q6_K output matrix included), so the full-shape file holds exactly the tensor types llama.cpp's quantizer
chooses, without 28.6 GB of bf16 converter output on this disk. CHECKPOINT: ``fate-edge synth --like
qwen1.5-moe-a2.7b`` (28.6 GB bf16). Each convert runs in a fresh process with the page cache dropped, wall time and
peak RSS by /usr/bin/time; rounds interleaved; the store is removed after each. Disk-bound means: the convert's time
against reading its input and writing its store at this disk's measured sequential speeds (O_DIRECT, ``dd``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fate_edge_lab.bench.host import cpu_model, load_average
from fate_edge_lab.bench.prepare import drop_page_cache
from fate_edge_lab.bench.publish import add_results_arg, publish

_spec = importlib.util.spec_from_file_location("gguf_parity", Path(__file__).with_name("gguf_parity.py"))
assert _spec is not None and _spec.loader is not None
parity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parity)


def repeat_layers(src: Path, out: Path, layers: int) -> None:
    """``src``'s blocks repeated to ``layers`` (blk.i from blk.(i mod n)), every other field and tensor copied."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    n = reader.fields[f"{arch}.block_count"].contents()
    writer = gguf.GGUFWriter(out, arch=arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value = layers if field.name == f"{arch}.block_count" else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    block = re.compile(r"^blk\.(\d+)\.(.*)$")
    by_name = {t.name: t for t in reader.tensors}
    order = []
    for t in reader.tensors:
        m = block.match(t.name)
        if m is None:
            order.append((t.name, t))
        elif int(m.group(1)) == 0:  # one entry per layer and tensor kind, in the file's order
            order += [(f"blk.{i}.{m.group(2)}", by_name[f"blk.{i % n}.{m.group(2)}"]) for i in range(layers)]
    for name, t in order:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t in order:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()


def disk_speed(path: Path, scratch: Path, gb: int = 4) -> dict[str, float]:
    """Sequential O_DIRECT read of ``path``'s first ``gb`` GB and write of ``gb`` GB to ``scratch``, GB/s (dd)."""

    def dd(args: list[str]) -> float:
        out = subprocess.run(["dd", *args, "bs=16M", f"count={gb * 64}"], capture_output=True, text=True).stderr
        m = re.search(r"([\d.]+) s,", out)
        return gb * 2**30 / 1e9 / float(m.group(1)) if m else float("nan")

    drop_page_cache()
    read = dd([f"if={path}", "of=/dev/null", "iflag=direct"])
    write = dd(["if=/dev/zero", f"of={scratch}", "oflag=direct"])
    scratch.unlink(missing_ok=True)
    # Both at once, as a streaming convert reads and writes: this disk's combined rate is lower than either alone.
    drop_page_cache()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        list(
            pool.map(
                dd, [[f"if={path}", "of=/dev/null", "iflag=direct"], ["if=/dev/zero", f"of={scratch}", "oflag=direct"]]
            )
        )
    both = 2 * gb * 2**30 / 1e9 / (time.perf_counter() - t0)
    scratch.unlink(missing_ok=True)
    return {"read_gbps": round(read, 3), "write_gbps": round(write, 3), "both_gbps": round(both, 3)}


def startup_s(threads: int) -> float:
    """Seconds a fresh process takes to start and import the converter (part of every convert's wall time)."""
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import fate_edge.format.gguf_convert"], check=True, env=parity.child_env(threads)
    )
    return time.perf_counter() - t0


def size_gb(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slice_gguf", type=Path)
    ap.add_argument("checkpoint", type=Path, nargs="?", help="the bf16 checkpoint (not needed with --only gguf)")
    ap.add_argument("--only", choices=("gguf", "safetensors"), help="convert only this source (no --results)")
    ap.add_argument("--work", type=Path, required=True, help="where the 24-layer GGUF and the stores go")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="/tmp/gguf_full_shape.json")
    add_results_arg(ap, "write the table into docs/results/gguf_full_shape.md (or FILE) between its markers")
    args = ap.parse_args()
    if args.only != "gguf" and args.checkpoint is None:
        ap.error("CHECKPOINT is needed unless --only gguf")
    if args.only and args.results:
        ap.error("--results writes the table of both sources: leave out --only")
    args.work.mkdir(parents=True, exist_ok=True)
    full = args.work / f"model-q4_0-{args.layers}l.gguf"
    if not full.exists():
        repeat_layers(args.slice_gguf, full, args.layers)
    disk = disk_speed(full, args.work / "dd.scratch")
    sources = {"gguf": full, "safetensors": args.checkpoint}
    if args.only:
        sources = {args.only: sources[args.only]}
    runs: dict[str, list[dict]] = {k: [] for k in sources}
    start = statistics.median(startup_s(args.threads) for _ in range(3))
    load_start = load_average()
    for _ in range(args.rounds):
        for kind, src in sources.items():
            store = args.work / f"store-{kind}"
            shutil.rmtree(store, ignore_errors=True)
            drop_page_cache()
            cmd = parity.convert_cmd(src, store, args.threads, kind == "gguf")
            r = parity.timed(cmd, parity.child_env(args.threads))
            r.pop("stdout")
            r["in_gb"], r["out_gb"] = round(size_gb(src), 2), round(size_gb(store), 2)
            r["disk_bound_s"] = round(r["in_gb"] / disk["read_gbps"] + r["out_gb"] / disk["write_gbps"], 1)
            r["disk_at_once_s"] = round((r["in_gb"] + r["out_gb"]) / disk["both_gbps"], 1)
            runs[kind].append(r)
            print(kind, json.dumps(r), flush=True)
            shutil.rmtree(store, ignore_errors=True)
    fields = ("wall_s", "rss_mb", "disk_bound_s", "disk_at_once_s")
    med = {k: {f: statistics.median(r[f] for r in v) for f in fields} for k, v in runs.items()}
    result = {
        "cpu": cpu_model(),
        "threads": args.threads,
        "layers": args.layers,
        "disk": disk,
        "runs": runs,
        "median": med,
        "startup_s": round(start, 2),
        "loadavg_start": load_start,
        "loadavg_end": load_average(),
    }
    lines = [
        f"Qwen1.5-MoE-A2.7B shape, {args.layers} layers; {cpu_model()}, {args.threads} threads; load average "
        f"{load_start} at the start, {result['loadavg_end']} at the end. Each convert in a fresh process, page cache "
        f"dropped before it, {args.rounds} round(s), medians. This disk, O_DIRECT sequential: read "
        f"{disk['read_gbps']} GB/s, write {disk['write_gbps']} GB/s, both at once {disk['both_gbps']} GB/s in all. "
        f"Starting a process and importing the converter: {start:.1f} s. Stores: int4 group-32 experts, portable "
        "layout, `--no-bf16`.",
        "",
        "| source | input GB | store GB | convert s | less startup s | disk: read then write s | disk: both at once s "
        "| (convert − startup) / both at once | peak RSS MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, m in med.items():
        r0 = runs[kind][0]
        work = m["wall_s"] - start
        lines.append(
            f"| {kind} | {r0['in_gb']} | {r0['out_gb']} | {m['wall_s']:.1f} | {work:.1f} | {m['disk_bound_s']:.1f} | "
            f"{m['disk_at_once_s']:.1f} | {work / m['disk_at_once_s']:.2f}x | {m['rss_mb']:.0f} |"
        )
    if len(med) == 2:
        g, s = med["gguf"], med["safetensors"]
        lines += ["", f"GGUF convert / safetensors convert: **{g['wall_s'] / s['wall_s']:.2f}x** time."]
    publish(result, args.json, "\n".join(lines), args.results, "gguf_full_shape")
    return 0


if __name__ == "__main__":
    sys.exit(main())
