"""Checks ``hydrad start`` makes before any worker loads, each one clear line instead of a
worker's failure later: the port can be bound; on CPUs, ``/dev/shm`` can hold the cache
pools of a deployment that moves requests (a redeploy checks the same), and the machine's
memory (and the service's cgroup limit) can hold the CPU workers.

Plain Python: nothing here imports torch.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
from pathlib import Path

from hydrad.config import CacheConfig, EngineConfig
from hydrad.dtypes import resolve_dtype_name
from hydrad.errors import HydradError

logger = logging.getLogger("hydrad.supervisor")


SHM = "/dev/shm"
# Room /dev/shm should keep beside the pools: request images travel to the workers there.
SHM_SPARE_MB = 256


def _shared_memory(cache: CacheConfig, devices: list[str], path: str) -> tuple[int, int, str] | None:
    """(MiB free in ``path``, MiB the CPU instances' pools take there, what they are), or None
    when nothing of the pools would live there."""
    num_cpu = devices.count("cpu")
    per_instance = cache.cpu_pools_mb()
    if num_cpu < 2 or per_instance is None or not os.path.isdir(path):
        return None
    st = os.statvfs(path)
    need = num_cpu * per_instance
    return st.f_bavail * st.f_frsize >> 20, need, (
        f"the cache pools of {num_cpu} CPU instance(s) take {need} MiB there ({per_instance} MiB each: "
        f"cache.kv_cache_memory_mb and cache.image_cache_memory_mb)")


_SHM_ADVICE = "give it more room (a container: --shm-size, or --ipc=host) or make the pools smaller"


def shared_memory_error(cache: CacheConfig, devices: list[str], path: str | None = None) -> str | None:
    """One line saying why the CPU instances of ``devices`` cannot move requests between them
    (their pools do not fit in ``path``), or None if they can."""
    path = path or SHM
    found = _shared_memory(cache, devices, path)
    if found is None or found[1] <= found[0]:
        return None
    free, _, what = found
    return f"{path} has {free} MiB free, and {what}: {_SHM_ADVICE}"


def room_for_shared_pools(cache: CacheConfig, devices: list[str], path: str | None = None) -> bool:
    """Whether ``path`` has room for the CPU instances' pools and ``SHM_SPARE_MB`` beside them
    (False where fewer than two CPU instances would share them)."""
    found = _shared_memory(cache, devices, path or SHM)
    return found is not None and found[0] - found[1] >= SHM_SPARE_MB


def check_shared_memory(cache: CacheConfig, devices: list[str], moves_requests: bool,
                        path: str | None = None) -> None:
    """Raise ``HydradError`` when the cache pools of the CPU instances (one per ``devices``
    entry ``cpu``) cannot fit in ``path``'s free space, where they live when requests move
    between instances (``moves_requests``): a container's /dev/shm is 64 MB unless told
    otherwise, and a worker would otherwise fail its start with torch's error. Warn when they
    fit with little room to spare, or when the pools stay private (no request moves) but a
    redeploy to a deployment that moves requests would not fit."""
    path = path or SHM
    found = _shared_memory(cache, devices, path)
    if found is None:
        return
    free, need, what = found
    if not moves_requests:
        if need > free:
            logger.warning("%s has %d MiB free: enough for this deployment, but in a redeploy that moves requests "
                           "between instances %s; %s", path, free, what, _SHM_ADVICE)
        return
    if need > free:
        raise HydradError(shared_memory_error(cache, devices, path))
    if free - need < SHM_SPARE_MB:
        logger.warning("%s has %d MiB free and %s, which leaves %d MiB for the images of requests in flight; %s",
                       path, free, what, free - need, _SHM_ADVICE)


def check_listen(host: str, port: int) -> None:
    """Raise ``HydradError`` when ``host:port`` cannot be bound now (taken, or not an address
    of this host), so that ``hydrad start`` says so before it loads workers; the daemon's own
    bind later still reports a port taken in between."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise HydradError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as e:
                raise HydradError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


# -- memory ---------------------------------------------------------------------------------------
# What a CPU worker holds beyond its weights and pools (torch, the model's code, a step's
# activations), and the daemon's own process: rough, on the safe side of what runs here (the
# `small` LLaVA's workers at their peak, `hydractl status`: 435-645 MiB beyond both).
WORKER_OVERHEAD_MB = 768
DAEMON_MB = 512
_MAX_HEADER = 100 << 20  # the safetensors format's own bound on a header
_FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_STORED_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                 "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def weights_bytes(model_dir: str | os.PathLike, dtype: str) -> int | None:
    """Bytes of a checkpoint's weights once loaded on a CPU in ``dtype`` ("auto": as
    ``hydrad.dtypes`` resolves it there) from its safetensors headers (floating tensors take
    ``dtype``, others their own size); None without safetensors files or where a header
    cannot be read."""
    size = _FLOAT_BYTES.get(resolve_dtype_name(dtype, "cpu", model_dir), 4)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    try:
        for path in files:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > _MAX_HEADER:  # not a safetensors file: no read of that size
                    return None
                header = json.loads(f.read(length))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                numel = 1
                for dim in info["shape"]:
                    numel *= dim
                stored = info["dtype"]
                total += numel * (size if stored.startswith(("F", "BF")) else _STORED_BYTES.get(stored, 4))
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return total


def available_memory_mb(meminfo: str = "/proc/meminfo", cgroup_root: str = "/sys/fs/cgroup",
                        proc_cgroup: str = "/proc/self/cgroup") -> tuple[int, str] | None:
    """MiB this process's workers may still take, and where the bound comes from: the
    machine's available memory, or its cgroup's memory limit less what the group uses
    (``MemoryMax=``, a container's ``--memory``) where that is lower. None where unknown."""
    bounds: list[tuple[int, str]] = []
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    bounds.append((int(line.split()[1]) >> 10, "available on the machine"))
    except (OSError, ValueError):
        pass  # no /proc/meminfo (not Linux): only the cgroup's bound, if any
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            group, limit_file, usage_file = Path(cgroup_root), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            group, limit_file, usage_file = Path(cgroup_root) / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        here = group / path.strip("/")
        if not here.is_dir():  # a container's namespace: its group is the root
            here = group
        try:
            limit = (here / limit_file).read_text().strip()
            usage = int((here / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # v1 writes "no limit" as a huge number
            bounds.append(((int(limit) - usage) >> 20, f"left under the cgroup's memory limit of {int(limit) >> 20} MiB"))
    return min(bounds) if bounds else None


def memory_shortfall(config: EngineConfig, num_cpu: int, model_dir: str | os.PathLike) -> str | None:
    """Why ``num_cpu`` CPU workers (each with its own copy of the weights, its cache pools and
    its runtime) would not fit in the memory left; None when they would, or when the machine
    does not say."""
    if num_cpu == 0:
        return None
    weights = weights_bytes(model_dir, config.model.dtype)
    pools = config.cache.cpu_pools_mb()
    available = available_memory_mb()
    if weights is None or pools is None or available is None:
        return None
    per_worker = (weights >> 20) + pools + WORKER_OVERHEAD_MB
    need = num_cpu * per_worker + DAEMON_MB
    free, where = available
    if need <= free:
        return None
    return (f"the {num_cpu} CPU worker(s) need about {need} MiB (each {per_worker} MiB: {weights >> 20} of weights, "
            f"{pools} of cache pools, {WORKER_OVERHEAD_MB} for the runtime; the daemon {DAEMON_MB}), and {free} MiB "
            f"is {where}")


def check_memory(config: EngineConfig, devices: list[str], model_dir: str | os.PathLike) -> None:
    """Warn when the CPU workers of ``devices`` would not fit in the memory left
    (``memory_shortfall``): the kernel's out-of-memory killer would take them one by one (each
    restart loading them again)."""
    shortfall = memory_shortfall(config, devices.count("cpu"), model_dir)
    if shortfall is not None:
        logger.warning("%s: workers may be killed for memory; start fewer (--devices cpu:N) or make the pools "
                       "smaller", shortfall)
