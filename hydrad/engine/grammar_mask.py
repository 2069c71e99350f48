"""Structured outputs in a step: each constrained request's matcher, and the mask of its row.

A request with ``structured_outputs`` has an llguidance matcher on every instance that
samples it, built from the grammar it carries (``hydrad.grammar``) and advanced through
the tokens it has generated so far: a request handed over after its first token, or run
again after its worker died, gets a matcher in the same state without any state moving
between processes (a few microseconds a token). Each step, before the draw, the rows of
such requests keep only the tokens their matcher allows (one bitmask per row, computed
by llguidance's threads with the GIL released), and each sampled token is then consumed by
its matcher (``InputBatch.add_sampled``).

The tokenizer llguidance masks by is built from the checkpoint's own on the first
constrained request an instance sees, not at start.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from hydrad.errors import RequestError
from hydrad.grammar import one_line

logger = logging.getLogger("hydrad.engine")


class GrammarMasks:
    def __init__(self, tokenizer_path: str | None, vocab_size: int):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self._tokenizer = None
        self._executor = None
        self._bitmask = torch.zeros((0, 0), dtype=torch.int32)

    def _llg_tokenizer(self, eos_token_ids):
        if self._tokenizer is None:
            import llguidance.hf
            from transformers import AutoTokenizer

            if not self.tokenizer_path:
                raise RequestError("structured outputs need the model's tokenizer, which this instance was not "
                                   "given", "structured_outputs")
            try:
                hf_tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
                self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=sorted(eos_token_ids) or None)
            except (OSError, ValueError) as e:  # no tokenizer there, or not a fast one
                raise RequestError(f"structured outputs need the model's fast tokenizer: {e}",
                                   "structured_outputs") from None
            logger.info("structured outputs: llguidance's tokenizer built from %s (%d tokens)", self.tokenizer_path,
                        self.vocab_size)
        return self._tokenizer

    def matcher(self, req):
        """``req``'s matcher, past the tokens it has generated; RequestError where its grammar
        does not compile with this model's tokenizer or those tokens do not fit it."""
        from llguidance import LLMatcher

        params = req.sampling_params.structured_outputs
        matcher = LLMatcher(self._llg_tokenizer(req.eos_token_ids), params.compiled, log_level=0)
        if not matcher.is_error() and req.output_token_ids:
            matcher.consume_tokens(req.output_token_ids)
        if matcher.is_error():
            raise RequestError(f"structured outputs: {one_line(matcher.get_error())}", "structured_outputs")
        return matcher

    def apply(self, logits: torch.Tensor, raw: torch.Tensor, matchers: list[tuple[int, object]]) -> torch.Tensor:
        """Keep, in each listed row of ``logits``, only the tokens its matcher allows (-inf
        elsewhere), in place; returns ``logits``. ``raw``: the
        logits before logit bias, penalties and ``min_tokens``: a row where those left none of
        the allowed tokens (``min_tokens`` masking the EOS a finished language needs) takes
        them from ``raw`` instead, and a row whose matcher allows nothing (it failed) stays as
        it was."""
        num_rows, vocab = len(matchers), logits.shape[-1]
        words = (self.vocab_size + 31) // 32
        if self._bitmask.shape[0] < num_rows or self._bitmask.shape[1] != words:
            self._bitmask = torch.zeros((max(num_rows, 2 * self._bitmask.shape[0]), words), dtype=torch.int32)
        bitmask = self._bitmask
        if num_rows == 1:
            matchers[0][1].unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
        else:
            self._executor_threads().unsafe_compute_mask_ptr(
                [(matcher, k) for k, (_, matcher) in enumerate(matchers)], bitmask.data_ptr(), words * 4, num_rows)
        allowed_np = np.unpackbits(bitmask[:num_rows].numpy().view(np.uint8), axis=1, count=vocab,
                                   bitorder="little").view(np.bool_)
        allowed = torch.from_numpy(allowed_np).to(logits.device, non_blocking=True)
        rows = torch.as_tensor([i for i, _ in matchers], dtype=torch.long, device=logits.device)
        kept = logits[rows].masked_fill(~allowed, float("-inf"))
        dead = kept.amax(dim=-1) == float("-inf")
        if bool(dead.any()):
            fallback = raw[rows][dead]
            from_raw = fallback.masked_fill(~allowed[dead], float("-inf"))
            nothing = from_raw.amax(dim=-1) == float("-inf")  # the matcher allows no token at all
            kept[dead] = torch.where(nothing[:, None], fallback, from_raw)
        logits[rows] = kept
        return logits

    def _executor_threads(self):
        if self._executor is None:
            from llguidance import LLExecutor

            # As many threads as the instance's torch threads: its share of the cores.
            self._executor = LLExecutor(num_threads=max(1, torch.get_num_threads()))
        return self._executor
