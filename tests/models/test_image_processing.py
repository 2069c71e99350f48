"""The Request Processor per family: image placeholder runs, per-image token counts and pixels, M-RoPE
positions on the request, and its errors."""

from __future__ import annotations

import base64
import io
import json
import shutil

import pytest
import torch
from factories import hf_inputs, image, noise, text

import hydrad.processor
from hydrad.errors import RequestError
from hydrad.models.inputs import ImageInput
from hydrad.processed_images import ProcessedImages
from hydrad.processor import InputProcessor, find_image_runs
from hydrad.sampling_params import SamplingParams

ARCHS = ("llava", "llava-next", "qwen2-vl", "qwen2.5-vl")


@pytest.fixture(scope="module")
def processors(tiny_checkpoint):
    return {arch: InputProcessor(tiny_checkpoint(arch), max_images_per_request=3) for arch in ARCHS}


def test_find_image_runs_tells_adjacent_images_apart():
    ids = [1, 7, 7, 7, 7, 7, 2, 7, 7, 3]
    assert find_image_runs(ids, 7, [2, 3, 2]) == [1, 3, 7]
    assert find_image_runs(ids, 7, [5, 2]) == [1, 7]
    with pytest.raises(RequestError, match="holds 7 image placeholders for 2 images of 6 image tokens"):
        find_image_runs(ids, 7, [3, 3])
    with pytest.raises(RequestError, match="not contiguous"):
        find_image_runs(ids, 7, [4, 3])


@pytest.mark.parametrize("arch", ARCHS)
def test_each_image_gets_its_run_and_its_pixels(processors, arch):
    processor = processors[arch]
    conversation = [{"role": "user", "content": [image(100, 60, 1), text("and"), image(60, 150, 2)]},
                    {"role": "assistant", "content": "Two."},
                    {"role": "user", "content": [image(300, 90, 3), text("A third?")]}]
    prompt = processor.process_chat(conversation)
    reference = hf_inputs(processor.processor, conversation)
    ids = prompt.prompt_token_ids
    assert ids == reference["input_ids"][0].tolist()
    # Runs in order, each exactly its image's placeholders, nothing else between.
    placeholders = [i for i, t in enumerate(ids) if t == processor.image_token_id]
    covered = [i for im in prompt.images for i in range(im.offset, im.offset + im.length)]
    assert covered == placeholders
    assert [im.offset for im in prompt.images] == sorted(im.offset for im in prompt.images)
    lengths = [im.length for im in prompt.images]
    if arch == "llava":
        assert lengths == [16, 16, 16]
    else:
        assert len(set(lengths)) == 3, lengths
    # The pixels, split per image, are the processor's, in order.
    pixels = reference["pixel_values"]
    if arch == "llava-next":
        for k, im in enumerate(prompt.images):
            assert torch.equal(im.pixel_values, pixels[k, : im.pixel_values.shape[0]])
            assert not pixels[k, im.pixel_values.shape[0] :].any()  # only the batch's zero padding is left out
        assert [im.image_size for im in prompt.images] == [(60, 100), (150, 60), (90, 300)]
    elif arch == "llava":
        assert torch.equal(torch.stack([im.pixel_values for im in prompt.images]), pixels)
    else:  # Qwen: every image's patches, one after another
        assert torch.equal(torch.cat([im.pixel_values for im in prompt.images]), pixels)
    if arch.startswith("qwen"):
        assert [im.grid_thw for im in prompt.images] == [tuple(g) for g in reference["image_grid_thw"].tolist()]
        assert prompt.mrope_positions.shape == (3, len(ids)) and prompt.mrope_delta < 0
    else:
        assert prompt.mrope_positions is None and prompt.mrope_delta == 0


@pytest.mark.parametrize(("arch", "placeholder"), [("llava", "<image>"), ("llava-next", "<image>"),
                                                   ("qwen2-vl", "<|image_pad|>")])
def test_adjacent_placeholders_in_a_raw_prompt(processors, arch, placeholder):
    processor = processors[arch]
    images = [noise(100, 60, 1), noise(200, 200, 2)]
    prompt = processor._tokenize(processor.processor, f"Look:{placeholder}{placeholder}What?", images)
    first, second = prompt.images
    assert second.offset == first.offset + first.length
    assert sum(t == processor.image_token_id for t in prompt.prompt_token_ids) == first.length + second.length
    if arch == "qwen2-vl":
        # Positions are computed per image from its grid, even with no separator between the runs.
        rows, cols = first.grid_thw[1] // 2, first.grid_thw[2] // 2
        start = prompt.mrope_positions[0, first.offset].item()
        assert prompt.mrope_positions[:, second.offset].tolist() == [start + max(rows, cols)] * 3


def test_text_only_prompts(processors):
    qwen = processors["qwen2-vl"]
    prompt = qwen.process_chat([{"role": "user", "content": "Hello there"}])
    assert prompt.images == [] and prompt.mrope_positions is None
    with pytest.raises(RequestError, match="image placeholder tokens but no image"):
        qwen.process_prompt("a <|vision_start|><|image_pad|><|vision_end|> here")


def test_engine_request_carries_the_positions(processors):
    qwen = processors["qwen2.5-vl"]
    prompt = qwen.process_chat([{"role": "user", "content": [image(120, 80, 1), text("Describe.")]}])
    request = qwen.make_engine_request("r1", prompt, SamplingParams(max_tokens=4))
    assert request.mrope_positions is prompt.mrope_positions and request.mrope_delta == prompt.mrope_delta
    assert request.images[0].grid_thw == prompt.images[0].grid_thw


def test_image_limits_and_refused_images(processors):
    with pytest.raises(RequestError, match="4 images in one request; the limit is 3"):
        processors["llava-next"].process_chat([{"role": "user", "content": [image(20, 20, k) for k in range(4)]}])
    # Qwen2-VL's image processor refuses an aspect ratio above 200: a request error, not a crash.
    with pytest.raises(RequestError, match="could not process the images: absolute aspect ratio"):
        processors["qwen2-vl"].process_chat([{"role": "user", "content": [image(1000, 4, 1), text("?")]}])


def test_eos_ids_include_the_generation_config(tmp_path, tiny_checkpoint):
    path = tmp_path / "qwen"
    shutil.copytree(tiny_checkpoint("qwen2-vl"), path)
    processor = InputProcessor(path)
    im_end, endoftext = (processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert processor.eos_token_ids == (im_end,)
    generation = json.loads((path / "generation_config.json").read_text())
    generation["eos_token_id"] = [im_end, endoftext]
    (path / "generation_config.json").write_text(json.dumps(generation))
    assert InputProcessor(path).eos_token_ids == tuple(sorted((im_end, endoftext)))


def _as_file(part: dict) -> dict:
    """An image part of ``factories.image`` sent as a PNG data URL (lossless: the same pixels)."""
    buffer = io.BytesIO()
    part["image"].save(buffer, "PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        buffer.getvalue()).decode()}}


@pytest.mark.parametrize("arch", ARCHS)
def test_an_image_file_sent_again_is_neither_decoded_nor_processed_again(tiny_checkpoint, monkeypatch, arch):
    """The next turn of a conversation resends its images: they are found preprocessed, and the
    prompt is the one transformers' processor makes of the whole conversation (its ids, the
    images' pixels and placement, their digests as without the cache)."""
    path = tiny_checkpoint(arch)
    processor = InputProcessor(path, max_images_per_request=3, processed_image_cache_bytes=64 << 20)
    uncached = InputProcessor(path, max_images_per_request=3)
    first = [{"role": "user", "content": [image(100, 60, 1), text("and"), image(60, 150, 2)]}]
    second = [*first, {"role": "assistant", "content": "Two."},
              {"role": "user", "content": [image(300, 90, 3), text("A third?")]}]
    as_files = [{**m, "content": [_as_file(p) if p["type"] == "image" else p for p in m["content"]]}
                if isinstance(m["content"], list) else m for m in second]
    assert processor.process_chat(as_files[:1]).num_images_found == 0
    assert (processor.processed_images.num_found, processor.processed_images.num_missed) == (0, 2)
    kept = len(processor.processed_images)
    decoded = []
    real_open = hydrad.processor.open_image_bytes
    monkeypatch.setattr(hydrad.processor, "open_image_bytes", lambda *a, **k: decoded.append(1) or real_open(*a, **k))
    prompt = processor.process_chat(as_files)
    assert len(decoded) == 1 and processor.processed_images.num_found == 2  # only the new image decoded
    assert prompt.num_images_found == 2
    assert len(processor.processed_images) == kept + 1
    reference = hf_inputs(processor.processor, second)
    assert prompt.prompt_token_ids == reference["input_ids"][0].tolist()
    alone = uncached.process_chat(as_files)
    assert len(uncached.processed_images) == 0 and uncached.processed_images.num_missed == 0  # nothing looked up
    assert prompt.prompt_token_ids == alone.prompt_token_ids
    for found, computed in zip(prompt.images, alone.images):
        assert (found.offset, found.length, found.image_size, found.grid_thw, found.num_patches) == \
            (computed.offset, computed.length, computed.image_size, computed.grid_thw, computed.num_patches)
        assert torch.equal(found.pixel_values, computed.pixel_values)
        assert found.content_hash == computed.content_hash is not None
    if arch.startswith("qwen"):
        assert torch.equal(prompt.mrope_positions, alone.mrope_positions)
    # Found again by a third request: a copy of its own, which goes to shared memory with its
    # request while the cache's stays private (a shared tensor holds a descriptor open).
    again = processor.process_chat(as_files[:1])
    assert again.images[0].pixel_values.data_ptr() != prompt.images[0].pixel_values.data_ptr()
    again.images[0].pixel_values.share_memory_()
    assert not any(kept.pixel_values.is_shared() for kept in processor.processed_images._entries.values())
    # An image sent as an object has no file: nothing is looked up or kept.
    processor.process_chat(second)
    assert processor.processed_images.num_found + processor.processed_images.num_missed == 7


def test_processed_images_keep_the_most_recent_within_their_bytes():
    def entry(rows: int) -> ImageInput:
        return ImageInput(pixel_values=torch.zeros(rows, 256), offset=5, length=rows)  # 1 KiB a row

    cache = ProcessedImages(3 << 10)
    for k in range(3):
        cache.put(bytes([k]), entry(1))
    assert cache.get(bytes([0])).offset == -1  # found, with no placement: 0 is the most recent now
    cache.put(bytes([3]), entry(1))
    assert cache.get(bytes([1])) is None and cache.get(bytes([0])) is not None  # 1 was the least recent
    assert cache.num_bytes == 3 << 10 and len(cache) == 3
    cache.put(bytes([4]), entry(2))  # takes the room of two
    assert len(cache) == 2 and cache.num_bytes == 3 << 10
    cache.put(bytes([5]), entry(4))  # larger than the whole cache: not kept
    assert cache.get(bytes([5])) is None and len(cache) == 2
    # A row of a batch tensor is kept as its own bytes, not as a view holding the whole batch,
    # and each lookup gets a copy: changing it changes neither the batch nor the entry.
    batch = torch.ones(3, 256)
    cache.put(bytes([6]), ImageInput(pixel_values=batch[1], offset=0, length=1, image_size=(2, 3)))
    found = cache.get(bytes([6]))
    assert found.pixel_values.untyped_storage().nbytes() == 1 << 10 and found.image_size == (2, 3)
    found.pixel_values.zero_()
    assert torch.equal(cache.get(bytes([6])).pixel_values, batch[1]) and bool(batch.all())
    assert (cache.num_found, cache.num_missed) == (4, 2)
    empty = ProcessedImages(0)
    empty.put(b"k", entry(1))
    assert len(empty) == 0 and empty.get(b"k") is None
