"""LLaVA-1.5's image processing on the exact fast path gives the reference processor's
pixels to the bit, and leaves to it whatever it does not serve."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from hydrad.models.clip_images import ExactClipImages, exact_clip_images
from hydrad.models.hf_processor import load_hf_processor


def _photo(name: str) -> Image.Image:
    from skimage import data

    return Image.fromarray(getattr(data, name)())


def _noise(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


IMAGES = {
    "astronaut": lambda: _photo("astronaut"),  # RGB, square
    "camera": lambda: _photo("camera"),  # grayscale (mode L)
    "coffee": lambda: _photo("coffee"),  # landscape
    "chelsea": lambda: _photo("chelsea"),
    "palette": lambda: _noise(640, 480, 1).convert("P"),
    "tiny": lambda: _noise(20, 30, 2),  # smaller than the crop: upscaled
    "strip": lambda: _noise(300, 37, 3),
    "line": lambda: _noise(500, 1, 4),
    "portrait": lambda: _noise(240, 641, 5),
}


@pytest.fixture(scope="module")
def processors(tiny_llava_dir):
    reference = load_hf_processor(tiny_llava_dir, "llava")
    fast = load_hf_processor(tiny_llava_dir, "llava")
    fast.image_processor = exact_clip_images(fast.image_processor)
    assert isinstance(fast.image_processor, ExactClipImages)
    return reference, fast


@pytest.mark.parametrize("name", list(IMAGES))
def test_pixels_equal_the_reference_processors_bit_for_bit(processors, name):
    reference, fast = processors
    image = IMAGES[name]()
    want = reference(text="USER: <image>\nWhat is it?", images=[image], return_tensors="pt")
    got = fast(text="USER: <image>\nWhat is it?", images=[image], return_tensors="pt")
    assert got["pixel_values"].dtype == want["pixel_values"].dtype == torch.float32
    assert got["pixel_values"].shape == want["pixel_values"].shape
    assert torch.equal(got["pixel_values"], want["pixel_values"])
    assert torch.equal(got["input_ids"], want["input_ids"])


def test_several_images_in_one_call(processors):
    reference, fast = processors
    images = [IMAGES[name]() for name in ("coffee", "camera", "strip")]
    text = "USER: <image><image>\nand <image>"
    want = reference(text=text, images=images, return_tensors="pt")
    got = fast(text=text, images=images, return_tensors="pt")
    assert got["pixel_values"].shape[0] == 3 and torch.equal(got["pixel_values"], want["pixel_values"])
    # and without tensors asked: the same values
    plain = fast.image_processor(images)["pixel_values"]
    assert np.array_equal(np.asarray(plain), want["pixel_values"].numpy())


def test_what_it_does_not_serve_goes_to_the_reference(processors, monkeypatch):
    reference, fast = processors
    wrapper = fast.image_processor
    calls = []
    original = type(wrapper.reference).__call__

    def counted(self, *args, **kwargs):
        calls.append(kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(wrapper.reference), "__call__", counted)
    transparent = _noise(64, 48).convert("RGBA")
    transparent.putalpha(Image.fromarray(np.full((48, 64), 100, dtype=np.uint8)))
    array = np.asarray(_noise(64, 48))
    for images, kwargs in (([transparent], {}), ([array], {}), ([_noise(64, 48)], {"do_center_crop": False})):
        calls.clear()
        got = wrapper(images, return_tensors="pt", **kwargs)["pixel_values"]
        assert len(calls) == 1  # the wrapped processor's own call
        want = reference.image_processor(images, return_tensors="pt", **kwargs)["pixel_values"]
        assert torch.equal(got, want)
    calls.clear()
    wrapper([_noise(64, 48)], return_tensors="pt")
    assert calls == []  # served on the fast path


def test_other_settings_are_left_to_their_processor():
    from transformers import CLIPImageProcessor

    served = CLIPImageProcessor()
    assert isinstance(exact_clip_images(served), ExactClipImages)
    for other in (CLIPImageProcessor(do_center_crop=False), CLIPImageProcessor(size={"height": 224, "width": 224}),
                  CLIPImageProcessor(do_normalize=False)):
        assert exact_clip_images(other) is other


def test_the_request_processor_serves_llava_images_on_it(tiny_llava_dir):
    from hydrad.processor import InputProcessor

    processor = InputProcessor(tiny_llava_dir)
    assert isinstance(processor.processor.image_processor, ExactClipImages)
    processor.add_instances(1)
    with processor._hf_processor() as first, processor._hf_processor() as second:
        assert first is not second
        assert all(isinstance(p.image_processor, ExactClipImages) for p in (first, second))
