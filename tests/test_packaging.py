"""Packaging: one installed namespace. predictors/, quant/ and devices/ install as fate_edge.*, never top level."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
SIDE_FOLDERS = {"predictors": "fate_edge.predictors", "quant": "fate_edge.quant", "devices": "fate_edge.devices"}


def _config() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_code_package_in_the_tree_is_listed_for_installation():
    cfg = _config()
    listed = set(cfg["packages"])
    roots = {
        "fate_edge": REPO / "fate_edge",
        "fate_edge_lab": REPO / "fate_edge_lab",
        **{ns: REPO / d for d, ns in SIDE_FOLDERS.items()},
    }
    found = set()
    for ns, root in roots.items():
        for folder in (root, *(d for d in root.rglob("*") if d.is_dir())):
            rel = folder.relative_to(root).parts
            # a code package, or a data folder Python could import as a namespace package (setuptools warns at every
            # install about one missing from the list, and its files may not ship)
            if all(part.isidentifier() for part in rel) and "__pycache__" not in rel and any(folder.iterdir()):
                found.add(".".join((ns, *rel)))
    assert found <= listed, f"packages missing from pyproject [tool.setuptools] packages: {sorted(found - listed)}"
    assert {cfg["package-dir"][ns] for ns in SIDE_FOLDERS.values()} == set(SIDE_FOLDERS)


@pytest.mark.slow
def test_installed_namespace_has_no_generic_top_level_packages(tmp_path):
    # Run outside the checkout so the source folders are not on sys.path: only the install is seen.
    code = (
        "import importlib.util, fate_edge.quant, fate_edge.predictors, fate_edge.devices.profile\n"
        "print([n for n in ('quant', 'predictors', 'devices') if importlib.util.find_spec(n) is not None])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_wheel_ships_one_namespace_with_profiles_and_bundled_model(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = wheel.name.split("-py")[0] + ".dist-info"
    assert {n.split("/")[0] for n in names} == {"fate_edge", "fate_edge_lab", dist_info}
    for ns in SIDE_FOLDERS.values():
        assert ns.replace(".", "/") + "/__init__.py" in names
    assert any(n.startswith("fate_edge/devices/profiles/") and n.endswith(".toml") for n in names)
    assert "fate_edge/assets/tiny-moe/model.safetensors" in names
