"""A shared pool's pages are backed on a thread of their own (``hydrad.engine.pages``):
once it has run they are resident; where the kernel cannot populate, the pool is zeroed
before it is used; a pool that cannot be backed at all fails with one clear error."""

from __future__ import annotations

import errno

import pytest
import torch

from hydrad.engine import pages


def shmem_rss() -> int:
    """This process's resident shared memory (bytes)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no RssShmem in /proc/self/status")


NBYTES = 64 << 20


def test_the_pages_are_backed_on_a_thread_without_touching_their_contents():
    if pages.populate(0, 0) in (errno.ENOSYS, errno.EINVAL):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    storage = torch.UntypedStorage._new_shared(NBYTES)
    pool = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (NBYTES,))
    written = torch.arange(0, NBYTES, NBYTES // 16)  # a byte on 16 of its pages, as a step would write
    pool[written] = 7
    before = shmem_rss()
    backing = pages.PoolBacking()
    backing.back(storage, "test pool")
    backing.wait()
    assert backing.pending == 0
    assert shmem_rss() - before > 0.85 * NBYTES  # resident now, nothing written by Python
    assert (pool[written] == 7).all() and int(pool.sum()) == 7 * len(written)  # contents left as they were


def test_without_populate_the_pool_is_zeroed_before_it_is_used(monkeypatch):
    monkeypatch.setattr(pages, "_MADVISE", None)
    storage = torch.UntypedStorage._new_shared(NBYTES)
    before = shmem_rss()
    backing = pages.PoolBacking()
    backing.back(storage, "test pool")
    assert backing.pending == 0 and shmem_rss() - before > 0.9 * NBYTES  # at once, on this thread


def test_a_pool_that_cannot_be_backed_fails_with_one_line(monkeypatch):
    monkeypatch.setattr(pages, "populate", lambda address, nbytes: errno.ENOMEM)
    with pytest.raises(RuntimeError, match=r"cannot back the KV cache pool \(64 MiB\) in shared memory: "):
        pages.PoolBacking().back(torch.UntypedStorage._new_shared(NBYTES), "KV cache pool")
