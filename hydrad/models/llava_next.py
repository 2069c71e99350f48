"""LLaVA-NeXT (llava-v1.6): LLaVA with "anyres" images, so each image has its own number of tokens.

The processor picks, from ``image_grid_pinpoints``, the resolution that keeps most of the
image, resizes and pads the image to it, and cuts it into tiles of the tower's input size;
the image also goes in whole, resized to one tile (the base image). Every tile and the base
image pass through the CLIP tower and the projector. The tiles' features are laid out as one
grid again, the rows and columns that only cover padding are cut off ("unpadding"), and a
learned ``image_newline`` row ends every feature row. An image's tokens are then:

    base image (patches per tile)  +  unpadded rows x (unpadded columns + 1)

The language model is a Llama-family decoder (Vicuna, Mistral).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from transformers.image_processing_utils import select_best_resolution

from hydrad.models.inputs import ImageInput
from hydrad.errors import CheckpointError
from hydrad.models.interface import VisionLanguageModel
from hydrad.models.llava import LlavaMultiModalProjector, build_clip_tower, clip_features, clip_tower_positions


class LlavaNextProjector(LlavaMultiModalProjector):
    """LLaVA's projector, plus the learned row end that anyres inserts after every feature row."""

    def __init__(self, hf_config, dtype: torch.dtype):
        super().__init__(hf_config, dtype)
        self.image_newline = nn.Parameter(torch.empty(hf_config.text_config.hidden_size, dtype=dtype))


def _check_config(hf_config) -> None:
    if hf_config.vision_feature_select_strategy != "default":
        # The tiles' features must form a square grid of patches: the CLS token ("full") has no place in it.
        raise CheckpointError(
            f"llava_next: vision_feature_select_strategy {hf_config.vision_feature_select_strategy!r} is not "
            "supported (only 'default')"
        )
    side = hf_config.vision_config.image_size
    for pinpoint in hf_config.image_grid_pinpoints:
        if len(pinpoint) != 2 or pinpoint[0] % side or pinpoint[1] % side:
            raise CheckpointError(
                f"llava_next: image_grid_pinpoints entry {list(pinpoint)} is not a (height, width) multiple of the "
                f"tower's image_size {side}"
            )


def anyres_grid(hf_config, image_size: tuple[int, int]) -> tuple[int, int]:
    """(rows, columns) of tiles for an image of ``image_size`` (height, width)."""
    side = hf_config.vision_config.image_size
    height, width = select_best_resolution(list(image_size), hf_config.image_grid_pinpoints)
    return height // side, width // side


def unpadded_shape(image_size: tuple[int, int], rows: int, cols: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The feature rows and columns, as [start, end) ranges, that cover the image itself (not the
    padding the processor added around it) in a ``rows x cols`` feature grid."""
    height, width = image_size
    # The same float arithmetic as transformers' unpad_image, so the same rounding.
    if width / height > cols / rows:
        new_rows = int(round(height * (cols / width), 7))
        padding = (rows - new_rows) // 2
        return (padding, rows - padding), (0, cols)
    new_cols = int(round(width * (rows / height), 7))
    padding = (cols - new_cols) // 2
    return (0, rows), (padding, cols - padding)


def num_image_tokens(hf_config, image_size: tuple[int, int]) -> int:
    """How many tokens the image of ``image_size`` (height, width) becomes."""
    per_side = hf_config.vision_config.image_size // hf_config.vision_config.patch_size
    tile_rows, tile_cols = anyres_grid(hf_config, image_size)
    (r0, r1), (c0, c1) = unpadded_shape(image_size, tile_rows * per_side, tile_cols * per_side)
    return per_side * per_side + (r1 - r0) * (c1 - c0 + 1)


def num_vision_patches(hf_config, image_size: tuple[int, int]) -> int:
    """Positions the tower runs over for an image of ``image_size``: the base image and every
    tile, each its patches and the CLS token."""
    rows, cols = anyres_grid(hf_config, image_size)
    return (1 + rows * cols) * clip_tower_positions(hf_config.vision_config)


class LlavaNextForConditionalGeneration(VisionLanguageModel):
    # Image-cache blocks of 64 slots: images take from a few hundred to a few thousand tokens.
    default_image_block_size = 64

    def __init__(self, hf_config, **kwargs):
        _check_config(hf_config)
        super().__init__(hf_config, **kwargs)
        self.hf_config = hf_config
        self.patches_per_side = hf_config.vision_config.image_size // hf_config.vision_config.patch_size

    def build_vision(self, hf_config, dtype: torch.dtype) -> Mapping[str, nn.Module]:
        return {
            "vision_tower": build_clip_tower(hf_config, dtype),
            "multi_modal_projector": LlavaNextProjector(hf_config, dtype),
        }

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        # Every tile of every image has the tower's input size: one tower call for the whole batch.
        num_tiles = [image.pixel_values.shape[0] for image in images]
        for image, n in zip(images, num_tiles):
            rows, cols = anyres_grid(self.hf_config, image.image_size)
            if n != 1 + rows * cols:
                raise ValueError(f"an image of size {image.image_size} has {n} crops, expected {1 + rows * cols}")
        pixel_values = torch.cat([image.pixel_values for image in images]).to(self.device, self.dtype)
        # [total crops, patches per tile, hidden]
        features = self.multi_modal_projector(clip_features(self.vision_tower, pixel_values, self.hf_config))
        return [self._pack(f, image.image_size) for f, image in zip(features.split(num_tiles), images)]

    def _pack(self, features: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        # features: [1 + rows * cols, p * p, hidden], the base image first -> [num_image_tokens, hidden]
        p = self.patches_per_side
        rows, cols = anyres_grid(self.hf_config, image_size)
        base, tiles = features[0], features[1:]
        # The tiles' patches as one grid: [rows * p, cols * p, hidden]
        grid = tiles.view(rows, cols, p, p, -1).permute(0, 2, 1, 3, 4).reshape(rows * p, cols * p, -1)
        (r0, r1), (c0, c1) = unpadded_shape(image_size, rows * p, cols * p)
        grid = grid[r0:r1, c0:c1]
        newline = self.multi_modal_projector.image_newline.to(grid.dtype).expand(grid.shape[0], 1, -1)
        grid = torch.cat((grid, newline), dim=1)  # [unpadded rows, unpadded columns + 1, hidden]
        return torch.cat((base, grid.flatten(0, 1)))

    def num_vision_patches(self, image: ImageInput) -> int:
        return num_vision_patches(self.hf_config, image.image_size)

    @classmethod
    def image_inputs(cls, hf_config, processor_output: Mapping[str, torch.Tensor]) -> list[ImageInput]:
        # pixel_values: [num_images, max crops, 3, H, W], zero crops padding the images with fewer
        pixel_values = processor_output["pixel_values"]
        inputs = []
        for pv, size in zip(pixel_values, processor_output["image_sizes"].tolist()):
            image_size = (int(size[0]), int(size[1]))
            rows, cols = anyres_grid(hf_config, image_size)
            inputs.append(
                ImageInput(
                    pixel_values=pv[: 1 + rows * cols],
                    offset=-1,
                    length=num_image_tokens(hf_config, image_size),
                    image_size=image_size,
                    num_patches=num_vision_patches(hf_config, image_size),
                )
            )
        return inputs
