"""ModelRunner.encode with images of different token counts: each one's features land in its own blocks."""

from __future__ import annotations

import random

import pytest
import torch
from PIL import Image

from hydrad.engine.model_runner import ModelRunner
from hydrad.engine.request import Request
from hydrad.engine.sampler import Sampler
from hydrad.models.loader import iter_weights, load_config
from hydrad.models.registry import get_model_class
from hydrad.processor import InputProcessor
from hydrad.sampling_params import SamplingParams


def _request(processor, req_id: str, sizes: list[tuple[int, int]]) -> Request:
    content = [{"type": "image", "image": Image.new("RGB", size, (40 * k, 90, 200 - 30 * k))}
               for k, size in enumerate(sizes)]
    prompt = processor.process_chat([{"role": "user", "content": [*content, {"type": "text", "text": "Hi"}]}])
    return Request(processor.make_engine_request(req_id, prompt, SamplingParams(max_tokens=2)))


@pytest.mark.parametrize("arch", ["llava", "llava-next", "qwen2-vl"])
def test_each_image_lands_in_its_blocks(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    processor = InputProcessor(path)
    model = get_model_class(load_config(path))(load_config(path), load_language=False)
    model.load_weights(iter_weights(path, torch.float32, prefixes=("vision_tower.", "multi_modal_projector.")))
    block_size = 8
    requests = [_request(processor, "a", [(120, 80)]), _request(processor, "b", [(40, 90), (200, 200)])]
    encodes = [(req, i) for req in requests for i in range(len(req.images))]
    lengths = [req.images[i].length for req, i in encodes]
    if arch != "llava":
        assert len(set(lengths)) == 3, lengths
    # Shuffled, non-contiguous blocks from one pool.
    needed = [-(-n // block_size) for n in lengths]
    pool = random.Random(0).sample(range(sum(needed) + 3), sum(needed))
    for (req, i), n in zip(encodes, needed):
        req.image_block_ids[i], pool = pool[:n], pool[n:]
    runner = ModelRunner(model, device=torch.device("cpu"), dtype=torch.float32, num_kv_blocks=0, kv_block_size=16,
                         num_image_blocks=sum(needed) + 3, image_block_size=block_size, sampler=Sampler(0))
    runner.encode(encodes)

    # The encode cost the latency model counts: the patch positions the tower ran over.
    tower_inputs = {"llava": lambda im: 17, "llava-next": lambda im: im.pixel_values.shape[0] * 17,
                    "qwen2-vl": lambda im: im.pixel_values.shape[0]}[arch]
    assert [model.num_vision_patches(req.images[i]) for req, i in encodes] == [
        tower_inputs(req.images[i]) for req, i in encodes]

    flat = runner.image_cache.view(-1, model.image_hidden_size)
    for req, i in encodes:
        image = req.images[i]
        alone = model.encode_images([image])[0]  # [num_image_tokens, hidden]
        slots = torch.tensor([b * block_size + k for b in req.image_block_ids[i] for k in range(block_size)])
        torch.testing.assert_close(flat[slots[: image.length]], alone, atol=1e-5, rtol=1e-5)


def test_a_wrong_placeholder_count_is_refused(tiny_checkpoint):
    path = tiny_checkpoint("qwen2-vl")
    processor = InputProcessor(path)
    model = get_model_class(load_config(path))(load_config(path), load_language=False)
    model.load_weights(iter_weights(path, torch.float32, prefixes=("vision_tower.",)))
    req = _request(processor, "a", [(120, 80)])  # 3 x 4 merged patches: 12 tokens
    assert req.images[0].length == 12
    req.images[0].length -= 1
    req.image_block_ids[0] = [0, 1]
    runner = ModelRunner(model, device=torch.device("cpu"), dtype=torch.float32, num_kv_blocks=0, kv_block_size=16,
                         num_image_blocks=2, image_block_size=8, sampler=Sampler(0))
    with pytest.raises(ValueError, match="image 0 has 11 placeholder tokens but encodes to 12"):
        runner.encode([(req, 0)])
