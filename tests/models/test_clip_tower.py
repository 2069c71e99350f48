"""hydrad's CLIP vision tower against transformers' CLIPVisionModel: the same hidden states,
bit for bit, from only the layers the chosen feature layers need, with the checkpoint's
weights of the layers not built dropped at load."""

from __future__ import annotations

import pytest
import torch
from transformers import CLIPVisionConfig, CLIPVisionModel, LlavaConfig

from hydrad.errors import CheckpointError
from hydrad.models.clip import CLIPVisionTower, feature_layer_indices
from hydrad.models.interface import skip_weight_init
from hydrad.models.llama import ParamLoader
from hydrad.models.llava import build_clip_tower


def vision_config(act: str = "quick_gelu", layers: int = 5) -> CLIPVisionConfig:
    return CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                            image_size=56, patch_size=14, hidden_act=act, layer_norm_eps=1e-5)


def loaded_pair(config: CLIPVisionConfig, feature_layers):
    torch.manual_seed(0)
    reference = CLIPVisionModel(config).eval()
    ours = CLIPVisionTower(config, feature_layers, torch.float32).eval()
    loader = ParamLoader(ours)
    unexpected = [name for name, tensor in reference.state_dict().items() if not loader.load(name, tensor)]
    return reference, ours, loader, unexpected


@pytest.mark.parametrize("act, feature_layers", [
    ("quick_gelu", -2), ("quick_gelu", -1), ("gelu", -2), ("quick_gelu", 0), ("quick_gelu", [-2, -5]), ("gelu", [1, 3]),
])
def test_features_equal_transformers_hidden_states_bit_for_bit(act, feature_layers):
    config = vision_config(act)
    reference, ours, loader, unexpected = loaded_pair(config, feature_layers)
    assert unexpected == [] and loader.missing() == set()
    pixels = torch.randn(3, 3, config.image_size, config.image_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        states = reference(pixels, output_hidden_states=True).hidden_states
        layers = [feature_layers] if isinstance(feature_layers, int) else feature_layers
        expected = torch.cat([states[i] for i in layers], dim=-1)
        got = ours(pixels)
    assert got.shape == expected.shape
    assert torch.equal(got, expected)


def test_only_the_layers_up_to_the_deepest_feature_layer_are_built():
    config = vision_config(layers=5)
    _, ours, loader, unexpected = loaded_pair(config, -2)
    assert len(ours.encoder.layers) == 4
    assert not hasattr(ours, "post_layernorm")
    # The checkpoint's last layer and post-layernorm are dropped, not reported as unexpected.
    assert unexpected == []
    assert ours.ignores_weight("encoder.layers.4.mlp.fc1.weight")
    assert ours.ignores_weight("post_layernorm.weight")
    assert not ours.ignores_weight("encoder.layers.3.mlp.fc1.weight")
    # A name that is no weight of CLIP at all is still unexpected.
    assert not loader.load("encoder.extra.weight", torch.zeros(1))


def test_feature_layer_indices():
    config = vision_config(layers=5)
    assert feature_layer_indices(config, -2) == [4]
    assert feature_layer_indices(config, [0, -1]) == [0, 5]
    with pytest.raises(ValueError, match="out of range"):
        feature_layer_indices(config, -7)


def test_a_tower_that_is_not_clip_is_refused_in_one_line():
    config = LlavaConfig(vision_config={"model_type": "siglip_vision_model"})
    with pytest.raises(CheckpointError, match="vision tower 'siglip_vision_model' is not supported"):
        build_clip_tower(config, torch.float32)


def test_images_of_another_size_are_refused():
    config = vision_config()
    _, ours, _, _ = loaded_pair(config, -2)
    with pytest.raises(ValueError, match="takes 56x56"):
        ours(torch.zeros(1, 3, 28, 28))


def test_skip_weight_init_draws_no_random_numbers_and_restores_the_initialisers():
    before = torch.random.get_rng_state()
    initialiser = torch.nn.init.kaiming_uniform_
    with skip_weight_init():
        torch.nn.Linear(64, 64)
        torch.nn.Embedding(16, 8)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.nn.init.kaiming_uniform_ is initialiser
    torch.nn.Linear(4, 4)
    assert not torch.equal(torch.random.get_rng_state(), before)
