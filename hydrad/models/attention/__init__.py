"""Attention backends behind one interface, imported lazily by name.

A backend's ``forward(q, k, v, kv_cache_layer, meta, scale)`` takes the new tokens'
``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` (views into the fused projection's output: only the
last dimension is contiguous) and one layer's cache
``[2, num_blocks, block_size, Hkv, D]``; it first writes k and v into the cache at
``meta.slot_mapping``, then returns ``[T, Hq, D]``: each sequence's queries attending
causally over its whole paged context (query j of a sequence with query length q and
context length s sees keys 0 ... s - q + j). ``check_block_size(block_size)`` raises
``ConfigError`` when the backend cannot use KV blocks of that size; ``default_block_size`` is
the KV block size an unconfigured cache takes. A backend is built for one device and one
dtype (flash-attn's kernels take float16 and bfloat16 only).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from hydrad.models.attention.metadata import AttentionMetadata
from hydrad.errors import ConfigError

__all__ = ["AttentionMetadata", "backend_name", "get_attn_backend", "BACKENDS", "FLASH_ATTN_BLOCK_MULTIPLE",
           "FLASH_ATTN_DTYPES", "SDPA_BLOCK_SIZE"]

# The SDPA backend's default KV block size (any size works for it).
SDPA_BLOCK_SIZE = 16

# name -> (module, class)
BACKENDS = {
    "sdpa": ("hydrad.models.attention.sdpa", "SdpaBackend"),
    "flash_attn": ("hydrad.models.attention.flash_attn", "FlashAttnBackend"),
}


# The dtypes flash-attn's kernels take, and the multiple of tokens its paged kernels' blocks
# (pages) must hold.
FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)
FLASH_ATTN_BLOCK_MULTIPLE = 256


def backend_name(device: torch.device | str, name: str | None = None, dtype: torch.dtype | None = None,
                 block_size: int | None = None) -> str:
    """The backend ``name`` resolves to for ``device``, ``dtype`` (the model's) and the
    configured KV block size (None: unset). ``None`` or ``"auto"``: flash-attn on CUDA in
    float16 or bfloat16 when it is installed and the block size suits it, else SDPA."""
    if name in (None, "auto"):
        cuda_flash = (torch.device(device).type == "cuda" and dtype in FLASH_ATTN_DTYPES
                      and (block_size is None or block_size % FLASH_ATTN_BLOCK_MULTIPLE == 0)
                      and importlib.util.find_spec("flash_attn") is not None)
        name = "flash_attn" if cuda_flash else "sdpa"
    if name not in BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; choose one of auto, {', '.join(BACKENDS)}")
    return name


def get_attn_backend(device: torch.device | str, name: str | None = None, dtype: torch.dtype | None = None,
                     block_size: int | None = None):
    """The backend ``name`` (``backend_name``) built for ``device`` and ``dtype``."""
    device = torch.device(device)
    module, cls = BACKENDS[backend_name(device, name, dtype, block_size)]
    return getattr(importlib.import_module(module), cls)(device, dtype)
