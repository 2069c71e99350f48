"""Structured outputs in a step: each constrained request's matcher, and the mask of its row.

A request with ``structured_outputs`` has an llguidance matcher on every instance that
samples it, built from the grammar it carries (``hydrad.grammar``) and advanced through
the tokens it has generated so far: a request handed over after its first token, or run
again after its worker died, gets a matcher in the same state without any state moving
between processes (a few microseconds a token). Each step, before the draw, the rows of
such requests keep only the tokens their matcher allows (one bitmask per row, computed
by llguidance's threads with the GIL released), and each sampled token is then consumed by
its matcher (``InputBatch.add_sampled``).

Building a matcher from a grammar takes from a millisecond (a small JSON schema) to a few
hundred (the largest grammars a request may carry), so an instance builds each grammar
once: a fresh matcher per grammar is kept (``MAX_TEMPLATES``, least recently used first
out) and each request's is a copy of it (microseconds). A grammar not built yet is built
on a thread of its own (``prepare``): llguidance releases the GIL while it compiles, so a
worker keeps stepping its other requests meanwhile and admits the request once its grammar
is ready (``engine.worker``). A grammar the model's tokenizer refuses is remembered as its
error, and each request that carries it is refused the same way.

The tokenizer llguidance masks by is built from the checkpoint's own on the first
constrained request an instance sees, not at start.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from hydrad.errors import RequestError
from hydrad.grammar import one_line

logger = logging.getLogger("hydrad.engine")

# Grammars whose fresh matcher (or refusal) an instance keeps.
MAX_TEMPLATES = 32


class GrammarMasks:
    def __init__(self, tokenizer_path: str | None, vocab_size: int):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._executor = None
        self._bitmask = torch.zeros((0, 0), dtype=torch.int32)
        # grammar -> a fresh matcher of it, or the RequestError it is refused with
        self._templates: OrderedDict[str, object] = OrderedDict()
        self._building: dict[str, Future] = {}  # grammars being built on ``_builder``
        self._builder: ThreadPoolExecutor | None = None
        self.num_built = 0  # grammars built (not copied) here

    def _llg_tokenizer(self, eos_token_ids):
        with self._tokenizer_lock:  # the step thread and the builder's
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer(eos_token_ids)
            return self._tokenizer

    def _load_tokenizer(self, eos_token_ids):
        import llguidance.hf
        from transformers import AutoTokenizer

        if not self.tokenizer_path:
            raise RequestError("structured outputs need the model's tokenizer, which this instance was not "
                               "given", "structured_outputs")
        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=self.vocab_size,
                                                     eos_token=sorted(eos_token_ids) or None)
        except (OSError, ValueError) as e:  # no tokenizer there, or not a fast one
            raise RequestError(f"structured outputs need the model's fast tokenizer: {e}",
                               "structured_outputs") from None
        logger.info("structured outputs: llguidance's tokenizer built from %s (%d tokens)", self.tokenizer_path,
                    self.vocab_size)
        return tokenizer

    def prepare(self, params, eos_token_ids) -> Future | None:
        """Start building the grammar of ``params`` (a request's ``StructuredOutputsParams``)
        on the builder thread unless this instance has it; None: it has (a request carrying
        it is admitted at once), else the build's future (done: call ``prepare`` again or
        ``matcher``)."""
        grammar = params.compiled
        if grammar in self._templates:
            return None
        future = self._building.get(grammar)
        if future is None:
            if self._builder is None:
                self._builder = ThreadPoolExecutor(1, thread_name_prefix="hydrad-grammar")
            future = self._building[grammar] = self._builder.submit(self._build, grammar, tuple(eos_token_ids))
            return future
        if not future.done():
            return future
        self._template(grammar, eos_token_ids)  # kept from now on
        return None

    def matcher(self, req):
        """``req``'s matcher, past the tokens it has generated; RequestError where its grammar
        does not compile with this model's tokenizer or those tokens do not fit it. Built
        here (or waited for, where ``prepare`` started it) the first time this instance sees
        the grammar; a copy of that one after."""
        template = self._template(req.sampling_params.structured_outputs.compiled, req.eos_token_ids)
        if isinstance(template, RequestError):
            raise RequestError(str(template), template.param)
        matcher = template.deep_copy()
        if req.output_token_ids:
            matcher.consume_tokens(req.output_token_ids)
            if matcher.is_error():
                raise RequestError(f"structured outputs: {one_line(matcher.get_error())}", "structured_outputs")
        return matcher

    def _template(self, grammar: str, eos_token_ids):
        template = self._templates.get(grammar)
        if template is not None:
            self._templates.move_to_end(grammar)
            return template
        future = self._building.pop(grammar, None)
        template = future.result() if future is not None else self._build(grammar, tuple(eos_token_ids))
        self._templates[grammar] = template
        while len(self._templates) > MAX_TEMPLATES:
            self._templates.popitem(last=False)
        return template

    def _build(self, grammar: str, eos_token_ids: tuple[int, ...]):
        """A fresh matcher of ``grammar``, or the RequestError that refuses it (on any thread)."""
        from llguidance import LLMatcher

        try:
            matcher = LLMatcher(self._llg_tokenizer(eos_token_ids), grammar, log_level=0)
        except RequestError as e:
            return e
        self.num_built += 1
        if matcher.is_error():
            return RequestError(f"structured outputs: {one_line(matcher.get_error())}", "structured_outputs")
        # Its first mask once here: the lexer states that takes are kept in every copy, whose
        # own first mask then costs microseconds instead of milliseconds (a large schema).
        scratch = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        return matcher

    def close(self) -> None:
        if self._builder is not None:
            self._builder.shutdown(wait=False, cancel_futures=True)
            self._builder = None

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
