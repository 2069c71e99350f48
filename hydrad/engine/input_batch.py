"""The persistent rows of the requests that run language steps on this instance.

A request gets a row when it first runs a language step here and keeps it until it
leaves the running set (finished, aborted, preempted, offered). The row holds what
does not change from step to step — the KV block table (extended as blocks are
added), the sampling settings, the request's generator and penalty slot — so that a
step gathers its inputs with a few array operations instead of rebuilding them
request by request.
"""

from __future__ import annotations

import numpy as np
import torch

from hydrad.engine.grammar_mask import GrammarMasks
from hydrad.engine.request import Request
from hydrad.engine.sampler import PenaltyCache, Sampler, SamplingMetadata

_INITIAL_ROWS = 64


class InputBatch:
    def __init__(self, max_blocks_per_row: int, vocab_size: int, sampler: Sampler, device: torch.device,
                 grammars: GrammarMasks | None = None):
        self.max_blocks_per_row = max_blocks_per_row
        self.vocab_size = vocab_size
        self.sampler = sampler
        self.penalties = PenaltyCache(vocab_size, device)
        sampler.penalties = self.penalties
        self.grammars = grammars if grammars is not None else GrammarMasks(None, vocab_size)
        sampler.grammars = self.grammars
        self.capacity = 0
        self._free: list[int] = []
        self.block_table = np.zeros((0, max_blocks_per_row), dtype=np.int64)
        # Blocks of each row copied into block_table so far (a Python list: read per request per step).
        self.num_blocks: list[int] = []
        self.temperature = np.zeros(0, dtype=np.float32)
        self.top_k = np.zeros(0, dtype=np.int64)
        self.top_p = np.zeros(0, dtype=np.float32)
        self.min_p = np.zeros(0, dtype=np.float32)
        self.repetition_penalty = np.zeros(0, dtype=np.float32)
        self.presence_penalty = np.zeros(0, dtype=np.float32)
        self.frequency_penalty = np.zeros(0, dtype=np.float32)
        self.penalty_slot = np.zeros(0, dtype=np.int64)
        self.num_logprobs = np.zeros(0, dtype=np.int64)
        self.min_tokens = np.zeros(0, dtype=np.int64)
        self.generators: list[torch.Generator | None] = []
        # Per row: (token ids, values) of its logit bias, and the ids min_tokens masks.
        self.bias: list[tuple[list[int], list[float]] | None] = []
        self.stop_ids: list[list[int]] = []
        # Per row: the matcher of a request with structured outputs (``grammar_mask``).
        self.matchers: list = []
        # The request holding each row: a request's ``row`` may refer to a batch that was
        # dropped since (a redeploy freed the KV pool), so ownership is checked, not assumed.
        self.owners: list[Request | None] = []
        self.num_rows_used = 0
        # Rows with a generator of their own, and with a logit bias: a step whose rows have
        # neither (the usual case) looks at no row's in Python.
        self.num_seeded = 0
        self.num_biased = 0
        self.num_constrained = 0
        self._grow(_INITIAL_ROWS)

    # -- rows ------------------------------------------------------------------------------
    def add(self, req: Request) -> int:
        """Give ``req`` a row and record its settings (ValueError if they do not fit the model)."""
        params = req.sampling_params
        if params.logit_bias:
            bad = [t for t in params.logit_bias if t >= self.vocab_size]
            if bad:
                raise ValueError(f"logit_bias names token {bad[0]}, the vocabulary has {self.vocab_size} tokens")
        if not self._free:
            self._grow(2 * self.capacity)
        row = self._free.pop()
        req.row = row
        self.owners[row] = req
        self.num_rows_used += 1
        self.num_blocks[row] = 0
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.repetition_penalty[row] = params.repetition_penalty
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        # A request that asked for its prompt's log-probabilities gets them with its first
        # token's (``PromptLogprobs``), so its tokens carry theirs (none beyond the token's own).
        self.num_logprobs[row] = (params.logprobs if params.logprobs is not None else
                                  -1 if params.prompt_logprobs is None else 0)
        self.min_tokens[row] = params.min_tokens
        self.stop_ids[row] = sorted(req.stop_ids)
        self.bias[row] = (list(params.logit_bias), list(params.logit_bias.values())) if params.logit_bias else None
        if params.seed is not None and not params.greedy and req.generator is None:
            # Tokens without a generator: those a request brings to run again (EngineRequest).
            req.generator = self.sampler.generator_for(params.seed, req.num_output_tokens)
        self.generators[row] = req.generator if params.seed is not None else None
        self.num_seeded += self.generators[row] is not None
        self.num_biased += self.bias[row] is not None
        if params.structured_outputs is not None and req.matcher is None:
            # Handed over, preempted on another instance, or run again: past its tokens so far.
            req.matcher = self.grammars.matcher(req)
        self.matchers[row] = req.matcher if params.structured_outputs is not None else None
        self.num_constrained += self.matchers[row] is not None
        self.penalty_slot[row] = (self.penalties.allocate(req.prompt_token_ids, req.output_token_ids)
                                  if params.has_penalties else -1)
        return row

    def holds(self, req: Request) -> bool:
        return 0 <= req.row < self.capacity and self.owners[req.row] is req

    def remove(self, req: Request) -> None:
        row = req.row
        if not self.holds(req):
            req.row = -1
            return
        req.row = -1
        self.owners[row] = None
        if self.penalty_slot[row] >= 0:
            self.penalties.free(int(self.penalty_slot[row]))
            self.penalty_slot[row] = -1
        self.num_seeded -= self.generators[row] is not None
        self.num_biased -= self.bias[row] is not None
        self.num_constrained -= self.matchers[row] is not None
        self.generators[row] = None
        self.bias[row] = None
        self.matchers[row] = None
        self._free.append(row)
        self.num_rows_used -= 1

    def rows_of(self, reqs: list[Request]) -> list[int]:
        """The rows of ``reqs``, each added when it has none here, with their blocks synced
        (a step's decodes, as columns)."""
        owners, num_blocks, capacity = self.owners, self.num_blocks, self.capacity
        rows = [req.row for req in reqs]
        # One pass that finds nothing in the usual step: rows held, blocks synced but a few.
        for i in [i for i, req, row in zip(range(len(reqs)), reqs, rows)
                  if not (0 <= row < capacity and owners[row] is req and len(req.kv_block_ids) == num_blocks[row])]:
            req = reqs[i]
            if not self.holds(req):
                rows[i] = self.add(req)
            self.sync_blocks(rows[i], req.kv_block_ids)
        return rows

    def sync_blocks(self, row: int, block_ids: list[int]) -> None:
        """Copy the blocks added to a request since the last step into its row."""
        known = self.num_blocks[row]
        if len(block_ids) > self.max_blocks_per_row:
            raise ValueError(f"{len(block_ids)} KV blocks exceed the {self.max_blocks_per_row} a row holds")
        self.block_table[row, known: len(block_ids)] = block_ids[known:]
        self.num_blocks[row] = len(block_ids)

    # -- sampling ----------------------------------------------------------------------------
    def sampling_metadata(self, rows: np.ndarray, reqs: list[Request]) -> SamplingMetadata:
        """Settings of the rows that sample this step (``reqs`` in the same order)."""
        generators = []
        if self.num_seeded:
            generators = [(i, self.generators[r]) for i, r in enumerate(rows.tolist()) if self.generators[r] is not None]
        meta = SamplingMetadata(
            temperature=self.temperature[rows], top_k=self.top_k[rows], top_p=self.top_p[rows],
            min_p=self.min_p[rows], repetition_penalty=self.repetition_penalty[rows],
            presence_penalty=self.presence_penalty[rows], frequency_penalty=self.frequency_penalty[rows],
            penalty_slots=self.penalty_slot[rows], num_logprobs=self.num_logprobs[rows], generators=generators,
        )
        bias = [(i, self.bias[r]) for i, r in enumerate(rows.tolist()) if self.bias[r] is not None] if self.num_biased else []
        if bias:
            meta.bias = ([i for i, (ids, _) in bias for _ in ids], [t for _, (ids, _) in bias for t in ids],
                         [v for _, (_, values) in bias for v in values])
        if self.num_constrained:
            matchers = [(i, self.matchers[r]) for i, r in enumerate(rows.tolist()) if self.matchers[r] is not None]
            meta.matchers = matchers or None
        if self.min_tokens[rows].any():
            mask_rows, mask_ids = [], []
            for i, req in enumerate(reqs):
                if req.num_output_tokens < req.sampling_params.min_tokens:
                    ids = self.stop_ids[int(rows[i])]
                    mask_rows += [i] * len(ids)
                    mask_ids += ids
            if mask_rows:
                meta.min_tokens_mask = (mask_rows, mask_ids)
        return meta

    def add_sampled(self, rows: np.ndarray, token_ids: list[int]) -> None:
        """Count the sampled tokens of rows with penalty state; advance the rows' matchers."""
        slots = self.penalty_slot[rows]
        with_state = slots >= 0
        if with_state.any():
            self.penalties.add_tokens(slots[with_state].tolist(), np.asarray(token_ids)[with_state].tolist())
        if self.num_constrained:
            matchers = self.matchers
            for row, token_id in zip(rows.tolist(), token_ids):
                if matchers[row] is not None:
                    matchers[row].consume_token(token_id)

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        if capacity <= old:
            return

        def grown(array: np.ndarray, fill) -> np.ndarray:
            new = np.full((capacity, *array.shape[1:]), fill, dtype=array.dtype)
            new[:old] = array
            return new

        self.block_table = grown(self.block_table, 0)
        for name, fill in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0),
                           ("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                           ("penalty_slot", -1), ("num_logprobs", -1), ("min_tokens", 0)):
            setattr(self, name, grown(getattr(self, name), fill))
        self.num_blocks += [0] * (capacity - old)
        self.generators += [None] * (capacity - old)
        self.bias += [None] * (capacity - old)
        self.matchers += [None] * (capacity - old)
        self.stop_ids += [[] for _ in range(capacity - old)]
        self.owners += [None] * (capacity - old)
        self._free.extend(range(capacity - 1, old - 1, -1))
        self.capacity = capacity
