"""Turns a scheduled batch into tensors, runs the model, samples.

The runner owns the cache pools (one KV tensor, one image tensor) so they can be
shared with other processes once at start. Vision work (``encode``) and language
work (``execute``) are separate entry points: the engine may run them at the same
time on two executors.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from hydrad.models.attention.metadata import AttentionMetadata
from hydrad.engine.grammar_mask import GrammarMasks
from hydrad.engine.pages import PoolBacking
from hydrad.engine.input_batch import InputBatch
from hydrad.engine.request import Request
from hydrad.engine.inputs import PromptLogprobs
from hydrad.engine.sampler import Sampler, SamplerOutput, rows_logprobs
from hydrad.models.qwen2_vl import mrope_positions_slice


# Prompt positions priced at once (``ModelRunner._price_prompt``): a vocabulary's logits each.
PROMPT_LOGPROBS_ROWS = 256


class ModelRunner:
    def __init__(
        self,
        model,
        *,
        device: torch.device,
        dtype: torch.dtype,
        num_kv_blocks: int,
        kv_block_size: int,
        num_image_blocks: int,
        image_block_size: int,
        sampler: Sampler,
        shared: bool = False,
        max_blocks_per_seq: int = 0,
        vocab_size: int = 0,
        tokenizer_path: str | None = None,
    ):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.kv_block_size = kv_block_size
        self.image_block_size = image_block_size
        self.sampler = sampler
        # Qwen2-VL's decoder rotates by 3-D positions that the requests carry (M-RoPE).
        self.uses_mrope = model.uses_mrope
        self.shared = shared
        self.backing = PoolBacking()  # the shared pools' pages, backed on threads
        self.max_blocks_per_seq = max_blocks_per_seq
        self.vocab_size = vocab_size
        # Structured outputs' matchers and masks (the tokenizer, from ``tokenizer_path``, on first use).
        self.grammars = GrammarMasks(tokenizer_path, vocab_size)
        # A pool of 0 blocks is not allocated: the role does not use that cache.
        # kv_cache [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]; batch: the
        # rows of the requests running language steps (only instances with a KV cache).
        self.kv_cache: torch.Tensor | None = None
        self.batch: InputBatch | None = None
        # [num_blocks, block_size, hidden]: projected image features, the rows prefill reads
        self.image_cache: torch.Tensor | None = None
        if num_kv_blocks:
            self.allocate_kv_cache(num_kv_blocks)
        if num_image_blocks:
            self.allocate_image_cache(num_image_blocks)

    def allocate_kv_cache(self, num_blocks: int, pool: torch.Tensor | None = None) -> None:
        """``pool``: one made ahead (``new_pool``) for this shape, taken as it is."""
        self.kv_cache = self._made(self.model.kv_cache_shape(num_blocks, self.kv_block_size), pool)
        self.batch = InputBatch(self.max_blocks_per_seq, self.vocab_size, self.sampler, self.device, self.grammars)

    def allocate_image_cache(self, num_blocks: int, pool: torch.Tensor | None = None) -> None:
        self.image_cache = self._made(self.image_cache_shape(num_blocks), pool)

    def image_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.image_block_size, self.model.image_hidden_size)

    def new_pool(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A pool of ``shape`` as ``allocate_*`` would make it, attached to nothing: safe to
        make on another thread while this runner steps."""
        return self._pool(shape, self.shared)

    def _made(self, shape: tuple[int, ...], pool: torch.Tensor | None) -> torch.Tensor:
        if pool is not None and tuple(pool.shape) == tuple(shape) and pool.is_shared() == (
                self.shared and self.device.type == "cpu"):
            return pool
        return self._pool(shape, self.shared)

    def share_pools(self) -> int:
        """Move the pools to shared memory (in place: data and views stay); new pools follow.
        Returns the bytes moved (0 where they were there already, or on a GPU)."""
        moved = 0
        if not self.shared:
            self.shared = True
            for pool in (self.kv_cache, self.image_cache):
                if pool is not None and pool.device.type == "cpu":
                    pool.share_memory_()
                    moved += pool.untyped_storage().nbytes()
        return moved

    def free_kv_cache(self) -> None:
        """Drop the KV pool (peers that still hold a view keep its memory alive until they let go)."""
        self.kv_cache, self.batch = None, None

    def free_image_cache(self) -> None:
        self.image_cache = None

    def _pool(self, shape: tuple[int, ...], shared: bool) -> torch.Tensor:
        # Other instances copy straight out of this pool (pull-based migration): on CPU it must
        # live in shared memory; CUDA memory is exported through IPC handles by torch itself.
        if shared and self.device.type == "cpu":
            # Made in shared memory at once (not zeroed privately, then copied there); its
            # pages are backed on a thread of their own (``pages``): new shared memory reads
            # as zeros either way.
            nbytes = math.prod(shape) * torch.empty((), dtype=self.dtype).element_size()
            storage = torch.UntypedStorage._new_shared(nbytes)
            self.backing.back(storage, "cache pool")
            return torch.empty(0, dtype=self.dtype).set_(storage, 0, shape)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # -- migration ------------------------------------------------------------------------------
    @torch.inference_mode()
    def copy_in(self, kind: str, src_pool: torch.Tensor, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        """Copy blocks of another instance's pool into ours (same block size on both sides)."""
        src = torch.tensor(src_block_ids, dtype=torch.long, device=src_pool.device)
        dst = torch.tensor(dst_block_ids, dtype=torch.long, device=self.device)
        if kind == "kv":
            # blocks are dim 2 of [num_layers, 2, num_blocks, ...]
            self.kv_cache.index_copy_(2, dst, src_pool.index_select(2, src).to(self.device))
        else:
            self.image_cache.index_copy_(0, dst, src_pool.index_select(0, src).to(self.device))

    # -- vision ------------------------------------------------------------------------------
    def _image_slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        # flat slots in the image cache of image tokens [start, end)
        rel = torch.arange(start, end)
        blocks = torch.tensor(block_ids, dtype=torch.long)
        return blocks[rel // self.image_block_size] * self.image_block_size + rel % self.image_block_size

    @torch.inference_mode()
    def encode(self, encodes: list[tuple[Request, int]]) -> None:
        """Encode the listed images and write their features into their image-cache blocks.

        The model batches them as its family can (one tower call for LLaVA-1.5's equal crops,
        for LLaVA-NeXT's tiles, for Qwen2-VL's patches) and returns one feature matrix per image.
        """
        flat_cache = self.image_cache.view(-1, self.image_cache.shape[-1])
        features = self.model.encode_images([req.images[index] for req, index in encodes])
        for (req, index), feats in zip(encodes, features):
            # feats: [num_image_tokens, hidden]
            image = req.images[index]
            if feats.shape[0] != image.length:
                raise ValueError(
                    f"request {req.req_id}: image {index} has {image.length} placeholder tokens "
                    f"but encodes to {feats.shape[0]}"
                )
            slots = self._image_slots(req.image_block_ids[index], 0, image.length).to(self.device)
            flat_cache[slots] = feats.to(self.dtype)

    # -- language -----------------------------------------------------------------------------
    def drop(self, reqs) -> None:
        """These requests left the running set: free their batch rows."""
        for req in reqs:
            self.batch.remove(req)

    @torch.inference_mode()
    def execute(self, chunks: list[tuple[Request, int]], num_decodes: int = 0) -> SamplerOutput:
        """Run prefill chunks and decodes in one flattened forward; sample one token for
        every request whose chunk reaches the end of its tokens, in chunk order.

        ``num_decodes``: the first chunks are this many decodes (one new token, the request's
        last, past its prompt: the scheduler's order); their inputs are gathered column by
        column rather than request by request."""
        batch = self.batch
        decodes = [req for req, _ in chunks[:num_decodes]]
        rows = batch.rows_of(decodes)
        starts = [req.num_computed_tokens for req in decodes]
        token_ids = [req.output_token_ids[-1] for req in decodes]
        query_lens = [1] * num_decodes
        sample_rows, sample_pos, sample_reqs = list(rows), list(range(num_decodes)), list(decodes)
        mm_dst, mm_src = [], []
        # Chunks of requests that asked for their prompt's log-probabilities: (request, its
        # first row in the step, the prompt positions [lo, hi) whose next token they price).
        prompt_spans, wants_prompt = [], False
        offset = num_decodes
        for req, num_new in chunks[num_decodes:]:
            (row,) = batch.rows_of([req])
            start = req.num_computed_tokens
            end = start + num_new
            rows.append(row)
            starts.append(start)
            query_lens.append(num_new)
            if num_new == 1 and start >= req.num_prompt_tokens:
                token_ids.append(req.output_token_ids[start - req.num_prompt_tokens])
            else:
                token_ids.extend(req.token_ids(start, end))
            if req.num_held_images:
                self._place_images(req, start, end, offset, mm_dst, mm_src)
            if req.prompt_logprobs is not None:
                wants_prompt = True
                # Those not priced yet (a recompute after preemption priced them before); a chunk
                # past a gap (none: such a request skips the prefix cache) prices nothing.
                lo, hi = max(start, len(req.prompt_logprobs)), min(end, req.num_prompt_tokens - 1)
                if start <= len(req.prompt_logprobs) and lo < hi:
                    prompt_spans.append((req, offset + lo - start, lo, hi))
            offset += num_new
            if end == req.num_tokens:
                sample_rows.append(row)
                sample_pos.append(offset - 1)
                sample_reqs.append(req)

        device = self.device
        rows_np = np.array(rows, dtype=np.int64)
        query_lens_np = np.array(query_lens, dtype=np.int64)
        seq_lens = np.array(starts, dtype=np.int64) + query_lens_np
        max_num_blocks = -(-int(seq_lens.max()) // self.kv_block_size)
        meta = AttentionMetadata.build(query_lens_np, seq_lens, batch.block_table[rows_np, :max_num_blocks],
                                       self.kv_block_size, device, mask_dtype=self.dtype)
        input_ids = torch.from_numpy(np.array(token_ids, dtype=np.int64)).to(device)  # torch.tensor: 2x slower
        embeds = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        if mm_dst:
            flat_cache = self.image_cache.view(-1, self.image_cache.shape[-1])
            embeds[torch.cat(mm_dst).to(device)] = flat_cache[torch.cat(mm_src).to(device)].to(embeds.dtype)
        positions = meta.positions
        if self.uses_mrope:
            positions = self._mrope_positions(chunks, starts, query_lens_np).to(device)
        hidden = self.model(embeds, positions, self.kv_cache, meta)
        for span in prompt_spans:
            self._price_prompt(hidden, *span)
        if not sample_reqs:
            return SamplerOutput([])
        if len(sample_pos) < hidden.shape[0]:
            hidden = hidden[torch.tensor(sample_pos, device=device)]
        logits = self.model.compute_logits(hidden)  # (every token samples: they are in order)
        sample_rows_np = np.array(sample_rows, dtype=np.int64)
        out = self.sampler.sample(logits, batch.sampling_metadata(sample_rows_np, sample_reqs))
        batch.add_sampled(sample_rows_np, out.token_ids)
        if wants_prompt:
            # A request's first token carries its prompt's log-probabilities (its row has
            # logprobs: ``InputBatch.add``).
            for j, req in enumerate(sample_reqs):
                entries = req.prompt_logprobs
                if entries is not None and not req.output_token_ids and len(entries) == req.num_prompt_tokens - 1:
                    out.logprobs[j].prompt = PromptLogprobs(req.prompt_token_ids[0], entries)
        return out

    def _price_prompt(self, hidden: torch.Tensor, req: Request, row: int, lo: int, hi: int) -> None:
        """Append to ``req.prompt_logprobs`` the log-probabilities of its prompt tokens ``lo + 1``
        to ``hi``, from the hidden states of positions ``lo`` to ``hi - 1`` (rows ``row`` on), as
        the sampler's logprobs are: of the raw distribution, with the rank and the most likely."""
        k = req.sampling_params.prompt_logprobs
        for first in range(lo, hi, PROMPT_LOGPROBS_ROWS):  # a vocabulary's row each: in slices
            n = min(PROMPT_LOGPROBS_ROWS, hi - first)
            start = row + first - lo
            raw = torch.log_softmax(self.model.compute_logits(hidden[start:start + n]), dim=-1)
            targets = torch.tensor(req.prompt_token_ids[first + 1:first + 1 + n], dtype=torch.long, device=raw.device)
            req.prompt_logprobs += rows_logprobs(raw, np.arange(n), np.full(n, k), targets, n)

    @staticmethod
    def _mrope_positions(chunks: list[tuple[Request, int]], starts: list[int], query_lens: np.ndarray) -> torch.Tensor:
        """The step's M-RoPE positions from what each request carries (never from the sequence
        index alone): [num_tokens] when every token's three positions are equal (text-only prompts
        and generated tokens: sequence index + delta), else [3, num_tokens], where the chunks
        through a prompt with images take that prompt's own positions."""
        num_tokens = int(query_lens.sum())
        starts_np = np.array(starts, dtype=np.int64)
        deltas = np.fromiter((req.mrope_delta for req, _ in chunks), dtype=np.int64, count=len(chunks))
        first_token = np.cumsum(query_lens) - query_lens
        flat = torch.from_numpy(np.arange(num_tokens) + np.repeat(starts_np + deltas - first_token, query_lens))
        positions = None
        for (req, num_new), start, offset in zip(chunks, starts, first_token.tolist()):
            if req.mrope_positions is None or start >= req.num_prompt_tokens:
                continue
            if positions is None:
                positions = flat.expand(3, -1).clone()
            # A chunk through the prompt (and, recomputed after preemption, its generated tokens).
            positions[:, offset : offset + num_new] = mrope_positions_slice(
                req.mrope_positions, req.mrope_delta, start, start + num_new)
        return flat if positions is None else positions

    def _place_images(self, req: Request, start: int, end: int, offset: int, mm_dst: list, mm_src: list) -> None:
        """Image-cache rows of the image tokens in [start, end) and where they go in the batch."""
        for i, image in enumerate(req.images):
            lo, hi = max(start, image.offset), min(end, image.offset + image.length)
            if lo < hi:
                mm_src.append(self._image_slots(req.image_block_ids[i], lo - image.offset, hi - image.offset))
                mm_dst.append(torch.arange(lo - start, hi - start) + offset)
