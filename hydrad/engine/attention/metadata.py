"""Where the tokens of one flattened language batch sit, in the sequences and in the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class AttentionMetadata:
    """One flattened batch of B sequences: prefill chunks and decodes in any order.

    Sequence b contributes ``query_lens_cpu[b]`` consecutive tokens to the batch, the
    tokens at positions ``seq_len - query_len ... seq_len - 1`` of that sequence; its
    context (earlier tokens and the new ones) lives in the KV-cache blocks listed in
    its row of ``block_tables``.
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
        table = torch.tensor(padded, dtype=torch.int32).view(len(block_tables), max_num_blocks)

        # Position of every new token in its sequence, and the sequence it belongs to.
        query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
        seq_ids = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens_t)  # [num_tokens]
        query_start = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        torch.cumsum(query_lens_t, 0, out=query_start[1:])
        positions = torch.arange(int(query_start[-1])) - query_start[seq_ids] + (seq_lens_t - query_lens_t)[seq_ids]
        slot_mapping = table[seq_ids, positions // block_size].long() * block_size + positions % block_size

        return cls(
            query_start_loc=query_start.to(device=device, dtype=torch.int32),
            seq_lens=seq_lens_t.to(device=device, dtype=torch.int32),
            block_tables=table.to(device),
            slot_mapping=slot_mapping.to(device),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            block_size=block_size,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @cached_property
    def seq_start_loc(self) -> torch.Tensor:
        # [B + 1] int32, cumulative context lengths (the varlen kernels' cu_seqlens_k)
        loc = torch.zeros(self.num_seqs + 1, dtype=torch.int32, device=self.seq_lens.device)
        torch.cumsum(self.seq_lens, 0, dtype=torch.int32, out=loc[1:])
        return loc
