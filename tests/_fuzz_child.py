"""The fuzzer's child process: hypothesis-generated damage to a real GGUF, config.json or safetensors header, each
run through ``fate-edge convert`` under a watchdog. An outcome is a store or one error line; a traceback fails
the property (hypothesis prints the smallest such input), and memory past its limit or an example past its time
ends the process with WATCHDOG on stderr.

Run as ``python _fuzz_child.py KIND SOURCE WORKDIR EXAMPLES SEED [KIND SOURCE WORKDIR EXAMPLES SEED ...]`` by
tests/test_fuzz_inputs.py: the fuzzers one after the other in one process, ``FUZZ START KIND`` printed before each
and ``FUZZ OK KIND`` after each that held.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import struct
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from _gguf_rewrite import parse, rewrite  # noqa: E402

from fate_edge.apps.cli import main  # noqa: E402

MEMORY_LIMIT = 1 << 30  # growth of the resident set within one example
EXAMPLE_SECONDS = 30.0
_started = [time.monotonic()]
_base_rss = [psutil.Process().memory_info().rss]


def _watchdog() -> None:
    proc = psutil.Process()
    while True:
        time.sleep(0.05)
        grown = proc.memory_info().rss - _base_rss[0]
        if grown > MEMORY_LIMIT or time.monotonic() - _started[0] > EXAMPLE_SECONDS:
            print(
                f"WATCHDOG: rss grew {grown >> 20} MB, example ran {time.monotonic() - _started[0]:.1f} s",
                file=sys.stderr,
                flush=True,
            )
            os._exit(3)


def _run_convert(src: Path, work: Path) -> None:
    """One example: convert must give a store (exit 0) or one error line (exit 2), never raise."""
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    err = io.StringIO()
    _base_rss[0], _started[0] = psutil.Process().memory_info().rss, time.monotonic()
    with contextlib.redirect_stderr(err):
        rc = main(["convert", str(src), str(out), "--quiet", "--force"])
    text = err.getvalue().strip()
    if os.environ.get("FATE_EDGE_FUZZ_VERBOSE"):
        print(rc, psutil.Process().memory_info().rss >> 20, "MB", text[:200], flush=True)
    assert rc in (0, 2), (rc, text)
    if rc == 2:
        assert len(text.splitlines()) == 1 and "Traceback" not in text, text
        assert not out.exists()


# values a damaged or hostile header may hold where a count is expected
WILD = st.one_of(
    st.sampled_from([0, 1, -1, 2, 3, 7, 2**31, 2**32 - 1, 2**40, 2**63 - 1, 2**64 - 1]),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.booleans(),
    st.lists(st.integers(min_value=-5, max_value=2**33), max_size=4),
    st.none(),
)


def fuzz_gguf(source: Path, work: Path, examples: int, rng_seed: int) -> None:
    parsed = parse(source)
    keys = sorted(parsed.header.fields)
    names = [t.name for t in parsed.header.tensors]

    @seed(rng_seed)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(
        changes=st.lists(st.tuples(st.sampled_from(keys), WILD), max_size=3),
        dropped=st.lists(st.sampled_from(keys), max_size=2),
        damage=st.lists(
            st.tuples(
                st.sampled_from(names),
                st.sampled_from(["dims", "offset", "qtype", "drop"]),
                st.integers(min_value=0, max_value=2**64 - 1),
            ),
            max_size=2,
        ),
    )
    def prop(changes, dropped, damage):
        fields = dict(parsed.header.fields)
        for k, v in changes:
            fields[k] = v
        for k in dropped:
            fields.pop(k, None)
        fields = {k: v for k, v in fields.items() if v is not None}
        tensors = list(parsed.header.tensors)
        for name, what, n in damage:
            i = next((j for j, t in enumerate(tensors) if t.name == name), None)
            if i is None:
                continue
            t = tensors[i]
            if what == "drop":
                del tensors[i]
            elif what == "dims":
                dims = list(t.dims)
                dims[n % len(dims)] = n >> 8
                tensors[i] = replace(t, dims=tuple(d % (1 << 64) for d in dims))
            elif what == "offset":
                tensors[i] = replace(t, offset=n)
            else:
                tensors[i] = replace(t, qtype=n % (1 << 32))
        _run_convert(rewrite(parsed, work / "f.gguf", fields=fields, tensors=tensors), work)

    prop()


def fuzz_config(source: Path, work: Path, examples: int, rng_seed: int) -> None:
    base = json.loads((source / "config.json").read_text())
    model = work / "model"
    shutil.copytree(source, model, dirs_exist_ok=True)
    keys = sorted(base)

    @seed(rng_seed)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(
        changes=st.lists(st.tuples(st.sampled_from(keys), WILD), max_size=3),
        dropped=st.lists(st.sampled_from(keys), max_size=2),
    )
    def prop(changes, dropped):
        cfg = dict(base)
        for k, v in changes:
            cfg[k] = v
        for k in dropped:
            cfg.pop(k, None)
        (model / "config.json").write_text(json.dumps(cfg))
        _run_convert(model, work)

    prop()


def fuzz_safetensors(source: Path, work: Path, examples: int, rng_seed: int) -> None:
    raw = (source / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    names = sorted(k for k in header if k != "__metadata__")
    model = work / "model"
    shutil.copytree(source, model, dirs_exist_ok=True, ignore=shutil.ignore_patterns("model.safetensors"))

    entry_value = st.one_of(
        WILD,
        st.sampled_from(["F32", "BF16", "Q9", ""]),
        st.lists(st.integers(min_value=-3, max_value=2**41), max_size=3),
    )

    @seed(rng_seed)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(
        damage=st.lists(
            st.tuples(st.sampled_from(names), st.sampled_from(["dtype", "shape", "data_offsets"]), entry_value),
            min_size=1,
            max_size=3,
        ),
        whole=st.sampled_from(["object", "list", "cut"]),
    )
    def prop(damage, whole):
        h = json.loads(json.dumps(header))
        for name, field, value in damage:
            h[name][field] = value
        body = json.dumps(h if whole == "object" else list(h.values())).encode()
        blob = struct.pack("<Q", len(body)) + body + (data if whole != "cut" else data[: len(data) // 2])
        (model / "model.safetensors").write_bytes(blob)
        _run_convert(model, work)

    prop()


if __name__ == "__main__":
    args = sys.argv[1:]
    assert args and len(args) % 5 == 0, "KIND SOURCE WORKDIR EXAMPLES SEED, once or more"
    threading.Thread(target=_watchdog, daemon=True).start()
    for i in range(0, len(args), 5):
        kind, source, work, examples, rng_seed = args[i : i + 5]
        print(f"FUZZ START {kind}", flush=True)
        {"gguf": fuzz_gguf, "config": fuzz_config, "safetensors": fuzz_safetensors}[kind](
            Path(source), Path(work), int(examples), int(rng_seed)
        )
        print(f"FUZZ OK {kind}", flush=True)
