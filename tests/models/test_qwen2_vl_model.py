"""Qwen2-VL and Qwen2.5-VL (dynamic resolution, M-RoPE) against transformers on tiny checkpoints."""

from __future__ import annotations

import random

import pytest
import torch
from factories import conversations, hf_greedy, hf_inputs, hf_model, image, text
from paged_greedy import run_greedy
from vlm_cases import load_ours, num_cuts_inside_images, paged_sequences

from hydrad.models.attention import AttentionMetadata
from hydrad.errors import CheckpointError
from hydrad.models.linear import ENV_SWITCH
from hydrad.models.loader import load_config
from hydrad.models.qwen2_vl import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
    get_mrope_positions,
    mrope_positions_slice,
)
from hydrad.models.registry import get_model_class
from hydrad.processor import InputProcessor

MODEL_CLASSES = {"qwen2-vl": Qwen2VLForConditionalGeneration, "qwen2.5-vl": Qwen2_5_VLForConditionalGeneration}


@pytest.fixture(scope="module", params=list(MODEL_CLASSES))
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, arch):
    return tiny_checkpoint(arch)


@pytest.fixture(scope="module")
def hf(checkpoint):
    return hf_model(checkpoint)


@pytest.fixture(scope="module")
def processor(checkpoint):
    return InputProcessor(checkpoint)


@pytest.fixture(scope="module")
def ours(checkpoint, arch):
    return load_ours(MODEL_CLASSES[arch], checkpoint)


@pytest.fixture(scope="module")
def references(hf, processor):
    """Per conversation: our processed prompt, transformers' processor outputs, greedy tokens and logits."""
    refs = []
    for conv in conversations():
        prompt = processor.process_chat(conv)
        inputs = hf_inputs(processor.processor, conv)
        assert inputs["input_ids"][0].tolist() == prompt.prompt_token_ids
        refs.append((prompt, inputs, *hf_greedy(hf, inputs)))
    return refs


def test_registry_and_interface(checkpoint, arch, ours):
    assert get_model_class(load_config(checkpoint)) is MODEL_CLASSES[arch]
    assert ours.uses_mrope and ours.image_hidden_size == 64 and ours.default_image_block_size == 64


def test_tokens_per_image_follow_the_resized_patch_grid(processor):
    # The processor resizes to multiples of 28 within [56 * 56, 28 * 28 * 64] pixels; every
    # 2 x 2 of its 14-pixel patches is one token.
    sizes = {(100, 60): (2, 4), (60, 150): (5, 2), (200, 200): (7, 7), (30, 20): (2, 3), (1000, 300): (4, 14)}
    for k, ((width, height), (rows, cols)) in enumerate(sizes.items()):
        prompt = processor.process_chat([{"role": "user", "content": [image(width, height, k), text("Hi")]}])
        (im,) = prompt.images
        placeholders = sum(t == processor.image_token_id for t in prompt.prompt_token_ids)
        assert im.grid_thw == (1, 2 * rows, 2 * cols), (width, height)
        assert im.length == placeholders == rows * cols
        assert tuple(im.pixel_values.shape) == (4 * rows * cols, 3 * 2 * 14 * 14)


def test_mrope_positions_match_get_rope_index(hf, references):
    num_with_images = 0
    for prompt, inputs, _, _ in references:
        ref_positions, ref_delta = hf.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs.get("image_grid_thw")
        )
        if prompt.images:
            num_with_images += 1
            assert prompt.mrope_positions.dtype == torch.int64
            assert torch.equal(prompt.mrope_positions, ref_positions[:, 0])
            assert prompt.mrope_delta == int(ref_delta) < 0
        else:
            # A text-only prompt carries no positions: the flat arange, which transformers computes too.
            assert prompt.mrope_positions is None and prompt.mrope_delta == 0
            num_prompt = len(prompt.prompt_token_ids)
            assert torch.equal(mrope_positions_slice(None, 0, 0, num_prompt), ref_positions[:, 0])
    assert num_with_images >= 3


def test_mrope_slices_continue_as_transformers_does(hf, references):
    # Positions sliced at chunk boundaries (inside images too) and past the prompt (generated
    # tokens) are the positions transformers gives the whole generated sequence.
    rng = random.Random(0)
    for prompt, inputs, tokens, _ in references:
        num_prompt = len(prompt.prompt_token_ids)
        full_ids = torch.cat([inputs["input_ids"], torch.tensor([tokens])], dim=1)
        types = torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, len(tokens)))
        ref_positions, _ = hf.model.get_rope_index(full_ids, types, inputs.get("image_grid_thw"))
        cuts = sorted(rng.sample(range(1, full_ids.shape[1]), 5))
        bounds = [0, *cuts, full_ids.shape[1]]
        pieces = [mrope_positions_slice(prompt.mrope_positions, prompt.mrope_delta, a, b)
                  for a, b in zip(bounds, bounds[1:])]
        assert torch.equal(torch.cat(pieces, dim=1), ref_positions[:, 0]), num_prompt


def test_adjacent_images_are_told_apart_by_their_grids():
    # Two image runs with nothing between them: a 2 x 3 grid of merged tokens, then a 1 x 2.
    pad, ids = 9, [1, 2] + [9] * 6 + [9] * 2 + [3]
    positions, delta = get_mrope_positions(ids, pad, [(1, 4, 6), (1, 2, 4)], 2)
    assert positions[:, :2].tolist() == [[0, 1]] * 3
    assert positions[:, 2:8].tolist() == [[2] * 6, [2, 2, 2, 3, 3, 3], [2, 3, 4, 2, 3, 4]]
    # The second image starts after the first's larger side (3).
    assert positions[:, 8:10].tolist() == [[5, 5], [5, 5], [5, 6]]
    assert positions[:, 10].tolist() == [7, 7, 7]
    assert delta == 7 + 1 - len(ids)
    with pytest.raises(ValueError, match="cover 8"):
        get_mrope_positions(ids + [9], pad, [(1, 4, 6), (1, 2, 4)], 2)
    with pytest.raises(ValueError, match="do not form a run"):
        get_mrope_positions([9, 9, 1, 9, 9], pad, [(1, 2, 8)], 2)


def test_encode_images_matches_transformers(ours, hf, references):
    # All images of all conversations in one call; the reference encodes each conversation's alone.
    images = [im for prompt, _, _, _ in references for im in prompt.images]
    features = ours.encode_images(images)
    refs = []
    for _, inputs, _, _ in references:
        if "pixel_values" in inputs:
            with torch.no_grad():
                refs += hf.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    assert [f.shape for f in features] == [r.shape for r in refs]
    assert len({f.shape[0] for f in features}) >= 4
    for got, ref in zip(features, refs):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("layout", ["hub", "module"])
def test_prompt_logits_match_transformers(tiny_checkpoint, arch, hf, references, layout):
    model = load_ours(MODEL_CLASSES[arch], tiny_checkpoint(arch, layout))
    prompt, inputs, _, _ = references[0]  # two images of different aspect ratios
    ids = torch.tensor(prompt.prompt_token_ids)
    embeds = model.embed_tokens(ids)
    for im, feats in zip(prompt.images, model.encode_images(prompt.images)):
        embeds[im.offset : im.offset + im.length] = feats
    kv_cache = torch.zeros(model.kv_cache_shape(8, 16))
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[7, 2, 5, 0, 1, 3, 4, 6]], 16, torch.device("cpu"))
    logits = model.compute_logits(model(embeds, prompt.mrope_positions, kv_cache, meta))
    with torch.no_grad():
        ref = hf(**inputs).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


def test_paged_chunked_greedy_matches_generate(ours, arch, processor, references):
    # An odd block size for one family, the usual one for the other (block sizes are the
    # attention backend's concern, tested with every size in the LLaVA tests).
    block_size = {"qwen2-vl": 3, "qwen2.5-vl": 16}[arch]
    rng = random.Random(block_size)
    prompts = [prompt for prompt, _, _, _ in references]
    seqs, kv_cache = paged_sequences(ours, prompts, block_size, rng)
    # A budget of 11 tokens cuts prefill chunks inside image runs.
    assert run_greedy(ours, seqs, kv_cache, block_size, 11, rng, suppressed=processor.eos_token_ids) > 0
    assert num_cuts_inside_images(seqs, prompts) >= 3
    for b, (s, (_, _, ref_tokens, ref_logits)) in enumerate(zip(seqs, references)):
        assert s.new_tokens == ref_tokens, f"conversation {b}"
        logits = torch.stack([s.logits[p] for p in sorted(s.logits)])
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4, msg=f"conversation {b}")


def test_vision_only_and_language_only_load_their_parts(checkpoint, arch, monkeypatch):
    # The loaded weights as parameters: CPU weight packing would turn the linear ones into buffers.
    monkeypatch.setenv(ENV_SWITCH, "0")
    ours = load_ours(MODEL_CLASSES[arch], checkpoint)
    vision = load_ours(MODEL_CLASSES[arch], checkpoint, load_language=False)
    language = load_ours(MODEL_CLASSES[arch], checkpoint, load_vision=False)
    full = dict(ours.named_parameters())
    for part, roots in ((vision, {"vision_tower"}), (language, {"language_model", "lm_head"})):
        params = dict(part.named_parameters())
        assert {name.split(".")[0] for name in params} == roots
        assert all(torch.equal(param, full[name]) for name, param in params.items())
    assert any(name.startswith("vision_tower.merger.") for name in dict(vision.named_parameters()))


def test_decoder_config_errors(checkpoint, arch):
    config = load_config(checkpoint)
    config.text_config.rope_parameters["mrope_section"] = [2, 3, 4]
    with pytest.raises(CheckpointError, match=r"mrope_section \[2, 3, 4\] must sum to head_dim / 2 = 8"):
        MODEL_CLASSES[arch](config, load_vision=False)
    config = load_config(checkpoint)
    config.text_config.layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(CheckpointError, match="sliding-window attention layers are not supported"):
        MODEL_CLASSES[arch](config, load_vision=False)
