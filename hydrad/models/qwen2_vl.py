"""Qwen2-VL and Qwen2.5-VL: a native-resolution vision transformer and a Qwen2 decoder with M-RoPE.

The processor resizes each image so both sides are multiples of 28 and the pixel count lies
within [min_pixels, max_pixels], then cuts it into 14 x 14 patches (each repeated over two
"frames", the temporal patch). The vision transformer runs over one image's patches with
2-D rotary positions (Qwen2.5-VL: window attention in most layers, a gated MLP, RMSNorm);
the patch merger then folds every 2 x 2 patches into one token of the language model's width.
An image of h x w patches therefore gives h * w / 4 tokens.

The decoder (``hydrad.models.llama``, q/k/v with bias) rotates by three positions per token
(M-RoPE): text tokens have the same value in all three; an image's tokens share one
temporal position and take their row and column, offset by where the image starts. After an
image the positions resume at its start plus its larger side, so a sequence's last position is
generally below its length: a generated token at sequence index i sits at i + delta.
``get_mrope_positions`` computes a prompt's positions and delta once; the engine keeps them
with the request and slices them with ``mrope_positions_slice``.

The vision transformer is transformers' own module, loaded from the checkpoint.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from hydrad.models.inputs import ImageInput
from hydrad.models.interface import VisionLanguageModel

# model_type -> (module, class) of transformers' vision transformer (patch embedding to merger).
VISION_TRANSFORMERS = {
    "qwen2_vl": ("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VisionTransformerPretrainedModel"),
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel"),
}


def get_mrope_positions(
    prompt_token_ids: Sequence[int],
    image_token_id: int,
    image_grid_thw: Sequence[Sequence[int]],
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """A prompt's M-RoPE positions, ``[3, num_tokens]`` int64, and its delta, as transformers'
    ``get_rope_index`` computes them: the k-th image occupies the next ``t * h * w / merge**2``
    image tokens, so adjacent images are told apart by their grids. A generated token at sequence
    index i has position i + delta in all three rows.

    Raises ValueError when the image tokens do not form one contiguous run per grid.
    """
    ids = torch.as_tensor(list(prompt_token_ids), dtype=torch.long)
    num_tokens = len(ids)
    image_positions = (ids == image_token_id).nonzero().flatten().tolist()
    positions = torch.empty(3, num_tokens, dtype=torch.long)
    next_position = 0  # position of the next token
    cursor = 0  # sequence index of the next token
    consumed = 0  # image tokens placed so far
    for t, h, w in image_grid_thw:
        rows, cols = h // spatial_merge_size, w // spatial_merge_size
        length = t * rows * cols
        if consumed + length > len(image_positions):
            raise ValueError(f"the prompt has {len(image_positions)} image tokens, fewer than its image grids need")
        start = image_positions[consumed]
        if image_positions[consumed + length - 1] != start + length - 1:
            raise ValueError(f"the image tokens at {start} do not form a run of {length}")
        # Text before the image: one position per token, the same in all three rows.
        positions[:, cursor:start] = torch.arange(next_position, next_position + start - cursor)
        next_position += start - cursor
        # The image: (frame, row, column) of each merged patch, offset by where the image starts.
        grid = torch.stack(
            torch.meshgrid(torch.arange(t), torch.arange(rows), torch.arange(cols), indexing="ij")
        ).flatten(1)  # [3, length]
        positions[:, start : start + length] = grid + next_position
        next_position += max(h, w) // spatial_merge_size
        cursor = start + length
        consumed += length
    if consumed != len(image_positions):
        raise ValueError(f"the prompt has {len(image_positions)} image tokens; its image grids cover {consumed}")
    positions[:, cursor:] = torch.arange(next_position, next_position + num_tokens - cursor)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


def mrope_positions_slice(prompt_positions: torch.Tensor | None, delta: int, start: int, end: int) -> torch.Tensor:
    """``[3, end - start]``: the positions of sequence tokens [start, end) of a request whose
    prompt positions are ``prompt_positions`` (None: a text-only prompt, the flat arange) and
    whose generated tokens sit at index + ``delta``."""
    if prompt_positions is None:
        return torch.arange(start + delta, end + delta).expand(3, -1)
    num_prompt = prompt_positions.shape[1]
    prompt_part = prompt_positions[:, start : min(end, num_prompt)]
    generated = torch.arange(max(start, num_prompt), max(end, num_prompt)) + delta
    return torch.cat((prompt_part, generated.expand(3, -1)), dim=1)


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    uses_mrope = True
    # Image-cache blocks of 64 slots: an image takes from 4 to max_pixels / 28**2 tokens.
    default_image_block_size = 64

    def __init__(self, hf_config, **kwargs):
        super().__init__(hf_config, **kwargs)
        self.spatial_merge_size = hf_config.vision_config.spatial_merge_size

    def build_vision(self, hf_config, dtype: torch.dtype) -> Mapping[str, nn.Module]:
        module, name = VISION_TRANSFORMERS[hf_config.model_type]
        vision_cls = getattr(importlib.import_module(module), name)
        from transformers.initialization import no_init_weights

        # The merger is part of transformers' module: the whole vision side is one tower. Its
        # weights come from the checkpoint: transformers' own initialisation is skipped too.
        with no_init_weights():
            return {"vision_tower": vision_cls._from_config(hf_config.vision_config, dtype=dtype)}

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        # One call for the batch: the tower attends within each image (and window) by its grid.
        pixel_values = torch.cat([image.pixel_values for image in images]).to(self.device, self.dtype)
        grid_thw = torch.tensor([image.grid_thw for image in images], dtype=torch.long, device=self.device)
        merged = self.vision_tower(pixel_values, grid_thw=grid_thw).pooler_output  # [total tokens, hidden]
        return list(merged.split([self._num_tokens(image.grid_thw) for image in images]))

    def _num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.spatial_merge_size**2

    def num_vision_patches(self, image: ImageInput) -> int:
        # Every patch before the merge (4 per token); attention spans one image (or window).
        t, h, w = image.grid_thw
        return t * h * w

    @classmethod
    def image_inputs(cls, hf_config, processor_output: Mapping[str, torch.Tensor]) -> list[ImageInput]:
        grids = [tuple(int(n) for n in grid) for grid in processor_output["image_grid_thw"].tolist()]
        # pixel_values: [total patches, channels * temporal_patch * patch * patch], images one after another
        pixel_values = processor_output["pixel_values"].split([t * h * w for t, h, w in grids])
        merge = hf_config.vision_config.spatial_merge_size
        return [
            ImageInput(pixel_values=pv, offset=-1, length=t * h * w // merge**2, grid_thw=(t, h, w),
                       num_patches=t * h * w)
            for pv, (t, h, w) in zip(pixel_values, grids)
        ]


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL differs only inside the vision transformer (``VISION_TRANSFORMERS``)."""
