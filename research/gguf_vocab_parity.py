"""fate-edge's GGUF tokenizer against llama.cpp on llama.cpp's own real-vocabulary fixtures.

    python research/gguf_vocab_parity.py [--chars 400000] [--vocab NAME ...] [--results]

For each vocab-only GGUF of llama.cpp's ``models/`` directory whose tokenizer fate-edge rebuilds
(``fate_edge_lab.bench.gguf_vocab.VOCABS``, from the llama-cpp-python sdist), the tokenizer is built from the GGUF's
metadata as ``fate-edge convert`` builds it, then compared:

- with the ``.out`` ids of every ``.inp`` text (no BOS, special-token text as text: the fixtures' settings);
- with llama.cpp itself (llama-cpp-python, ``vocab_only``) on the ``.inp`` texts as fate-edge's runtime encodes
  them (BOS per the GGUF, special tokens matched), on texts holding the vocabulary's special tokens (both ways), and
  on held-out stdlib source cut into pieces of about 2,000 characters at line ends (both ways).

Prints one row per vocabulary and, with --results, writes the table between the ``gguf_vocab_parity`` markers of
docs/results/gguf_vocab_parity.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from fate_edge.corpus import heldout_source
from fate_edge.errors import FateEdgeError
from fate_edge_lab.bench import gguf_vocab as gv
from fate_edge_lab.bench.gguf import llama_cpp_missing
from fate_edge_lab.bench.host import cpu_model, load_average
from fate_edge_lab.bench.publish import add_results_arg, replace_between_markers, results_file
from fate_edge_lab.bench.run import code_commit

NAME = "gguf_vocab_parity"


def measure(name: str, text_chunks: list[str], work: Path) -> dict:
    gguf = gv.vocab_path(name)
    t0 = time.perf_counter()
    row: dict = {"vocab": name, "stands_for": gv.VOCABS[name]}
    try:
        tok = gv.gguf_tokenizer(gguf, work / name)
    except FateEdgeError as exc:
        row["error"] = str(exc).split(": ", 1)[-1].split(";")[0]  # the reason, without the path
        return row
    row["build_s"] = round(time.perf_counter() - t0, 2)
    variant = name in gv.VARIANTS  # its .inp texts are its fixture's; the .out ids are for the unchanged key
    cases = gv.read_cases(gv.vocab_path(gv.VARIANTS[name][0]) if variant else gguf)
    if not variant:
        row["fixture"] = gv.Agreement()
        for text, want in cases:
            row["fixture"].add(text, want, gv.ours(tok, text, "plain"))
    if llama_cpp_missing() is None:
        from llama_cpp import Llama

        llm = Llama(model_path=str(gguf), vocab_only=True, verbose=False)
        probes = {"inp": [t for t, _ in cases], "special": gv.special_texts(tok), "edge": gv.edge_texts()}
        for mode in ("plain", "runtime"):
            for label, texts in (*probes.items(), ("heldout", text_chunks)):
                if label == "inp" and mode == "plain" and not variant:
                    continue  # the .out ids above are llama.cpp's plain ids of these texts
                a = gv.Agreement()
                for text in texts:
                    a.add(text, gv.theirs(llm, text, mode), gv.ours(tok, text, mode))
                row[f"{label}_{mode}"] = a
        del llm
    return row


def ratio(a: gv.Agreement | None, tokens: bool = False) -> str:
    if a is None:
        return "-"
    if tokens:
        return f"{a.tokens_matched:,}/{a.tokens:,}"
    return f"{a.matched}/{a.texts}"


def table(rows: list[dict], chars: int, loads: tuple[list[float], list[float]]) -> str:
    have_llama = any("heldout_plain" in r for r in rows)
    commit = code_commit()
    lines = [
        "Generated: `python research/gguf_vocab_parity.py --results`"
        + (f" at commit {commit}" if commit else "")
        + " rewrites the table between the markers. What it shows: [gguf.md](../gguf.md#measured).",
        "",
        f"llama.cpp's tokenizer fixtures (`models/ggml-vocab-*.gguf` of the {gv.fixtures_dir().name} sdist's "
        "llama.cpp): fate-edge's tokenizer built from each GGUF's metadata against the `.out` ids of every `.inp` text "
        "(no BOS, special-token text read as text, as llama.cpp's test-tokenizer-0 wrote them; for the variant with "
        "a changed key, llama.cpp's own ids of its fixture's texts) and "
        f"against llama.cpp itself (llama-cpp-python `vocab_only`) on {chars:,} characters of held-out stdlib "
        "source in pieces of about 2,000 characters at line ends, plain (the fixtures' settings) and as the runtime "
        "encodes (BOS where the GGUF says, special tokens matched; llama.cpp `add_special`, `parse_special`). "
        "Special texts: up to 12 of the vocabulary's control, unknown-type and user-defined tokens after words, spaces "
        "and newlines and next to each other; edge texts: runs of 1-40 spaces, tabs and newlines, byte- and "
        "control-token text, U+2581, other spaces, control bytes (`fate_edge_lab.bench.gguf_vocab`). "
        "Tokens: llama.cpp's, "
        "counted up to each text's first difference. "
        f"{cpu_model() or 'CPU unknown'}; load average {loads[0]} at the start, {loads[1]} at the end.",
        "",
    ]
    if not have_llama:
        lines += ["(llama-cpp-python not installed: the `.out` fixtures only.)", ""]
    lines += [
        "| vocabulary | stands for | `.out` texts | `.inp` as runtime | special texts plain / runtime "
        "| edge texts plain / runtime | held-out pieces plain / runtime | held-out tokens plain / runtime |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['vocab']} | {r['stands_for']} | not built: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {r['vocab']} | {r['stands_for']} | {ratio(r.get('fixture') or r.get('inp_plain'))} | "
            f"{ratio(r.get('inp_runtime'))} | "
            f"{ratio(r.get('special_plain'))} / {ratio(r.get('special_runtime'))} | "
            f"{ratio(r.get('edge_plain'))} / {ratio(r.get('edge_runtime'))} | "
            f"{ratio(r.get('heldout_plain'))} / {ratio(r.get('heldout_runtime'))} | "
            f"{ratio(r.get('heldout_plain'), True)} / {ratio(r.get('heldout_runtime'), True)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chars", type=int, default=400_000, help="held-out stdlib characters compared per vocabulary")
    ap.add_argument("--vocab", nargs="*", default=list(gv.VOCABS), choices=list(gv.VOCABS), help="vocabularies")
    ap.add_argument("--misses", action="store_true", help="print the first differences of each comparison")
    add_results_arg(ap, f"write the table between the {NAME} markers of FILE (without FILE: {results_file(NAME)})")
    args = ap.parse_args(argv)
    missing = gv.fixtures_missing()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    text, _ = heldout_source(args.chars)
    pieces = gv.chunks(text)
    start = load_average()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name in args.vocab:
            row = measure(name, pieces, Path(work))
            rows.append(row)
            parts = [f"{k} {ratio(v)} ({ratio(v, True)} tokens)" for k, v in row.items() if isinstance(v, gv.Agreement)]
            head = row.get("error") or f"built in {row['build_s']} s"
            print(f"{name:15s} {head}; " + "; ".join(parts), flush=True)
            if args.misses:
                for k, v in row.items():
                    if isinstance(v, gv.Agreement) and v.first_misses:
                        print(f"  {k}: " + json.dumps(v.first_misses, ensure_ascii=False)[:1500])
    out = table(rows, len(text), (start, load_average()))
    print(out)
    if args.results:
        replace_between_markers(results_file(NAME) if args.results is True else args.results, NAME, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
