"""Qwen2-VL's and Qwen2.5-VL's image processing (the size that keeps the aspect ratio within
a pixel budget, rescale, normalize, then the patches as the vision tower reads them) on the
exact fast path (``exact_images``).

The reference normalizes the whole image in float32, then copies it into the patch layout,
duplicated along time (an image is ``temporal_patch_size`` equal frames). Here the resized
8-bit pixels take the patch layout first (a quarter of the bytes to move), one table lookup
gives their floats, and one copy writes each frame; the image grids are the reference's own
``smart_resize``.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from hydrad.models.exact_images import ExactImages, set_sizes


class ExactQwen2VLImages(ExactImages):
    """A ``Qwen2VLImageProcessorPil``'s ``pixel_values`` ([patches of all images, channels *
    temporal patch * patch * patch]) and ``image_grid_thw`` ([images, 3], int64)."""

    def __init__(self, reference):
        super().__init__(reference)
        self.min_pixels = int(reference.size.shortest_edge)
        self.max_pixels = int(reference.size.longest_edge)
        self.patch = int(reference.patch_size)
        self.merge = int(reference.merge_size)
        self.temporal = int(reference.temporal_patch_size)
        self.flat_table = self.table.reshape(-1)
        self.channel_offsets = (np.arange(3, dtype=np.uint16) * 256).reshape(3, 1, 1)

    @staticmethod
    def serves(p) -> bool:
        return (type(p).__name__ == "Qwen2VLImageProcessorPil" and ExactImages._pil_steps(p)
                and set_sizes(getattr(p, "size", None)) == {"shortest_edge", "longest_edge"}
                and all(isinstance(getattr(p, name, None), int)
                        for name in ("patch_size", "merge_size", "temporal_patch_size")))

    def image_outputs(self, rgb: Image.Image) -> dict:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        p, m, t = self.patch, self.merge, self.temporal
        # May raise ValueError (an aspect ratio over 200), as the reference's call does.
        height, width = smart_resize(rgb.height, rgb.width, factor=p * m, min_pixels=self.min_pixels,
                                     max_pixels=self.max_pixels)
        gh, gw = height // p, width // p
        # The reference's layout: (h/m, w/m, m, m, channel, time, p, p), each frame the image.
        tiles = self.resized(rgb, height, width).reshape(gh // m, m, p, gw // m, m, p, 3)
        index = np.ascontiguousarray(tiles.transpose(0, 3, 1, 4, 6, 2, 5)).astype(np.uint16)
        index += self.channel_offsets  # each channel's row of the table, flattened
        values = np.take(self.flat_table, index)
        out = np.empty((gh // m, gw // m, m, m, 3, t, p, p), dtype=values.dtype)
        out[...] = values[:, :, :, :, :, None]
        return {"pixel_values": out.reshape(gh * gw, 3 * t * p * p), "grid": (1, gh, gw)}

    @staticmethod
    def join(outputs: list[dict]) -> dict[str, np.ndarray]:
        pixels = [out["pixel_values"] for out in outputs]
        return {"pixel_values": pixels[0] if len(pixels) == 1 else np.concatenate(pixels),
                "image_grid_thw": np.array([out["grid"] for out in outputs], dtype=np.int64)}
