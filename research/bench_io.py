"""Read bandwidth of expert blobs through the fetch engine (``fate_edge/fetch/fetch_engine.py``) on this machine.

A temporary file (default 256 MB) is filled with random blobs of 1-4 MB, each starting on a 4096-byte
boundary like an expert store, and read back blob by blob through :class:`FetchEngine` (pooled aligned
buffers, CRC32 of every blob) with 1 and 2 worker threads, as demand reads (one request per blob from the
raw disk, chunked through a link) unless a row says reads ahead (1 MB chunks, the engine's default):

* ``cold buffered``: the page cache is dropped first (``/proc/sys/vm/drop_caches`` when writable, and
  ``posix_fadvise(DONTNEED)`` on the file, which needs no privilege); buffered ``pread``.
* ``O_DIRECT``: bypasses the page cache (falls back to buffered where the filesystem refuses it; the
  engine's ``direct_io_note`` is reported); as demand reads, as reads ahead in the engine's 1 MB chunks, and
  in 256 KB chunks (the engine's chunk before), since without kernel readahead the request size sets the
  bandwidth; and the same in a shuffled order, as a model reads its experts (in file order the disk's own
  readahead can hide the request size).
* ``warm page cache``: buffered reads of a file already in the page cache.
* ``link: <profile>``: warm reads throttled by ``devices.link.ThrottledLink`` to a device profile's
  storage (default: Jetson Orin Nano 8GB, 3.0 GB/s and 80 µs per request, and Raspberry Pi 5, 0.45 GB/s
  and 100 µs); the expected bandwidth is ``bytes / (blobs * latency + bytes / bandwidth)``, and the run
  checks it is delivered within 10%. A link faster than the warm reads of the same worker count cannot
  be emulated here: such rows are marked host-limited.

Every row is the median of ``--runs`` passes over the whole file. The file is deleted at the end.

    python research/bench_io.py --runs 3 --json bench-out/io.json --results
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fate_edge.devices.link import ThrottledLink, storage_link
from fate_edge.devices.profile import load_profile

from fate_edge.fetch.fetch_engine import BufferPool, FetchEngine, Priority
from fate_edge.format.blob import ALIGN, BlobRef
from fate_edge.format.checksum import crc32
from fate_edge_lab.bench.host import cpu_model
from fate_edge_lab.bench.publish import add_results_arg, publish

MB = 1 << 20


def make_blob_file(path: Path, total: int, min_blob: int, max_blob: int, seed: int = 0) -> list[BlobRef]:
    """Write random blobs of ``min_blob..max_blob`` bytes at 4096-aligned offsets until ``total`` bytes."""
    rng = random.Random(seed)
    refs, offset = [], 0
    with open(path, "wb") as f:
        while offset < total:
            length = rng.randint(min_blob, max_blob)
            data = os.urandom(length)
            f.seek(offset)
            f.write(data)
            refs.append(BlobRef(str(path), offset, length, crc32(data), 0, len(refs), 4))
            offset += -(-length // ALIGN) * ALIGN
        f.truncate(offset)  # whole aligned blocks, so the last O_DIRECT read is in bounds
        f.flush()
        os.fsync(f.fileno())
    return refs


def drop_page_cache(path: Path) -> dict:
    """Evict ``path`` from the page cache: globally if permitted, and per file with fadvise."""
    out = {"drop_caches": False, "fadvise": False}
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        out["drop_caches"] = True
    except OSError as exc:
        out["drop_caches_error"] = exc.strerror
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            out["fadvise"] = True
        finally:
            os.close(fd)
    return out


def warm_page_cache(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(16 * MB):
            pass


def read_all(
    refs: list[BlobRef],
    workers: int,
    direct_io: bool,
    link: ThrottledLink | None = None,
    chunk_bytes: int | None = None,
    priority: Priority = Priority.DEMAND,
) -> dict:
    """Read every blob through a fresh FetchEngine, consuming in order; bandwidth of payload bytes.

    At most ``pool.count`` requests are outstanding: with more, a worker that picked the oldest request
    can lose the race for a buffer to workers reading later ones, and the in-order consumer then waits
    forever (a FetchEngine hazard for any caller that submits more requests than buffers).
    """
    pool = BufferPool(2 * workers + 2, max(r.read_length for r in refs))
    kw = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}  # None: the engine's default (1 MB)
    with FetchEngine(pool, workers=workers, link=link, direct_io=direct_io, **kw) as engine:
        t0 = time.perf_counter()
        reqs = [engine.submit(r, priority) for r in refs[: pool.count]]
        for i, req in enumerate(reqs):
            engine.wait(req, timeout=120)
            engine.release(req)
            if i + pool.count < len(refs):
                reqs.append(engine.submit(refs[i + pool.count], priority))
        seconds = time.perf_counter() - t0
        note = engine.direct_io_note
        throttled = sum(r.throttled_s for r in reqs)
    total = sum(r.length for r in refs)
    return {"seconds": seconds, "gb_per_s": total / seconds / 1e9, "io": note, "throttled_s": throttled}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where to put the test file")
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--min-blob-mb", type=float, default=1.0)
    ap.add_argument("--max-blob-mb", type=float, default=4.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--profiles",
        nargs="+",
        default=["jetson-orin-nano-8gb", "raspberry-pi-5-8gb"],
        help="device profiles whose storage link to emulate",
    )
    ap.add_argument("--json", type=Path, default=Path("bench-out/io.json"))
    add_results_arg(
        ap, "rewrite the table between the bench_io markers of FILE (without FILE: docs/results/bench_io.md)"
    )
    args = ap.parse_args()

    links = [(load_profile(name), storage_link(load_profile(name))) for name in args.profiles]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally below removes the file
    fd, name = tempfile.mkstemp(prefix="fate-bench-io-", suffix=".bin", dir=args.dir)
    os.close(fd)
    path = Path(name)
    rows, drops = [], []
    try:
        refs = make_blob_file(path, args.size_mb * MB, int(args.min_blob_mb * MB), int(args.max_blob_mb * MB))
        total = sum(r.length for r in refs)
        demand, ahead = Priority.DEMAND, Priority.AHEAD
        modes = [
            ("cold buffered", False, "cold", None, None, demand),
            ("O_DIRECT", True, "cold", None, None, demand),
            ("O_DIRECT, reads ahead (1 MB chunks)", True, "cold", None, None, ahead),
            ("O_DIRECT, reads ahead in 256 KB chunks", True, "cold", None, 256 * 1024, ahead),
            ("O_DIRECT, shuffled", True, "shuffled", None, None, demand),
            ("O_DIRECT, shuffled, reads ahead in 256 KB chunks", True, "shuffled", None, 256 * 1024, ahead),
            ("warm page cache", False, "warm", None, None, demand),
        ]
        modes += [(f"link: {profile.name}", False, "link", spec, None, demand) for profile, spec in links]
        warm: dict[int, float] = {}
        for label, direct, state, spec, chunk, prio in modes:
            for workers in args.workers:
                runs = []
                for _ in range(args.runs):
                    if state in ("cold", "shuffled"):
                        drops.append(drop_page_cache(path))
                    else:
                        warm_page_cache(path)
                    link = ThrottledLink(spec) if spec is not None else None
                    order = random.Random(len(runs)).sample(refs, len(refs)) if state == "shuffled" else refs
                    runs.append(read_all(order, workers, direct, link, chunk, prio))
                row = {
                    "mode": label,
                    "workers": workers,
                    "gb_per_s": statistics.median(r["gb_per_s"] for r in runs),
                    "runs_gb_per_s": [round(r["gb_per_s"], 3) for r in runs],
                    "io": runs[-1]["io"],
                }
                if state == "warm":
                    warm[workers] = row["gb_per_s"]
                if spec is not None:
                    expected = total / (len(refs) * spec.latency_s + total / spec.bandwidth_bytes_per_s) / 1e9
                    row.update(
                        link_gb_per_s=spec.bandwidth_bytes_per_s / 1e9,
                        latency_us=spec.latency_s * 1e6,
                        expected_gb_per_s=expected,
                        ratio_to_expected=row["gb_per_s"] / expected,
                        host_limited=expected > warm.get(workers, float("inf")),
                    )
                    row["within_10pct"] = abs(row["ratio_to_expected"] - 1) <= 0.10
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        path.unlink(missing_ok=True)

    result = {
        "file_mb": args.size_mb,
        "blobs": len(refs),
        "blob_mb": [args.min_blob_mb, args.max_blob_mb],
        "runs": args.runs,
        "dir": str(args.dir),
        # Whether the engine tells the link when each request began (so emulated transfers overlap real reads).
        "link_overlaps_read": "issued_at" in inspect.getsource(FetchEngine._read),
        "global_drop_caches": all(d["drop_caches"] for d in drops) if drops else None,
        "fadvise_dontneed": all(d["fadvise"] for d in drops) if drops else None,
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "rows": rows,
    }
    publish(result, args.json, render(result), args.results, "bench_io")


def render(result: dict) -> str:
    drop = (
        "`drop_caches` (permitted here) and `posix_fadvise(DONTNEED)`"
        if result["global_drop_caches"]
        else "`posix_fadvise(DONTNEED)` only (`drop_caches` not writable)"
    )
    lines = [
        "GB/s of blob payload through `FetchEngine` (demand reads: one request per blob from the disk, 1 MB chunks "
        "through a link; CRC32 checked), "
        f"{result['blobs']} blobs of "
        f"{result['blob_mb'][0]:g}-{result['blob_mb'][1]:g} MB in a {result['file_mb']} MB file under "
        f"`{result['dir']}`, median of {result['runs']} passes; cold runs evict the page cache with {drop}. "
        f"Load average during the run: {', '.join(f'{v:.1f}' for v in result['load_average'])} on "
        f"{result.get('cpus')} CPUs ({result.get('cpu_model') or 'model unknown'}) "
        "(`research/bench_io.py`)."
        + (
            ""
            if result["link_overlaps_read"]
            else " The engine does not pass `issued_at` to the link yet, so "
            "emulated transfers start after each real chunk read instead of overlapping it."
        ),
        "",
        "| mode | workers | GB/s | I/O path | note |",
        "|---|---:|---:|---|---|",
    ]
    for r in result["rows"]:
        note = ""
        if "expected_gb_per_s" in r:
            note = (
                f"target {r['expected_gb_per_s']:.2f} GB/s ({r['link_gb_per_s']:g} GB/s, {r['latency_us']:g} µs "
                f"per request): {r['ratio_to_expected']:.0%} of it, "
                + ("within 10%" if r["within_10pct"] else "NOT within 10%")
                + (" (host-limited: faster than warm reads here)" if r["host_limited"] else "")
            )
        lines.append(f"| {r['mode']} | {r['workers']} | {r['gb_per_s']:.2f} | {r['io']} | {note} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
