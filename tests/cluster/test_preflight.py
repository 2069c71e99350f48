"""The checks ``hydrad start`` makes before any worker loads (``hydrad.cluster.preflight``):
room in /dev/shm for the CPU pools of a deployment that moves requests, and memory for the
CPU workers. (The port's check is in test_launch.py, with the launch it precedes.)"""

from __future__ import annotations

import json
import logging
import os
import struct

import pytest

from hydrad.cluster import preflight
from hydrad.cluster.preflight import available_memory_mb, check_memory, check_shared_memory, weights_bytes
from hydrad.config import CacheConfig
from hydrad.config_file import load_config
from hydrad.errors import HydradError


def test_cache_pools_that_cannot_fit_in_shared_memory_are_said_before_any_worker_loads(tmp_path, monkeypatch,
                                                                                           caplog):
    """CPU pools live in /dev/shm when requests move between instances (a container's is 64 MB
    unless told otherwise): a start that cannot fit them is one clear error before any worker
    loads; little room left beside them, or a deployment that keeps its pools private but
    could not move requests after a redeploy, is a warning."""
    from types import SimpleNamespace

    free_mb = [100]
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=free_mb[0] * 256, f_frsize=4096))
    shm = str(tmp_path)
    with pytest.raises(HydradError) as refused:
        check_shared_memory(CacheConfig(), ["cpu", "cpu"], True, shm)
    assert str(refused.value).startswith(f"{shm} has 100 MiB free, and the cache pools of 2 CPU instance(s) take "
                                         "1536 MiB there (768 MiB each") and "--shm-size" in str(refused.value)
    assert not caplog.records
    small = CacheConfig(kv_cache_memory_mb=32, image_cache_memory_mb=8)
    check_shared_memory(small, ["cpu", "cpu"], True, shm)  # 80 of 100 MiB: fits, little room left
    assert len(caplog.records) == 1 and "leaves 20 MiB for the images of requests in flight" in caplog.text
    caplog.clear()
    free_mb[0] = 4096
    check_shared_memory(small, ["cpu", "cpu"], True, shm)
    check_shared_memory(CacheConfig(), ["cpu", "cpu"], True, shm)
    assert not caplog.records
    free_mb[0] = 100
    check_shared_memory(CacheConfig(), ["cpu", "cpu"], False, shm)  # private pools: a warning for redeploys
    assert len(caplog.records) == 1 and "in a redeploy that moves requests" in caplog.text
    caplog.clear()
    check_shared_memory(CacheConfig(), ["cpu"], False, shm)  # one instance: none to move requests to
    check_shared_memory(CacheConfig(), ["cuda", "cuda"], True, shm)  # GPU pools: not in /dev/shm
    check_shared_memory(CacheConfig(num_kv_blocks=64), ["cpu", "cpu"], True, shm)  # sized by the model: not said
    check_shared_memory(CacheConfig(), ["cpu", "cpu"], True, str(tmp_path / "none"))  # no such folder here
    assert not caplog.records


def test_pools_are_made_shared_at_start_where_dev_shm_has_room_beside_them(tmp_path, monkeypatch):
    """Where no request moves between the CPU instances, their pools are still made in shared
    memory if /dev/shm has room for them and for the images in flight (``SHM_SPARE_MB``):
    a later redeploy that moves requests then shares them as they are, instead of copying
    them there while the workers step nothing."""
    from types import SimpleNamespace

    from hydrad.cluster.preflight import SHM_SPARE_MB, room_for_shared_pools

    free_mb = [0]
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=free_mb[0] * 256, f_frsize=4096))
    small = CacheConfig(kv_cache_memory_mb=32, image_cache_memory_mb=8)  # 40 MiB an instance
    shm = str(tmp_path)
    free_mb[0] = 80 + SHM_SPARE_MB
    assert room_for_shared_pools(small, ["cpu", "cpu"], shm)
    free_mb[0] -= 1
    assert not room_for_shared_pools(small, ["cpu", "cpu"], shm)
    free_mb[0] = 1 << 20
    assert not room_for_shared_pools(small, ["cpu"], shm)  # one instance: no redeploy moves requests
    assert not room_for_shared_pools(small, ["cuda", "cuda"], shm)  # GPU pools: exported through IPC
    assert not room_for_shared_pools(small, ["cpu", "cpu"], str(tmp_path / "none"))


def _safetensors(path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file's header (what ``weights_bytes`` reads), data left out."""
    header = json.dumps({"__metadata__": {"format": "pt"},
                         **{name: {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]}
                            for name, (dtype, shape) in tensors.items()}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)


def test_weights_are_counted_in_the_dtype_they_load_in(tmp_path, monkeypatch):
    from hydrad import dtypes

    _safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": ("BF16", [1024, 1024]), "ids": ("I64", [8])})
    _safetensors(tmp_path / "model-00002-of-00002.safetensors", {"b": ("F32", [256, 1024])})
    floats = 1024 * 1024 + 256 * 1024
    assert weights_bytes(tmp_path, "auto") == floats * 4 + 64  # float32 on a CPU (no config.json: stored float32)
    assert weights_bytes(tmp_path, "bfloat16") == floats * 2 + 64
    # A checkpoint stored in bfloat16: "auto" loads it in bfloat16 where the CPU has it natively.
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    for native, size in ((True, 2), (False, 4)):
        monkeypatch.setattr(dtypes, "native_bfloat16", lambda native=native: native)
        assert weights_bytes(tmp_path, "auto") == floats * size + 64
    assert weights_bytes(tmp_path / "none", "auto") is None
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\x10")  # cut short
    assert weights_bytes(tmp_path, "auto") is None
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(struct.pack("<Q", 1 << 60))  # not safetensors
    assert weights_bytes(tmp_path, "auto") is None


def test_memory_left_is_the_machines_or_the_cgroups_when_lower(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 16000000 kB\nMemAvailable: 8388608 kB\n")
    root = tmp_path / "cgroup"
    (root / "system.slice" / "hydrad.service").mkdir(parents=True)
    (tmp_path / "proc").write_text("0::/system.slice/hydrad.service\n")
    args = dict(meminfo=str(tmp_path / "meminfo"), cgroup_root=str(root), proc_cgroup=str(tmp_path / "proc"))
    assert available_memory_mb(**args) == (8192, "available on the machine")  # no limit files: the machine's
    group = root / "system.slice" / "hydrad.service"
    (group / "memory.max").write_text("max\n")
    (group / "memory.current").write_text(f"{100 << 20}\n")
    assert available_memory_mb(**args) == (8192, "available on the machine")
    (group / "memory.max").write_text(f"{4 << 30}\n")  # MemoryMax=4G
    assert available_memory_mb(**args) == (4096 - 100, "left under the cgroup's memory limit of 4096 MiB")
    # cgroup v1, a container's view (its group is the memory hierarchy's root).
    (tmp_path / "proc").write_text("4:memory:/docker/abc\n")
    (root / "memory").mkdir()
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{512 << 20}\n")
    assert available_memory_mb(**args) == (1536, "left under the cgroup's memory limit of 2048 MiB")
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert available_memory_mb(**args) == (8192, "available on the machine")


def test_cpu_workers_that_would_not_fit_in_memory_are_warned_of(tmp_path, monkeypatch, caplog):
    """Each CPU worker loads its own copy of the weights: a start whose workers would not fit
    in the memory left says so (the kernel's out-of-memory killer would take them one by one)."""
    _safetensors(tmp_path / "model.safetensors", {"w": ("BF16", [256 << 20])})  # 1 GiB in float32
    engine = load_config(None, {"model.path": str(tmp_path)}).engine
    free = [4096]
    monkeypatch.setattr(preflight, "available_memory_mb", lambda: (free[0], "available on the machine"))
    check_memory(engine, ["cpu", "cpu"], tmp_path)  # 2 x (1024 + 768 + 768) + 512 = 5632 MiB
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
    assert ("the 2 CPU worker(s) need about 5632 MiB (each 2560 MiB: 1024 of weights, 768 of cache pools, 768 for "
            "the runtime; the daemon 512), and 4096 MiB is available on the machine") in caplog.text
    caplog.clear()
    check_memory(engine, ["cpu"], tmp_path)  # one worker: 3072 MiB
    check_memory(engine, ["cuda:0", "cuda:1"], tmp_path)  # weights and pools on the GPUs
    free[0] = 8192
    check_memory(engine, ["cpu", "cpu"], tmp_path)
    assert not caplog.records
