"""A checkpoint with realistic expert sizes but the bundled model's trained routing and outputs.

Each routed expert's intermediate size is raised (default: so one int4 expert is ~2 MB, like
Qwen1.5-MoE-A2.7B's) by appending inert units: their gate/up rows are random (so compute and bytes
are real) and their down-projection columns are zero (so they add exactly nothing). The outputs equal
the source model's; benchmarks on it measure realistic I/O and compute with trained routing.
``research/make_inflated_model.py`` is the command line; the benchmark builds its default model here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fate_edge.errors import FateEdgeError

INT4_BYTES_PER_WEIGHT = 4.5 / 8  # int4 codes + fp16 scale and zero per group of 64


def inflated_size(hidden: int, target_mb: float, multiple: int = 128) -> int:
    """The expert intermediate size (a multiple of ``multiple``) giving ~``target_mb`` MB per int4 expert."""
    weights = target_mb * 1e6 / INT4_BYTES_PER_WEIGHT / 3
    return max(multiple, round(weights / hidden / multiple) * multiple)


def inflate(src: Path, out: Path, intermediate: int, seed: int = 0) -> Path:
    """Write ``src`` with expert intermediate size ``intermediate`` (inert extra units) to ``out``."""
    src, out = Path(src), Path(out)
    cfg = json.loads((src / "config.json").read_text())
    old = cfg["moe_intermediate_size"]
    if intermediate <= old:
        raise FateEdgeError(
            f"target intermediate size {intermediate} must exceed {src}'s current {old}; "
            "ask for a larger size (or a larger --int4-expert-mb)"
        )
    tensors = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    extra = intermediate - old
    for name in list(tensors):
        if ".experts." not in name:
            continue
        t = tensors[name]
        if name.endswith(("gate_proj.weight", "up_proj.weight")):  # [I, H]: new rows, random like trained ones
            new = torch.randn(extra, t.shape[1], generator=gen) * t.float().std()
            tensors[name] = torch.cat([t, new.to(t.dtype)], dim=0).contiguous()
        elif name.endswith("down_proj.weight"):  # [H, I]: new columns are zero, so the new units add nothing
            tensors[name] = torch.cat([t, torch.zeros(t.shape[0], extra, dtype=t.dtype)], dim=1).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg["moe_intermediate_size"] = intermediate
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json", "README.md", "model_card.json") and f.is_file():
            shutil.copy2(f, out / f.name)
    if (src / "predictors").is_dir():  # routers, norms and hidden size are unchanged: the predictors still apply
        shutil.copytree(src / "predictors", out / "predictors", dirs_exist_ok=True)
    (out / "README.md").write_text(
        f"Inflated copy of {src.name}: expert intermediate size {old} -> {intermediate} with inert units "
        "(zero down-projection columns). Same outputs, realistic expert bytes. "
        "Made by fate_edge_lab.synthetic.inflate.\n"
    )
    return out
