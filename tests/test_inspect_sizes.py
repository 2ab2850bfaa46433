"""One size formatter; inspect counts a store's experts and aligns its tables; demo checks its budget first."""

import pytest

from fate_edge.apps.cli import main
from fate_edge.sizes import format_bytes


@pytest.mark.parametrize(
    "n,text",
    [
        (0, "0 B"),
        (999, "999 B"),
        (14_200, "14.2 KB"),
        (3_500_000, "3.50 MB"),
        (41_472, "41.5 KB"),
        (1_200_000_000, "1.20 GB"),
        (25e9, "25.0 GB"),
    ],
)
def test_format_bytes_picks_the_unit_that_fits(n, text):
    assert format_bytes(n) == text


def test_inspect_store_counts_its_experts_and_aligns_tables(tmp_path, bundled_dir, capsys):
    from fate_edge.format.convert import ConvertOptions, convert
    from fate_edge.format.store import ExpertStore

    store = convert(bundled_dir, tmp_path / "s", ConvertOptions.full(bits=4, cold_bits=2), progress=False)
    assert main(["inspect", str(store)]) == 0
    out = capsys.readouterr().out
    s = ExpertStore(store)
    n = len(s.index["moe_layers"]) * s.index["num_experts"]
    assert f"expert bytes   {format_bytes(n * s.expert_bytes(4))} at int4" in out and "0 B" not in out
    assert main(["inspect"]) == 0
    model = capsys.readouterr().out
    line = [x for x in model.splitlines() if x.startswith("parameters")][0]
    assert line in out  # a store has as many parameters as its model
    for table in (out.split("\n\n")[1], out.split("\n\n")[2]):  # layer table, precision table
        lines = table.splitlines()
        assert len({len(x) for x in lines}) == 1, table  # right-aligned last column: every row as wide


def test_demo_rejects_a_too_small_budget_before_printing(capsys):
    assert main(["demo", "--memory-budget", "10KB"]) == 2
    out, err = capsys.readouterr()
    assert "fate-edge demo:" not in out and "def fibonacci" not in out
    assert "memory budget" in err and len(err.strip().splitlines()) == 1
