"""LLaVA-NeXT's image processing (anyres: the image resized into the best of its grid's
resolutions, padded, cut into tiles, after a square view of the whole; each tile then
resized to the shortest edge, centre-cropped, rescaled and normalized) on the exact fast
path (``exact_images``).

The reference turns every tile into a PIL image and back to resize it to the size it
already has, then rescales it in float64 and normalizes it in float32; here a tile of that
size goes straight to the table lookup, and only a tile of another size takes PIL's resize.
The resolution, the resized size and the padding come from transformers' own functions.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from hydrad.models.exact_images import ExactImages, set_sizes


class ExactLlavaNextImages(ExactImages):
    """A ``LlavaNextImageProcessorPil``'s ``pixel_values`` ([images, most tiles of any, 3, crop h,
    crop w], zeros past an image's tiles) and ``image_sizes`` ([images, 2]: height, width)."""

    def __init__(self, reference):
        super().__init__(reference)
        self.shortest_edge = int(reference.size.shortest_edge)
        self.crop = (int(reference.crop_size.height), int(reference.crop_size.width))
        self.pinpoints = [list(map(int, r)) for r in reference.image_grid_pinpoints]

    @staticmethod
    def serves(p) -> bool:
        pinpoints = getattr(p, "image_grid_pinpoints", None)
        return (type(p).__name__ == "LlavaNextImageProcessorPil" and ExactImages._pil_steps(p)
                and bool(p.do_center_crop and p.do_pad)
                and set_sizes(getattr(p, "size", None)) == {"shortest_edge"}
                and set_sizes(getattr(p, "crop_size", None)) == {"height", "width"}
                and isinstance(pinpoints, list) and len(pinpoints) > 0)

    def image_outputs(self, rgb: Image.Image) -> dict:
        from transformers.image_processing_utils import get_patch_output_size, select_best_resolution
        from transformers.image_utils import ChannelDimension

        size = (rgb.height, rgb.width)
        best = select_best_resolution(size, self.pinpoints)
        shape = np.broadcast_to(np.uint8(0), (1, *size))  # the size, as the reference reads it
        height, width = get_patch_output_size(shape, best, input_data_format=ChannelDimension.FIRST)
        padded = np.zeros((*best, 3), dtype=np.uint8)  # the reference pads with zeros, centred
        top, left = (best[0] - height) // 2, (best[1] - width) // 2
        padded[top:top + height, left:left + width] = self.resized(rgb, height, width)
        edge = self.shortest_edge  # the whole image's square view, then the tiles row by row
        tiles = [self.resized(rgb, edge, edge)]
        side = self.crop[0]
        tiles += [padded[i:i + side, j:j + side] for i in range(0, best[0], side) for j in range(0, best[1], side)]
        # Each tile then takes CLIP's steps (resized only where that changes its size).
        pixels = np.stack([self.edge_and_crop(tile, self.shortest_edge, self.crop) for tile in tiles])
        return {"pixel_values": pixels, "image_size": size}

    @staticmethod
    def join(outputs: list[dict]) -> dict[str, np.ndarray]:
        most = max(len(out["pixel_values"]) for out in outputs)
        first = outputs[0]["pixel_values"]
        pixels = np.zeros((len(outputs), most, *first.shape[1:]), dtype=first.dtype)
        for i, out in enumerate(outputs):
            pixels[i, : len(out["pixel_values"])] = out["pixel_values"]
        return {"pixel_values": pixels, "image_sizes": np.array([out["image_size"] for out in outputs], dtype=np.int64)}
