import random

import pytest
import torch
import transformers
from paged_greedy import PagedSequence, run_greedy, shuffled_blocks
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, Qwen2Config

from hydrad.models.attention import AttentionMetadata
from hydrad.engine.inputs import ImageInput
from hydrad.errors import CheckpointError
from hydrad.models.linear import ENV_SWITCH
from hydrad.models.llava import LlavaForConditionalGeneration
from hydrad.models.registry import get_model_class

VOCAB = 320
IMAGE_TOKEN = VOCAB - 1
IMAGE_SIZE = 56  # 4 x 4 patches of 14 px: 16 image tokens
NUM_NEW_TOKENS = 6


def make_config(text: str = "llama", **llava_kwargs) -> LlavaConfig:
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=14,
    )
    common = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
    )
    if text == "llama":
        text_config = LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    else:  # Qwen2 style: q/k/v bias, tied embeddings, head_dim given explicitly
        text_config = Qwen2Config(**common, head_dim=16, tie_word_embeddings=True)
    return LlavaConfig(vision_config=vision, text_config=text_config, image_token_id=IMAGE_TOKEN, **llava_kwargs)


def make_pair(config: LlavaConfig, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    hf = transformers.LlavaForConditionalGeneration(config).eval()
    ours = LlavaForConditionalGeneration(config, **kwargs)
    ours.load_weights(canonical_weights(hf).items())
    return hf, ours


def canonical_weights(hf) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in hf.state_dict().items()}


def make_prompt(seed: int, num_images: int, num_text: int) -> tuple[torch.Tensor, torch.Tensor]:
    # BOS, then text with a run of 16 placeholders after every num_text // (num_images + 1) text tokens;
    # pixels: [num_images, 3, H, W]
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(3, IMAGE_TOKEN, (num_text,), generator=gen)
    step = num_text // (num_images + 1)
    pieces = [torch.tensor([1])]
    for i in range(num_images):
        pieces += [text[i * step : (i + 1) * step], torch.full((16,), IMAGE_TOKEN)]
    pieces.append(text[num_images * step :])
    pixels = torch.randn(num_images, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen)
    return torch.cat(pieces), pixels


def image_inputs(pixels: torch.Tensor) -> list[ImageInput]:
    return [ImageInput(pixel_values=p, offset=-1, length=16) for p in pixels]


def prompt_embeds(model: LlavaForConditionalGeneration, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    # The placeholder rows take the image features, in order, as transformers does.
    embeds = model.embed_tokens(ids)
    if len(pixels):
        embeds[ids == IMAGE_TOKEN] = torch.cat(model.encode_images(image_inputs(pixels)))
    return embeds


@pytest.fixture(scope="module")
def llava_pair():
    return make_pair(make_config())


@pytest.mark.parametrize(
    ("feature_layer", "strategy"), [(-2, "default"), ([-3, -1], "default"), (-1, "full"), ([0, 2], "full")]
)
def test_encode_images_matches_transformers(feature_layer, strategy):
    config = make_config(vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy)
    hf, ours = make_pair(config)
    pixels = torch.randn(3, 3, IMAGE_SIZE, IMAGE_SIZE)

    with torch.no_grad():
        ref = torch.stack(hf.get_image_features(pixels, feature_layer, strategy).pooler_output)
    features = torch.stack(ours.encode_images(image_inputs(pixels)))

    assert features.shape == (3, ours.num_image_tokens_per_image, ours.image_hidden_size)
    assert ours.num_image_tokens_per_image == (16 if strategy == "default" else 17)
    torch.testing.assert_close(features, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("text", ["llama", "qwen2"])
def test_full_prompt_logits_match_transformers(text):
    hf, ours = make_pair(make_config(text))
    ids, pixels = make_prompt(seed=1, num_images=2, num_text=21)

    with torch.no_grad():
        ref = hf(input_ids=ids[None], pixel_values=pixels).logits[0]
    kv_cache = torch.zeros(ours.kv_cache_shape(num_blocks=4, block_size=16))
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[3, 0, 2, 1]], 16, torch.device("cpu"))
    hidden = ours(prompt_embeds(ours, ids, pixels), torch.arange(len(ids)), kv_cache, meta)
    logits = ours.compute_logits(hidden)

    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    torch.testing.assert_close(logits, ref.float(), atol=1e-4, rtol=1e-4)


def hf_greedy(hf, ids: torch.Tensor, pixels: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    # transformers' greedy continuation, and its logits at every position of prompt + continuation
    kwargs = {"pixel_values": pixels} if len(pixels) else {}
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
            max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS, pad_token_id=0, **kwargs,
        )[0]
        logits = hf(input_ids=out[None, :-1], **kwargs).logits[0]
    return out[len(ids) :].tolist(), logits


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_paged_chunked_batches_match_transformers(llava_pair, block_size):
    hf, ours = llava_pair
    rng = random.Random(block_size)
    prompts = [make_prompt(10, 1, 13), make_prompt(11, 0, 9), make_prompt(12, 2, 20), make_prompt(13, 1, 2)]
    refs = [hf_greedy(hf, ids, pixels) for ids, pixels in prompts]

    tables, num_blocks = shuffled_blocks([len(ids) + NUM_NEW_TOKENS for ids, _ in prompts], block_size, rng)
    seqs = [
        PagedSequence(prompt_embeds(ours, ids, pixels), block_ids, NUM_NEW_TOKENS, start_step=3 * i)
        for i, ((ids, pixels), block_ids) in enumerate(zip(prompts, tables))
    ]
    kv_cache = torch.zeros(ours.kv_cache_shape(num_blocks, block_size))
    assert run_greedy(ours, seqs, kv_cache, block_size, token_budget=7, rng=rng) > 0

    for b, (s, (ref_tokens, ref_logits)) in enumerate(zip(seqs, refs)):
        assert s.new_tokens == ref_tokens, f"sequence {b}"
        assert sorted(s.logits) == list(range(len(ref_logits)))
        logits = torch.stack([s.logits[p] for p in sorted(s.logits)])
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4, msg=f"sequence {b}")


def test_load_weights_reports_missing_and_unexpected(llava_pair):
    hf, _ = llava_pair
    weights = canonical_weights(hf)
    del weights["language_model.layers.1.self_attn.k_proj.weight"]
    del weights["vision_tower.encoder.layers.0.mlp.fc1.bias"]
    weights["language_model.layers.0.self_attn.rotary.inv_freq"] = torch.zeros(8)
    model = LlavaForConditionalGeneration(make_config())

    with pytest.raises(CheckpointError) as excinfo:
        model.load_weights(weights.items())

    message = str(excinfo.value)
    assert (
        "missing weights: language_model.layers.1.self_attn.k_proj.weight, vision_tower.encoder.layers.0.mlp.fc1.bias"
    ) in message
    assert "unexpected weights: language_model.layers.0.self_attn.rotary.inv_freq" in message


def test_load_weights_rejects_wrong_shapes(llava_pair):
    hf, _ = llava_pair
    weights = canonical_weights(hf)
    weights["language_model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(CheckpointError, match="up_proj.weight has shape"):
        LlavaForConditionalGeneration(make_config()).load_weights(weights.items())


def test_vision_only_and_language_only_load_their_parts(llava_pair, monkeypatch):
    hf, _ = llava_pair
    # The loaded weights as parameters: CPU weight packing would turn the linear ones into buffers.
    monkeypatch.setenv(ENV_SWITCH, "0")
    weights = canonical_weights(hf)
    full = LlavaForConditionalGeneration(make_config())
    full.load_weights(weights.items())
    vision = LlavaForConditionalGeneration(make_config(), load_language=False)
    vision.load_weights(weights.items())
    language = LlavaForConditionalGeneration(make_config(), load_vision=False)
    language.load_weights(weights.items())

    full_params = dict(full.named_parameters())
    for part, roots in ((vision, {"vision_tower", "multi_modal_projector"}), (language, {"language_model", "lm_head"})):
        params = dict(part.named_parameters())
        assert {name.split(".")[0] for name in params} == roots
        for name, param in params.items():
            assert torch.equal(param, full_params[name]), name
    # A part that is loaded must still be complete.
    del weights["multi_modal_projector.linear_2.bias"]
    with pytest.raises(CheckpointError, match="multi_modal_projector.linear_2.bias"):
        LlavaForConditionalGeneration(make_config(), load_language=False).load_weights(weights.items())


def test_registry():
    assert get_model_class(make_config()) is LlavaForConditionalGeneration
    with pytest.raises(CheckpointError, match="'llama' is not supported"):
        get_model_class(LlamaConfig())
