"""Where the tokens of one flattened language batch sit, in the sequences and in the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's run of more than one new token, as the SDPA backend attends over it."""

    tokens: slice  # its rows of the flattened batch
    # [num_blocks] int64, the sequence's KV blocks in order; None when the chunk is the whole
    # context (nothing cached before it), so it attends over its own keys only
    block_ids: torch.Tensor | None
    # [query_len, seq_len] additive mask (``mask_dtype``): query j sees keys
    # 0 ... seq_len - query_len + j; None when block_ids is None
    mask: torch.Tensor | None


@dataclass(frozen=True)
class DecodeBatch:
    """Sequences with exactly one new token, as one padded SDPA batch."""

    token_ids: torch.Tensor  # [num_decodes] int64, their rows of the flattened batch
    # [num_decodes, max_num_blocks] int64, each sequence's KV blocks, padded with block 0
    block_ids: torch.Tensor
    # [num_decodes, 1, 1, max_num_blocks * block_size] additive mask (``mask_dtype``), -inf past each
    # sequence's length
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
    positions: torch.Tensor  # [num_tokens] int64, each new token's position in its sequence
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # [B, max_num_blocks] int64 on the host: the block tables the gather indices are built from
    block_tables_cpu: torch.Tensor
    # The dtype of the additive masks: the queries'. torch's cuDNN attention (the default SDPA
    # kernel on Hopper GPUs) reads a float32 mask beside float16 or bfloat16 queries as if it
    # were in their dtype, silently: its NaNs and shifted -infs made every masked call wrong.
    mask_dtype: torch.dtype = torch.float32

    @classmethod
    def build(
        cls,
        query_lens,
        seq_lens,
        block_tables,
        block_size: int,
        device: torch.device,
        mask_dtype: torch.dtype = torch.float32,
    ) -> AttentionMetadata:
        """``query_lens``, ``seq_lens``: one per sequence; ``block_tables``: [B, max_num_blocks]
        (a 2-d array padded with any block id, or a list of block-id lists); ``mask_dtype``:
        the model's dtype."""
        query_lens = np.asarray(query_lens, dtype=np.int64)
        seq_lens = np.asarray(seq_lens, dtype=np.int64)
        if isinstance(block_tables, np.ndarray):
            table = block_tables.astype(np.int64, copy=False)
            num_blocks = None
        else:
            num_blocks = np.array([len(b) for b in block_tables], dtype=np.int64)
            table = np.zeros((len(block_tables), int(num_blocks.max(initial=0))), dtype=np.int64)
            for b, blocks in enumerate(block_tables):
                table[b, : len(blocks)] = blocks
        if not len(query_lens) == len(seq_lens) == table.shape[0]:
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        if ((query_lens < 0) | (query_lens > seq_lens)).any():
            b = int(np.argmax((query_lens < 0) | (query_lens > seq_lens)))
            raise ValueError(f"sequence {b}: query_len {query_lens[b]} must be in [0, seq_len {seq_lens[b]}]")
        capacity = (num_blocks if num_blocks is not None else table.shape[1]) * block_size
        if (capacity < seq_lens).any():
            b = int(np.argmax(capacity < seq_lens))
            raise ValueError(f"sequence {b}: its blocks of {block_size} cannot hold {seq_lens[b]} tokens")

        # Position of every new token in its sequence, and the sequence it belongs to.
        query_start = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        num_tokens = int(query_start[-1])
        if num_tokens == len(query_lens) and (query_lens == 1).all():  # decodes only
            seq_ids = np.arange(num_tokens)
            positions = seq_lens - 1
        else:
            seq_ids = np.repeat(np.arange(len(query_lens)), query_lens)
            positions = np.arange(num_tokens) - query_start[seq_ids] + (seq_lens - query_lens)[seq_ids]
        slot_mapping = table[seq_ids, positions // block_size] * block_size + positions % block_size
        table_t = torch.from_numpy(table)
        return cls(
            query_start_loc=torch.from_numpy(query_start).to(device=device, dtype=torch.int32),
            seq_lens=torch.from_numpy(seq_lens).to(device=device, dtype=torch.int32),
            block_tables=table_t.to(device=device, dtype=torch.int32),
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            positions=torch.from_numpy(positions).to(device),
            query_lens_cpu=query_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            max_query_len=int(query_lens.max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
            block_size=block_size,
            block_tables_cpu=table_t,
            mask_dtype=mask_dtype,
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
        if self.max_query_len <= 1:  # decodes only
            return []
        chunks, start = [], 0
        for b, (query_len, seq_len) in enumerate(zip(self.query_lens_cpu, self.seq_lens_cpu)):
            if query_len > 1:
                tokens = slice(start, start + query_len)
                if query_len == seq_len:
                    chunks.append(PrefillChunk(tokens, None, None))
                else:
                    block_ids = self.block_tables_cpu[b, : -(-seq_len // self.block_size)].to(self.device)
                    visible = torch.ones(query_len, seq_len, dtype=torch.bool).tril(seq_len - query_len)
                    mask = _additive_mask(visible, self.device, self.mask_dtype)
                    chunks.append(PrefillChunk(tokens, block_ids, mask))
            start += query_len
        return chunks

    @property
    def decode_batch(self) -> DecodeBatch | None:
        """Every decode in one padded batch (None: the batch has none)."""
        groups = self.decode_groups(None)
        return groups[0] if groups else None

    def decode_groups(self, max_tokens: int | None) -> tuple[DecodeBatch, ...]:
        """The decodes in padded batches of at most ``max_tokens`` key slots each (rows times
        the batch's longest context, rounded up to blocks; None: one batch), so that what a
        backend gathers for one stays small. When one batch would exceed it, rows of similar
        lengths go together (less padding); a batch holds at least one row. Built once per
        ``max_tokens`` for every layer."""
        built = self.__dict__.setdefault("_built_decode_groups", {})
        if max_tokens not in built:
            built[max_tokens] = self._decode_groups(max_tokens)
        return built[max_tokens]

    def _decode_groups(self, max_tokens: int | None) -> tuple[DecodeBatch, ...]:
        query_lens = np.asarray(self.query_lens_cpu)
        is_decode = query_lens == 1
        if not is_decode.any():
            return ()
        seq_ids = np.flatnonzero(is_decode)
        token_ids = (np.cumsum(query_lens) - 1)[seq_ids]
        lens = np.asarray(self.seq_lens_cpu)[seq_ids]
        slots = -(-lens // self.block_size) * self.block_size  # each row's padded length
        if max_tokens is None or len(lens) * int(slots.max()) <= max_tokens:
            bounds = [np.arange(len(lens))]
        else:
            order = np.argsort(lens, kind="stable")
            sorted_slots, bounds, start = slots[order], [], 0
            while start < len(order):
                # Sorted ascending: a group's last row is its longest.
                width = np.arange(1, len(order) - start + 1) * sorted_slots[start:]
                end = start + max(1, int(np.searchsorted(width, max_tokens, side="right")))
                bounds.append(order[start:end])
                start = end
        device = self.device
        groups = []
        every_sequence = len(bounds) == 1 and len(seq_ids) == self.num_seqs  # a step of decodes only
        for rows in bounds:
            max_num_blocks = int(slots[rows].max()) // self.block_size
            mask = _length_mask(lens[rows], max_num_blocks * self.block_size, device, self.mask_dtype)
            tables = (self.block_tables_cpu[:, :max_num_blocks] if every_sequence
                      else self.block_tables_cpu[torch.from_numpy(seq_ids[rows]), :max_num_blocks])
            groups.append(DecodeBatch(
                token_ids=torch.from_numpy(token_ids[rows]).to(device),
                block_ids=tables.to(device),
                mask=mask[:, None, None, :],
            ))
        return tuple(groups)


_ZERO, _NEG_INF = torch.tensor(0.0), torch.tensor(float("-inf"))


def _additive_mask(visible: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # SDPA would turn a boolean mask into this one in every layer; every row has a visible key.
    # One pass over the mask (zeros then a masked fill is two, and a third for the negation).
    return torch.where(visible, _ZERO.to(dtype), _NEG_INF.to(dtype)).to(device)


# Per (device, dtype): ``half`` zeros then ``half`` -infs, ``half`` a power of two at least
# the widest decode mask built so far.
_RAMPS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _length_mask(lens: np.ndarray, width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[rows, width] additive mask, 0 over each row's first ``lens[i]`` keys (1 ... width) and
    -inf past them: each row a window of one cached ramp, starting ``lens[i]`` before its
    -infs, so the whole mask is one gather on the device (a comparison and a ``where`` over
    it are two passes and an index tensor; 5-9x slower at 256 rows on a CPU)."""
    ramp = _RAMPS.get((device, dtype))
    if ramp is None or ramp.shape[0] < 2 * width:
        half = 1 << max(width - 1, 0).bit_length()
        ramp = torch.cat([torch.zeros(half, dtype=dtype), torch.full((half,), float("-inf"), dtype=dtype)]).to(device)
        _RAMPS[(device, dtype)] = ramp
    half = ramp.shape[0] // 2
    windows = ramp.unfold(0, width, 1)  # row i: ramp[i : i + width]
    return windows.index_select(0, torch.from_numpy(half - np.asarray(lens, dtype=np.int64)).to(device))
