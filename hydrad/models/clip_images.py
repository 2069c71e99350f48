"""LLaVA-1.5's image processing (CLIP's: shortest edge, centre crop, rescale, normalize) with
the reference processor's pixels, bit for bit, in fewer passes over them.

transformers' PIL image processor turns the picture into a channels-first array, back into
a PIL image to resize it, into an array again, crops it, then rescales it in float64 and
normalizes it in float32, each step a pass over every pixel: 4.0 ms of the daemon's CPU for a
decoded 640x480 JPEG here, 3.1 ms this way (most of it PIL's bicubic resize). Rescaling and normalizing map each 8-bit value of
each channel to one float on their own, so the 768 floats they can give are computed once,
by the reference processor's own ``rescale`` and ``normalize``, and the cropped pixels are
looked up in that table. The resize is PIL's own call with the same arguments, and the
sizes come from transformers' own functions, so the result is the reference's to the bit
(``tests/models/test_clip_images.py`` compares them on photographs, grayscale, palette and
odd-sized images).

``exact_clip_images(image_processor)`` wraps a processor whose settings are these steps'
(a ``CLIPImageProcessor``-style configuration) and leaves any other alone; the wrapper
hands everything it does not do this way (arrays, images with transparency, other
arguments) to the processor it wraps.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

# The arguments a call may carry for the fast path to serve it.
_SERVED_KWARGS = frozenset({"return_tensors"})


def exact_clip_images(image_processor):
    """``image_processor`` wrapped in ``ExactClipImages`` where its settings are the steps
    this module does, else ``image_processor`` itself."""
    if ExactClipImages.serves(image_processor):
        return ExactClipImages(image_processor)
    return image_processor


class ExactClipImages:
    """Calls as the wrapped image processor does, and gives its ``pixel_values``."""

    def __init__(self, reference):
        from transformers.image_utils import ChannelDimension

        self.reference = reference
        self.resample = Image.Resampling(int(reference.resample))
        self.shortest_edge = int(reference.size.shortest_edge)
        self.crop = (int(reference.crop_size.height), int(reference.crop_size.width))
        # Every 8-bit value of each channel through the reference's own rescale and normalize.
        ramp = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 1, 256)).copy()
        scaled = reference.rescale(ramp, reference.rescale_factor, input_data_format=ChannelDimension.FIRST)
        table = reference.normalize(scaled, reference.image_mean, reference.image_std,
                                    input_data_format=ChannelDimension.FIRST)
        self.table = np.ascontiguousarray(table[:, 0, :])  # [3, 256]

    @staticmethod
    def serves(p) -> bool:
        def named(size) -> set[str]:  # the sizes a SizeDict (or a dict) sets
            items = vars(size).items() if hasattr(size, "__dataclass_fields__") else dict(size or {}).items()
            return {key for key, value in items if value is not None}

        return (type(p).__name__.startswith("CLIPImageProcessor") and getattr(p, "backend", None) == "pil"
                and bool(p.do_resize and p.do_center_crop and p.do_rescale and p.do_normalize and p.do_convert_rgb)
                and not getattr(p, "do_pad", False) and p.resample is not None
                and named(getattr(p, "size", None)) == {"shortest_edge"}
                and named(getattr(p, "crop_size", None)) == {"height", "width"})

    def __getattr__(self, name):
        return getattr(self.reference, name)

    def __call__(self, images, **kwargs):
        from transformers.feature_extraction_utils import BatchFeature

        listed = images if isinstance(images, (list, tuple)) else [images]
        if set(kwargs) - _SERVED_KWARGS or not all(self._plain(image) for image in listed):
            return self.reference(images, **kwargs)
        pixels = np.stack([self.pixel_values(image) for image in listed])
        return BatchFeature(data={"pixel_values": pixels}, tensor_type=kwargs.get("return_tensors"))

    @staticmethod
    def _plain(image) -> bool:
        """A PIL image without transparency (the reference composites those onto white)."""
        return (isinstance(image, Image.Image) and "A" not in image.getbands()
                and image.info.get("transparency") is None)

    def pixel_values(self, image: Image.Image) -> np.ndarray:
        """One image's [3, crop height, crop width] float32 pixels."""
        from transformers.image_transforms import center_crop, get_resize_output_image_size
        from transformers.image_utils import ChannelDimension

        rgb = image if image.mode == "RGB" else image.convert("RGB")
        shape = np.broadcast_to(np.uint8(0), (1, rgb.height, rgb.width))  # the size, as the reference reads it
        height, width = get_resize_output_image_size(shape, size=self.shortest_edge, default_to_square=False,
                                                     input_data_format=ChannelDimension.FIRST)
        resized = np.asarray(rgb.resize((width, height), resample=self.resample, reducing_gap=None))
        cropped = center_crop(resized, self.crop, data_format=ChannelDimension.LAST,
                              input_data_format=ChannelDimension.LAST)
        out = np.empty((3, *cropped.shape[:2]), dtype=self.table.dtype)
        for c in range(3):
            np.take(self.table[c], cropped[..., c], out=out[c])
        return out
