"""Where the results go: JSON, markdown and plots at explicit paths, and the bench markers of docs/results/bench.md."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fate_edge_lab.bench.config import BenchConfig
from fate_edge_lab.bench.plots import plots
from fate_edge_lab.bench.publish import markers, replace_between_markers
from fate_edge_lab.bench.report import markdown

README_BEGIN, README_END = markers("bench")


def check_readme(readme: Path) -> None:
    content = readme.read_text() if readme.exists() else ""
    if README_BEGIN not in content or README_END not in content:
        raise SystemExit(f"{readme}: no {README_BEGIN} ... {README_END} markers to fill")


def update_readme(readme: Path, text: str) -> None:
    check_readme(readme)
    replace_between_markers(readme, "bench", text)


def output_paths(cfg: BenchConfig) -> tuple[Path, Path, Path]:
    """(JSON, markdown, plot): explicit paths win; the plot goes next to the JSON unless --plots-dir is given."""
    out = Path(cfg.out_dir)
    stem = "bench_quick" if cfg.quick else "bench"
    json_path = Path(cfg.json_path) if cfg.json_path else out / f"{stem}.json"
    md_path = Path(cfg.md_path) if cfg.md_path else out / f"{stem}.md"
    plot_dir = Path(cfg.plots_dir) if cfg.plots_dir else json_path.parent
    plot_path = Path(cfg.plot_path) if cfg.plot_path else plot_dir / f"{stem}.png"
    return json_path, md_path, plot_path


def write_outputs(result: dict, cfg: BenchConfig) -> dict[str, Path]:
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    json_path, md_path, plot_path = output_paths(cfg)
    written = plots(result, plot_path)
    md = markdown(result)
    if written:
        rel = [os.path.relpath(p, Path(cfg.readme).resolve().parent) if cfg.readme else str(p) for p in written]
        md += "\n\n" + "\n".join(
            f"![{'tokens/s vs budget' if i == 0 else 'per-layer hit rate'}]({r})" for i, r in enumerate(rel)
        )
    result["outputs"] = {"json": str(json_path), "markdown": str(md_path), "plots": [str(p) for p in written]}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(md + "\n")
    if cfg.readme:
        update_readme(Path(cfg.readme), md)
    return {"json": json_path, "markdown": md_path, **{f"plot{i}": p for i, p in enumerate(written)}}
