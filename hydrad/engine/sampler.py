"""Token sampling for a whole step at once, on the device that holds the logits.

One pass over the step's rows, as batched tensor operations (no Python loop over
rows, no copy to the host per row):

1. logit bias, then repetition / presence / frequency penalties over per-request token
   counts kept on the device (``PenaltyCache``), then the ``min_tokens`` mask of EOS
   and the stop token ids, then, for requests with structured outputs, the tokens their
   grammar does not allow (``grammar_mask``);
2. greedy rows: argmax (only over the greedy rows; a step without one skips it);
3. sampled rows: temperature, then transformers' warper order top-k, top-p, min-p,
   then one draw per row by inverse CDF (one uniform per row: from the instance's
   generator, or from the request's own generator when it has a seed, so a seeded
   request's tokens do not depend on what shares its batch; that generator is a CPU
   one on every device, so its state moves with the request between any instances;
   a top-p row that draws again takes more uniforms, a seeded one from its seed apart,
   ``Sampler._redraws``).

With top-k the candidates are the k largest, kept sorted by logit, so top-p and min-p
cut a prefix of them and one cumulative sum serves the filters and the draw. Without
top-k the draw runs over the whole vocabulary in its own order (two-level inverse CDF,
``_draw_unsorted``): min-p is a threshold on the weights, and top-p rejects a token drawn
whose heavier tokens already hold its share of the mass, then draws again above it
(``_draw_nucleus``); a row still drawing after a few rounds takes top-p's cut, the
smallest weight it keeps (``top_p_cut``: among the few largest, or a sort of the row's
values, without ids).
Log-probabilities come from the raw logits (the model's distribution before any
processing), as vLLM's default.
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from hydrad.engine.inputs import TokenLogprobs
from hydrad.sampling_params import GREEDY_BELOW

# The largest scratch buffer the sampler keeps between steps (larger ones are not kept).
MAX_SCRATCH_BYTES = 256 << 20


@dataclass
class SamplingMetadata:
    """The sampled rows' settings, one entry per row of the logits (numpy, host side)."""

    temperature: np.ndarray  # float32
    top_k: np.ndarray  # int64, <= 0: off
    top_p: np.ndarray  # float32
    min_p: np.ndarray  # float32
    repetition_penalty: np.ndarray  # float32
    presence_penalty: np.ndarray  # float32
    frequency_penalty: np.ndarray  # float32
    penalty_slots: np.ndarray  # int64, -1: no penalty state
    num_logprobs: np.ndarray  # int64, -1: none asked
    # (row, generator) for rows of seeded requests.
    generators: list[tuple[int, torch.Generator]]
    # (rows, token ids, values) of every logit_bias entry, flattened; None: no bias.
    bias: tuple[list[int], list[int], list[float]] | None = None
    # (rows, token ids) to mask until min_tokens is reached; None: none.
    min_tokens_mask: tuple[list[int], list[int]] | None = None
    # (row, llguidance matcher) of rows with structured outputs; None: none.
    matchers: list[tuple[int, object]] | None = None

    @classmethod
    def greedy(cls, num_rows: int) -> SamplingMetadata:
        """Plain greedy rows (no processors, no logprobs)."""
        def zeros():
            return np.zeros(num_rows, dtype=np.float32)

        return cls(temperature=zeros(), top_k=np.zeros(num_rows, dtype=np.int64), top_p=zeros() + 1, min_p=zeros(),
                   repetition_penalty=zeros() + 1, presence_penalty=zeros(), frequency_penalty=zeros(),
                   penalty_slots=np.full(num_rows, -1, dtype=np.int64),
                   num_logprobs=np.full(num_rows, -1, dtype=np.int64), generators=[])


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # One entry per row when any row asked for logprobs (None for rows that did not).
    logprobs: list[TokenLogprobs | None] | None = None


class PenaltyCache:
    """Per-request penalty state on the device, sparse over the vocabulary.

    A slot lists the distinct tokens its request has seen (prompt and output), each with
    how often it was generated; it is filled once when the request starts running here
    and updated after every step (``add_tokens``), never rebuilt from the token lists.
    Penalizing a step gathers and scatters only those tokens' logits: a request sees a
    few hundred or thousand distinct tokens, far fewer than a vocabulary holds.
    """

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.ids = torch.zeros((0, 0), dtype=torch.long, device=device)  # [slots, width]
        self.counts = torch.zeros((0, 0), dtype=torch.int32, device=device)  # [slots, width]
        # Per slot: token id -> its column (the number of columns in use is its length).
        self.columns: list[dict[int, int]] = []
        self._free: list[int] = []

    def allocate(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> int:
        if not self._free:
            self._grow(slots=max(8, 2 * len(self.columns)))
        slot = self._free.pop()
        counts: dict[int, int] = dict.fromkeys(prompt_token_ids, 0)
        for token_id in output_token_ids:
            counts[token_id] = counts.get(token_id, 0) + 1
        self._grow(width=len(counts))
        self.columns[slot] = {token_id: col for col, token_id in enumerate(counts)}
        self.counts[slot].zero_()
        if counts:
            self.ids[slot, : len(counts)] = torch.tensor(list(counts), device=self.device)
            self.counts[slot, : len(counts)] = torch.tensor(list(counts.values()), device=self.device)
        return slot

    def free(self, slot: int) -> None:
        self.columns[slot] = {}
        self._free.append(slot)

    def add_tokens(self, slots: list[int], token_ids: list[int]) -> None:
        """Count one generated token per listed slot."""
        new_slots, new_cols, new_ids, cols = [], [], [], []
        for slot, token_id in zip(slots, token_ids):
            columns = self.columns[slot]
            col = columns.get(token_id)
            if col is None:
                col = columns[token_id] = len(columns)
                new_slots.append(slot)
                new_cols.append(col)
                new_ids.append(token_id)
            cols.append(col)
        if new_slots:
            self._grow(width=max(new_cols) + 1)
            self.ids[torch.tensor(new_slots), torch.tensor(new_cols)] = torch.tensor(new_ids, device=self.device)
        index = (torch.tensor(slots, device=self.device), torch.tensor(cols, device=self.device))
        self.counts.index_put_(index, torch.ones(len(slots), dtype=torch.int32, device=self.device), accumulate=True)

    def penalize(self, logits: torch.Tensor, rows: torch.Tensor, slots: list[int], repetition: torch.Tensor,
                 presence: torch.Tensor, frequency: torch.Tensor) -> None:
        """Apply the penalties to ``logits[rows]`` in place; ``slots`` and the penalties are one
        per row: transformers' RepetitionPenaltyLogitsProcessor over every seen token, then
        OpenAI's ``logit -= count * frequency + (count > 0) * presence`` over generated ones."""
        num_seen = np.fromiter((len(self.columns[s]) for s in slots), dtype=np.int64, count=len(slots))
        if not num_seen.all():  # a slot that has seen nothing (no prompt) has nothing to penalize
            keep = np.flatnonzero(num_seen)
            rows, repetition, presence, frequency = (t[_index(keep, self.device)]
                                                     for t in (rows, repetition, presence, frequency))
            slots, num_seen = [slots[i] for i in keep], num_seen[keep]
        if not len(slots):
            return
        width = int(num_seen.max())
        slots_t = _index(slots, self.device)
        # Dense [rows, width] tables: a row's columns past its tokens repeat its first column,
        # so they compute and write back that token's value again (the same value: harmless),
        # where boolean indexing would cost a pass and a copy per table (~10x slower here).
        past = torch.arange(width, device=self.device)[None, :] >= torch.from_numpy(num_seen).to(self.device)[:, None]
        ids = self.ids[slots_t, :width]
        ids = torch.where(past, ids[:, :1], ids)
        counts = self.counts[slots_t, :width]
        counts = torch.where(past, counts[:, :1], counts).to(logits.dtype)
        flat = logits.view(-1)
        index = (rows[:, None] * logits.shape[-1] + ids).view(-1)
        values = flat.index_select(0, index).view(len(slots), width)
        rep = repetition[:, None]
        values = torch.where(values < 0, values * rep, values / rep)
        values = values - counts * frequency[:, None] - (counts > 0).to(logits.dtype) * presence[:, None]
        flat.index_put_((index,), values.view(-1))

    def _grow(self, slots: int = 0, width: int = 0) -> None:
        old_slots, old_width = self.ids.shape
        new_slots, new_width = max(slots, old_slots), old_width
        while new_width < width:
            new_width = max(64, 2 * new_width)
        if (new_slots, new_width) == (old_slots, old_width):
            return
        ids = torch.zeros((new_slots, new_width), dtype=torch.long, device=self.device)
        counts = torch.zeros((new_slots, new_width), dtype=torch.int32, device=self.device)
        ids[:old_slots, :old_width] = self.ids
        counts[:old_slots, :old_width] = self.counts
        self.ids, self.counts = ids, counts
        self.columns += [{} for _ in range(new_slots - old_slots)]
        self._free.extend(range(new_slots - 1, old_slots - 1, -1))


def sorted_keep_counts(sorted_logits: torch.Tensor, top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For candidates sorted by logit (descending, -inf past a row's end): how many of
    each row's first candidates survive top-p then min-p (at least one), the weights
    ``exp(logit - max)`` and their running sum. ``top_p`` / ``min_p`` None: off for every
    row (the caller knows it from the settings, without a pass over them)."""
    weights = torch.exp(sorted_logits - sorted_logits[:, :1])
    cum = torch.cumsum(weights, dim=-1)
    total = cum[:, -1]
    keep = torch.full_like(total, sorted_logits.shape[-1], dtype=torch.int64)
    if top_p is not None and (top_p < 1.0).any():
        # A token goes once the mass strictly before it reaches top_p (transformers' TopP): the
        # first stays, then one more per running sum (up to the token before) below the threshold.
        below = torch.searchsorted(cum, (top_p * total)[:, None])[:, 0]  # running sums < threshold
        keep = (below + 1).clamp_(max=sorted_logits.shape[-1])
    if min_p is not None and (min_p > 0.0).any():
        # transformers' MinP: probability below min_p times the most likely token's.
        keep = torch.minimum(keep, (weights >= min_p[:, None]).sum(-1))
    return keep.clamp_(min=1), weights, cum


def _draw_sorted(sorted_logits: torch.Tensor, sorted_ids: torch.Tensor, top_p: torch.Tensor | None,
                 min_p: torch.Tensor | None, uniform: torch.Tensor) -> torch.Tensor:
    keep, _, cum = sorted_keep_counts(sorted_logits, top_p, min_p)
    target = uniform * cum.gather(1, (keep - 1)[:, None])[:, 0]
    pos = torch.searchsorted(cum, target[:, None], right=True)[:, 0]
    pos = torch.minimum(pos, keep - 1)
    return sorted_ids.gather(1, pos[:, None])[:, 0]


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        # Uniforms of rows without a seed; seeds of requests that bring one are theirs.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # The penalty state of the requests this sampler serves (owned by the runner's batch),
        # and the masks of structured outputs (``grammar_mask.GrammarMasks``).
        self.penalties: PenaltyCache | None = None
        self.grammars = None
        # Scratch for the full-vocabulary draw and the top-p cut, kept between steps: a fresh
        # buffer of this size every step costs its page faults again (as much as the
        # arithmetic on a CPU).
        self._scratch: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def scratch(self, rows: int, width: int, name: str = "draw", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A [rows, width] buffer of one use (``name``), reused while it is at most ``MAX_SCRATCH_BYTES``."""
        size = rows * width
        if size * dtype.itemsize > MAX_SCRATCH_BYTES:
            return torch.empty(rows, width, dtype=dtype, device=self.device)
        buffer = self._scratch.get((name, dtype))
        if buffer is None or buffer.numel() < size:
            buffer = self._scratch[(name, dtype)] = torch.empty(size, dtype=dtype, device=self.device)
        return buffer[:size].view(rows, width)

    @staticmethod
    def generator_for(seed: int, num_drawn: int = 0) -> torch.Generator:
        """A seeded request's own generator: on the CPU whatever the device, so its state moves
        with the request between instances on any devices (a CUDA generator's state cannot be
        set on a CPU one, nor the reverse) and a seed draws the same numbers on each.
        ``num_drawn``: uniforms already drawn from it (one per sampled token, ``_uniforms``) by
        an instance that is gone: the generator goes on after them."""
        generator = torch.Generator().manual_seed(seed)
        if num_drawn:
            torch.rand(num_drawn, generator=generator)  # the same state as num_drawn draws of one
        return generator

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # logits: [num_rows, vocab] float32, one row per request that samples this step
        num_rows = logits.shape[0]
        greedy = meta.temperature < GREEDY_BELOW
        wants_logprobs = meta.num_logprobs >= 0
        logprob_rows = np.flatnonzero(wants_logprobs) if wants_logprobs.any() else None
        raw_logprobs = None
        if logprob_rows is not None:
            raw_logprobs = torch.log_softmax(logits[_index(logprob_rows, logits.device)].float(), dim=-1)
        raw = logits
        logits = self._process(logits, meta)
        if meta.matchers:
            logits = self.grammars.apply(logits, raw, meta.matchers)

        if greedy.all():
            tokens = argmax_rows(logits)
        else:
            tokens = torch.empty(num_rows, dtype=torch.long, device=logits.device)
            if greedy.any():
                rows = _index(np.flatnonzero(greedy), logits.device)
                tokens[rows] = argmax_rows(logits[rows])
            sampled = np.flatnonzero(~greedy)
            if len(sampled) == num_rows:  # no row to leave out: no copy of the logits
                tokens = self._draw(logits, meta, sampled)
            else:
                rows = _index(sampled, logits.device)
                tokens[rows] = self._draw(logits[rows], meta, sampled)
        token_ids = tokens.tolist()
        out = SamplerOutput(token_ids)
        if raw_logprobs is not None:
            out.logprobs = rows_logprobs(raw_logprobs, logprob_rows, meta.num_logprobs, tokens, num_rows)
        return out

    def _process(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Logit bias, penalties and the min_tokens mask (a new tensor only when needed)."""
        if meta.bias is None and meta.min_tokens_mask is None and not (meta.penalty_slots >= 0).any():
            return logits
        logits = logits.float().clone()
        device = logits.device
        if meta.bias is not None:
            rows, ids, values = meta.bias
            logits.index_put_((_index(rows, device), _index(ids, device)),
                              torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)
        if (meta.penalty_slots >= 0).any():
            self._apply_penalties(logits, meta)
        if meta.min_tokens_mask is not None:
            rows, ids = meta.min_tokens_mask
            logits[_index(rows, device), _index(ids, device)] = float("-inf")
        return logits

    def _apply_penalties(self, logits: torch.Tensor, meta: SamplingMetadata) -> None:
        rows_np = np.flatnonzero(meta.penalty_slots >= 0)
        f32 = lambda a: torch.from_numpy(a[rows_np]).to(logits.device)  # noqa: E731
        self.penalties.penalize(logits, _index(rows_np, logits.device), meta.penalty_slots[rows_np].tolist(),
                                f32(meta.repetition_penalty), f32(meta.presence_penalty),
                                f32(meta.frequency_penalty))

    def _uniforms(self, rows: np.ndarray, meta: SamplingMetadata, device: torch.device) -> torch.Tensor:
        """One uniform per sampled row: the request's own generator for seeded rows."""
        uniform = torch.rand(len(rows), generator=self.generator, device=device)
        if meta.generators:
            position = {int(r): i for i, r in enumerate(rows)}
            seeded = [(i, generator) for row, generator in meta.generators if (i := position.get(row)) is not None]
            if seeded:  # drawn on the CPU (``generator_for``), copied over in one go
                draws = torch.cat([torch.rand(1, generator=generator) for _, generator in seeded])
                uniform[_index(np.array([i for i, _ in seeded]), device)] = draws.to(device)
        return uniform

    def _redraws(self, rows: np.ndarray, uniform: torch.Tensor, meta: SamplingMetadata):
        """``redraw(positions, round)`` for a draw over ``rows`` (meta rows) that drew ``uniform``
        first: more uniforms for the rows at those positions. A seeded request's come from a
        generator of its own seed, its first uniform and the round, not from its generator,
        which draws one uniform per token (``generator_for`` replays that count after a
        migration): the same request draws the same tokens in any batch, on any instance."""
        seeds = {row: generator.initial_seed() for row, generator in meta.generators}

        def redraw(positions: torch.Tensor, round: int) -> torch.Tensor:
            more = torch.rand(len(positions), generator=self.generator, device=uniform.device)
            if seeds:
                at = positions.tolist()
                seeded = [(i, seeds[row]) for i, row in enumerate(rows[at].tolist()) if row in seeds]
                if seeded:
                    firsts = uniform[[at[i] for i, _ in seeded]].cpu().numpy().view(np.uint32).tolist()
                    draws = [torch.rand(1, generator=torch.Generator().manual_seed(_mix(seed, first, round)))
                             for (_, seed), first in zip(seeded, firsts)]
                    more[_index([i for i, _ in seeded], more.device)] = torch.cat(draws).to(more.device)
            return more

        return redraw

    def _draw(self, logits: torch.Tensor, meta: SamplingMetadata, rows: np.ndarray) -> torch.Tensor:
        # logits: [num_sampled, vocab], the sampled rows only
        device = logits.device
        vocab = logits.shape[-1]
        uniform = self._uniforms(rows, meta, device)
        temperature, top_k, top_p, min_p = meta.temperature[rows], meta.top_k[rows], meta.top_p[rows], meta.min_p[rows]
        with_k = (top_k > 0) & (top_k < vocab)
        with_p = ~with_k & (top_p < 1.0)
        plain = ~with_k & ~with_p
        t = lambda a, m: torch.from_numpy(a[m]).to(device)  # noqa: E731
        # Settings off for every row of a kind need no tensor (nor a pass over one).
        t_on = lambda a, m, off: t(a, m) if (a[m] != off).any() else None  # noqa: E731

        def draw_top_k(x: torch.Tensor, u: torch.Tensor, m: np.ndarray) -> torch.Tensor:
            # A positive temperature keeps the order: take the top k, then scale only those.
            max_k = int(top_k[m].max())
            values, ids = topk_rows(x, max_k)
            if (temperature[m] != 1.0).any():
                values = values / t(temperature, m)[:, None]
            if (top_k[m] != max_k).any():  # rows of a smaller k: their candidates past it go
                past_k = torch.arange(max_k, device=device)[None, :] >= t(top_k, m)[:, None]
                values = values.masked_fill(past_k, float("-inf"))
            return _draw_sorted(values, ids, t_on(top_p, m, 1.0), t_on(min_p, m, 0.0), u)

        def draw_unsorted(x: torch.Tensor, u: torch.Tensor, m: np.ndarray) -> torch.Tensor:
            p = t_on(top_p, m, 1.0)
            return _draw_unsorted(x, t_on(min_p, m, 0.0), u, t_on(temperature, m, 1.0),
                                  self.scratch(x.shape[0], vocab + -vocab % _BLOCK), p, self.scratch,
                                  None if p is None else self._redraws(rows[m], u, meta))

        tokens = None
        # Rows with top-p and rows without apart: a row without pays no cut.
        for mask, draw in ((with_k, draw_top_k), (with_p, draw_unsorted), (plain, draw_unsorted)):
            if not mask.any():
                continue
            if mask.all():  # every row of one kind: no copy of the logits, no scatter
                return draw(logits, uniform, mask)
            if tokens is None:
                tokens = torch.empty(len(rows), dtype=torch.long, device=device)
            idx = _index(np.flatnonzero(mask), device)
            tokens[idx] = draw(logits[idx], uniform[idx], mask)
        return tokens


# Inverse CDF over the whole vocabulary in two levels: which block of this many tokens,
# then which token in it; the running sum covers the block sums and one block per row.
_BLOCK = 128


def _draw_unsorted(logits: torch.Tensor, min_p: torch.Tensor | None, uniform: torch.Tensor,
                   temperature: torch.Tensor | None = None, out: torch.Tensor | None = None,
                   top_p: torch.Tensor | None = None, scratch=None, redraw=None) -> torch.Tensor:
    """One token per row from ``softmax(logits / temperature)`` (after top-p then min-p; None:
    off), by inverse CDF. ``out``: a [rows, vocab rounded up to the block] buffer to work in
    (the logits are not changed); ``scratch``: ``Sampler.scratch``.

    Top-p: with ``redraw`` (``redraw(positions, round)``: fresh uniforms for those rows), by
    rejection (``_draw_nucleus``), else by its cut (``top_p_cut``) as one more threshold."""
    rows, vocab = logits.shape
    width = vocab + (-vocab % _BLOCK)
    if out is None:
        out = torch.empty(rows, width, dtype=torch.float32, device=logits.device)
    weights = out[:, :vocab]
    # A positive temperature keeps the largest logit the largest: scale after subtracting it.
    torch.sub(logits, logits.amax(dim=-1, keepdim=True), out=weights)
    if temperature is not None:
        weights.div_(temperature[:, None])
    # On a CPU, exp of a score below about -87.3 (a masked token's -inf, a low temperature's far
    # tail) is a denormal or 0 and takes a slow path, ~15x for the whole step where a few
    # percent of the scores are there: those are clamped first, and what the clamp raised
    # weighs 0 again (two passes). Whether to is read off every ``_PROBE_STRIDE``-th score of
    # wide rows (a full read costs as much as the clamp): a few such scores that it misses
    # cost little on the slow path, and the result is the same either way.
    probe = weights[:, ::_PROBE_STRIDE] if vocab >= 32 * _PROBE_STRIDE else weights
    if weights.device.type == "cpu" and bool(probe.amin() < _LOWEST_SCORE):
        weights.clamp_(min=_LOWEST_SCORE).exp_()
        torch.nn.functional.threshold_(weights, _NO_WEIGHT, 0.0)
    else:
        weights.exp_()  # the largest weighs 1
    if width > vocab:
        out[:, vocab:].zero_()
    min_p = min_p if min_p is not None and (min_p > 0).any() else None
    if top_p is not None and redraw is not None:
        def exactly(positions: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
            pick = lambda x: None if x is None else x[positions]  # noqa: E731
            return _draw_unsorted(logits[positions], pick(min_p), uniform, pick(temperature), None,
                                  top_p[positions], scratch)

        return _draw_nucleus(out, vocab, top_p, min_p, uniform, redraw, exactly, scratch)
    # Top-p and min-p are thresholds on the weights: tokens below the higher weigh nothing.
    floor = top_p_cut(weights, top_p, scratch) if top_p is not None else None
    if min_p is not None:
        floor = min_p if floor is None else torch.maximum(floor, min_p)
    if floor is not None:
        drop_below(weights, floor)
    return _inverse_cdf(out, uniform)[0]


def _inverse_cdf(out: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``out`` ([rows, width], weights >= 0, width a multiple of ``_BLOCK``, a
    row's largest weight at most 1e38), the token where ``uniform`` of the row's mass falls:
    the block from the blocks' running mass, then the token from that block's own. Returns
    the tokens and the blocks' masses ([rows, width / block])."""
    rows, width = out.shape
    num_blocks = width // _BLOCK
    flat_blocks = out.view(-1, _BLOCK)  # [rows * num_blocks, block]
    # Running mass of the blocks after a leading 0: [rows, 1 + num_blocks].
    block_cum = torch.zeros(rows, 1 + num_blocks, device=out.device)
    sums = flat_blocks.sum(-1).view(rows, num_blocks)
    torch.cumsum(sums, dim=-1, out=block_cum[:, 1:])
    # u < 1 puts the target below the row's mass (u * m rounds below m for every float32 u < 1),
    # so the block found holds some of it.
    target = uniform * block_cum[:, -1]
    block = torch.searchsorted(block_cum, target[:, None], right=True)[:, 0].sub_(1)
    before = block_cum.gather(1, block[:, None])[:, 0]  # the mass of the blocks before it
    # The chosen block of each row in the flattened blocks (index_select: the fastest row gather on a CPU).
    flat = torch.arange(0, rows * num_blocks, num_blocks, device=out.device).add_(block)
    inner = torch.cumsum(flat_blocks.index_select(0, flat), dim=-1)
    # The block's own running sum is not the difference of the blocks' (other summation orders):
    # the target may pass its end. Kept below it, it lands on a token of some weight.
    inner_target = torch.minimum(target - before, inner[:, -1] * _BELOW_ONE)
    pos = torch.searchsorted(inner, inner_target[:, None], right=True)[:, 0]
    return pos.add_(block, alpha=_BLOCK), sums


# Rounds of top-p's rejection before the rows still drawing take the exact cut.
_NUCLEUS_ROUNDS = 3


def _draw_nucleus(out: torch.Tensor, vocab: int, top_p: torch.Tensor, min_p: torch.Tensor | None,
                  uniform: torch.Tensor, redraw, exactly, scratch) -> torch.Tensor:
    """Top-p's draw without its cut (FlashInfer's way, on a CPU too): draw from the row's
    weights (``out``, [rows, width]; after min-p), keep the token if the mass of the tokens
    heavier than it is below top-p of the row's mass (the test ``top_p_cut`` keeps a token
    by), else drop it and every lighter token and draw again. Every token top-p keeps
    stays in the running, so an accepted token is a draw from exactly top-p's distribution.
    A round reads the rows still drawing two to four times (``_past_top_p``); at top-p 0.95
    one row in twenty draws again, on its own row only. The rows still drawing after ``_NUCLEUS_ROUNDS`` take the cut
    (``exactly(positions, uniforms)``). The sort the cut needs costs ~10x one round on flat
    rows (256 x 32k: ~40 ms)."""
    weights = out[:, :vocab]
    mass = weights.sum(-1)  # top-p's share is of the row's whole mass, before min-p
    if min_p is not None:
        floor = min_p.clamp(min=_MIN_FLOOR)
        drop_below(weights, floor)
        mass = mass / floor
    tokens, sums = _inverse_cdf(out, uniform)
    drawn, positions, share = tokens, None, top_p * mass
    for round in range(1, _NUCLEUS_ROUNDS + 2):
        picked = out.gather(1, drawn[:, None])[:, 0].clamp_(min=_MIN_FLOOR)
        rejected = _past_top_p(out, vocab, picked, sums, share, scratch)
        if positions is not None:
            tokens[positions] = drawn
        if not rejected.any():
            return tokens
        again = rejected.nonzero()[:, 0]
        positions = again if positions is None else positions[again]
        if round > _NUCLEUS_ROUNDS:
            break
        # The rows drawing again, over the token drawn: it and every lighter token go.
        out = torch.div(out[again], picked[again, None])
        torch.nn.functional.threshold_(out, 1.0, 0.0)
        share = share[again] / picked[again]
        drawn, sums = _inverse_cdf(out, redraw(positions, round))
    tokens[positions] = exactly(positions, redraw(positions, _NUCLEUS_ROUNDS + 1))
    return tokens


def _past_top_p(out: torch.Tensor, vocab: int, picked: torch.Tensor, sums: torch.Tensor | None,
                share: torch.Tensor, scratch) -> torch.Tensor:
    """Per row, whether the tokens heavier than the one drawn (of weight ``picked``) hold at
    least ``share`` of the mass. First a bound from the blocks (``sums``: their masses): the
    blocks whose largest weight is above the token's hold every heavier token, so where
    their whole mass is below the share the token stays (most rows of peaked logits: a few
    heavy blocks); the other rows sum their heavier tokens, or every row does where they
    are more than half (``sums`` None: every row)."""
    rows = len(out)
    if sums is not None:
        heavy = out.view(rows, -1, _BLOCK).amax(dim=-1) > picked[:, None]
        unsure = ((sums * heavy).sum(-1) >= share).nonzero()[:, 0]
        if 2 * len(unsure) <= rows:  # else all rows are summed: a copy of most of them costs more
            rejected = torch.zeros(rows, dtype=torch.bool, device=out.device)
            if len(unsure):
                rejected[unsure] = _past_top_p(out[unsure], vocab, picked[unsure], None, share[unsure], scratch)
            return rejected
    # The mass above the token drawn, over its weight: the heavier tokens' weights over it, past 1.
    above = scratch(rows, vocab, "above") if scratch else torch.empty(rows, vocab, device=out.device)
    torch.nn.functional.threshold_(torch.div(out[:, :vocab], picked[:, None], out=above), 1.0, 0.0)
    return above.sum(-1) * picked >= share


# Scores (less the row's largest) are clamped to this before ``exp``; weights at or below
# ``_NO_WEIGHT`` (above exp(-87), the clamp's own) are 0: at most 2e-38 of the largest weight.
_LOWEST_SCORE, _NO_WEIGHT = -87.0, 2e-38
_PROBE_STRIDE = 256
# The largest float32 below 1, and the smallest floor ``drop_below`` divides by.
_BELOW_ONE = float(np.nextafter(np.float32(1.0), np.float32(0.0)))
_MIN_FLOOR = 1e-30


def drop_below(weights: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """Zero each row's weights below its ``floor`` (a weight equal to it stays), in place, as
    ``weights / floor`` then one scalar threshold at 1: a comparison and a masked fill are
    ~10x slower on a CPU (a boolean tensor, and a branch per entry). The rows come out
    scaled by 1 / floor, which a draw does not see; division rounds so that ``w / f >= 1``
    exactly when ``w >= f``. A floor is taken to be at least 1e-30 (of the row's largest
    weight, which is 1): the weights under it would otherwise overflow."""
    weights.div_(floor.clamp(min=_MIN_FLOOR)[:, None])
    return torch.nn.functional.threshold_(weights, _BELOW_ONE, 0.0)


# The top-p cut first looks for its token among the scores of this many blocks of this
# many tokens, those with the largest maxima (0 blocks: always sort the row).
_CUT_BLOCKS, _CUT_BLOCK = 32, 32


def top_p_cut(weights: torch.Tensor, top_p: torch.Tensor, scratch=None) -> torch.Tensor:
    """Per row, the smallest weight top-p keeps (``weights``: [rows, vocab], ``exp`` of the
    scores after temperature, less the row's largest; ``top_p``: [rows]), transformers' TopP as
    one threshold, so that the draw needs no sorted order and no ids. A token stays while the
    mass of the tokens above it is below top_p of the row's (the largest always stays); ties at
    the cut stay together.

    Where a few tokens hold the top-p mass (a trained model's rows): the blocks of
    ``_CUT_BLOCK`` tokens with the ``_CUT_BLOCKS`` largest maxima hold every token at or above
    the smallest of those maxima, in exact order once sorted; when the cut falls among them,
    no more is needed. Other rows (flat ones) sort their weights, values only (``_sorted``),
    then, as transformers, take the running mass from the smallest up. ``scratch``:
    ``Sampler.scratch`` (None: fresh buffers)."""
    rows, vocab = weights.shape
    num_blocks = vocab // _CUT_BLOCK
    cut = rest = None
    if 0 < 4 * _CUT_BLOCKS <= num_blocks:
        threshold = top_p * weights.sum(-1)  # the mass above a kept token is below this
        maxima, _, candidates = _best_blocks(weights, _CUT_BLOCKS, _CUT_BLOCK)
        floor = maxima.amin(dim=-1)  # every token at or above it is a candidate
        descending = _sorted(candidates).flip(-1)
        through = descending.cumsum(dim=-1)
        last = ((through - descending) < threshold[:, None]).sum(-1, keepdim=True) - 1  # the last one kept
        cut = descending.gather(1, last)[:, 0]
        done = (through.gather(1, last)[:, 0] >= threshold) & (cut >= floor)
        if done.all():
            return cut
        rest = (~done).nonzero()[:, 0]
    flat = weights if rest is None else weights[rest]
    p = top_p if rest is None else top_p[rest]
    ascending = _sorted(flat, scratch(len(flat), vocab, "sorted") if scratch and flat.device.type == "cpu" else None)
    mass = torch.cumsum(ascending, dim=-1, out=scratch(len(flat), vocab, "mass") if scratch else None)
    # The first position whose running mass passes (1 - top_p) of the row's.
    first = torch.searchsorted(mass, ((1 - p) * mass[:, -1])[:, None], right=True).clamp_(max=vocab - 1)
    values = ascending.gather(1, first)[:, 0]
    if rest is None:
        return values
    cut[rest] = values
    return cut


# Rows of at least this many values in all are sorted in two halves at once where the step
# has more than one thread (numpy's sort releases the GIL; torch's threads are idle then).
_SPLIT_SORT_AT = 1 << 20
_sort_pool: ThreadPoolExecutor | None = None
_sort_pool_lock = threading.Lock()


def _sorted(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's values, ascending (no ids). On a CPU numpy's vectorized sort, in place in
    ``out`` when given (``torch.sort`` is ~12x slower at 256 x 32k here), half the rows on a
    second thread where the process's torch threads allow two (1.9x at 256 x 32k)."""
    if x.device.type != "cpu":
        return x.sort(dim=-1).values
    out = out.copy_(x) if out is not None else x.clone()
    values = out.numpy()
    half = len(values) // 2
    if values.size >= _SPLIT_SORT_AT and half and torch.get_num_threads() > 1:
        future = _sorting_thread().submit(values[half:].sort, axis=-1)
        values[:half].sort(axis=-1)
        future.result()
    else:
        values.sort(axis=-1)
    return out


def _sorting_thread() -> ThreadPoolExecutor:
    global _sort_pool
    with _sort_pool_lock:
        if _sort_pool is None:
            _sort_pool = ThreadPoolExecutor(1, thread_name_prefix="hydrad-sort")
        return _sort_pool


# Width of the blocks whose maxima ``topk_rows`` ranks first on a CPU.
_TOPK_BLOCK = 32


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima, as ``torch.argmax``). On a CPU numpy's:
    torch's CPU argmax over a vocabulary is 5-10x slower (256 rows x 32k: 6.9 ms on two
    threads against 1.2 ms; in bfloat16 17 ms)."""
    if x.device.type == "cpu" and x.is_floating_point():
        return torch.from_numpy(x.float().numpy().argmax(axis=-1))  # bf16/fp16 widen exactly
    return x.argmax(dim=-1)


def _best_blocks(x: torch.Tensor, num_best: int, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's ``num_best`` blocks of ``block`` entries with the largest maxima (one pass
    ranks them): their maxima and indices ([rows, num_best], in no order), and their entries
    followed by the row's tail past its last whole block ([rows, num_best * block + tail]).
    Every entry at or above the smallest of those maxima is among them."""
    rows, vocab = x.shape
    num_blocks = vocab // block
    blocks = x[:, : num_blocks * block].view(rows, num_blocks, block)
    maxima, best = blocks.amax(dim=-1).topk(num_best, dim=-1, sorted=False)
    candidates = blocks.gather(1, best[:, :, None].expand(-1, -1, block)).view(rows, -1)
    if num_blocks * block < vocab:
        candidates = torch.cat([candidates, x[:, num_blocks * block:]], dim=1)
    return maxima, best, candidates


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, dim=-1)``: each row's k largest values, descending, and their ids. On a CPU
    with rows far wider than k, torch's topk reads every entry k-wise; instead keep the k
    blocks with the largest maxima (every top-k entry lies in one: k blocks have a larger
    maximum than a block left out) and the row's tail, and take the top k of those
    candidates (1.7x faster at 256 x 32k, 2.5x at 16 rows). Blocks of ``_TOPK_BLOCK``, or
    narrower where the row is not 4k blocks of that width."""
    rows, vocab = x.shape
    block = next((b for b in (_TOPK_BLOCK, _TOPK_BLOCK // 2) if 4 * k * b <= vocab), 0)
    if x.device.type != "cpu" or not block:
        return x.topk(k, dim=-1)
    _, best, candidates = _best_blocks(x, k, block)
    ids = (best[:, :, None] * block + torch.arange(block)).view(rows, -1)
    tail = vocab // block * block
    if tail < vocab:
        ids = torch.cat([ids, torch.arange(tail, vocab).expand(rows, -1)], dim=1)
    values, positions = candidates.topk(k, dim=-1)
    return values, ids.gather(1, positions)


def allowed_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] True where a token can be drawn after temperature, top-k, top-p and
    min-p: the support of the sampler's draw, built with the same operations as each row's
    path (top-k rows: sorted candidates and cut-offs; the others: the top-p cut and the
    min-p threshold of ``_draw_unsorted``; top-p's rejection draws from the same tokens),
    for tests and diagnostics."""
    vocab = logits.shape[-1]
    with_k = (top_k > 0) & (top_k < vocab)
    x = logits / temperature[:, None]
    k = torch.where(with_k, top_k, vocab)
    values, ids = x.sort(dim=-1, descending=True)
    values = values.masked_fill(torch.arange(vocab)[None, :] >= k[:, None], float("-inf"))
    keep, _, _ = sorted_keep_counts(values, top_p, min_p)
    allowed = torch.zeros_like(x, dtype=torch.bool)
    allowed.scatter_(1, ids, torch.arange(vocab)[None, :] < keep[:, None])
    rows = (~with_k).nonzero()[:, 0]
    if len(rows):
        weights = ((logits[rows] - logits[rows].amax(dim=-1, keepdim=True)) / temperature[rows, None]).exp()
        cut = torch.where(top_p[rows] < 1.0, top_p_cut(weights, top_p[rows]), 0.0)
        allowed[rows] = drop_below(weights, torch.maximum(cut, min_p[rows])) > 0
    return allowed


def _mix(*values: int) -> int:
    """A 63-bit seed from ``values``, the same in every process (Python's ``hash`` of bytes is not)."""
    digest = hashlib.blake2b(b"".join(v.to_bytes(8, "little", signed=False) for v in values), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _index(values, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int64), device=device)


def rows_logprobs(raw: torch.Tensor, rows: np.ndarray, num_logprobs: np.ndarray, tokens: torch.Tensor,
                  num_rows: int) -> list[TokenLogprobs | None]:
    """Each of ``rows``' token (``tokens[row]``) with its log-probability and rank in ``raw``
    (``[len(rows), vocab]``, the log-softmax of those rows' raw logits, in ``rows``' order) and
    its row's ``num_logprobs[row]`` most likely tokens; None for the other of ``num_rows`` rows."""
    chosen = tokens[_index(rows, raw.device)]
    chosen_lp = raw.gather(1, chosen[:, None])[:, 0]
    ranks = (raw > chosen_lp[:, None]).sum(-1) + 1
    k = int(num_logprobs[rows].max())
    top_lp, top_ids = topk_rows(raw, k) if k > 0 else (None, None)
    chosen_lp, ranks, chosen = chosen_lp.tolist(), ranks.tolist(), chosen.tolist()
    top_lp = top_lp.tolist() if top_lp is not None else None
    top_ids = top_ids.tolist() if top_ids is not None else None
    out: list[TokenLogprobs | None] = [None] * num_rows
    for i, row in enumerate(rows.tolist()):
        n = int(num_logprobs[row])
        out[row] = TokenLogprobs(chosen[i], chosen_lp[i], ranks[i], top_ids[i][:n] if n else [],
                                 top_lp[i][:n] if n else [])
    return out
