"""Image processors' pixels, the reference's to the bit, in fewer passes over them.

transformers' PIL image processors turn a picture into a channels-first array, back into a
PIL image to resize it, into an array again, then rescale it in float64 and normalize it in
float32, each step a pass over every pixel. Rescaling and normalizing map each 8-bit value
of each channel to one float on their own, so the 768 floats they can give are computed
once, by the reference processor's own ``rescale`` and ``normalize``, and the resized pixels
are looked up in that table. The resize is PIL's own call with the arguments the reference
passes, and the sizes come from transformers' own functions, so the result is the
reference's to the bit (``tests/models/test_exact_images.py`` compares them family by family
on photographs, grayscale, palette and odd-sized images).

``exact_images(image_processor)`` wraps a processor whose family and settings one of the
subclasses serves (LLaVA-1.5's CLIP steps: ``clip_images``; LLaVA-NeXT's anyres tiles:
``llava_next_images``; Qwen2-VL's and Qwen2.5-VL's patches: ``qwen2_vl_images``) and leaves
any other alone; a wrapper hands everything it does not do this way (arrays, images with
transparency, other arguments) to the processor it wraps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
from PIL import Image

# The arguments a call may carry for the fast path to serve it, and the flags it may repeat
# with the values the processor has.
_SERVED_KWARGS = frozenset({"return_tensors"})
_SETTINGS = frozenset({"do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb", "do_pad"})


def exact_images(image_processor):
    """``image_processor`` wrapped by the fast path that serves its family and settings, else
    ``image_processor`` itself."""
    from hydrad.models.clip_images import ExactClipImages
    from hydrad.models.llava_next_images import ExactLlavaNextImages
    from hydrad.models.qwen2_vl_images import ExactQwen2VLImages

    for cls in (ExactClipImages, ExactLlavaNextImages, ExactQwen2VLImages):
        if cls.serves(image_processor):
            return cls(image_processor)
    return image_processor


def set_sizes(size) -> set[str]:
    """The sizes a ``SizeDict`` (or a plain dict) sets."""
    items = vars(size).items() if hasattr(size, "__dataclass_fields__") else dict(size or {}).items()
    return {key for key, value in items if value is not None}


class ExactImages(ABC):
    """Calls as the wrapped image processor does; a subclass gives one image's outputs
    (``image_outputs``) and how they join into the call's (``join``)."""

    def __init__(self, reference):
        from transformers.image_utils import ChannelDimension

        self.reference = reference
        self.resample = Image.Resampling(int(reference.resample))
        # Every 8-bit value of each channel through the reference's own rescale and normalize.
        ramp = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 1, 256)).copy()
        scaled = reference.rescale(ramp, reference.rescale_factor, input_data_format=ChannelDimension.FIRST)
        table = reference.normalize(scaled, reference.image_mean, reference.image_std,
                                    input_data_format=ChannelDimension.FIRST)
        self.table = np.ascontiguousarray(table[:, 0, :])  # [3, 256]

    @staticmethod
    @abstractmethod
    def serves(p) -> bool:
        """Whether this path gives ``p``'s outputs: its family and settings."""

    @staticmethod
    def _pil_steps(p) -> bool:
        """The PIL backend resizing, rescaling and normalizing RGB pixels: the steps shared by
        every family served."""
        return (getattr(p, "backend", None) == "pil" and p.resample is not None
                and bool(p.do_resize and p.do_rescale and p.do_normalize and p.do_convert_rgb))

    def __getattr__(self, name):
        return getattr(self.reference, name)

    def __call__(self, images, **kwargs):
        from transformers.feature_extraction_utils import BatchFeature

        listed = images if isinstance(images, (list, tuple)) else [images]
        if not all(self._served(name, value) for name, value in kwargs.items()) or not all(
                self._plain(image) for image in listed):
            return self.reference(images, **kwargs)
        outputs = [self.image_outputs(image if image.mode == "RGB" else image.convert("RGB")) for image in listed]
        return BatchFeature(data=self.join(outputs), tensor_type=kwargs.get("return_tensors"))

    def _served(self, name: str, value) -> bool:
        """Whether a call's argument leaves the steps as they are: ``return_tensors``, or a
        setting given the value the processor has (LLaVA-NeXT's processor passes ``do_pad``)."""
        return name in _SERVED_KWARGS or (name in _SETTINGS and getattr(self.reference, name, None) is value)

    @staticmethod
    def _plain(image) -> bool:
        """A PIL image without transparency (the reference composites those onto white)."""
        return (isinstance(image, Image.Image) and "A" not in image.getbands()
                and image.info.get("transparency") is None)

    @abstractmethod
    def image_outputs(self, rgb: Image.Image) -> dict:
        """One RGB image's outputs."""

    @staticmethod
    @abstractmethod
    def join(outputs: list[dict]) -> dict[str, np.ndarray]:
        """The call's outputs from its images' (``image_outputs``), in order."""

    def resized(self, rgb: Image.Image, height: int, width: int) -> np.ndarray:
        """[height, width, 3] uint8: the reference's resize (PIL's, no reducing gap)."""
        return np.asarray(rgb.resize((width, height), resample=self.resample, reducing_gap=None))

    def edge_and_crop(self, image: Image.Image | np.ndarray, shortest_edge: int, crop: tuple[int, int]) -> np.ndarray:
        """[3, crop h, crop w] floats of an RGB image (or [H, W, 3] uint8 pixels): CLIP's steps,
        resized to ``shortest_edge`` (PIL's resize, skipped for pixels already that size, which
        it would copy unchanged), centre-cropped, rescaled and normalized."""
        from transformers.image_transforms import center_crop, get_resize_output_image_size
        from transformers.image_utils import ChannelDimension

        size = (image.height, image.width) if isinstance(image, Image.Image) else image.shape[:2]
        shape = np.broadcast_to(np.uint8(0), (1, *size))  # the size, as the reference reads it
        height, width = get_resize_output_image_size(shape, size=shortest_edge, default_to_square=False,
                                                     input_data_format=ChannelDimension.FIRST)
        if isinstance(image, Image.Image) or (height, width) != size:
            if not isinstance(image, Image.Image):
                image = Image.fromarray(np.ascontiguousarray(image))
            image = self.resized(image, height, width)
        cropped = center_crop(image, crop, data_format=ChannelDimension.LAST, input_data_format=ChannelDimension.LAST)
        return self.normalized(cropped)

    def normalized(self, pixels: np.ndarray) -> np.ndarray:
        """[3, H, W] float32 from [H, W, 3] uint8: the reference's rescale and normalize."""
        out = np.empty((3, *pixels.shape[:2]), dtype=self.table.dtype)
        for c in range(3):
            np.take(self.table[c], pixels[..., c], out=out[c])
        return out
