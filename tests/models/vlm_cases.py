"""Helpers shared by the model tests of the variable-token families: our model through the
loader, and paged greedy runs of processed prompts (the conversations and transformers'
references are in ``factories``)."""

from __future__ import annotations

import random

import torch
from factories import NUM_NEW_TOKENS
from paged_greedy import PagedSequence, shuffled_blocks


def paged_sequences(model, prompts, block_size: int, rng: random.Random, num_new_tokens: int = NUM_NEW_TOKENS):
    """PagedSequences for processed prompts: every image of every prompt encoded in one call, its
    features written over its placeholder rows; and the KV cache they share."""
    images = [im for prompt in prompts for im in prompt.images]
    features = iter(model.encode_images(images) if images else ())
    tables, num_blocks = shuffled_blocks([len(p.prompt_token_ids) + num_new_tokens for p in prompts], block_size, rng)
    seqs = []
    for i, (prompt, block_ids) in enumerate(zip(prompts, tables)):
        embeds = model.embed_tokens(torch.tensor(prompt.prompt_token_ids))
        for im in prompt.images:
            embeds[im.offset : im.offset + im.length] = next(features)
        mrope = (prompt.mrope_positions, prompt.mrope_delta) if model.uses_mrope else None
        seqs.append(PagedSequence(embeds, block_ids, num_new_tokens, start_step=2 * i, mrope=mrope))
    return seqs, torch.zeros(model.kv_cache_shape(num_blocks, block_size))


def load_ours(model_cls, path, **kwargs):
    """Our model of the checkpoint at ``path``, through the loader as the engine reads it."""
    from hydrad.models.loader import iter_weights, load_config

    model = model_cls(load_config(path), **kwargs)
    model.load_weights(iter_weights(path, torch.float32))
    return model


def num_cuts_inside_images(seqs, prompts) -> int:
    """How many prefill chunks ended strictly inside an image's placeholder run."""
    return sum(im.offset < cut < im.offset + im.length
               for s, prompt in zip(seqs, prompts) for cut in s.prefill_cuts for im in prompt.images)
