import subprocess
import sys

import pytest
from _corrupt import flip_byte

from fate_edge.apps.cli import main


def test_run_streams_a_continuation_and_stats(capsys):
    assert main(["run", "--max-tokens", "16", "--ignore-eos", "def "]) == 0
    out, err = capsys.readouterr()
    assert len(out.strip()) > 0
    assert "16 generated" in err and "tok/s" in err and "peak RSS" in err


@pytest.mark.slow
def test_run_reads_prompt_from_stdin():
    proc = subprocess.run(
        [sys.executable, "-m", "fate_edge", "run", "--max-tokens", "8", "--ignore-eos", "--echo"],
        input="import os\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("import os\n") and len(proc.stdout) > len("import os\n")


def test_run_bad_model_dir_is_a_clear_error(tmp_path, capsys):
    assert main(["run", "--model", str(tmp_path), "x"]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "Traceback" not in err


def test_inspect_reports_bytes_and_layers(capsys, bundled_model):
    assert main(["inspect"]) == 0
    out = capsys.readouterr().out
    cfg = bundled_model.config
    assert "qwen2_moe" in out and f"{cfg.num_experts} per MoE layer" in out
    assert "expert bytes" in out and "resident bytes" in out
    assert out.count(" moe ") == len(cfg.moe_layers)


@pytest.mark.slow
def test_inspect_verify_checks_every_blob_and_names_a_corrupted_one(tmp_path, capsys, bundled_dir):
    from fate_edge.format.convert import ConvertOptions, convert
    from fate_edge.format.store import ExpertStore

    store = convert(bundled_dir, tmp_path / "s", ConvertOptions.full(bits=4, keep_bf16=False), progress=False)
    assert main(["inspect", str(store), "--verify"]) == 0
    assert "all intact" in capsys.readouterr().out
    ref = ExpertStore(store).ref(2, 9, 4)
    flip_byte(ref.path, ref.offset + 40, 0x80)
    assert main(["inspect", str(store), "--verify"]) != 0
    err = capsys.readouterr().err
    assert "layer 2 expert 9" in err and "re-run fate-edge convert" in err


@pytest.mark.parametrize("flags, group", [([], 32), (["--cold-group", "64"], 64)])
def test_convert_with_a_cold_copy_picks_the_smallest_group_unless_told(tmp_path, bundled_dir, flags, group):
    """`convert --cold-bits 2` alone once crashed (QuantSpec got group None): the cold copy takes the smallest of
    32/64/128 dividing the expert dimensions (192x128: 32), or the one asked for."""
    from fate_edge.format.store import ExpertStore

    out = tmp_path / "s"
    assert main(["convert", str(bundled_dir), str(out), "--cold-bits", "2", "--no-bf16", "--quiet", *flags]) == 0
    store = ExpertStore(out)
    assert store.precisions[2].spec.group_size == group and store.precisions[4].spec.group_size == 64
