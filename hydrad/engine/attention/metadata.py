"""Where the tokens of one flattened language batch sit, in the sequences and in the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's run of more than one new token, as the SDPA backend attends over it."""

    tokens: slice  # its rows of the flattened batch
    # [num_blocks] int64, the sequence's KV blocks in order; None when the chunk is the whole
    # context (nothing cached before it), so it attends over its own keys only
    block_ids: torch.Tensor | None
    # [query_len, seq_len] additive fp32 mask: query j sees keys 0 ... seq_len - query_len + j;
    # None when block_ids is None
    mask: torch.Tensor | None


@dataclass(frozen=True)
class DecodeBatch:
    """The sequences with exactly one new token, as one padded SDPA batch."""

    token_ids: torch.Tensor  # [num_decodes] int64, their rows of the flattened batch
    # [num_decodes, max_num_blocks] int64, each sequence's KV blocks, padded with block 0
    block_ids: torch.Tensor
    # [num_decodes, 1, 1, max_num_blocks * block_size] additive fp32 mask, -inf past each sequence's length
    mask: torch.Tensor


@dataclass
class AttentionMetadata:
    """One flattened batch of B sequences: prefill chunks and decodes in any order.

    Sequence b contributes ``query_lens_cpu[b]`` consecutive tokens to the batch, the
    tokens at positions ``seq_len - query_len ... seq_len - 1`` of that sequence; its
    context (earlier tokens and the new ones) lives in the KV-cache blocks listed in
    its row of ``block_tables``.

    One instance serves every layer of a forward pass: whatever a backend derives from it
    (the ``cached_property``s) is built by the first layer that asks and reused by the rest.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length after this step (computed + new tokens)
    block_tables: torch.Tensor  # [B, max_num_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, block_id * block_size + offset of each new token
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # [B, max_num_blocks] int64 on the host: the block tables the gather indices are built from
    block_tables_cpu: torch.Tensor

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        if not len(query_lens) == len(seq_lens) == len(block_tables):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        for b, (q, s, blocks) in enumerate(zip(query_lens, seq_lens, block_tables)):
            if not 0 <= q <= s:
                raise ValueError(f"sequence {b}: query_len {q} must be in [0, seq_len {s}]")
            if len(blocks) * block_size < s:
                raise ValueError(f"sequence {b}: {len(blocks)} blocks of {block_size} cannot hold {s} tokens")

        max_num_blocks = max((len(blocks) for blocks in block_tables), default=0)
        # [B, max_num_blocks]
        padded = [blocks + [0] * (max_num_blocks - len(blocks)) for blocks in block_tables]
        table = torch.tensor(padded, dtype=torch.int64).view(len(block_tables), max_num_blocks)

        # Position of every new token in its sequence, and the sequence it belongs to.
        query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
        seq_ids = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens_t)  # [num_tokens]
        query_start = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        torch.cumsum(query_lens_t, 0, out=query_start[1:])
        positions = torch.arange(int(query_start[-1])) - query_start[seq_ids] + (seq_lens_t - query_lens_t)[seq_ids]
        slot_mapping = table[seq_ids, positions // block_size] * block_size + positions % block_size

        return cls(
            query_start_loc=query_start.to(device=device, dtype=torch.int32),
            seq_lens=seq_lens_t.to(device=device, dtype=torch.int32),
            block_tables=table.to(device=device, dtype=torch.int32),
            slot_mapping=slot_mapping.to(device),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            block_size=block_size,
            block_tables_cpu=table,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device

    @cached_property
    def seq_start_loc(self) -> torch.Tensor:
        # [B + 1] int32, cumulative context lengths (the varlen kernels' cu_seqlens_k)
        loc = torch.zeros(self.num_seqs + 1, dtype=torch.int32, device=self.seq_lens.device)
        torch.cumsum(self.seq_lens, 0, dtype=torch.int32, out=loc[1:])
        return loc

    @cached_property
    def prefill_chunks(self) -> list[PrefillChunk]:
        chunks, start = [], 0
        for b, (query_len, seq_len) in enumerate(zip(self.query_lens_cpu, self.seq_lens_cpu)):
            if query_len > 1:
                tokens = slice(start, start + query_len)
                if query_len == seq_len:
                    chunks.append(PrefillChunk(tokens, None, None))
                else:
                    block_ids = self.block_tables_cpu[b, : -(-seq_len // self.block_size)].to(self.device)
                    visible = torch.ones(query_len, seq_len, dtype=torch.bool).tril(seq_len - query_len)
                    chunks.append(PrefillChunk(tokens, block_ids, _additive_mask(visible, self.device)))
            start += query_len
        return chunks

    @cached_property
    def decode_batch(self) -> DecodeBatch | None:
        seq_ids, token_ids, start = [], [], 0
        for b, query_len in enumerate(self.query_lens_cpu):
            if query_len == 1:
                seq_ids.append(b)
                token_ids.append(start)
            start += query_len
        if not seq_ids:
            return None
        lens = torch.tensor([self.seq_lens_cpu[b] for b in seq_ids])
        max_num_blocks = -(-int(lens.max()) // self.block_size)
        # [num_decodes, max_num_blocks * block_size]
        visible = torch.arange(max_num_blocks * self.block_size) < lens[:, None]
        device = self.device
        return DecodeBatch(
            token_ids=torch.tensor(token_ids, device=device),
            block_ids=self.block_tables_cpu[seq_ids, :max_num_blocks].to(device),
            mask=_additive_mask(visible[:, None, None, :], device),
        )


def _additive_mask(visible: torch.Tensor, device: torch.device) -> torch.Tensor:
    # SDPA would turn a boolean mask into this one in every layer; every row has a visible key.
    return torch.zeros(visible.shape).masked_fill_(~visible, float("-inf")).to(device)
