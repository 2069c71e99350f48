"""The cache pools' sizes: from [cache], or from a GPU's memory (``hydrad.engine.memory``).

On a GPU an unset size is what ``gpu_memory_utilization`` of the device leaves after the
weights and the largest step. These tests run that path on the CPU with the device's
readings replaced (``FakeGpuMemory``): the engine measures its largest step, drops its
provisional pools and allocates them at their shares; a redeploy that gives an instance a
pool allocates it from the share left free; the planner sizes its simulated pools the same
way. The readings themselves (``torch.cuda.mem_get_info`` and the allocator's peak) run only
on a GPU (tests/cuda/test_cuda_memory.py)."""

from __future__ import annotations

import pytest
import torch

from factories import FakeGpuMemory
from hydrad import LLM, SamplingParams
from hydrad.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from hydrad.engine import memory
from hydrad.engine.core import EngineCore, PoolGeometry
from hydrad.errors import ConfigError
from hydrad.planner.profile import role_layouts

MB, GB = 1 << 20, 1 << 30


def test_cpu_defaults_are_unchanged():
    """Unset sizes on a CPU: 512 MB of KV, 256 MB of images; a role without one pool gives its
    memory to the other, as before sizes could be unset."""
    cache = CacheConfig()
    assert not memory.sized_from_device(cache, torch.device("cpu"))
    assert memory.role_pool_bytes(cache, "EPD", None) == (512 * MB, 256 * MB)
    assert memory.role_pool_bytes(cache, "E", None) == (0, 768 * MB)
    assert memory.role_pool_bytes(cache, "D", None) == (768 * MB, 0)
    assert memory.role_pool_bytes(CacheConfig(kv_cache_memory_mb=100), "PD", None) == (100 * MB, 256 * MB)


def test_sizes_come_from_a_gpu_only_where_unset():
    cuda = torch.device("cuda", 0)
    assert memory.sized_from_device(CacheConfig(), cuda)
    assert memory.sized_from_device(CacheConfig(kv_cache_memory_mb=64), cuda)
    assert not memory.sized_from_device(CacheConfig(kv_cache_memory_mb=64, image_cache_memory_mb=32), cuda)
    assert not memory.sized_from_device(CacheConfig(num_kv_blocks=8, num_image_blocks=8), cuda)


def test_the_budget_and_its_shares():
    now = memory.DeviceMemory(total=80 * GB, free=60 * GB, reserved=20 * GB, peak_reserved=20 * GB)
    # Its share of the device, less what it holds, the step and the reserve ...
    assert memory.pool_budget(0.9, now, own=15 * GB, step_peak=2 * GB, reserve=1 * GB) == int(0.9 * 80 * GB) - 18 * GB
    # ... at most what is free (other processes hold the rest).
    assert memory.pool_budget(0.9, now, own=1 * GB, step_peak=2 * GB, reserve=1 * GB) == 57 * GB
    # Unset sizes: an eighth to images, the rest to KV, whatever pools the role holds.
    assert memory.split_budget(CacheConfig(), True, True, 800 * MB) == (700 * MB, 100 * MB)
    assert memory.split_budget(CacheConfig(), True, False, 800 * MB) == (700 * MB, 0)
    assert memory.split_budget(CacheConfig(), False, True, 800 * MB) == (0, 100 * MB)
    # A set size is kept; the unset pool takes its share of what is left.
    assert memory.split_budget(CacheConfig(kv_cache_memory_mb=750), True, True, 800 * MB) == (750 * MB, 50 * MB)
    assert memory.split_budget(CacheConfig(image_cache_memory_mb=300), True, True, 800 * MB) == (500 * MB, 300 * MB)
    assert memory.split_budget(CacheConfig(), True, True, -5) == (0, 0)
    assert memory.step_reserve(256, 32000) == memory.CUDA_GATHER_BYTES + 256 * 32000 * 24


def test_gpu_memory_utilization_is_checked():
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ConfigError, match="gpu_memory_utilization"):
            CacheConfig(gpu_memory_utilization=bad)
    with pytest.raises(ConfigError, match=">= 1 MB"):
        CacheConfig(kv_cache_memory_mb=0)


def _expected_budget(fake: FakeGpuMemory, engine: EngineCore, own: int = 0, utilization: float = 0.9) -> int:
    reserve = memory.step_reserve(engine.config.scheduler.max_num_seqs, engine.vocab_size)
    return min(int(utilization * fake.total) - own, fake.free) - fake.step_peak - reserve


def test_pools_sized_from_the_device_keep_transformers_tokens(tiny_llava_dir, monkeypatch):
    """One EPD instance on a (pretend) 600 MB device whose largest step needs 40 MB: its pools
    get 0.9 x 600 MB less that and the reserve, an eighth of it images; it ran its largest
    step on provisional pools first, and serves the same greedy tokens as an instance with
    pools from [cache]."""
    from hydrad.engine import profiler

    fake = FakeGpuMemory(monkeypatch, total=600 * MB, free=600 * MB, step_peak=40 * MB)
    calls = []
    real = profiler.probe_images
    monkeypatch.setattr(profiler, "probe_images", lambda *a, **k: calls.append(k.get("sizes")) or real(*a, **k))
    prompts = ["The cat sat on", "Once upon a time there", "Numbers: 1 2 3"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_llava_dir), max_num_seqs=16) as sized:
        engine = sized.engine
        budget = _expected_budget(fake, engine)
        assert budget > 100 * MB and engine.pool_bytes == budget
        geometry = engine.geometry()
        kv_bytes, image_bytes = budget - int(budget / 8), int(budget / 8)
        assert engine.kv_manager.num_blocks == kv_bytes // geometry.kv_block_bytes
        assert engine.image_manager.num_blocks == image_bytes // geometry.image_block_bytes
        assert engine.runner.kv_cache.shape[2] == engine.kv_manager.num_blocks
        assert engine.runner.image_cache.shape[0] == engine.image_manager.num_blocks
        assert engine._step_peak == fake.step_peak and fake.resets >= 2
        # The largest steps' images are made once at start: the probe pictures, the largest one.
        assert calls == [None, ((4096, 4096),)], calls
        assert geometry.pool_bytes == budget
        got = [o.token_ids for o in sized.generate(prompts, params, use_tqdm=False)]
        assert engine.kv_manager.num_used_blocks == 0
    monkeypatch.undo()
    with LLM(str(tiny_llava_dir), max_num_seqs=16) as fixed:
        assert fixed.engine.pool_bytes is None
        assert fixed.engine.kv_manager.num_blocks * fixed.engine.geometry().kv_block_bytes <= 512 * MB
        want = [o.token_ids for o in fixed.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_the_pools_take_at_most_what_is_free(tiny_llava_dir, monkeypatch, caplog):
    """Other processes hold most of the device: the pools take what is free, and the log says so."""
    fake = FakeGpuMemory(monkeypatch, total=2 * GB, free=300 * MB, step_peak=10 * MB)
    with LLM(str(tiny_llava_dir), max_num_seqs=16) as llm:
        assert llm.engine.pool_bytes == _expected_budget(fake, llm.engine) == 290 * MB - memory.step_reserve(
            16, llm.engine.vocab_size)
    assert "less than gpu_memory_utilization allows it" in caplog.text


def test_a_set_kv_size_is_kept_on_the_device(tiny_llava_dir, monkeypatch):
    fake = FakeGpuMemory(monkeypatch, total=GB, free=GB, step_peak=10 * MB)
    with LLM(str(tiny_llava_dir), kv_cache_memory_mb=64, max_num_seqs=16) as llm:
        engine = llm.engine
        assert engine.pool_bytes == _expected_budget(fake, engine)
        assert engine.kv_manager.num_blocks == 64 * MB // engine.geometry().kv_block_bytes
        assert engine.image_manager.num_blocks == int(engine.pool_bytes / 8) // engine.geometry().image_block_bytes


def test_no_room_is_one_clear_error(tiny_llava_dir, monkeypatch):
    FakeGpuMemory(monkeypatch, total=GB, free=20 * MB, step_peak=10 * MB)
    config = EngineConfig(model=ModelConfig(path=str(tiny_llava_dir)), scheduler=SchedulerConfig(max_num_seqs=16))
    with pytest.raises(ConfigError) as error:
        EngineCore(config, role="EPD")
    message = str(error.value)
    assert "no memory left for the cache pools" in message and "gpu_memory_utilization = 0.9" in message
    assert "\n" not in message


def test_a_redeploy_allocates_a_new_pool_from_its_share(tiny_llava_dir, monkeypatch):
    """An encode-only instance takes only its image share; given P and D in a redeploy it
    measures the language part's largest step and allocates its KV share (left free on the
    device), or less when it holds more since its start."""
    fake = FakeGpuMemory(monkeypatch, total=GB, free=GB, step_peak=20 * MB)
    with LLM(str(tiny_llava_dir), deploy="1E+1PD", devices="cpu:2", worker_processes=False,
             max_num_seqs=16, token_budget=64) as llm:
        encoder, language = llm.engine.engines
        assert encoder.kv_manager is None
        budget = encoder.pool_bytes
        assert budget == _expected_budget(fake, encoder)
        assert encoder.image_manager.num_blocks == int(budget / 8) // encoder.geometry().image_block_bytes
        assert language.kv_manager.num_blocks == (budget - int(budget / 8)) // language.geometry().kv_block_bytes
        fake.reserved += 300 * MB  # its image pool and the language weights, since it started
        fake.step_peak = 60 * MB  # the language part's largest step, measured in the redeploy
        encoder.expand("PD")
        assert encoder._step_peak == 60 * MB
        room = _expected_budget(fake, encoder, own=300 * MB)
        assert 0 < room < budget - int(budget / 8)
        assert encoder.kv_manager.num_blocks == room // encoder.geometry().kv_block_bytes
        # The provisional pool of the measurement (64 tokens) did not limit the context.
        assert encoder.scheduler.max_model_len == encoder.max_model_len == language.max_model_len == 2048
        out = llm.generate(["Hello there"], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.token_ids) == 6


def test_the_planner_sizes_each_role_as_the_engine_does():
    geometry = PoolGeometry(16, 4096, 64, 8192, pool_bytes=800 * MB)
    config = EngineConfig()
    layouts = role_layouts(config, geometry)
    assert (layouts["EPD"].num_kv_blocks, layouts["EPD"].num_image_blocks) == (700 * MB // 4096, 100 * MB // 8192)
    assert (layouts["E"].num_kv_blocks, layouts["E"].num_image_blocks) == (0, 100 * MB // 8192)
    assert (layouts["D"].num_kv_blocks, layouts["D"].num_image_blocks) == (700 * MB // 4096, 0)
    fixed = role_layouts(config, PoolGeometry(16, 4096, 64, 8192))
    assert (fixed["D"].num_kv_blocks, fixed["E"].num_image_blocks) == (768 * MB // 4096, 768 * MB // 8192)


def test_a_largest_step_the_device_cannot_hold_is_one_clear_error(tiny_llava_dir, monkeypatch):
    """The probe timer answers a step that runs out of device memory with infinity: the start
    fails with one line naming the step, instead of sizing the pools from a step cut short."""
    from hydrad.engine.profiler import EngineTimer

    FakeGpuMemory(monkeypatch, total=GB, free=GB, step_peak=10 * MB)
    monkeypatch.setattr(EngineTimer, "__call__", lambda self, probe: float("inf"))
    config = EngineConfig(model=ModelConfig(path=str(tiny_llava_dir)), scheduler=SchedulerConfig(max_num_seqs=16))
    largest_step = r"its largest step \(2048 prompt tokens, 4 images of \d+ tokens\) does not fit"
    with pytest.raises(ConfigError, match=largest_step):
        EngineCore(config, role="EPD")


def test_the_largest_steps_include_the_largest_image_the_processor_makes(tiny_llava_dir, monkeypatch):
    """Where the image processor makes an image larger than the largest probe picture (Qwen2-VL
    up to its max_pixels), one such image beside the prompt is a largest step too, and the
    provisional image pool holds either step."""
    import dataclasses

    from hydrad.engine import profiler

    real = profiler.probe_images

    def probe_images(engine, sizes=profiler.PROBE_PICTURE_SIZES):
        image = real(engine)[-1]
        if sizes == profiler.PROBE_PICTURE_SIZES:
            return [dataclasses.replace(image, length=16), dataclasses.replace(image, length=40)]
        return [dataclasses.replace(image, num_patches=image.num_patches * 9, length=300)]

    with LLM(str(tiny_llava_dir), max_num_seqs=16, image_block_size=16) as llm:
        monkeypatch.setattr(profiler, "probe_images", probe_images)
        engine = llm.engine
        steps, images = engine._largest_steps(True, True)
        assert [step.images for step in steps] == [((images[1].num_patches, 40),) * 4,
                                                   ((images[1].num_patches * 9, 300),)]
        assert all(step.prefills == ((0, 2048),) for step in steps)
        assert [image.length for image in images] == [16, 40, 300]
        # 4 images of 40 tokens take 12 blocks of 16; one of 300 takes 19.
        assert engine._provisional_sizes(steps, True, True, 16) == (2048 // engine.kv_block_size, 19)
