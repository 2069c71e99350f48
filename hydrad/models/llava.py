"""LLaVA-1.5: a CLIP vision tower, a two-layer projector, and a Llama-family decoder.

Every image is resized and cropped to the tower's square input, so every image has the
same number of image tokens: one per patch (plus the CLS token with the "full" strategy).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from transformers.activations import ACT2FN

from hydrad.errors import CheckpointError
from hydrad.models.clip import CLIPVisionTower
from hydrad.models.inputs import ImageInput
from hydrad.models.interface import VisionLanguageModel


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, hf_config, dtype: torch.dtype):
        super().__init__()
        layers = hf_config.vision_feature_layer
        num_feature_layers = 1 if isinstance(layers, int) else len(layers)
        vision_hidden = hf_config.vision_config.hidden_size * num_feature_layers
        text_hidden = hf_config.text_config.hidden_size
        bias = hf_config.multimodal_projector_bias
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias, dtype=dtype)
        self.act = ACT2FN[hf_config.projector_hidden_act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias, dtype=dtype)

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(image_features)))


def check_feature_strategy(hf_config) -> None:
    if hf_config.vision_feature_select_strategy not in ("default", "full"):
        raise CheckpointError(
            f"vision_feature_select_strategy {hf_config.vision_feature_select_strategy!r} is not supported"
        )


def clip_features(vision_tower: CLIPVisionTower, pixel_values: torch.Tensor, hf_config) -> torch.Tensor:
    # pixel_values: [num_crops, 3, H, W] -> [num_crops, num_tokens, vision_hidden * len(layers)]:
    # the chosen layers' hidden states side by side, without the CLS token for "default"
    features = vision_tower(pixel_values)
    if hf_config.vision_feature_select_strategy == "default":
        features = features[:, 1:]
    return features


def build_clip_tower(hf_config, dtype: torch.dtype) -> CLIPVisionTower:
    kind = getattr(hf_config.vision_config, "model_type", None)
    if kind != "clip_vision_model":
        raise CheckpointError(f"vision tower {kind!r} is not supported (LLaVA checkpoints with a CLIP tower are)")
    try:
        return CLIPVisionTower(hf_config.vision_config, hf_config.vision_feature_layer, dtype)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


class LlavaForConditionalGeneration(VisionLanguageModel):
    def __init__(self, hf_config, **kwargs):
        check_feature_strategy(hf_config)
        super().__init__(hf_config, **kwargs)
        self.hf_config = hf_config
        num_patches = (hf_config.vision_config.image_size // hf_config.vision_config.patch_size) ** 2
        # "default" drops the CLS token, "full" keeps it.
        self.num_image_tokens_per_image = num_patches + (hf_config.vision_feature_select_strategy == "full")
        # One block holds one image: nothing is wasted, since every image has the same size.
        self.default_image_block_size = self.num_image_tokens_per_image

    def build_vision(self, hf_config, dtype: torch.dtype) -> Mapping[str, nn.Module]:
        return {
            "vision_tower": build_clip_tower(hf_config, dtype),
            "multi_modal_projector": LlavaMultiModalProjector(hf_config, dtype),
        }

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        # Images of one shape (all of them, with the usual processor) go through the tower in one call.
        features: list[torch.Tensor | None] = [None] * len(images)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, image in enumerate(images):
            by_shape.setdefault(tuple(image.pixel_values.shape), []).append(i)
        for indices in by_shape.values():
            # [num_images, 3, H, W]
            pixel_values = torch.stack([images[i].pixel_values for i in indices]).to(self.device, self.dtype)
            projected = self.multi_modal_projector(clip_features(self.vision_tower, pixel_values, self.hf_config))
            for i, feats in zip(indices, projected):
                features[i] = feats  # [num_image_tokens, hidden]
        return features

    def num_vision_patches(self, image: ImageInput) -> int:
        return clip_tower_positions(self.hf_config.vision_config)

    @classmethod
    def image_inputs(cls, hf_config, processor_output: Mapping[str, torch.Tensor]) -> list[ImageInput]:
        pixel_values = processor_output["pixel_values"]  # [num_images, 3, H, W]
        num_patches = (pixel_values.shape[-2] // hf_config.vision_config.patch_size) * (
            pixel_values.shape[-1] // hf_config.vision_config.patch_size
        )
        length = num_patches + (hf_config.vision_feature_select_strategy == "full")
        cost = clip_tower_positions(hf_config.vision_config)
        return [ImageInput(pixel_values=pv, offset=-1, length=length, num_patches=cost) for pv in pixel_values]


def clip_tower_positions(vision_config) -> int:
    """Positions the CLIP tower runs over for one crop: its patches and the CLS token."""
    return (vision_config.image_size // vision_config.patch_size) ** 2 + 1
