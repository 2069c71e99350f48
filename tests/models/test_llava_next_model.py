"""LLaVA-NeXT (anyres tiles, unpadding, image_newline) against transformers on tiny checkpoints."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from factories import conversations, hf_greedy, hf_inputs, hf_model, image, text
from paged_greedy import run_greedy
from vlm_cases import load_ours, num_cuts_inside_images, paged_sequences

from hydrad.models.attention import AttentionMetadata
from hydrad.errors import CheckpointError
from hydrad.models.linear import ENV_SWITCH
from hydrad.models.llava_next import LlavaNextForConditionalGeneration, num_image_tokens
from hydrad.models.loader import canonical_name, load_config
from hydrad.processor import InputProcessor

ARCH = "llava-next"


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint(ARCH)


@pytest.fixture(scope="module")
def hf(checkpoint):
    return hf_model(checkpoint)


@pytest.fixture(scope="module")
def processor(checkpoint):
    return InputProcessor(checkpoint)


@pytest.fixture(scope="module")
def ours(checkpoint):
    return load_ours(LlavaNextForConditionalGeneration, checkpoint)


def test_tokens_per_image_follow_size_and_aspect_ratio(processor):
    config = processor.hf_config
    sizes = [(100, 60), (60, 150), (200, 200), (30, 20), (300, 90), (56, 56)]  # (width, height)
    lengths = []
    for k, (width, height) in enumerate(sizes):
        prompt = processor.process_chat([{"role": "user", "content": [image(width, height, k), text("Hi")]}])
        (im,) = prompt.images
        placeholders = sum(t == config.image_token_id for t in prompt.prompt_token_ids)
        assert im.length == placeholders == num_image_tokens(config, (height, width))
        assert im.image_size == (height, width)
        lengths.append(im.length)
    # Worked by hand: 60 x 150 fits the 3 x 1 tile grid (12 x 4 patches); scaled to 4 columns it is
    # 10 rows high, so one padding row goes at each end: 16 base + 10 rows x (4 + 1).
    assert lengths[1] == 16 + 10 * (4 + 1)
    # 300 x 90 fits the 1 x 3 grid (4 x 12 patches); scaled it is 3.6 rows high, too little padding
    # to drop a row: 16 + 4 x (12 + 1).
    assert lengths[4] == 16 + 4 * (12 + 1)
    assert len(set(lengths)) >= 4, lengths


def test_encode_images_matches_transformers(ours, hf, processor):
    # All images of all conversations in one call, as the engine batches them; the reference
    # encodes each conversation's images alone.
    convs = [c for c in conversations() if any(isinstance(m["content"], list) and
                                               any(p["type"] == "image" for p in m["content"]) for m in c)]
    prompts = [processor.process_chat(c) for c in convs]
    features = ours.encode_images([im for p in prompts for im in p.images])
    refs = []
    for conv in convs:
        inputs = hf_inputs(processor.processor, conv)
        with torch.no_grad():
            refs += hf.get_image_features(inputs["pixel_values"], inputs["image_sizes"]).pooler_output
    assert [f.shape for f in features] == [r.shape for r in refs]
    assert len({f.shape[0] for f in features}) >= 4
    for got, ref in zip(features, refs):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


def _prompt_logits(model, processor, conversation) -> torch.Tensor:
    prompt = processor.process_chat(conversation)
    ids = torch.tensor(prompt.prompt_token_ids)
    embeds = model.embed_tokens(ids)
    for im, feats in zip(prompt.images, model.encode_images(prompt.images)):
        embeds[im.offset : im.offset + im.length] = feats
    num_blocks = -(-len(ids) // 16)
    kv_cache = torch.zeros(model.kv_cache_shape(num_blocks, 16))
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(num_blocks))[::-1]], 16, torch.device("cpu"))
    return model.compute_logits(model(embeds, torch.arange(len(ids)), kv_cache, meta))


@pytest.mark.parametrize("layout", ["hub", "hf5", "module"])
def test_prompt_logits_match_transformers(tiny_checkpoint, hf, processor, layout):
    model = load_ours(LlavaNextForConditionalGeneration, tiny_checkpoint(ARCH, layout))
    conversation = conversations()[0]  # two images of different aspect ratios
    logits = _prompt_logits(model, processor, conversation)
    with torch.no_grad():
        ref = hf(**hf_inputs(processor.processor, conversation)).logits[0]
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


def test_llama_language_model_matches_transformers(checkpoint, processor):
    # llava-v1.6-vicuna: the same vision side over a Llama decoder.
    config = load_config(checkpoint)
    text_config = config.text_config
    config.text_config = transformers.LlamaConfig(
        **{k: getattr(text_config, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                                 "num_attention_heads", "num_key_value_heads", "head_dim",
                                                 "max_position_embeddings")},
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    torch.manual_seed(1)
    hf = transformers.LlavaNextForConditionalGeneration(config).eval()
    ours = LlavaNextForConditionalGeneration(config)
    ours.load_weights((canonical_name("llava_next", name), t) for name, t in hf.state_dict().items())
    conversation = conversations()[4]  # a tiny image next to a tall one
    with torch.no_grad():
        ref = hf(**hf_inputs(processor.processor, conversation)).logits[0]
    torch.testing.assert_close(_prompt_logits(ours, processor, conversation), ref, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def references(hf, processor):
    """Per conversation: our processed prompt, and transformers' greedy tokens and logits."""
    refs = []
    for conv in conversations():
        prompt = processor.process_chat(conv)
        inputs = hf_inputs(processor.processor, conv)
        assert inputs["input_ids"][0].tolist() == prompt.prompt_token_ids
        refs.append((prompt, *hf_greedy(hf, inputs)))
    return refs


@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_chunked_greedy_matches_generate(ours, processor, references, block_size):
    rng = random.Random(block_size)
    prompts = [prompt for prompt, _, _ in references]
    refs = [(tokens, logits) for _, tokens, logits in references]
    seqs, kv_cache = paged_sequences(ours, prompts, block_size, rng)
    # A budget of 13 tokens cuts prefill chunks inside image runs.
    assert run_greedy(ours, seqs, kv_cache, block_size, 13, rng, suppressed=processor.eos_token_ids) > 0
    assert num_cuts_inside_images(seqs, prompts) >= 3
    for b, (s, (ref_tokens, ref_logits)) in enumerate(zip(seqs, refs)):
        assert s.new_tokens == ref_tokens, f"conversation {b}"
        logits = torch.stack([s.logits[p] for p in sorted(s.logits)])
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4, msg=f"conversation {b}")


def test_vision_only_and_language_only_load_their_parts(checkpoint, monkeypatch):
    # The loaded weights as parameters: CPU weight packing would turn the linear ones into buffers.
    monkeypatch.setenv(ENV_SWITCH, "0")
    ours = load_ours(LlavaNextForConditionalGeneration, checkpoint)
    vision = load_ours(LlavaNextForConditionalGeneration, checkpoint, load_language=False)
    language = load_ours(LlavaNextForConditionalGeneration, checkpoint, load_vision=False)
    full = dict(ours.named_parameters())
    for part, roots in ((vision, {"vision_tower", "multi_modal_projector"}), (language, {"language_model", "lm_head"})):
        params = dict(part.named_parameters())
        assert {name.split(".")[0] for name in params} == roots
        assert all(torch.equal(param, full[name]) for name, param in params.items())
    assert "multi_modal_projector.image_newline" in dict(vision.named_parameters())


def test_missing_image_newline_is_named(checkpoint, hf):
    weights = {canonical_name("llava_next", n): t for n, t in hf.state_dict().items()}
    del weights["multi_modal_projector.image_newline"]
    model = LlavaNextForConditionalGeneration(load_config(checkpoint), load_language=False)
    with pytest.raises(CheckpointError, match=r"missing weights: multi_modal_projector\.image_newline"):
        model.load_weights(weights.items())


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"vision_feature_select_strategy": "full"}, "vision_feature_select_strategy 'full' is not supported"),
        ({"image_grid_pinpoints": [[56, 100]]}, r"\[56, 100\] is not a \(height, width\) multiple"),
    ],
)
def test_unsupported_configs_are_refused(checkpoint, changes, message):
    config = load_config(checkpoint)
    for key, value in changes.items():
        setattr(config, key, value)
    with pytest.raises(CheckpointError, match=message):
        LlavaNextForConditionalGeneration(config)
