"""A tiny scheduler for model tests: greedy decoding of several sequences through our forward.

Each step batches the running decodes first, then prefill chunks within a token budget (so
chunk ends fall inside image runs), shuffles the batch, and runs it as one flattened forward
over a paged KV cache whose blocks are shuffled, non-contiguous ids of one pool. Every logit
row is kept, so tests compare whole sequences of logits with transformers', not only tokens.
"""

from __future__ import annotations

import random

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from hydrad.models.attention import AttentionMetadata
from hydrad.models.qwen2_vl import mrope_positions_slice


class PagedSequence:
    """One request's state: prompt rows, blocks, positions, outputs."""

    def __init__(
        self,
        embeds: torch.Tensor,
        block_ids: list[int],
        num_new_tokens: int,
        start_step: int = 0,
        mrope: tuple[torch.Tensor | None, int] | None = None,
    ):
        self.embeds = embeds  # prompt rows, then one row per generated token
        self.num_prompt = len(embeds)
        self.block_ids = block_ids
        self.num_new_tokens = num_new_tokens
        self.start_step = start_step
        # M-RoPE: (prompt positions [3, num_prompt] or None, delta); None for 1-D positions.
        self.mrope = mrope
        self.num_computed = 0
        self.prefill_cuts: list[int] = []  # where prefill chunks ended before the prompt's end
        self.new_tokens: list[int] = []
        self.logits: dict[int, torch.Tensor] = {}  # position -> logit row

    @property
    def done(self) -> bool:
        return len(self.new_tokens) == self.num_new_tokens

    def positions(self, start: int, end: int) -> torch.Tensor:
        if self.mrope is None:
            return torch.arange(start, end)
        return mrope_positions_slice(*self.mrope, start, end)


def shuffled_blocks(num_tokens: list[int], block_size: int, rng: random.Random) -> tuple[list[list[int]], int]:
    """Block ids for sequences of ``num_tokens`` tokens, shuffled over one pool; and the pool's size."""
    needed = [-(-n // block_size) for n in num_tokens]
    num_blocks = sum(needed) + 5
    pool = rng.sample(range(num_blocks), sum(needed))
    tables = []
    for n in needed:
        tables.append(pool[:n])
        pool = pool[n:]
    return tables, num_blocks


def run_greedy(model, seqs: list[PagedSequence], kv_cache: torch.Tensor, block_size: int, token_budget: int,
               rng: random.Random, suppressed: tuple[int, ...] = ()) -> int:
    """Run every sequence to its last token, never sampling a ``suppressed`` id (the EOS ids, as
    transformers' ``min_new_tokens`` does); return the number of steps that mixed prefill and decode."""
    step, num_mixed_steps = 0, 0
    while not all(s.done for s in seqs):
        batch, budget = [], token_budget
        for s in seqs:
            if s.num_computed >= s.num_prompt and not s.done:
                batch.append((s, 1))
                budget -= 1
        for s in seqs:
            if step >= s.start_step and s.num_computed < s.num_prompt and budget > 0:
                n = min(budget, s.num_prompt - s.num_computed)
                batch.append((s, n))
                budget -= n
        num_decodes = sum(s.num_computed >= s.num_prompt for s, _ in batch)
        num_mixed_steps += 0 < num_decodes < len(batch)
        rng.shuffle(batch)
        if batch:
            run_step(model, batch, kv_cache, block_size, suppressed)
        step += 1
    return num_mixed_steps


def run_step(model, batch: list[tuple[PagedSequence, int]], kv_cache: torch.Tensor, block_size: int,
             suppressed: tuple[int, ...] = ()) -> None:
    embeds = [s.embeds[s.num_computed : s.num_computed + n] for s, n in batch]
    positions = [s.positions(s.num_computed, s.num_computed + n) for s, n in batch]
    meta = AttentionMetadata.build(
        [n for _, n in batch], [s.num_computed + n for s, n in batch], [s.block_ids for s, _ in batch],
        block_size, torch.device("cpu"),
    )
    # Whole prompts, chunks after cached context and decodes all take torch's fused attention
    # kernel: with only that one allowed, a fallback to the slow math kernel raises.
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        hidden = model(torch.cat(embeds), torch.cat(positions, dim=-1), kv_cache, meta)
    logits = model.compute_logits(hidden)
    row = 0
    for s, n in batch:
        for p in range(s.num_computed, s.num_computed + n):
            s.logits[p] = logits[row]
            row += 1
        s.num_computed += n
        if s.num_computed < s.num_prompt:
            s.prefill_cuts.append(s.num_computed)
        else:
            token = int(logits[row - 1].index_fill(0, torch.tensor(suppressed, dtype=torch.long), -torch.inf).argmax())
            s.new_tokens.append(token)
            if not s.done:
                s.embeds = torch.cat([s.embeds, model.embed_tokens(torch.tensor([token]))])
