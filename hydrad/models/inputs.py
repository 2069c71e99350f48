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
    # The latency model's square term is num_patches * attention_span. Where the parts are
    # independent all through the encoder, the engine encodes them one by one (``groups``).
    attention_span: int = 0
    # A video's frames (as kept: sampled, at most ``server.max_video_frames``); 0 for an image.
    frames: int = 0
    # A digest of what the encoder makes of it (the image and the layout above): requests whose
    # images have equal digests share the KV of their common prefix (prefix caching). Filled by
    # the processor (``digest``); None where unknown, and then no KV past the image is shared.
    content_hash: bytes | None = None

    @property
    def num_groups(self) -> int:
        """How many independent parts the engine encodes this input as (``groups``)."""
        return encode_groups(self.num_patches, self.attention_span, self.length)

    def groups(self) -> list[ImageInput]:
        """The input as the engine schedules its encode: a video whose encoder attends within
        each group of its frames (``attention_span`` < ``num_patches``: Qwen2-VL and Qwen2.5-VL,
        whose tower, windows and merger never cross a group) as one input per group, so that
        its encode can be spread over steps beside running decodes instead of taking a step of
        its own; anything else as itself. A family that sets ``attention_span`` lays out its
        pixel rows, tokens and grid (``t``, the first axis) group after group, as Qwen2-VL
        does: group k takes the k-th equal share of each. Each group's digest is the input's
        and its index (None where the input's is). Splitting a group again gives it back."""
        n = self.num_groups
        if n == 1:
            return [self]
        tokens, patches = self.length // n, self.num_patches // n
        rows = None if self.pixel_values is None else self.pixel_values.shape[0] // n
        grid = None if self.grid_thw is None else (self.grid_thw[0] // n, *self.grid_thw[1:])
        per_group = -(-self.frames // n)  # the last group's short share is padded by the processor
        parts = []
        for k in range(n):
            digest = None
            if self.content_hash is not None:
                digest = hashlib.blake2b(self.content_hash + k.to_bytes(4, "little"), digest_size=16,
                                         person=b"hydrad-group").digest()
            parts.append(ImageInput(
                pixel_values=None if rows is None else self.pixel_values[k * rows:(k + 1) * rows],
                offset=self.offset + k * tokens, length=tokens, image_size=self.image_size, grid_thw=grid,
                num_patches=patches, attention_span=self.attention_span,
                frames=max(0, min(per_group, self.frames - k * per_group)), content_hash=digest))
        return parts

    def digest(self, source: bytes | None = None) -> bytes | None:
        """``content_hash``, computed where it is not yet: from ``source``, the bytes of the image
        file the pixels were decoded from or a digest of them (``processed_images.file_key``:
        decoding is deterministic, and a file is a fraction of its float pixels: a 640x480 JPEG
        about 1/30), else from the pixels when there are some.
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


def encode_groups(num_patches: int, span: int, num_tokens: int) -> int:
    """The independent parts an input of ``num_patches`` patches, attention span ``span`` and
    ``num_tokens`` tokens encodes as (``ImageInput.groups``): ``num_patches / span`` where
    the tower attends within parts that split its patches and tokens evenly, else 1."""
    if 0 < span < num_patches and num_patches % span == 0:
        n = num_patches // span
        if num_tokens % n == 0:
            return n
    return 1
