"""The C allocator of a process with CPU engines keeps freed memory for the next step."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")


def torch_has_packed_linears() -> bool:
    import torch

    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")

# Three 16 MiB blocks (a step's activations) freed and allocated again, five times: with
# glibc's defaults the freed top of the heap goes back to the kernel (over its trim threshold)
# and every round faults the pages in again; once freed memory is kept, the same pages come back.
_PROBE = r"""
import ctypes, resource, sys
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
if sys.argv[1] == "keep":
    from hydrad.engine.allocator import keep_freed_memory
    assert keep_freed_memory() and keep_freed_memory()
size = 16 << 20

def step():
    blocks = [libc.malloc(size) for _ in range(3)]
    for p in blocks:
        libc.memset(p, 1, size)
    for p in blocks:
        libc.free(p)

step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_freed_blocks_come_back_without_page_faults():
    pages = 3 * (16 << 20) // 4096  # of one round
    assert _page_faults("default") >= 4 * pages  # the check can fail: fresh pages every round
    assert _page_faults("keep") < pages // 10


def test_a_cpu_engine_sets_it(tiny_llava_dir, monkeypatch):
    from hydrad import LLM
    from hydrad.engine import allocator

    calls = []
    monkeypatch.setattr("hydrad.engine.core.keep_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr("hydrad.engine.core.bound_shape_caches", lambda: calls.append(2))
    LLM(str(tiny_llava_dir))
    assert calls == [1, 2]
    assert allocator.keep_freed_memory()  # and in this process it is set (or was already)


# A packed matmul run at 600 row counts: each count builds (and caches) oneDNN objects.
_SHAPES = r"""
import ctypes, sys
import torch
if sys.argv[1] == "bound":
    from hydrad.engine.allocator import bound_shape_caches
    bound_shape_caches()
torch.set_num_threads(1)
libc = ctypes.CDLL(None)
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
weight = torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, 16), 16)
run = lambda rows: torch.ops.mkldnn._linear_pointwise(torch.randn(rows, 16), weight, None, "none", [], "")
for rows in (1, 2, 3):
    run(rows)
libc.malloc_trim(0)
before = resident()
for rows in range(4, 604):
    run(rows)
libc.malloc_trim(0)
print(resident() - before)
"""


@pytest.mark.skipif(not torch_has_packed_linears(), reason="torch without oneDNN's packed linear")
def test_the_matmuls_built_per_shape_stay_within_a_bound():
    from hydrad.engine.allocator import _SHAPE_CACHES

    # An engine built in this process (an earlier test) set the bounds in its environment.
    env = {k: v for k, v in os.environ.items() if k not in _SHAPE_CACHES}

    def growth(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _SHAPES, mode], capture_output=True, text=True, check=True,
                             env=env)
        return int(out.stdout.strip())

    assert growth("default") > 200 << 20  # the check can fail: ~0.5 MiB for each of 600 counts
    assert growth("bound") < 150 << 20  # 256 of them kept
