"""Token sampling for a whole step at once, on the device that holds the logits.

One pass over the step's rows, as batched tensor operations (no Python loop over
rows, no copy to the host per row):

1. logit bias, then repetition / presence / frequency penalties over per-request token
   counts kept on the device (``PenaltyCache``), then the ``min_tokens`` mask of EOS
   and the stop token ids;
2. greedy rows: argmax (only over the greedy rows; a step without one skips it);
3. sampled rows: temperature, then transformers' warper order top-k, top-p, min-p,
   then one draw per row by inverse CDF (one uniform per row: from the instance's
   generator, or from the request's own generator when it has a seed, so a seeded
   request's tokens do not depend on what shares its batch).

Candidates are kept sorted by logit, so top-p and min-p cut a prefix of them and one
cumulative sum serves the filters and the draw. With top-k the sort covers k entries,
not the vocabulary; top-p alone first tries the top 1024 entries and sorts the whole
vocabulary only for rows whose top-p mass lies beyond them. Log-probabilities come
from the raw logits (the model's distribution before any processing), as vLLM's
default.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hydrad.engine.inputs import TokenLogprobs
from hydrad.sampling_params import GREEDY_BELOW

# Candidates tried before a full sort for rows with top-p and no top-k.
TOP_P_CANDIDATES = 1024


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
    """Per-request token counts on the device, for the penalties: a slot per request.

    A slot holds the counts of the tokens generated so far and which tokens the prompt
    holds; it is filled once when the request starts running here and updated after
    every step (``add_tokens``), never rebuilt from the token lists.
    """

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self._free: list[int] = []

    def allocate(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> int:
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.counts[slot].zero_()
        self.in_prompt[slot].zero_()
        if prompt_token_ids:
            self.in_prompt[slot, torch.tensor(prompt_token_ids, device=self.device)] = True
        if output_token_ids:
            ids = torch.tensor(output_token_ids, device=self.device)
            self.counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return slot

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def add_tokens(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        self.counts.index_put_((slots, token_ids), torch.ones_like(slots, dtype=torch.int32), accumulate=True)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        in_prompt[:old] = self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        self._free.extend(range(new - 1, old - 1, -1))


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor,
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """Penalized ``logits`` [rows, vocab]; ``counts``/``in_prompt`` are the rows' slots,
    the penalties one per row."""
    seen = counts > 0
    if (repetition != 1.0).any():
        # transformers' RepetitionPenaltyLogitsProcessor, over prompt and output tokens
        rep = repetition[:, None]
        penalized = torch.where(logits < 0, logits * rep, logits / rep)
        logits = torch.where(seen | in_prompt, penalized, logits)
    if (frequency != 0.0).any() or (presence != 0.0).any():
        # OpenAI: logit -= count * frequency_penalty + (count > 0) * presence_penalty
        logits = logits - counts * frequency[:, None] - seen * presence[:, None]
    return logits


def sorted_keep_counts(sorted_logits: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                       total: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For candidates sorted by logit (descending, -inf past a row's end): how many of
    each row's first candidates survive top-p then min-p (at least one), the weights
    ``exp(logit - max)`` and their running sum. ``total``: the row's whole weight when the
    candidates are a subset of the distribution (top-p alone)."""
    weights = torch.exp(sorted_logits - sorted_logits[:, :1])
    cum = torch.cumsum(weights, dim=-1)
    if total is None:
        total = cum[:, -1]
    keep = torch.full_like(total, sorted_logits.shape[-1], dtype=torch.int64)
    if (top_p < 1.0).any():
        # A token goes once the mass strictly before it reaches top_p (transformers' TopP).
        before = cum - weights
        keep = (before < top_p[:, None] * total[:, None]).sum(-1)
    if (min_p > 0.0).any():
        # transformers' MinP: probability below min_p times the most likely token's.
        keep = torch.minimum(keep, (weights >= min_p[:, None]).sum(-1))
    return keep.clamp_(min=1), weights, cum


def _draw_sorted(sorted_logits: torch.Tensor, sorted_ids: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                 uniform: torch.Tensor, total: torch.Tensor | None = None) -> torch.Tensor:
    keep, _, cum = sorted_keep_counts(sorted_logits, top_p, min_p, total)
    target = uniform * cum.gather(1, (keep - 1)[:, None])[:, 0]
    pos = torch.searchsorted(cum, target[:, None], right=True)[:, 0]
    pos = torch.minimum(pos, keep - 1)
    return sorted_ids.gather(1, pos[:, None])[:, 0]


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        # Uniforms of rows without a seed; seeds of requests that bring one are theirs.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # The penalty state of the requests this sampler serves (owned by the runner's batch).
        self.penalties: PenaltyCache | None = None

    def generator_for(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # logits: [num_rows, vocab] float32, one row per request that samples this step
        num_rows = logits.shape[0]
        greedy = meta.temperature < GREEDY_BELOW
        wants_logprobs = meta.num_logprobs >= 0
        logprob_rows = np.flatnonzero(wants_logprobs) if wants_logprobs.any() else None
        raw_logprobs = None
        if logprob_rows is not None:
            raw_logprobs = torch.log_softmax(logits[_index(logprob_rows, logits.device)].float(), dim=-1)
        logits = self._process(logits, meta)

        if greedy.all():
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.empty(num_rows, dtype=torch.long, device=logits.device)
            if greedy.any():
                rows = _index(np.flatnonzero(greedy), logits.device)
                tokens[rows] = logits[rows].argmax(dim=-1)
            sampled = np.flatnonzero(~greedy)
            rows = _index(sampled, logits.device)
            tokens[rows] = self._draw(logits[rows], meta, sampled)
        token_ids = tokens.tolist()
        out = SamplerOutput(token_ids)
        if raw_logprobs is not None:
            out.logprobs = _logprobs(raw_logprobs, logprob_rows, meta.num_logprobs, tokens, num_rows)
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
        cache: PenaltyCache = self.penalties
        rows_np = np.flatnonzero(meta.penalty_slots >= 0)
        rows = _index(rows_np, logits.device)
        slots = _index(meta.penalty_slots[rows_np], logits.device)
        f32 = lambda a: torch.from_numpy(a[rows_np]).to(logits.device)  # noqa: E731
        logits[rows] = apply_penalties(logits[rows], cache.counts[slots], cache.in_prompt[slots],
                                       f32(meta.repetition_penalty), f32(meta.presence_penalty),
                                       f32(meta.frequency_penalty))

    def _uniforms(self, rows: np.ndarray, meta: SamplingMetadata, device: torch.device) -> torch.Tensor:
        """One uniform per sampled row: the request's own generator for seeded rows."""
        uniform = torch.rand(len(rows), generator=self.generator, device=device)
        if meta.generators:
            position = {int(r): i for i, r in enumerate(rows)}
            for row, generator in meta.generators:
                i = position.get(row)
                if i is not None:
                    uniform[i] = torch.rand(1, generator=generator, device=device)[0]
        return uniform

    def _draw(self, logits: torch.Tensor, meta: SamplingMetadata, rows: np.ndarray) -> torch.Tensor:
        # logits: [num_sampled, vocab], the sampled rows only
        device = logits.device
        vocab = logits.shape[-1]
        temperature = meta.temperature[rows]
        if (temperature != 1.0).any():
            logits = logits / torch.from_numpy(temperature).to(device)[:, None]
        uniform = self._uniforms(rows, meta, device)
        top_k, top_p, min_p = meta.top_k[rows], meta.top_p[rows], meta.min_p[rows]
        with_k = (top_k > 0) & (top_k < vocab)
        with_p = ~with_k & (top_p < 1.0)
        plain = ~with_k & ~with_p
        tokens = torch.empty(len(rows), dtype=torch.long, device=device)
        t = lambda a, m: torch.from_numpy(a[m]).to(device)  # noqa: E731
        if with_k.any():
            idx = _index(np.flatnonzero(with_k), device)
            k = t(top_k, with_k)
            values, ids = logits[idx].topk(int(k.max()), dim=-1)
            past_k = torch.arange(values.shape[-1], device=device)[None, :] >= k[:, None]
            values = values.masked_fill(past_k, float("-inf"))
            tokens[idx] = _draw_sorted(values, ids, t(top_p, with_k), t(min_p, with_k), uniform[idx])
        if with_p.any():
            idx_np = np.flatnonzero(with_p)
            tokens[_index(idx_np, device)] = self._draw_top_p(logits[_index(idx_np, device)], t(top_p, with_p),
                                                              t(min_p, with_p), uniform[_index(idx_np, device)])
        if plain.any():
            idx = _index(np.flatnonzero(plain), device) if not plain.all() else None
            # One fused pass for the probabilities, one for their running sum.
            probs = torch.softmax(logits if idx is None else logits[idx], dim=-1)
            mp = min_p[plain]
            if (mp > 0).any():
                top = probs.max(dim=-1, keepdim=True).values
                probs = probs.masked_fill(probs < torch.from_numpy(mp).to(device)[:, None] * top, 0.0)
            cum = torch.cumsum(probs, dim=-1)
            if idx is None:
                pos = torch.searchsorted(cum, (uniform * cum[:, -1])[:, None], right=True)[:, 0]
                tokens[:] = pos.clamp_(max=vocab - 1)
                return tokens
            pos = torch.searchsorted(cum, (uniform[idx] * cum[:, -1])[:, None], right=True)[:, 0]
            tokens[idx] = pos.clamp_(max=vocab - 1)
        return tokens

    def _draw_top_p(self, logits: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                    uniform: torch.Tensor) -> torch.Tensor:
        """Top-p without top-k: the top candidates when they hold the top-p mass, else a full sort."""
        vocab = logits.shape[-1]
        k = min(vocab, TOP_P_CANDIDATES)
        values, ids = logits.topk(k, dim=-1)
        total = torch.exp(logits - values[:, :1]).sum(-1)
        covered = torch.cumsum(torch.exp(values - values[:, :1]), dim=-1)[:, -1] >= top_p * total
        if k == vocab or covered.all():
            return _draw_sorted(values, ids, top_p, min_p, uniform, total)
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        if covered.any():
            c = covered.nonzero()[:, 0]
            tokens[c] = _draw_sorted(values[c], ids[c], top_p[c], min_p[c], uniform[c], total[c])
        rest = (~covered).nonzero()[:, 0]
        values, ids = logits[rest].sort(dim=-1, descending=True)
        tokens[rest] = _draw_sorted(values, ids, top_p[rest], min_p[rest], uniform[rest])
        return tokens


def allowed_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] True where a token can be drawn after temperature, top-k, top-p and
    min-p: the support of the sampler's draw, built from the same candidate sorting and
    cut-offs (for tests and diagnostics)."""
    x = logits / temperature[:, None]
    vocab = x.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    values, ids = x.sort(dim=-1, descending=True)
    values = values.masked_fill(torch.arange(vocab)[None, :] >= k[:, None], float("-inf"))
    keep, _, _ = sorted_keep_counts(values, top_p, min_p)
    allowed = torch.zeros_like(x, dtype=torch.bool)
    allowed.scatter_(1, ids, torch.arange(vocab)[None, :] < keep[:, None])
    return allowed


def _index(values, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int64), device=device)


def _logprobs(raw: torch.Tensor, rows: np.ndarray, num_logprobs: np.ndarray, tokens: torch.Tensor,
              num_rows: int) -> list[TokenLogprobs | None]:
    # raw: [len(rows), vocab] log-softmax of the raw logits of the rows that asked
    chosen = tokens[_index(rows, raw.device)]
    chosen_lp = raw.gather(1, chosen[:, None])[:, 0]
    ranks = (raw > chosen_lp[:, None]).sum(-1) + 1
    k = int(num_logprobs[rows].max())
    top_lp, top_ids = raw.topk(k, dim=-1) if k > 0 else (None, None)
    chosen_lp, ranks = chosen_lp.tolist(), ranks.tolist()
    top_lp = top_lp.tolist() if top_lp is not None else None
    top_ids = top_ids.tolist() if top_ids is not None else None
    out: list[TokenLogprobs | None] = [None] * num_rows
    for i, row in enumerate(rows.tolist()):
        n = int(num_logprobs[row])
        out[row] = TokenLogprobs(chosen_lp[i], ranks[i], top_ids[i][:n] if n else [], top_lp[i][:n] if n else [])
    return out
