"""An image as a model family takes it: preprocessed pixels and its place in the prompt.

Defined with the models (each family says what its images carry) and part of what a
frontend hands the engine (``hydrad.engine.inputs``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # plain records: the scheduler and the planner use them without torch
    import torch


@dataclass
class ImageInput:
    """One image of a request, preprocessed, and where its tokens sit in the prompt."""

    # The image processor's output for this image (model dtype not applied yet): LLaVA-1.5
    # [3, H, W]; LLaVA-NeXT [num_tiles, 3, H, W] (the resized whole image, then the tiles);
    # Qwen2-VL [num_patches, channels * temporal_patch * patch * patch].
    # None once encoded elsewhere (a migrated request carries only the placement).
    pixel_values: torch.Tensor | None
    # First placeholder position in the prompt and the number of placeholders (= image tokens).
    offset: int
    length: int
    # What a variable-resolution encoder needs besides the pixels, as plain ints (they travel in
    # messages): LLaVA-NeXT's original (height, width), which fixes the tile grid and the unpadding;
    # Qwen2-VL's patch grid (t, h, w) before the 2x2 merge.
    image_size: tuple[int, int] | None = None
    grid_thw: tuple[int, int, int] | None = None
    # What encoding it costs: the patch positions the vision tower runs over (the family's
    # ``num_vision_patches``), filled by the processor so that the scheduler and the latency model
    # read a plain number; 0 when unknown (the image is then costed by its tokens alone).
    num_patches: int = 0
    # The patches one attention of the vision tower spans where it attends within parts of the
    # image (Qwen2-VL: each group of a video's frames, h*w patches); 0: all of ``num_patches``.
    # The latency model's square term is num_patches * attention_span.
    attention_span: int = 0
    # A video's frames (as kept: sampled, at most ``server.max_video_frames``); 0 for an image.
    frames: int = 0
    # A digest of what the encoder makes of it (the image and the layout above): requests whose
    # images have equal digests share the KV of their common prefix (prefix caching). Filled by
    # the processor (``digest``); None where unknown, and then no KV past the image is shared.
    content_hash: bytes | None = None

    def digest(self, source: bytes | None = None) -> bytes | None:
        """``content_hash``, computed where it is not yet: from ``source``, the bytes of the image
        file the pixels were decoded from (decoding is deterministic, and a file is a fraction of
        its float pixels: a 640x480 JPEG about 1/30), else from the pixels when there are some.
        The same picture sent as another file, or as an image object, is another image here."""
        if self.content_hash is not None:
            return self.content_hash
        layout = repr((self.length, self.image_size, self.grid_thw))
        if source is not None:
            h = hashlib.blake2b(digest_size=16, person=b"hydrad-file")
            h.update(layout.encode())
            h.update(source)
            self.content_hash = h.digest()
        elif self.pixel_values is not None:
            import torch  # a tensor is here: torch is loaded

            pixels = self.pixel_values.detach().cpu().contiguous()
            h = hashlib.blake2b(digest_size=16, person=b"hydrad-pixels")
            h.update(repr((str(pixels.dtype), tuple(pixels.shape), layout)).encode())
            h.update(pixels.reshape(-1).view(torch.uint8).numpy().data)
            self.content_hash = h.digest()
        return self.content_hash
