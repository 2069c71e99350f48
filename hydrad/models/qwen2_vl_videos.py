"""Qwen2-VL's and Qwen2.5-VL's video processing, without torchvision.

transformers' ``Qwen2VLVideoProcessor`` (which needs torchvision) takes a video's frames as
a uint8 tensor [frames, 3, height, width], resizes them all to one size (``smart_resize``
within the video's own pixel budget) with torch's antialiased bicubic interpolation on the
uint8 frames, rescales and normalizes in one step (``(x - mean / rescale) / (std /
rescale)`` in float32), repeats the last frame until the count is a multiple of the temporal
patch, and lays the patches out as the vision tower reads them: for each group of
``temporal_patch_size`` frames, each 2x2 block of patches, each patch (channel, frame, row,
column). The same operations here, with torch alone, so the floats are the reference's own;
the frames take the patch layout while still 8-bit (a quarter of the bytes to move), then
each value is normalized there by the same float32 subtraction and division. The settings
are the checkpoint's video processor's (``processor_config.json``'s ``video_processor``
entry, or ``video_preprocessor_config.json``), the reference's defaults where it says nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hydrad.errors import CheckpointError

BICUBIC = 3  # PIL's number for bicubic resampling, as the processors' configs write it
# Qwen2VLVideoProcessor's class defaults (transformers).
DEFAULTS = {
    "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 1 / 255, "resample": BICUBIC,
    "do_resize": True, "do_rescale": True, "do_normalize": True,
    # Frame sampling (``hydrad.videos``; how many at most is the server's max_video_frames).
    "fps": 2.0, "min_frames": 4,
}


def video_settings(model_path: str | Path) -> dict:
    """The checkpoint's video processor settings over the reference's defaults."""
    path = Path(model_path)
    found: dict = {}
    config_file = path / "processor_config.json"
    if config_file.is_file():
        found = json.loads(config_file.read_text()).get("video_processor") or {}
    if not found and (path / "video_preprocessor_config.json").is_file():
        found = json.loads((path / "video_preprocessor_config.json").read_text())
    settings = {**DEFAULTS, **{k: v for k, v in found.items() if v is not None}}
    size = dict(settings["size"])
    # Older configs name the pixel budget min_pixels / max_pixels.
    if found.get("min_pixels") is not None:
        size["shortest_edge"] = found["min_pixels"]
    if found.get("max_pixels") is not None:
        size["longest_edge"] = found["max_pixels"]
    settings["size"] = size
    return settings


@dataclass
class ProcessedVideo:
    pixel_values: torch.Tensor  # [grid_t * grid_h * grid_w, 3 * temporal_patch * patch * patch] float32
    grid_thw: tuple[int, int, int]


class Qwen2VLVideos:
    """``pixel_values_videos`` and ``video_grid_thw`` of one video's frames, as transformers'
    ``Qwen2VLVideoProcessor`` computes them for frames already sampled."""

    def __init__(self, settings: dict):
        size = settings.get("size") or {}
        if not (settings.get("do_resize") and settings.get("do_rescale") and settings.get("do_normalize")
                and int(settings.get("resample", BICUBIC)) == BICUBIC
                and size.get("shortest_edge") and size.get("longest_edge")):
            raise CheckpointError("this checkpoint's video processor settings are not served, so it takes no "
                                  "videos here (resizing with bicubic resampling, rescaling and normalizing are)")
        self.min_pixels = int(size["shortest_edge"])
        self.max_pixels = int(size["longest_edge"])
        self.patch = int(settings["patch_size"])
        self.merge = int(settings["merge_size"])
        self.temporal = int(settings["temporal_patch_size"])
        self.fps = float(settings["fps"])
        self.min_frames = int(settings["min_frames"])
        # The reference's fused rescale and normalize: (x - mean / rescale) / (std / rescale) in float32.
        factor = 1.0 / float(settings["rescale_factor"])
        self.mean = (torch.tensor(settings["image_mean"]) * factor).view(1, 1, 1, 1, 1, 3, 1, 1, 1)
        self.std = (torch.tensor(settings["image_std"]) * factor).view(1, 1, 1, 1, 1, 3, 1, 1, 1)

    @classmethod
    def from_checkpoint(cls, model_path: str | Path) -> Qwen2VLVideos:
        return cls(video_settings(model_path))

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        # ValueError for an aspect ratio over 200, as the reference's call raises it.
        return smart_resize(height, width, factor=self.patch * self.merge, min_pixels=self.min_pixels,
                            max_pixels=self.max_pixels)

    def __call__(self, frames: np.ndarray) -> ProcessedVideo:
        """``frames``: [frames, height, width, 3] uint8 RGB."""
        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
        num_frames, _, height, width = video.shape
        h, w = self.resized_size(height, width)
        if (h, w) != (height, width):
            video = F.interpolate(video, size=[h, w], mode="bicubic", align_corners=False, antialias=True)
        if pad := -num_frames % self.temporal:
            video = torch.cat((video, video[-1:].expand(pad, -1, -1, -1)))
        p, m, t = self.patch, self.merge, self.temporal
        gt, gh, gw = video.shape[0] // t, h // p, w // p
        # (group, frame, channel, rows of blocks, block row, patch row, cols of blocks, block col, patch col)
        patches = video.view(gt, t, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        # The same float32 operations on each element as the reference's, in the patch layout.
        values = patches.to(torch.float32).sub_(self.mean).div_(self.std)
        return ProcessedVideo(values.reshape(gt * gh * gw, 3 * t * p * p), (gt, gh, gw))
