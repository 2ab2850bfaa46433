"""The README stays short and leads with its two setup commands; every relative link in it and in docs/ resolves
to a file in the repository, and to a heading of that file when it names one; each generated table lives in its own
docs/results file, between its markers."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # inline links and images, optional title
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
MARKER = re.compile(r"<!-- (\S+):(begin|end) -->")


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (links there are examples, not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link in a heading anchors by its text
    return re.sub(r"[^\w\- ]", "", text.replace("`", "").lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} (.+?)#*$", FENCE.sub("", page.read_text()), re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of ``page`` that names no file in ``root``, or a heading its target does not have."""
    bad = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or not dest.is_relative_to(root):
            bad.append(f"{page.relative_to(root)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{page.relative_to(root)}: {target} (no heading #{anchor} in {dest.relative_to(root)})")
    return bad


def test_the_readme_is_at_most_300_lines():
    assert len(README.read_text().splitlines()) <= 300


def test_the_readme_leads_with_the_demo_and_the_tests():
    first_block = re.search(r"^```bash\n(.*?)^```", README.read_text(), re.M | re.S)
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    assert (ROOT / "scripts" / "demo.sh").exists() and (ROOT / "scripts" / "test.sh").exists()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_docs_have_links_to_check():
    """The pages link to each other: the check above is not passing because it found nothing."""
    readme_links = LINK.findall(prose(README.read_text()))
    assert any(t.startswith("docs/") and "#" in t for t in readme_links), readme_links
    assert sum(len(LINK.findall(prose(p.read_text()))) for p in PAGES) > 100


def test_a_broken_link_or_anchor_is_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Beside llama.cpp (`--x`)\n\n```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md) [ok](other.md#beside-llamacpp---x) [ok](#page) [web](https://x.y/z)\n"
        "[gone](missing.md) [no heading](other.md#not-a-heading) [no heading](#nowhere)\n"
        "![gone](img.png) `[code](not-checked.md)`\n"
    )
    assert broken_links(page, tmp_path) == [
        "page.md: missing.md (no such file)",
        "page.md: other.md#not-a-heading (no heading #not-a-heading in other.md)",
        "page.md: #nowhere (no heading #nowhere in page.md)",
        "page.md: img.png (no such file)",
    ]


def test_headings_anchor_as_github_does():
    assert slug("§6 Cache and policies") == "6-cache-and-policies"
    assert (
        slug("At real scale (Qwen1.5-MoE-A2.7B shapes, 28.6 GB bf16)")
        == "at-real-scale-qwen15-moe-a27b-shapes-286-gb-bf16"
    )
    assert (
        slug("Device-faithful emulation (`fate-edge bench --emulate DEVICE`)")
        == "device-faithful-emulation-fate-edge-bench---emulate-device"
    )
    assert slug("Kernels and I/O on this machine") == "kernels-and-io-on-this-machine"


def test_each_generated_table_has_its_own_results_file():
    """Scripts write docs/results/NAME.md between the NAME markers (bench.publish.results_file); the README holds
    none, so no script rewrites it."""
    from fate_edge_lab.bench.publish import results_file

    assert not MARKER.search(README.read_text())
    files = sorted((ROOT / "docs" / "results").glob("*.md"))
    assert len(files) >= 20
    for f in files:
        found = MARKER.findall(f.read_text())
        assert found == [(f.stem, "begin"), (f.stem, "end")], f"{f.name}: markers {found}"
        assert ROOT / results_file(f.stem) == f
    for page in PAGES:
        if page.parent.name != "results":
            assert not MARKER.search(page.read_text()), f"{page.name} holds generated-table markers"


SCRIPT_PATH = re.compile(r"(?<![\w/.-])(?:scripts|research)/[\w/.-]+\.(?:py|sh)\b")


def missing_scripts(text: str, root: Path = ROOT) -> list[str]:
    """Each ``scripts/...py|sh`` or ``research/...py`` path named in ``text`` (commands in code spans and blocks
    included) that the repository does not have: a command a reader copies must run."""
    return sorted({p for p in SCRIPT_PATH.findall(text) if not (root / p).exists()})


# docs/results tables record the command of the run that made them, with its commit: a record, not a recipe
@pytest.mark.parametrize(
    "page", [p for p in PAGES if p.parent.name != "results"], ids=lambda p: str(p.relative_to(ROOT))
)
def test_every_script_a_page_names_exists(page):
    assert missing_scripts(page.read_text()) == []


def test_a_moved_script_is_reported(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "here.sh").write_text("")
    text = "`bash scripts/here.sh` then `python scripts/gone.py --x` and fate_edge/scripts/not_ours.py"
    assert missing_scripts(text, tmp_path) == ["scripts/gone.py"]
    assert missing_scripts("`python research/moved_away.py`", tmp_path) == ["research/moved_away.py"]
