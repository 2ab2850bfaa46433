"""fate_edge/process_memory.py: handing the heap's freed pages back to the kernel."""

import subprocess
import sys

import pytest

# Freed blocks between live ones (as a trace's kept rows sit between freed temporaries) stay resident: free()
# returns only the heap's top. Blocks of 32 KiB are under glibc's mmap threshold, so they come from the heap.
HOLES = """
import ctypes, psutil
from fate_edge.process_memory import release_freed_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
rss = lambda: psutil.Process().memory_info().rss
blocks = [libc.malloc(32768) for _ in range(8192)]  # 256 MiB
for b in blocks:
    ctypes.memset(b, 1, 32768)
for b in blocks[::2]:
    libc.free(b)  # 128 MiB freed, in holes between live blocks
before = rss()
release_freed_memory()
print(before - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's; elsewhere it does nothing")
@pytest.mark.slow
def test_freed_holes_in_the_heap_go_back_to_the_kernel():
    out = subprocess.run([sys.executable, "-c", HOLES], capture_output=True, text=True, check=True)
    released = int(out.stdout)
    assert released > 80 * 2**20  # most of the 128 MiB of holes (each loses its chunk header page)
