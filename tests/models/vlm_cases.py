"""Conversations and references shared by the model tests of the variable-token families.

The images are noise of many sizes and aspect ratios, so each one has its own number of image
tokens (LLaVA-NeXT: its tile grid and unpadding; Qwen2-VL: its resized patch grid). The
reference is transformers on the checkpoint's own processor outputs, one conversation at a time.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from paged_greedy import PagedSequence, shuffled_blocks
from PIL import Image

NUM_NEW_TOKENS = 8


def noise(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def image(width: int, height: int, seed: int) -> dict:
    return {"type": "image", "image": noise(width, height, seed)}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def conversations() -> list[list[dict]]:
    """Two images of different aspect ratios in one turn, one image after text, text only, multi-turn."""
    return [
        [{"role": "user", "content": [image(100, 60, 1), text("Compare these two:"), image(60, 150, 2)]}],
        [{"role": "user", "content": [text("What is this?"), image(200, 200, 3)]}],
        [{"role": "user", "content": "Tell me a story about a brave little robot."}],
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": [image(300, 90, 4), text("What is in the picture?")]},
            {"role": "assistant", "content": "A long red bus."},
            {"role": "user", "content": "And its colour?"},
        ],
        [{"role": "user", "content": [image(30, 20, 5), image(90, 140, 6), text("Two images, side by side.")]}],
    ]


def hf_inputs(hf_processor, conversation: list[dict]) -> dict[str, torch.Tensor]:
    """The checkpoint's processor outputs for ``conversation`` (images as parts of the messages)."""
    images, messages = [], []
    for message in conversation:
        content = message["content"]
        if isinstance(content, str):
            content = [text(content)]
        parts = []
        for part in content:
            if part["type"] == "image":
                images.append(part["image"])
                parts.append({"type": "image"})
            else:
                parts.append(part)
        messages.append({"role": message["role"], "content": parts})
    prompt = hf_processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return dict(hf_processor(text=prompt, images=images or None, return_tensors="pt"))


def hf_greedy(hf, inputs: dict[str, torch.Tensor], num_new_tokens: int = NUM_NEW_TOKENS):
    """transformers' greedy continuation, and its logits at every position of prompt + continuation
    but the last: the prompt's from one forward, the continuation's as ``generate`` computed them."""
    with torch.no_grad():
        out = hf.generate(**inputs, do_sample=False, max_new_tokens=num_new_tokens, min_new_tokens=num_new_tokens,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        prompt_logits = hf(**inputs).logits[0]
    num_prompt = inputs["input_ids"].shape[1]
    # out.logits[k] (raw, before min_new_tokens masks EOS) predicts new token k from the token before it.
    logits = torch.cat([prompt_logits, *(step[:1] for step in out.logits[1:])])
    return out.sequences[0, num_prompt:].tolist(), logits


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
