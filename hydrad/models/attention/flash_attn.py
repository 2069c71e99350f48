"""Paged attention with flash-attn's varlen kernel on CUDA.

One ``flash_attn_varlen_func`` call covers the whole flattened batch: it reads the keys
and values straight from the paged cache through ``block_table`` and aligns the causal
mask bottom-right, so a chunk's queries see the context cached before them. The cache
write is the same slot-mapped copy as in the SDPA backend.

It takes float16 and bfloat16 only; "auto" picks it on CUDA in those dtypes when flash-attn
is installed. The SDPA backend is the tested reference: tests/cuda/test_flash_attn.py compares
the two on a GPU (the README says what of it has run).
"""

from __future__ import annotations

import torch

from hydrad.models.attention import FLASH_ATTN_BLOCK_MULTIPLE, FLASH_ATTN_DTYPES
from hydrad.models.attention.metadata import AttentionMetadata
from hydrad.models.attention.sdpa import write_kv_cache
from hydrad.errors import ConfigError


class FlashAttnBackend:
    name = "flash_attn"
    default_block_size = FLASH_ATTN_BLOCK_MULTIPLE

    def __init__(self, device: torch.device, dtype: torch.dtype | None = None):
        if device.type != "cuda":
            raise ConfigError(f"attention backend 'flash_attn' needs a CUDA device, got {device}; use 'sdpa'")
        if dtype is not None and dtype not in FLASH_ATTN_DTYPES:
            raise ConfigError(
                f"attention backend 'flash_attn' needs model.dtype float16 or bfloat16, got "
                f"{str(dtype).removeprefix('torch.')}; change it or use 'sdpa'"
            )
        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError as e:
            raise ConfigError(
                "attention backend 'flash_attn' needs the flash-attn package (pip install 'hydrad[cuda]'); use 'sdpa'"
            ) from e
        self.device = device
        self._varlen = flash_attn_varlen_func

    def check_block_size(self, block_size: int) -> None:
        if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
            raise ConfigError(
                f"attention backend 'flash_attn' needs cache.kv_block_size to be a multiple of "
                f"{FLASH_ATTN_BLOCK_MULTIPLE}, got {block_size}; change it or use 'sdpa'"
            )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        self.check_block_size(meta.block_size)
        write_kv_cache(k, v, kv_cache_layer, meta.slot_mapping)
        return self._varlen(
            q,
            kv_cache_layer[0],  # [num_blocks, block_size, num_kv_heads, head_dim]
            kv_cache_layer[1],
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=meta.seq_start_loc,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_tables,
        )
