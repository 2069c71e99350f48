"""Turns a scheduled batch into tensors, runs the model, samples.

The runner owns the cache pools (one KV tensor, one image tensor) so they can be
shared with other processes once at start. Vision work (``encode``) and language
work (``execute``) are separate entry points: the engine may run them at the same
time on two executors.
"""

from __future__ import annotations

import torch

from hydrad.engine.attention.metadata import AttentionMetadata
from hydrad.engine.request import Request
from hydrad.engine.sampler import Sampler


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
    ):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.kv_block_size = kv_block_size
        self.image_block_size = image_block_size
        self.sampler = sampler
        # A pool of 0 blocks is not allocated: the role does not use that cache.
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = self._pool(model.kv_cache_shape(num_kv_blocks, kv_block_size), shared) if num_kv_blocks else None
        # [num_blocks, block_size, hidden]: projected image features, the rows prefill reads
        self.image_cache = (
            self._pool((num_image_blocks, image_block_size, model.image_hidden_size), shared)
            if num_image_blocks
            else None
        )

    def _pool(self, shape: tuple[int, ...], shared: bool) -> torch.Tensor:
        pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # Other instances copy straight out of this pool (pull-based migration): on CPU it must
        # live in shared memory; CUDA memory is exported through IPC handles by torch itself.
        return pool.share_memory_() if shared and pool.device.type == "cpu" else pool

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
    @torch.inference_mode()
    def execute(self, chunks: list[tuple[Request, int]]) -> dict[str, int]:
        """Run prefill chunks and decodes in one flattened forward; return the token sampled
        for every request that has caught up with its tokens."""
        token_ids: list[int] = []
        positions: list[torch.Tensor] = []
        query_lens, seq_lens, block_tables = [], [], []
        mm_dst, mm_src = [], []
        sample_rows, sample_reqs = [], []
        offset = 0
        for req, num_new in chunks:
            start = req.num_computed_tokens
            end = start + num_new
            token_ids.extend(req.token_ids(start, end))
            positions.append(torch.arange(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
            block_tables.append(req.kv_block_ids)
            for i, image in enumerate(req.images):
                lo, hi = max(start, image.offset), min(end, image.offset + image.length)
                if lo < hi:
                    mm_src.append(self._image_slots(req.image_block_ids[i], lo - image.offset, hi - image.offset))
                    mm_dst.append(torch.arange(lo - start, hi - start) + offset)
            if end == req.num_tokens:
                sample_rows.append(offset + num_new - 1)
                sample_reqs.append(req)
            offset += num_new

        device = self.device
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        embeds = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        if mm_dst:
            flat_cache = self.image_cache.view(-1, self.image_cache.shape[-1])
            embeds[torch.cat(mm_dst).to(device)] = flat_cache[torch.cat(mm_src).to(device)].to(embeds.dtype)
        meta = AttentionMetadata.build(query_lens, seq_lens, block_tables, self.kv_block_size, device)
        hidden = self.model(embeds, torch.cat(positions).to(device), self.kv_cache, meta)
        if not sample_reqs:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=device)])
        params = [r.sampling_params for r in sample_reqs]
        generators = []
        for req in sample_reqs:
            if not req.sampling_params.greedy and req.generator is None:
                req.generator = self.sampler.generator_for(req.sampling_params)
            generators.append(req.generator)
        sampled = self.sampler.sample(logits, params, generators)
        return {req.req_id: tok for req, tok in zip(sample_reqs, sampled)}
