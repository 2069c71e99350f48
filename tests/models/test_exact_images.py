"""Image processing on the exact fast paths (LLaVA-1.5, LLaVA-NeXT, Qwen2-VL and Qwen2.5-VL)
gives the reference processor's outputs to the bit, and leaves to it whatever it does not
serve."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from hydrad.models.clip_images import ExactClipImages
from hydrad.models.exact_images import ExactImages, exact_images
from hydrad.models.hf_processor import load_hf_processor
from hydrad.models.llava_next_images import ExactLlavaNextImages
from hydrad.models.qwen2_vl_images import ExactQwen2VLImages


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
    "portrait": lambda: _noise(240, 641, 5),
}
# model_type, the fast path its checkpoint's processor takes, the arch to build it with.
FAMILIES = {
    "llava": ("llava", ExactClipImages),
    "llava-next": ("llava_next", ExactLlavaNextImages),
    "qwen2-vl": ("qwen2_vl", ExactQwen2VLImages),
    "qwen2.5-vl": ("qwen2_5_vl", ExactQwen2VLImages),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def processors(request, tiny_checkpoint):
    model_type, fast_class = FAMILIES[request.param]
    path = tiny_checkpoint(request.param)
    reference = load_hf_processor(path, model_type)
    fast = load_hf_processor(path, model_type)
    fast.image_processor = exact_images(fast.image_processor)
    assert isinstance(fast.image_processor, fast_class)
    return reference, fast


def _prompt(processor, num_images: int) -> str:
    parts = [{"type": "image"}] * num_images + [{"type": "text", "text": "What is it?"}]
    return processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                         tokenize=False)


def _assert_same(got, want) -> None:
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert got[key].shape == want[key].shape, key
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("name", list(IMAGES))
def test_outputs_equal_the_reference_processors_bit_for_bit(processors, name):
    reference, fast = processors
    image = IMAGES[name]()
    text = _prompt(reference, 1)
    _assert_same(fast(text=text, images=[image], return_tensors="pt"),
                 reference(text=text, images=[image], return_tensors="pt"))


def test_several_images_in_one_call(processors):
    reference, fast = processors
    # Of different sizes and shapes: LLaVA-NeXT pads the shorter tile lists, Qwen2-VL joins the patches.
    images = [IMAGES[name]() for name in ("coffee", "camera", "strip")]
    text = _prompt(reference, 3)
    want = reference(text=text, images=images, return_tensors="pt")
    _assert_same(fast(text=text, images=images, return_tensors="pt"), want)
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
    for images, kwargs in (([transparent], {}), ([array], {}), ([_noise(64, 48)], {"do_normalize": False})):
        calls.clear()
        got = wrapper(images, return_tensors="pt", **kwargs)["pixel_values"]
        assert len(calls) == 1  # the wrapped processor's own call
        want = reference.image_processor(images, return_tensors="pt", **kwargs)["pixel_values"]
        assert torch.equal(got, want)
    calls.clear()
    wrapper([_noise(64, 48)], return_tensors="pt", do_normalize=True)  # a setting as it is
    assert calls == []  # served on the fast path


def test_published_settings():
    """The processors as the published checkpoints configure them (LLaVA-1.5 and LLaVA-NeXT
    at 336 pixels, Qwen2-VL's default pixel budget), not only the tiny checkpoints' ones."""
    from transformers import CLIPImageProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    clip = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}}
    published = [
        CLIPImageProcessor(**clip),
        LlavaNextImageProcessorPil(**clip, image_grid_pinpoints=[[336, 672], [672, 336], [672, 672], [1008, 336],
                                                                 [336, 1008]]),
        Qwen2VLImageProcessorPil(),
        # Tiles (the crop's size) smaller than the shortest edge: each is resized, then cropped.
        LlavaNextImageProcessorPil(size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224},
                                   image_grid_pinpoints=[[224, 448], [448, 224], [448, 448]]),
    ]
    images = [IMAGES[name]() for name in ("astronaut", "coffee", "portrait", "palette")]
    for reference in published:
        fast = exact_images(reference)
        assert isinstance(fast, ExactImages)
        for image in images:
            _assert_same(fast([image], return_tensors="pt"), reference([image], return_tensors="pt"))


def test_other_settings_are_left_to_their_processor():
    from transformers import CLIPImageProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    served = CLIPImageProcessor()
    assert isinstance(exact_images(served), ExactClipImages)
    assert isinstance(exact_images(Qwen2VLImageProcessorPil()), ExactQwen2VLImages)
    for other in (CLIPImageProcessor(do_center_crop=False), CLIPImageProcessor(size={"height": 224, "width": 224}),
                  CLIPImageProcessor(do_normalize=False), Qwen2VLImageProcessorPil(do_normalize=False)):
        assert exact_images(other) is other


def test_an_image_qwen2_vl_cannot_resize_is_refused_as_by_the_reference(tiny_checkpoint):
    path = tiny_checkpoint("qwen2-vl")
    reference = load_hf_processor(path, "qwen2_vl").image_processor
    fast = exact_images(load_hf_processor(path, "qwen2_vl").image_processor)
    thin = _noise(1000, 4)  # an aspect ratio over 200
    for processor in (reference, fast):
        with pytest.raises(ValueError, match="aspect ratio"):
            processor([thin], return_tensors="pt")


@pytest.mark.parametrize("arch", ["llava", "llava-next", "qwen2-vl"])
def test_the_request_processor_serves_images_on_it(tiny_checkpoint, arch):
    from hydrad.processor import InputProcessor

    processor = InputProcessor(tiny_checkpoint(arch))
    assert isinstance(processor.processor.image_processor, FAMILIES[arch][1])
    processor.add_instances(1)
    with processor._hf_processor() as first, processor._hf_processor() as second:
        assert first is not second
        assert all(isinstance(p.image_processor, FAMILIES[arch][1]) for p in (first, second))
