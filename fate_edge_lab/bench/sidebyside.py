"""fate-edge beside llama.cpp on the same checkpoint and the same prompt token ids (``fate-edge bench-llamacpp``).

Resident: fate-edge fp32 / bf16 / int4 experts vs llama.cpp f32 / bf16 / q4_0 GGUFs, every weight in RAM.
Memory-limited: fate-edge streaming its int4 experts under an expert budget, then llama.cpp q4_0 memory-mapped
inside a memory cgroup capped at fate-edge's measured peak RSS, the page cache dropped before each run.
Each measurement is a fresh process; rounds interleave the sides so the host's drift hits them alike."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fate_edge.bundled import bundled_model_dir as _bundled
from fate_edge_lab.bench.llamacpp import PROGRESS, llama_child, read_bytes, time_tokens
from fate_edge_lab.bench.publish import markers


@dataclass(frozen=True)
class Side:
    name: str
    kind: str  # fate-edge | llama.cpp
    precision: str  # fp32 | bf16 | int4 | mxfp4 (fate-edge); f32 | bf16 | q4_0 | mxfp4 (the GGUF's type)
    experts: str  # what the experts are stored and computed in
    rest: str  # attention, embeddings, shared experts, lm_head
    # resident | limited (fate-edge: expert budget; llama.cpp: mmap under a cgroup cap) | engine (fate-edge: the
    # Engine with every setting at its default, as `fate-edge run MODEL` serves: the experts it reads stay cached
    # where the automatic budget holds them)
    mode: str = "resident"
    dtype: str = ""  # fate-edge int4 sides: what the rest is held and computed in ("" = fp32)
    resident_bits: int | None = None  # fate-edge: attention, shared experts, lm_head quantized (fused.py)
    # fate-edge: the store it reads. BASELINES keeps bf16 experts and float resident weights (quantized at load as
    # the side asks); DEFAULT is the lean store ``fate-edge run MODEL`` converts, read as a user's run reads it;
    # PUBLISHED keeps the rest as the checkpoint holds it (gpt-oss's bf16 beside llama.cpp's bf16 GGUF)
    store: str = "baselines"


BASELINES, DEFAULT, PUBLISHED = "baselines", "default", "published"


RESIDENT = [
    Side("fate-edge fp32", "fate-edge", "fp32", "fp32", "fp32"),
    Side("fate-edge bf16", "fate-edge", "bf16", "bf16", "bf16 (router fp32)"),
    Side("fate-edge int4", "fate-edge", "int4", "int4 (fate-edge store, group-wise RTN), fp32 compute", "fp32"),
    Side("llama.cpp f32", "llama.cpp", "f32", "f32", "f32"),
    Side("llama.cpp bf16", "llama.cpp", "bf16", "bf16", "bf16 (norms f32)"),
    Side("llama.cpp q4_0", "llama.cpp", "q4_0", "q4_0", "llama.cpp's Q4_0 mix (most matrices q4_0, norms f32)"),
]
LIMITED = [
    Side(
        "fate-edge int4, expert budget",
        "fate-edge",
        "int4",
        "int4, streamed from disk into the budget",
        "fp32",
        "limited",
    ),
    Side(
        "llama.cpp q4_0, mmap under cap", "llama.cpp", "q4_0", "q4_0, memory-mapped", "llama.cpp's Q4_0 mix", "limited"
    ),
]
PAIRS = [
    ("fate-edge fp32", "llama.cpp f32"),
    ("fate-edge bf16", "llama.cpp bf16"),
    ("fate-edge int4", "llama.cpp q4_0"),
    ("fate-edge int4, expert budget", "llama.cpp q4_0, mmap under cap"),
]

# Real-size checkpoints (bf16, synthetic or not): no f32 side (twice the bytes of bf16, same values), the rest in
# bf16 as the checkpoint stores it, and fate-edge's quantized resident weights beside llama.cpp's q4_0 mix.
_Q4_MIX = "llama.cpp's Q4_0 mix (attention q4_0, output q6_K, norms f32)"
_DEFAULT_REST = "int4, the default store's (embeddings int8; int4 when tied to the head)"
REAL_RESIDENT = [
    Side("fate-edge bf16", "fate-edge", "bf16", "bf16", "bf16 (router fp32)"),
    Side("fate-edge int4, bf16 rest", "fate-edge", "int4", "int4 (group-wise RTN)", "bf16", dtype="bf16"),
    Side(
        "fate-edge int4, int8 rest",
        "fate-edge",
        "int4",
        "int4 (group-wise RTN)",
        "int8 (embeddings bf16)",
        dtype="bf16",
        resident_bits=8,
    ),
    # what a user's default run reads: the lean store's int4 linears and its embedding table in int8, or in int4
    # where it is tied to the head (read whole every token; write_store); not bf16 quantized at load
    Side(
        "fate-edge int4, int4 rest",
        "fate-edge",
        "int4",
        "int4 (group-wise RTN)",
        _DEFAULT_REST,
        dtype="bf16",
        resident_bits=4,
        store=DEFAULT,
    ),
    # the same store through the product's own path: no setting but the store (budget, policy, dtype all automatic)
    Side(
        "fate-edge int4, default engine",
        "fate-edge",
        "int4",
        "int4, read once into the engine's cache (automatic budget)",
        _DEFAULT_REST,
        "engine",
        store=DEFAULT,
    ),
    Side("llama.cpp bf16", "llama.cpp", "bf16", "bf16", "bf16 (norms f32)"),
    Side("llama.cpp q4_0", "llama.cpp", "q4_0", "q4_0", _Q4_MIX),
]
REAL_LIMITED = [
    # like with like: llama.cpp's mix quantizes attention and the output matrix too
    Side(
        "fate-edge int4, expert budget",
        "fate-edge",
        "int4",
        "int4, streamed from disk into the budget",
        _DEFAULT_REST,
        "limited",
        dtype="bf16",
        resident_bits=4,
        store=DEFAULT,
    ),
    Side("llama.cpp q4_0, mmap under cap", "llama.cpp", "q4_0", "q4_0, memory-mapped", _Q4_MIX, "limited"),
]
REAL_PAIRS = [
    ("fate-edge bf16", "llama.cpp bf16"),
    ("fate-edge int4, bf16 rest", "llama.cpp q4_0"),
    ("fate-edge int4, int8 rest", "llama.cpp q4_0"),
    ("fate-edge int4, int4 rest", "llama.cpp q4_0"),
    ("fate-edge int4, default engine", "llama.cpp q4_0"),
    ("fate-edge int4, expert budget", "llama.cpp q4_0, mmap under cap"),
]


# gpt-oss as published (MXFP4 experts): fate-edge's default store keeps the blocks and computes on them (rest bf16,
# as the checkpoint holds it; and in fp32, what this host's --dtype auto measured), llama.cpp's converter keeps them
# too (its GGUF's other tensors bf16: --outtype bf16).
_MX_REST = "bf16 (norms f32)"
_MX_KEPT = "MXFP4 as published, kept exact"
MXFP4_RESIDENT = [
    Side("fate-edge mxfp4", "fate-edge", "mxfp4", _MX_KEPT, "bf16", dtype="bf16", store=PUBLISHED),
    Side("fate-edge mxfp4, fp32 compute", "fate-edge", "mxfp4", _MX_KEPT, "fp32", store=PUBLISHED),
    Side("llama.cpp mxfp4", "llama.cpp", "mxfp4", "MXFP4 (its converter keeps gpt-oss's)", _MX_REST),
]
MXFP4_LIMITED = [
    Side(
        "fate-edge mxfp4, expert budget",
        "fate-edge",
        "mxfp4",
        "MXFP4, streamed from disk into the budget",
        "bf16",
        "limited",
        dtype="bf16",
        store=PUBLISHED,
    ),
    Side("llama.cpp mxfp4, mmap under cap", "llama.cpp", "mxfp4", "MXFP4, memory-mapped", _MX_REST, "limited"),
]
MXFP4_PAIRS = [
    ("fate-edge mxfp4", "llama.cpp mxfp4"),
    ("fate-edge mxfp4, fp32 compute", "llama.cpp mxfp4"),
    ("fate-edge mxfp4, expert budget", "llama.cpp mxfp4, mmap under cap"),
]


@dataclass(frozen=True)
class SideSet:
    """What one comparison runs: the sides, the pairs that get ratios, and the GGUF types it needs."""

    resident: list[Side]
    limited: list[Side]
    pairs: list[tuple[str, str]]
    gguf_types: tuple[str, ...]


SIDE_SETS = {
    "small": SideSet(RESIDENT, LIMITED, PAIRS, ("f32", "bf16", "q4_0")),
    "real": SideSet(REAL_RESIDENT, REAL_LIMITED, REAL_PAIRS, ("bf16", "q4_0")),
    "mxfp4": SideSet(MXFP4_RESIDENT, MXFP4_LIMITED, MXFP4_PAIRS, ("mxfp4",)),
}


def has_mxfp4_experts(model_dir: str | Path) -> bool:
    """Whether the checkpoint's experts are MXFP4 as gpt-oss publishes them (its config's quantization_config)."""
    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    quant = cfg.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


def pick_side_set(name: str, model_dir: str | Path) -> SideSet:
    """``small`` (fp32 / bf16 / int4 vs f32 / bf16 / q4_0), ``real`` (bf16 and int4 experts with bf16 / int8 /
    int4 rest vs bf16 / q4_0), ``mxfp4`` (MXFP4 experts kept on both sides), or ``auto``: ``mxfp4`` for a checkpoint
    with MXFP4 experts (gpt-oss as published), ``real`` for one stored in bf16 (the real-size ones), else ``small``."""
    if name == "auto":
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        name = "real" if cfg.get("torch_dtype", cfg.get("dtype")) == "bfloat16" else "small"
        name = "mxfp4" if has_mxfp4_experts(model_dir) else name
    elif name == "mxfp4" and not has_mxfp4_experts(model_dir):
        raise ValueError(
            f"--sides mxfp4: {model_dir} has no MXFP4 experts (gpt-oss as published: fate-edge synth --mxfp4)"
        )
    return SIDE_SETS[name]


def only_sides(sides: SideSet, names: list[str]) -> SideSet:
    """``sides`` restricted to the sides called ``names`` (and the GGUF types their llama.cpp sides need)."""
    known = [side.name for side in sides.resident + sides.limited]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"no side {unknown} in this comparison; its sides are {known}")
    keep = [side for side in sides.resident + sides.limited if side.name in names]
    types = tuple(t for t in sides.gguf_types if any(s.kind == "llama.cpp" and s.precision == t for s in keep))
    return SideSet(
        [s for s in sides.resident if s in keep],
        [s for s in sides.limited if s in keep],
        [p for p in sides.pairs if p[0] in names and p[1] in names],
        types,
    )


def side_stores(model: str | Path, sides: list[Side]) -> dict[str, Path]:
    """The stores ``sides``' fate-edge sides read, converted once each (cached): ``baselines`` (bf16 experts and
    float resident weights, :meth:`ConvertOptions.full`) and ``default`` (what ``fate-edge run MODEL`` converts:
    ``ensure_store``'s own defaults). Only those asked for: at real size the baselines' bf16 experts are the
    checkpoint's size again."""
    kinds = dict.fromkeys(side.store for side in sides if side.kind == "fate-edge")
    return {kind: _ensure_kind(model, kind) for kind in kinds}


def _ensure_kind(model: str | Path, kind: str) -> Path:
    from fate_edge.format.converted_stores import ensure_store

    if kind == PUBLISHED:  # the rest unquantized, the experts as the default keeps them (MXFP4 as published)
        return ensure_store(model, progress=False, resident_bits=None, embedding_bits=None)
    return ensure_store(model, progress=False, baselines=kind == BASELINES)


def side_spec(base: dict[str, Any], side: Side, ggufs: dict[str, str], stores: dict[str, Path]) -> dict[str, Any]:
    """What one run of ``side`` is told: ``base`` (model, prompt, threads, budget) and the side's own settings, the
    store it reads among them (fate-edge) or its GGUF (llama.cpp)."""
    return {
        **base,
        "kind": side.kind,
        "precision": side.precision,
        "mode": side.mode,
        "gguf": ggufs.get(side.precision, ""),
        "dtype": side.dtype,
        "resident_bits": side.resident_bits,
        "store": str(stores[side.store]) if side.kind == "fate-edge" else "",
    }


def readme_marker(model: str, threads: int) -> str:
    """The markers (and docs/results file) a run writes: ``bench_llamacpp`` for the bundled model at 2 threads (as
    before), else one per model and thread count, so the tables of several models coexist."""
    if Path(model).resolve() == _bundled().resolve() and threads == 2:
        return "bench_llamacpp"
    return f"bench_llamacpp-{Path(model).resolve().name}-{threads}t"


def add_markers(readme: Path, name: str) -> None:
    """Empty ``name`` markers at the end of ``readme`` (created if missing), where they are not in it yet."""
    doc = readme.read_text() if readme.exists() else ""
    begin, end = markers(name)
    if begin in doc:
        return
    readme.parent.mkdir(parents=True, exist_ok=True)
    readme.write_text(doc + ("\n" if doc and not doc.endswith("\n") else "") + f"{begin}\n{end}\n")


def child_command(spec: dict[str, Any], folder: str | Path) -> list[str]:
    """The command that runs one side for ``spec``, which it reads from a file written into ``folder`` (a long
    prompt's ids and text overflow the argument list: a 4,096-token prompt did)."""
    path = Path(folder) / f"spec-{uuid.uuid4().hex}.json"
    path.write_text(json.dumps(spec))
    code = "import sys; from fate_edge_lab.bench.sidebyside import child_main; child_main(open(sys.argv[1]).read())"
    if spec["kind"] == "llama.cpp":
        code = llama_child(code)
    return [sys.executable, "-c", code, str(path)]


def resident_int4(store: str | Path, device: str = "cpu"):
    """Every int4 expert of ``store`` decoded once into memory on ``device``: the int4 model with nothing left to
    fetch (int4 experts compute in the activations' dtype, so one provider serves fp32 and bf16 models)."""
    from fate_edge.fetch.store_provider import StoreExpertProvider
    from fate_edge.format.store import ExpertStore
    from fate_edge.model.experts import InMemoryExpertProvider

    s = ExpertStore(store)
    prov = StoreExpertProvider(s, bits=4, device=device)
    try:
        experts = {
            (layer, e): prov.get(layer, e) for layer in s.index["moe_layers"] for e in range(s.index["num_experts"])
        }
    finally:
        prov.close()
    return InMemoryExpertProvider(experts)


def _fate_edge_stream(spec: dict[str, Any]):
    import torch

    from fate_edge.runtime.generate import GenerateConfig, stream_from_model
    from fate_edge.runtime.loader import load_model
    from fate_edge.tokenizer import Tokenizer

    torch.set_num_threads(spec["threads"])
    cfg = GenerateConfig(max_tokens=spec["decode_tokens"] + 1, ignore_eos=True)
    rest = torch.bfloat16 if spec.get("dtype") == "bf16" else torch.float32
    if spec["mode"] in ("limited", "engine"):
        from fate_edge.runtime.engine import Engine
        from fate_edge.runtime.engine_config import EngineConfig

        if spec["mode"] == "engine":  # the SDK's entry point with every setting at its default but the threads
            default = Engine.load(spec["store"], threads=spec["threads"])
            return (r.token for r in default.stream(spec["ids"], cfg))

        engine = Engine(
            EngineConfig(
                spec["store"],
                spec["budget"],
                "fate-edge",
                dtype=rest,
                workers=spec["workers"],
                resident_bits=spec.get("resident_bits"),
            )
        )
        return (r.token for r in engine.stream(spec["ids"], cfg))
    if spec["precision"] in ("int4", "mxfp4"):  # the store's 4-bit experts: int4, or MXFP4 kept as published
        model = load_model(
            spec["store"],
            rest,
            experts=resident_int4(spec["store"]),
            resident_bits=spec.get("resident_bits"),
            compile=spec.get("compile", "off"),
        )
    else:
        model = load_model(
            spec["model"],
            torch.float32 if spec["precision"] == "fp32" else torch.bfloat16,
            compile=spec.get("compile", "off"),
        )
    return (r.token for r in stream_from_model(model, Tokenizer(spec["model"]), spec["ids"], cfg))


def _progress(state: dict[str, Any], **kw) -> None:
    """One ``{"progress": ...}`` line on stdout: how far this run got, for the parent to report if it has to stop
    the run (threads.run_child); wall-clock times, which the parent compares with its own."""
    state.update(kw, read_bytes=read_bytes())
    print(json.dumps({PROGRESS: state}), flush=True)


def _mark_first(stream, marks: list, state: dict[str, Any] | None = None):
    """``stream``'s tokens; the bytes read so far are appended to ``marks`` when the first one arrives, so the
    prefill's reads (at real size the whole model, once) stay out of the decode's reads per token. With ``state``,
    a progress line as the stream starts and as each token arrives."""
    if state is not None:
        _progress(state, tokens=0, start=time.time())
    for i, tok in enumerate(stream):
        if i == 0:
            marks.append(read_bytes())
        if state is not None:
            _progress(state, tokens=i + 1, **({"first": time.time()} if i == 0 else {}))
        yield tok


def child_main(spec_json: str) -> None:
    """One side, one run: load, prefill the ids, decode; print one JSON line (tok/s, peak RSS, bytes read)."""
    from fate_edge.process_memory import peak_rss_bytes

    spec = json.loads(spec_json)
    ids, io0 = spec["ids"], read_bytes()
    extra: dict[str, Any] = {}
    if spec["kind"] == "llama.cpp":
        from fate_edge_lab.bench.llamacpp import llama_stream, open_llama, tokens_agree

        llm = open_llama(
            spec["gguf"],
            len(ids) + spec["decode_tokens"] + 8,
            spec["threads"],
            mmap=spec["mode"] == "limited",
            repack=spec.get("repack", True),
        )
        stream = llama_stream(llm, ids)
    else:
        stream = _fate_edge_stream(spec)
    io1 = read_bytes()
    first: list[int | None] = []
    state = {"prompt_tokens": len(ids), "want": spec["decode_tokens"] + 1}
    t = time_tokens(_mark_first(stream, first, state), len(ids), spec["decode_tokens"] + 1)
    io2 = read_bytes()
    if spec["kind"] == "llama.cpp" and spec.get("text"):
        extra["tokenization"] = tokens_agree(llm, spec["text"], spec["text_ids"])
    if io0 is not None and io1 is not None and io2 is not None and first[0] is not None:  # the kernel reports reads
        n_dec = max(1, len(t["tokens"]) - 1)
        extra.update(
            load_read_mb=(io1 - io0) / 1e6,
            prefill_read_mb=(first[0] - io1) / 1e6,
            decode_read_mb_per_token=(io2 - first[0]) / 1e6 / n_dec,
        )
    print(json.dumps({**t, **extra, "peak_rss_bytes": peak_rss_bytes()}), flush=True)


def summarize(
    runs: dict[str, list[dict[str, Any]]], sides: list[Side], pairs: list[tuple[str, str]] = PAIRS
) -> dict[str, dict[str, Any]]:
    """Medians per side (over the runs that did not fail) and fate-edge / llama.cpp ratios per pair."""
    out: dict[str, dict[str, Any]] = {}
    for side in sides:
        rs = runs.get(side.name, [])
        ok = [r for r in rs if "error" not in r]
        row: dict[str, Any] = {
            "kind": side.kind,
            "experts": side.experts,
            "rest": side.rest,
            "mode": side.mode,
            "runs": len(rs),
            "failed": len(rs) - len(ok),
            "errors": sorted({r["error"] for r in rs if "error" in r}),
        }
        for key in (
            "prefill_tps",
            "prefill_cpu_tps",
            "decode_tps",
            "decode_cpu_tps",
            "peak_rss_bytes",
            "decode_read_mb_per_token",
            "load_avg",
        ):
            vals = [r[key] for r in ok if r.get(key) is not None]
            row[key] = statistics.median(vals) if vals else None
        stopped = [r for r in rs if "timed_out_s" in r]
        if stopped and not ok:
            row["unfinished"] = unfinished(stopped[0])
        out[side.name] = row
    for ours, theirs in pairs:
        a, b = out.get(ours), out.get(theirs)
        if a and b:
            for key in ("prefill_tps", "prefill_cpu_tps", "decode_tps", "decode_cpu_tps"):
                if a[key] and b[key]:
                    a[f"{key}_ratio"] = a[key] / b[key]
            for key in ("prefill_tps", "decode_tps"):  # theirs did not finish: at most this fast
                below = (b.get("unfinished") or {}).get(f"{key}_below")
                if a[key] and below:
                    a[f"{key}_ratio_above"] = a[key] / below
    return out


def unfinished(run: dict[str, Any]) -> dict[str, Any]:
    """What a run stopped at its timeout measured: how long it ran, what it read, how far it got (its last
    progress line), and the rates it stayed below: prefill slower than its prompt over the time it had for it,
    or decode slower than the tokens it began over the time since its first token."""
    p = run.get("progress") or {}
    out: dict[str, Any] = {
        "after_s": run["timed_out_s"],
        "read_gb": None if run.get("read_bytes") is None else run["read_bytes"] / 1e9,
        "tokens": p.get("tokens"),
        "want": p.get("want"),
    }
    if p.get("tokens") == 0 and p.get("start"):
        out["prefill_tps_below"] = p["prompt_tokens"] / (run["stopped_at"] - p["start"])
    elif p.get("tokens") and p.get("first"):
        out["prefill_tps"] = p["prompt_tokens"] / (p["first"] - p["start"])
        # tokens - 1 decoded after the first, the next one unfinished
        out["decode_tps_below"] = p["tokens"] / (run["stopped_at"] - p["first"])
    return out


def same_tokens(runs: dict[str, list[dict[str, Any]]], ours: str, theirs: str) -> int | None:
    """How many leading greedy tokens two sides agree on (first successful run of each)."""
    a = next((r["tokens"] for r in runs.get(ours, []) if "tokens" in r), None)
    b = next((r["tokens"] for r in runs.get(theirs, []) if "tokens" in r), None)
    if a is None or b is None:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_rounds(
    base: dict[str, Any],
    sides: list[Side],
    ggufs: dict[str, str],
    rounds: int,
    timeout: float,
    stores: dict[str, Path],
    log=print,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Interleaved rounds of fresh processes; (runs per side, notes on the memory cap and the page cache).
    The llama.cpp mmap side runs under a cgroup capped at the first measured peak RSS of fate-edge's
    limited side, which therefore runs before it in every round. A side that did not finish within ``timeout``
    is not run again: its row reports the run that was stopped (how long, what it read, how far it got)."""
    import contextlib
    import os

    from fate_edge_lab.bench.host import load_average
    from fate_edge_lab.bench.peers import _memory_cgroup, cgroup_joiner
    from fate_edge_lab.bench.prepare import drop_page_cache
    from fate_edge_lab.bench.threads import run_child

    runs: dict[str, list[dict[str, Any]]] = {}
    notes: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fate-edge-sides-") as specs:  # each run's spec file
        for r in range(rounds):
            for side in sides:
                if any("timed_out_s" in run for run in runs.get(side.name, [])):
                    continue  # another round would take as long again and tell nothing new
                spec = side_spec(base, side, ggufs, stores)
                if r == 0 and side.kind == "llama.cpp":
                    spec.update(text=base["text"], text_ids=base["text_ids"])
                cg = None
                if side.mode == "limited":
                    notes["page_cache"] = drop_page_cache()[1]
                    if side.kind == "llama.cpp":
                        if "cap_bytes" not in notes:
                            runs.setdefault(side.name, []).append({"error": "no fate-edge peak RSS to cap at"})
                            continue
                        cg, notes["cgroup"] = _memory_cgroup(notes["cap_bytes"])
                load = load_average()
                try:
                    res = run_child(child_command(spec, specs), timeout, dict(os.environ), cgroup_joiner(cg))
                finally:
                    if cg is not None:
                        with contextlib.suppress(OSError):
                            cg.rmdir()
                res["load_avg"] = load[0]
                if side.mode == "limited" and side.kind == "fate-edge" and "peak_rss_bytes" in res:
                    notes.setdefault("cap_bytes", res["peak_rss_bytes"])
                runs.setdefault(side.name, []).append(res)
                log(
                    f"round {r + 1} {side.name}: prefill {res.get('prefill_tps') or 0:.0f} tok/s "
                    f"({res.get('prefill_cpu_tps') or 0:.0f} per CPU s), decode "
                    f"{res.get('decode_tps') or 0:.1f} tok/s {res.get('error', '')} (load {load[0]})"
                )
    return runs, notes
