"""Paged attention with torch's ``scaled_dot_product_attention``: any device, and the reference in tests.

Decodes (query length 1) of the whole batch run as one padded SDPA call with a key-padding
mask; each prefill chunk runs as its own call over its gathered context.
"""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F

from hydrad.engine.attention.metadata import AttentionMetadata


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # k, v: [num_tokens, num_kv_heads, head_dim]; kv_cache_layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
    slots = kv_cache_layer.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    slots[0].index_copy_(0, slot_mapping, k)
    slots[1].index_copy_(0, slot_mapping, v)


class SdpaBackend:
    name = "sdpa"

    def __init__(self, device: torch.device):
        self.device = device

    def check_block_size(self, block_size: int) -> None:
        pass

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
        write_kv_cache(k, v, kv_cache_layer, meta.slot_mapping)
        out = torch.empty_like(q)
        starts = list(accumulate(meta.query_lens_cpu, initial=0))
        decode_ids = []
        for b, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if query_len == 1:
                decode_ids.append(b)
            elif query_len > 1:
                tokens = slice(starts[b], starts[b] + query_len)
                out[tokens] = self._prefill(q[tokens], k[tokens], v[tokens], kv_cache_layer, meta, b, scale)
        if decode_ids:
            self._decode(q, kv_cache_layer, meta, decode_ids, [starts[b] for b in decode_ids], scale, out)
        return out

    @staticmethod
    def _prefill(q, k, v, kv_cache_layer, meta, b, scale) -> torch.Tensor:
        # q: [query_len, num_heads, head_dim]
        query_len, seq_len = q.shape[0], meta.seq_lens_cpu[b]
        if query_len == seq_len:
            # No earlier context: attend over the chunk's own keys, no gather from the cache.
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True
            )
            return o.transpose(0, 1)
        num_blocks = -(-seq_len // meta.block_size)
        blocks = meta.block_tables[b, :num_blocks]
        # [2, seq_len, num_kv_heads, head_dim]
        context = kv_cache_layer[:, blocks].flatten(1, 2)[:, :seq_len]
        # Query j sits at position seq_len - query_len + j and sees keys 0 ... that position.
        mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - query_len)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            context[0].transpose(0, 1),
            context[1].transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        return o.transpose(0, 1)

    @staticmethod
    def _decode(q, kv_cache_layer, meta, seq_ids, token_ids, scale, out) -> None:
        device = q.device
        seq_ids_t = torch.tensor(seq_ids, device=device)
        token_ids_t = torch.tensor(token_ids, device=device)
        max_seq_len = max(meta.seq_lens_cpu[b] for b in seq_ids)
        num_blocks = -(-max_seq_len // meta.block_size)
        blocks = meta.block_tables[seq_ids_t, :num_blocks]  # [num_decodes, num_blocks]
        # [2, num_decodes, max_seq_len, num_kv_heads, head_dim]; rows past a sequence's length are padding
        context = kv_cache_layer[:, blocks].flatten(2, 3)[:, :, :max_seq_len]
        # [num_decodes, 1, 1, max_seq_len]
        mask = torch.arange(max_seq_len, device=device) < meta.seq_lens[seq_ids_t, None]
        o = F.scaled_dot_product_attention(
            q[token_ids_t].unsqueeze(2),  # [num_decodes, num_heads, 1, head_dim]
            context[0].transpose(1, 2),
            context[1].transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        out[token_ids_t] = o.squeeze(2)

