"""Paged attention with torch's ``scaled_dot_product_attention``: any device, and the reference in tests.

Decodes (query length 1) run as padded SDPA calls with a key-padding mask, in groups of rows
of similar lengths whose keys and values (at most ``CPU_GATHER_BYTES`` / ``CUDA_GATHER_BYTES``)
are gathered, on a CPU into a buffer kept between steps; each prefill chunk runs as its
own call, over its own keys when nothing is cached before it, else over its context gathered
from the cache. The gather indices and masks come from ``AttentionMetadata`` (built once per
step). Every call passes 4-d tensors: torch's fused CPU kernel takes nothing else and would
fall back to the slow math kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hydrad.models.attention import SDPA_BLOCK_SIZE
from hydrad.models.attention.metadata import AttentionMetadata, PrefillChunk


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # k, v: [num_tokens, num_kv_heads, head_dim]; kv_cache_layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
    slots = kv_cache_layer.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    slots[0].index_copy_(0, slot_mapping, k)
    slots[1].index_copy_(0, slot_mapping, v)


def gather_blocks(kv_cache_layer: torch.Tensor, block_ids: torch.Tensor,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and the values of ``block_ids``, in order: [len(block_ids) * block_size,
    num_kv_heads, head_dim] each. Each is gathered as rows of a 2-d matrix (one block a row):
    torch's row gather copies whole rows in parallel, 1.3-3.6x as fast on a CPU as a gather
    along the second dimension of the 5-d pool. ``out``: a [2, >= the elements of one]
    buffer of the pool's dtype to gather into (the results are views of it)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
    n, row = block_ids.shape[0], block_size * num_kv_heads * head_dim

    def rows(i: int) -> torch.Tensor:
        source = kv_cache_layer[i].view(num_blocks, row)
        if out is None:
            return source.index_select(0, block_ids)
        return torch.index_select(source, 0, block_ids, out=out[i, : n * row].view(n, row))

    return tuple(rows(i).view(-1, num_kv_heads, head_dim) for i in (0, 1))


# The decodes' keys and values are gathered a group of decodes at a time, at most this many
# bytes of keys and values per group. On a CPU into one buffer kept between steps: a fresh
# buffer of tens of MB per layer costs its page faults again at every step (the allocator
# maps such sizes anew), which made a decode step's attention 2-4x as slow per context token
# at 32 x 1024 tokens as at 8 x 1024; groups of 8-16 MB measured fastest (bench/cpu_kernels.py).
# On a GPU into fresh memory (the CUDA allocator reuses freed blocks by itself), in groups
# large enough for few kernel calls and bounded so that cache pools sized from the GPU's
# memory leave room for them (hydrad.engine.memory).
CPU_GATHER_BYTES = 16 << 20
CUDA_GATHER_BYTES = 256 << 20


class SdpaBackend:
    name = "sdpa"
    default_block_size = SDPA_BLOCK_SIZE

    def __init__(self, device: torch.device, dtype: torch.dtype | None = None):
        self.device = device
        # The decode gather's buffer on a CPU (``CPU_GATHER_BYTES``); the CUDA allocator
        # keeps freed blocks for reuse by itself.
        self._gather_buffer: torch.Tensor | None = None

    def check_block_size(self, block_size: int) -> None:
        """Any block size works: blocks are gathered before the kernel sees them."""

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
        if meta.mask_dtype != q.dtype:  # cuDNN would read the masks wrong, without an error
            raise ValueError(f"attention masks built in {meta.mask_dtype} for {q.dtype} queries")
        write_kv_cache(k, v, kv_cache_layer, meta.slot_mapping)
        out = torch.empty_like(q)
        for chunk in meta.prefill_chunks:
            out[chunk.tokens] = self._prefill(q, k, v, kv_cache_layer, chunk, scale)
        self._decode(q, kv_cache_layer, meta, scale, out)
        return out

    @staticmethod
    def _prefill(q, k, v, kv_cache_layer, chunk: PrefillChunk, scale: float) -> torch.Tensor:
        # -> [query_len, num_heads, head_dim]
        t = chunk.tokens
        if chunk.block_ids is None:
            keys, values = k[t], v[t]
        else:
            seq_len = chunk.mask.shape[-1]
            # [seq_len, num_kv_heads, head_dim] each
            keys, values = (blocks[:seq_len] for blocks in gather_blocks(kv_cache_layer, chunk.block_ids))
        o = F.scaled_dot_product_attention(
            q[t].transpose(0, 1)[None],  # [1, num_heads, query_len, head_dim]
            keys.transpose(0, 1)[None],  # [1, num_kv_heads, seq_len, head_dim]
            values.transpose(0, 1)[None],
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)

    def _decode(self, q, kv_cache_layer, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        """Write the decodes' attention (if the batch has any) into their rows of ``out``
        [num_tokens, num_heads, head_dim]."""
        on_cpu = self.device.type == "cpu"
        block = kv_cache_layer[0, 0]  # [block_size, num_kv_heads, head_dim]
        gather_bytes = CPU_GATHER_BYTES if on_cpu else CUDA_GATHER_BYTES
        max_tokens = max(1, gather_bytes // (2 * block[0].numel() * block.element_size()))
        num_kv_heads = kv_cache_layer.shape[3]
        for group in meta.decode_groups(max_tokens):
            num_decodes = group.block_ids.shape[0]
            ids = group.block_ids.flatten()
            buffer = self._gather_buffer_for(ids.shape[0] * block.numel(), block.dtype) if on_cpu else None
            # [num_decodes, num_blocks * block_size, num_kv_heads, head_dim] each: one gather of
            # whole blocks (runs of contiguous memory) for the group's keys, one for the values
            keys, values = (blocks.unflatten(0, (num_decodes, -1))
                            for blocks in gather_blocks(kv_cache_layer, ids, buffer))
            # The query heads that share a KV head attend as the rows of one query over its keys:
            # the kernel then reads each KV head once, not once per query head.
            o = F.scaled_dot_product_attention(
                # [num_decodes, num_kv_heads, num_heads / num_kv_heads, head_dim]
                q.index_select(0, group.token_ids).unflatten(1, (num_kv_heads, -1)),
                keys.transpose(1, 2),  # [num_decodes, num_kv_heads, num_blocks * block_size, head_dim]
                values.transpose(1, 2),
                attn_mask=group.mask,
                scale=scale,
            )
            out.index_copy_(0, group.token_ids, o.flatten(1, 2))

    def _gather_buffer_for(self, elements: int, dtype: torch.dtype) -> torch.Tensor:
        """The kept [2, >= elements] gather buffer (grown for a group of one row longer than
        the groups' size)."""
        buffer = self._gather_buffer
        if buffer is None or buffer.dtype != dtype or buffer.shape[1] < elements:
            buffer = self._gather_buffer = torch.empty(2, elements, dtype=dtype, device=self.device)
        return buffer
