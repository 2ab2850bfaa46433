"""fate_edge/process_memory.py: what a long trace's recording leaves resident."""

import subprocess
import sys

import pytest

RECORD = """
import sys, psutil, torch
from fate_edge.process_memory import release_freed_memory
trim = sys.argv[1] == "trim"
rss = lambda: psutil.Process().memory_info().rss
start, keep, temporaries = rss(), [], []
for i in range(800):  # a trace's rows: kept in float16, computed through float32 temporaries
    keep.append(torch.randn(1024, 192).half())
    temporaries = (temporaries + [torch.randn(1024, 96)])[-4:]
    if trim and i % 32 == 31:
        release_freed_memory()
joined = torch.cat(keep)
keep.clear()
if trim:
    release_freed_memory()
print(rss() - start, joined.numel() * joined.element_size())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's; elsewhere it does nothing")
def test_trimming_while_recording_keeps_resident_memory_near_what_is_kept():
    grown = {}
    for mode in ("trim", "keep"):
        out = subprocess.run([sys.executable, "-c", RECORD, mode], capture_output=True, text=True, check=True)
        grown[mode], kept = map(int, out.stdout.split())
    assert grown["trim"] < 1.5 * kept  # the joined trace (315 MB) and little else
    assert grown["keep"] > 1.5 * grown["trim"]  # untrimmed, glibc keeps the freed temporaries and chunks
