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


def _vision_runs(ids: torch.Tensor, token_id: int, grids, spatial_merge_size: int, kind: str) -> list[tuple]:
    """(start, grid) of each image's (or video's) run of placeholder tokens: the k-th takes the
    next ``t * h * w / merge**2`` placeholders, so adjacent runs are told apart by their grids."""
    positions = (ids == token_id).nonzero().flatten().tolist()
    runs, consumed = [], 0
    for t, h, w in grids:
        length = t * (h // spatial_merge_size) * (w // spatial_merge_size)
        if consumed + length > len(positions):
            raise ValueError(f"the prompt has {len(positions)} {kind} tokens, fewer than its {kind} grids need")
        start = positions[consumed]
        if positions[consumed + length - 1] != start + length - 1:
            raise ValueError(f"the {kind} tokens at {start} do not form a run of {length}")
        runs.append((start, (t, h, w)))
        consumed += length
    if consumed != len(positions):
        raise ValueError(f"the prompt has {len(positions)} {kind} tokens; its {kind} grids cover {consumed}")
    return runs


def get_mrope_positions(
    prompt_token_ids: Sequence[int],
    image_token_id: int,
    image_grid_thw: Sequence[Sequence[int]],
    spatial_merge_size: int,
    *,
    video_token_id: int | None = None,
    video_grid_thw: Sequence[Sequence[int]] = (),
    video_time_intervals: Sequence[float] = (),
) -> tuple[torch.Tensor, int]:
    """A prompt's M-RoPE positions, ``[3, num_tokens]`` int64, and its delta, as transformers'
    ``get_rope_index`` computes them. An image's or video's tokens take (time, row, column)
    offset by where it starts; a video's k-th group of frames has time ``int(k * interval)``
    (``video_time_intervals``: 1 for Qwen2-VL; Qwen2.5-VL spaces groups by their seconds). The
    text after one resumes past its largest position, as Qwen's own code and vLLM place it: for
    an image that is its start plus its larger side in merged patches, as transformers has it;
    for a video whose time outruns its sides, transformers 5 resumes at the larger side alone
    (positions the model never saw in training), and hydrad does not follow it there. A
    generated token at sequence index i has position i + delta in all three rows.

    Raises ValueError when the placeholder tokens do not form one contiguous run per grid.
    """
    ids = torch.as_tensor(list(prompt_token_ids), dtype=torch.long)
    num_tokens = len(ids)
    runs = [(start, grid, 1.0) for start, grid in _vision_runs(ids, image_token_id, image_grid_thw,
                                                               spatial_merge_size, "image")]
    if video_token_id is not None:
        videos = _vision_runs(ids, video_token_id, video_grid_thw, spatial_merge_size, "video")
        intervals = list(video_time_intervals) or [1.0] * len(videos)
        runs += [(start, grid, interval) for (start, grid), interval in zip(videos, intervals)]
    positions = torch.empty(3, num_tokens, dtype=torch.long)
    next_position = 0  # position of the next token
    cursor = 0  # sequence index of the next token
    for start, (t, h, w), interval in sorted(runs):
        rows, cols = h // spatial_merge_size, w // spatial_merge_size
        length = t * rows * cols
        # Text before: one position per token, the same in all three rows.
        positions[:, cursor:start] = torch.arange(next_position, next_position + start - cursor)
        next_position += start - cursor
        # (time, row, column) of each merged patch, offset by where the image or video starts.
        times = (torch.arange(t) * interval).long()
        grid = torch.stack(torch.meshgrid(times, torch.arange(rows), torch.arange(cols), indexing="ij")).flatten(1)
        positions[:, start : start + length] = grid + next_position
        next_position += max(int(times[-1]) + 1, rows, cols)
        cursor = start + length
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
    # Videos: frames in groups of the temporal patch through the same tower, their tokens in
    # <|video_pad|> runs (``hydrad.models.qwen2_vl_videos``).
    takes_videos = True
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
                       num_patches=t * h * w, attention_span=h * w)
            for pv, (t, h, w) in zip(pixel_values, grids)
        ]

    @staticmethod
    def video_time_interval(hf_config, temporal_patch: int, fps: float) -> float:
        """M-RoPE time positions between a video's consecutive groups of frames: one for Qwen2-VL."""
        return 1.0


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL differs inside the vision transformer (``VISION_TRANSFORMERS``) and in how far
    apart a video's groups of frames sit in time."""

    @staticmethod
    def video_time_interval(hf_config, temporal_patch: int, fps: float) -> float:
        # tokens_per_second x the seconds one group of frames spans (transformers' second_per_grid_ts).
        return hf_config.vision_config.tokens_per_second * (temporal_patch / fps)
