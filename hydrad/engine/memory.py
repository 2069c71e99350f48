"""How much memory an instance's cache pools (the KV cache, the image cache) get.

A size set in ``[cache]`` (``kv_cache_memory_mb``, ``image_cache_memory_mb``, or a block
count) is taken as it is. An unset one is, on a CPU, 512 MB of KV and 256 MB of image cache
(the cores' memory is shared with everything else on the machine, so hydrad takes no share
of it by itself), and on a GPU what the device leaves: an instance may hold
``[cache] gpu_memory_utilization`` of the device's memory in all, counted as vLLM counts
it: what this instance allocated on the device since it started (its weights, then its
pools), not what other processes or instances hold, so that two instances on one GPU can
each take 0.45 of it. After its weights are loaded, it runs the largest steps its scheduler
can build (a prompt of ``token_budget`` tokens beside ``image_budget`` of the largest probe
images, and beside one image as large as the image processor makes any) on small
provisional pools and measures the memory they need; the pools then get

    gpu_memory_utilization * total  -  its own allocations  -  the step's peak  -  reserve

and no more than the device has free, less the step's peak and the reserve (other
processes may hold more than ``1 - gpu_memory_utilization``). The reserve covers what the
measured step does not hold: a decode step's gathered keys and values (at most the SDPA
backend's ``CUDA_GATHER_BYTES``; flash-attn reads the pool in place) and the sampler's rows
(``max_num_seqs`` rows of the vocabulary). The CUDA context (a few hundred MB) is not
counted: the rest of the device covers it. A size set for one pool is kept; an unset image
cache gets an eighth of the budget and an unset KV cache the rest (``split_budget``), shares
taken as if the instance held both pools: the share of a pool its role does not hold stays
free, for a redeploy that gives it that stage.

Plain arithmetic here, and the two calls that read the device (``device_memory``,
``reset_peak``): the engine (``EngineCore``) runs the step, the planner sizes its simulated
pools by ``pool_bytes`` (``role_pool_bytes``). On a GPU: ``tests/cuda/test_cuda_memory.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hydrad.config import CacheConfig
from hydrad.errors import ConfigError
from hydrad.models.attention.sdpa import CUDA_GATHER_BYTES

MB = 1 << 20
GB = 1 << 30
# The image cache's share of the pools' memory on a GPU when neither size is set: it holds
# encoded images until their prefill (and, with prefix caching, after it); the rest is KV.
IMAGE_SHARE = 1 / 8
# Bytes per element of the sampler's [rows, vocabulary] tensors at once (the logits, their
# probabilities, a sorted copy and its int64 indices for top-p / top-k).
_SAMPLER_BYTES_PER_LOGIT = 4 * 4 + 8


@dataclass(frozen=True)
class DeviceMemory:
    """A GPU's memory as an instance reads it (bytes): its total, what is free on it (for
    every process), and this process's memory reserved by torch's allocator, now and at its
    peak since ``reset_peak``."""

    total: int
    free: int
    reserved: int
    peak_reserved: int


def device_memory(device: torch.device) -> DeviceMemory:
    """``device``'s memory now (a CUDA device)."""
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total=total, free=free, reserved=torch.cuda.memory_reserved(device),
                        peak_reserved=torch.cuda.max_memory_reserved(device))


def reset_peak(device: torch.device) -> None:
    """Release the allocator's cached blocks and start the peak count again."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def sized_from_device(cache: CacheConfig, device: torch.device) -> bool:
    """Whether some pool's size comes from the device's memory: a GPU, and a pool whose size
    [cache] leaves unset."""
    unset = ((cache.kv_cache_memory_mb is None and cache.num_kv_blocks is None)
             or (cache.image_cache_memory_mb is None and cache.num_image_blocks is None))
    return device.type == "cuda" and unset


def fixed_pool_mb(cache: CacheConfig, has_kv: bool, has_image_cache: bool) -> tuple[int, int]:
    """MB of the KV and the image pool from [cache] (the CPU defaults where unset); a cache
    the role does not use gives its share to the other."""
    kv, image = cache.cpu_pool_mb()
    return kv + (0 if has_image_cache else image), image + (0 if has_kv else kv)


def step_reserve(max_num_seqs: int, vocab_size: int) -> int:
    """Bytes a step may need beyond the measured largest step (module docstring)."""
    return CUDA_GATHER_BYTES + max_num_seqs * vocab_size * _SAMPLER_BYTES_PER_LOGIT


def own_share(utilization: float, now: DeviceMemory, own: int) -> int:
    """What is left of an instance's ``utilization`` of the device after the ``own`` bytes it
    allocated since it started."""
    return int(utilization * now.total) - own


def pool_budget(utilization: float, now: DeviceMemory, own: int, step_peak: int, reserve: int) -> int:
    """Bytes the pools of an instance get on a device read ``now``, where it allocated
    ``own`` bytes since it started and its largest step needs ``step_peak`` and ``reserve``
    more: its share of ``utilization`` of the device, at most what is free; <= 0 when
    nothing is left."""
    return min(own_share(utilization, now, own), now.free) - step_peak - reserve


def split_budget(cache: CacheConfig, has_kv: bool, has_image_cache: bool, budget: int) -> tuple[int, int]:
    """The KV and image pools' bytes of an instance whose pools may use ``budget`` bytes of
    a GPU (0 for a pool the role does not hold). A size set in [cache] is kept; an unset
    image cache gets ``IMAGE_SHARE`` of the budget (at most what a set KV size leaves), an
    unset KV cache what the image cache leaves. Shares are taken as if the instance held
    both pools: the share of a pool its role does not hold stays free on the device, for a
    redeploy that gives it that stage (``EngineCore.expand``)."""
    budget = max(0, budget)
    kv_set = cache.kv_cache_memory_mb * MB if cache.kv_cache_memory_mb is not None else None
    image_set = cache.image_cache_memory_mb * MB if cache.image_cache_memory_mb is not None else None
    if image_set is not None:
        image = image_set
    else:
        image = min(int(budget * IMAGE_SHARE), max(0, budget - (kv_set or 0)))
    kv = kv_set if kv_set is not None else max(0, budget - image)
    return (kv if has_kv else 0), (image if has_image_cache else 0)


def role_pool_bytes(cache: CacheConfig, role: str, device_pool_bytes: int | None) -> tuple[int, int]:
    """The KV and image pools' bytes of an instance of ``role`` (0: the role holds none), as
    the engine sizes them: from [cache], or from ``device_pool_bytes``, the budget a GPU gave
    an instance's pools (``PoolGeometry.pool_bytes``; the planner's simulator takes one
    instance's budget for every role, where a role with fewer weights would get a little more)."""
    has_kv = "P" in role or "D" in role
    has_image_cache = "E" in role or "P" in role
    if device_pool_bytes is None:
        kv_mb, image_mb = fixed_pool_mb(cache, has_kv, has_image_cache)
        return (kv_mb * MB if has_kv else 0), (image_mb * MB if has_image_cache else 0)
    return split_budget(cache, has_kv, has_image_cache, device_pool_bytes)


def no_room_error(device: torch.device, utilization: float, now: DeviceMemory, own: int, step_peak: int,
                  reserve: int) -> ConfigError:
    """The one line an instance fails its start with when its pools get nothing."""
    return ConfigError(
        f"{device}: no memory left for the cache pools: the instance holds {own / GB:.2f} GiB (its weights), "
        f"its largest step needs {(step_peak + reserve) / GB:.2f} GiB, of the {utilization * now.total / GB:.2f} GiB "
        f"that [cache] gpu_memory_utilization = {utilization:g} allows ({now.free / GB:.2f} GiB free on the "
        f"device): raise it, lower [scheduler] token_budget, or set [cache] kv_cache_memory_mb")
