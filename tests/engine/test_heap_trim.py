"""The C heap's free memory handed back between a worker's steps (``allocator.HeapTrimmer``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hydrad.engine.allocator import HeapTrimmer, resident_bytes

pytestmark = pytest.mark.skipif(not HeapTrimmer().available, reason="not glibc")


def test_it_trims_only_after_steps_and_at_most_every_interval():
    heap = HeapTrimmer(interval=10.0)
    assert heap.due_in(0.0) is None and not heap.maybe(1e9)  # no step ran: nothing to hand back
    heap.stepped()
    start = heap._last
    assert heap.due_in(start + 4.0) == pytest.approx(6.0) and not heap.maybe(start + 4.0)
    assert heap.maybe(start + 10.0) and heap.due_in(start + 10.0) is None
    heap.stepped()
    assert not heap.maybe(start + 15.0) and heap.maybe(start + 20.0)


_FRAGMENTED = """
import ctypes
from hydrad.engine.allocator import HeapTrimmer, resident_bytes
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
# Freeing a block glibc mmapped raises its threshold: later blocks of that size come from its heap,
# as a worker's activations do after its first steps.
big = libc.malloc(8 << 20); libc.memset(big, 1, 8 << 20); libc.free(big)
blocks = [libc.malloc(1 << 20) for _ in range(200)]
for b in blocks:
    libc.memset(b, 1, 1 << 20)
for i, b in enumerate(blocks):
    if i % 10:
        libc.free(b)  # freed between live blocks: the heap cannot shrink from its top
heap = HeapTrimmer(interval=0.0)
heap.stepped()
before = resident_bytes()
assert heap.maybe(1e9)
print(before - resident_bytes(), heap.released)
"""


def test_the_free_memory_between_live_blocks_goes_back():
    out = subprocess.run([sys.executable, "-c", _FRAGMENTED], capture_output=True, text=True, timeout=60, check=True)
    fell, released = map(int, out.stdout.split())
    assert fell > 100 << 20 and released == fell  # 180 MiB were free in the heap


def test_resident_bytes():
    assert resident_bytes() > 10 << 20
