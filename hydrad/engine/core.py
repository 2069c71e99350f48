"""One engine instance: model, caches, scheduler, runner — the loop body of a worker.

The frontend (``hydrad.LLM`` in process, or the daemon through a worker process)
adds requests, calls ``step()`` and receives per-request token diffs. An instance
has a role, a non-empty subset of E (encode), P (prefill), D (decode): it loads
only the weights and caches its stages need, and hands a request whose next stage
it does not hold to another instance (``take_offers`` / ``add_migration`` /
``release``), which pulls the blocks straight out of this instance's pools.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from concurrent.futures import Future
from typing import Iterable

import torch

from hydrad.config import CacheConfig, EngineConfig
from hydrad.models.attention import SDPA_BLOCK_SIZE, backend_name, get_attn_backend
from hydrad.engine.block_manager import BlockManager
from hydrad.engine.inputs import (
    EngineOutput,
    EngineRequest,
    EngineStats,
    FinishedRequest,
    StepTiming,
)
from hydrad.engine.latency_model import Calibration, LatencyModel, LiveSpeed, handoff_wait, idle_bound
from hydrad.engine.model_runner import ModelRunner
from hydrad.engine.request import Request
from hydrad.engine.sampler import Sampler
from hydrad.engine.migration import MigrationOffer, PullCopier, Pulled, offer_for, quick_pull_seconds
from hydrad.engine.scheduler import Scheduler
from hydrad.engine.allocator import bound_shape_caches, keep_freed_memory
from hydrad.engine import memory
from hydrad.engine.streams import StageStreams
from hydrad.dtypes import resolve_dtype_name
from hydrad.errors import ConfigError, RequestError

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")
_LANGUAGE_PREFIXES = ("language_model.", "lm_head.")


def resolve_dtype(name: str, device: torch.device, model_dir=None) -> torch.dtype:
    """The dtype ``name`` runs the checkpoint in ``model_dir`` in on ``device``
    (``hydrad.dtypes``: "auto" follows the device and the checkpoint)."""
    return _DTYPES[resolve_dtype_name(name, device.type, model_dir)]


def role_caches(role: str) -> tuple[bool, bool]:
    """Whether a role holds a KV pool (it prefills or decodes) and an image pool (it encodes,
    or prefills from encoded images)."""
    return "P" in role or "D" in role, "E" in role or "P" in role


def normalize_role(role: str) -> str:
    stages = set(role.upper())
    if not stages or stages - set("EPD"):
        raise ConfigError(f"role {role!r}: a role is a non-empty subset of E, P, D")
    return "".join(s for s in "EPD" if s in stages)


def _kv_block_size(cache: CacheConfig, backend) -> int:
    """Tokens per KV block: the configured size (checked against the backend), else the
    backend's default (an instance without a language model yet: the SDPA default)."""
    if cache.kv_block_size is None:
        return backend.default_block_size if backend is not None else SDPA_BLOCK_SIZE
    if backend is not None:
        backend.check_block_size(cache.kv_block_size)
    return cache.kv_block_size


@dataclasses.dataclass(frozen=True)
class PoolGeometry:
    """One block of each pool: the tokens (slots) it holds and its bytes. The planner sizes
    its simulated pools and copies by it."""

    kv_block_size: int
    kv_block_bytes: int
    image_block_size: int
    image_block_bytes: int
    # The bytes a GPU gave the instance's pools, both shares (hydrad.engine.memory); None:
    # the pools are sized from [cache].
    pool_bytes: int | None = None


# A picture larger than any image processor keeps: the largest image a request can bring, as
# the processor makes it, for the memory a step needs (``EngineCore._largest_steps``).
_LARGEST_PICTURE = (4096, 4096)


def _num_blocks(explicit: int | None, memory_mb: int, bytes_per_block: int) -> int:
    if explicit is not None:
        return explicit
    return max(1, (memory_mb << 20) // bytes_per_block)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        *,
        role: str = "EPD",
        device: str = "cpu",
        instance_id: int = 0,
        shared_pools: bool = False,
    ):
        from hydrad.models.default import resolve_model_path
        from hydrad.models.loader import iter_weights, load_config
        from hydrad.models.registry import get_model_class

        self.config = config
        self.role = normalize_role(role)
        self.instance_id = instance_id
        self.device = torch.device(device)
        if self.device.type == "cpu":
            keep_freed_memory()  # the step's tensors reuse freed pages (engine.allocator)
            bound_shape_caches()  # and its matmuls built per shape stay within a bound
        self.model_path = resolve_model_path(config.model.path)
        self.dtype = resolve_dtype(config.model.dtype, self.device, self.model_path)
        has_vision = "E" in self.role
        has_language = "P" in self.role or "D" in self.role
        has_kv, has_image_cache = role_caches(self.role)

        self.hf_config = hf_config = load_config(self.model_path)
        model_cls = get_model_class(hf_config)
        # The language model's attention backend ("sdpa", "flash_attn"), or the one it would
        # have (an instance without one yet)
        self.attention_backend = backend_name(self.device, config.model.attention_backend, self.dtype,
                                              config.cache.kv_block_size)
        attn_backend = get_attn_backend(self.device, self.attention_backend, self.dtype) if has_language else None
        self.kv_block_size = _kv_block_size(config.cache, attn_backend)
        self.model = model_cls(
            hf_config,
            load_vision=has_vision,
            load_language=has_language,
            attn_backend=attn_backend,
            dtype=self.dtype,
            device=self.device,
        )
        # On a GPU with a pool's size unset, the pools get a share of the device from what this
        # instance allocates from here on (hydrad.engine.memory).
        from_device = memory.sized_from_device(config.cache, self.device)
        self._reserved_at_start = memory.device_memory(self.device).reserved if from_device else 0
        prefixes = (_VISION_PREFIXES if has_vision else ()) + (_LANGUAGE_PREFIXES if has_language else ())
        self.model.load_weights(iter_weights(self.model_path, self.dtype, prefixes=prefixes))
        self.model.eval()

        self.max_model_len = config.model.max_model_len or hf_config.text_config.max_position_embeddings
        cache = config.cache
        # An image takes as many blocks as its tokens need (the family's default: one LLaVA-1.5
        # image per block, 64 slots for the families whose images vary in size).
        image_block_size = cache.image_block_size or self.model.default_image_block_size
        # What a GPU gave the pools (their budget, both shares; None: sized from [cache]), and
        # the largest step's peak it was measured with.
        self.pool_bytes: int | None = None
        self._step_peak = 0
        # Sized from a GPU: small provisional pools first; the largest step runs on them, and the
        # pools are then sized from the memory the device has left (below).
        if from_device:
            largest = self._largest_steps(has_vision, has_language)
            num_kv_blocks, num_image_blocks = self._provisional_sizes(largest[0], has_kv, has_image_cache,
                                                                      image_block_size)
        else:
            num_kv_blocks, num_image_blocks = self._pool_sizes(has_kv, has_image_cache, image_block_size)
            if has_kv:
                self._limit_context(num_kv_blocks)
        self.kv_manager = BlockManager(num_kv_blocks, self.kv_block_size, "kv") if has_kv else None
        self.image_manager = BlockManager(num_image_blocks, image_block_size, "image") if has_image_cache else None
        # With dual streams a step's vision and language work run at once; without, one after the
        # other, and a step's prefill may read the features its own vision work wrote.
        dual = config.parallel.dual_streams_on(self.device.type) and has_vision and has_language
        self.scheduler = Scheduler(
            config.scheduler, self.kv_manager, self.image_manager, self.max_model_len, role=self.role,
            prefix_caching=cache.prefix_caching, prefill_after_encode=not dual,
        )
        self.runner = ModelRunner(
            self.model,
            device=self.device,
            dtype=self.dtype,
            num_kv_blocks=num_kv_blocks,
            kv_block_size=self.kv_block_size,
            num_image_blocks=num_image_blocks,
            image_block_size=image_block_size,
            sampler=Sampler(config.seed, self.device),
            shared=shared_pools,
            max_blocks_per_seq=-(-self.max_model_len // self.kv_block_size),
            vocab_size=hf_config.text_config.vocab_size,
            tokenizer_path=str(config.model.path),
        )
        self.vocab_size = hf_config.text_config.vocab_size
        self.streams = StageStreams(self.device, dual)

        # Migration: peers' pools (attached once at start), the copy thread, pulls to report.
        self.copier = PullCopier(self.device, self.runner.copy_in)
        self._pulled: list[Pulled] = []
        # Bytes per second of a pull's copy (set by the worker once measured; None: unknown,
        # and no step waits for a copy).
        self.copy_bandwidth: float | None = None
        # How steps with decodes run against their prediction on the machine now, and each
        # kind of work (the machine's speed under load, for the planner). The latter is kept
        # across models: each step is measured against the model that predicted it, and a
        # borrower switches between its models at every change of its thread count.
        self.calibration = Calibration()
        self.live_speed = LiveSpeed()
        # Set when a step found nothing it could run (e.g. blocks held by offered requests):
        # no step can do better until a request arrives, leaves or is released.
        self._stalled = False
        if from_device:
            num_kv_blocks, num_image_blocks = self._size_pools_from_device(*largest)
        logger.info(
            "instance %d (%s) ready: %s on %s (%s), %d KV blocks x %d tokens, %d image blocks x %d slots",
            instance_id, self.role, self.model_path.name, self.device, str(self.dtype).removeprefix("torch."),
            num_kv_blocks, self.kv_block_size, num_image_blocks, image_block_size,
        )

    def _limit_context(self, num_kv_blocks: int) -> None:
        """A context longer than the KV cache holds could never run: serve what it holds, and
        say so. The daemon serves the smallest of its instances' contexts, so the front end
        refuses a longer request with the context length before anything streams."""
        tokens = num_kv_blocks * self.kv_block_size
        if tokens < self.max_model_len:
            logger.warning(
                "instance %d (%s): its KV cache holds %d tokens, fewer than max_model_len %d: contexts are "
                "limited to %d tokens (enlarge [cache] kv_cache_memory_mb, or lower [model] max_model_len)",
                self.instance_id, self.role, tokens, self.max_model_len, tokens)
            self.max_model_len = tokens

    def _pool_sizes(self, has_kv: bool, has_image_cache: bool, image_block_size: int) -> tuple[int, int]:
        """Blocks of each pool a role uses (0: not used), from [cache]. Memory is split by
        role: a cache the role does not use gives its share to the other."""
        cache = self.config.cache
        kv_mb, image_mb = memory.fixed_pool_mb(cache, has_kv, has_image_cache)
        geometry = self.geometry(image_block_size)
        num_kv = _num_blocks(cache.num_kv_blocks, kv_mb, geometry.kv_block_bytes) if has_kv else 0
        num_image = (_num_blocks(cache.num_image_blocks, image_mb, geometry.image_block_bytes)
                     if has_image_cache else 0)
        return num_kv, num_image

    # -- pools sized from a GPU's memory (hydrad.engine.memory) ---------------------------------
    def _largest_steps(self, vision: bool, language: bool) -> tuple[list, list]:
        """The largest steps the scheduler builds with these parts (``Probe``s), and the images
        they encode: a prompt of ``token_budget`` tokens beside ``image_budget`` of the largest
        probe pictures, and beside one picture as large as the image processor makes any
        (the families whose images vary in size: Qwen2-VL up to its ``max_pixels``)."""
        from hydrad.engine.profiler import Probe, probe_images

        sched = self.config.scheduler
        prompt = ((0, min(sched.token_budget, self.max_model_len)),) if language else ()
        if not vision:
            return [Probe(prefills=prompt)], []
        images = probe_images(self)
        largest = probe_images(self, sizes=(_LARGEST_PICTURE,))[-1]
        kind = (images[-1].num_patches, images[-1].length)
        steps = [Probe(images=(kind,) * sched.image_budget, prefills=prompt)]
        if largest.length > images[-1].length:
            steps.append(Probe(images=((largest.num_patches, largest.length),), prefills=prompt))
            images.append(largest)
        return steps, images

    def _provisional_sizes(self, steps: list, has_kv: bool, has_image_cache: bool,
                           image_block_size: int) -> tuple[int, int]:
        """Blocks of each pool ``steps`` (``_largest_steps``) need, and no more."""
        prompt_tokens = max((tokens for step in steps for _, tokens in step.prefills), default=0)
        image_blocks = max(sum(-(-tokens // image_block_size) for _, tokens in step.images) for step in steps)
        num_kv = -(-max(1, prompt_tokens) // self.kv_block_size) if has_kv else 0
        num_image = max(1, image_blocks) if has_image_cache else 0
        return num_kv, num_image

    def _step_peak_bytes(self, steps: list, images: list) -> int:
        """Bytes ``steps`` (``_largest_steps``, encoding ``images``) need beyond what is allocated
        now (torch's reserved memory at its peak, over the pools they run on): the most of any."""
        from hydrad.engine.profiler import EngineTimer

        timer = EngineTimer(self, images=images, repeats=1)
        peak = 0
        for step in steps:
            memory.reset_peak(self.device)
            before = memory.device_memory(self.device).peak_reserved
            if math.isinf(timer(step)):  # the timer's answer to running out of memory
                raise ConfigError(
                    f"instance {self.instance_id} ({self.device}): its largest step "
                    f"({sum(tokens for _, tokens in step.prefills)} prompt tokens, {len(step.images)} images of "
                    f"{max((tokens for _, tokens in step.images), default=0)} tokens) does not fit in the device's "
                    f"memory beside its weights: lower [scheduler] token_budget or image_budget")
            peak = max(peak, memory.device_memory(self.device).peak_reserved - before)
        return peak

    def _device_room(self) -> int:
        """Bytes the device has for new pools now (``memory.pool_budget``)."""
        cache, sched = self.config.cache, self.config.scheduler
        memory.reset_peak(self.device)
        now = memory.device_memory(self.device)
        own = max(0, now.reserved - self._reserved_at_start)
        reserve = memory.step_reserve(sched.max_num_seqs, self.vocab_size)
        budget = memory.pool_budget(cache.gpu_memory_utilization, now, own, self._step_peak, reserve)
        if budget <= 0:
            raise memory.no_room_error(self.device, cache.gpu_memory_utilization, now, own, self._step_peak, reserve)
        if memory.own_share(cache.gpu_memory_utilization, now, own) > now.free:
            logger.warning("instance %d (%s): %.2f GiB free on %s, less than gpu_memory_utilization allows it "
                           "(other processes hold memory there): its pools take what is free", self.instance_id,
                           self.role, now.free / memory.GB, self.device)
        return budget

    def _size_pools_from_device(self, steps: list, images: list) -> tuple[int, int]:
        """Measure the largest steps on the provisional pools, drop them, and allocate the pools
        again at their shares of what the device has left. Returns their blocks."""
        self._step_peak = self._step_peak_bytes(steps, images)
        has_kv, has_image_cache = self.kv_manager is not None, self.image_manager is not None
        for kind, held in (("kv", has_kv), ("image", has_image_cache)):
            if held:
                self._drop_pool(kind)
        self.pool_bytes = self._device_room()
        num_kv = self._allocate_from_device("kv") if has_kv else 0
        num_image = self._allocate_from_device("image") if has_image_cache else 0
        self.scheduler.set_role(self.role, self.kv_manager, self.image_manager)
        geometry = self.geometry()
        logger.info("instance %d (%s): %.2f GiB of %s for its cache pools (KV %.2f GiB, images %.2f GiB), "
                    "%.2f GiB for its largest step", self.instance_id, self.role, self.pool_bytes / memory.GB,
                    self.device, num_kv * geometry.kv_block_bytes / memory.GB,
                    num_image * geometry.image_block_bytes / memory.GB, self._step_peak / memory.GB)
        return num_kv, num_image

    def _measure_new_parts(self, vision: bool, language: bool, new_kv: bool, new_image: bool) -> None:
        """The largest step of model parts a redeploy just loaded, on provisional pools of the
        pools it adds (a part whose pool the instance already holds, in use by its requests,
        is not measured again: the reserve covers it)."""
        if not (vision or language):
            return
        steps, images = self._largest_steps(vision, language)
        num_kv, num_image = self._provisional_sizes(steps, new_kv, new_image, self.runner.image_block_size)
        added = [(kind, num) for kind, num, new in (("kv", num_kv, new_kv), ("image", num_image, new_image)) if new]
        for kind, num in added:
            self._add_pool(kind, num, provisional=True)
        try:
            self._step_peak = max(self._step_peak, self._step_peak_bytes(steps, images))
        finally:
            for kind, _ in added:
                self._drop_pool(kind)

    def _allocate_from_device(self, kind: str, room: int | None = None) -> int:
        """Allocate the ``kind`` pool ("kv" or "image") at its share of the device's budget
        (at most ``room`` bytes: what the device has left now). Returns its blocks."""
        cache, geometry = self.config.cache, self.geometry()
        share = memory.split_budget(cache, True, True, self.pool_bytes)[0 if kind == "kv" else 1]
        size = min(share, room) if room is not None else share
        if kind == "kv":
            num = cache.num_kv_blocks or size // geometry.kv_block_bytes
        else:
            num = cache.num_image_blocks or size // geometry.image_block_bytes
        if num < 1:
            raise ConfigError(f"instance {self.instance_id} ({self.device}): no room for its {kind} cache "
                              f"({size / memory.GB:.2f} GiB left of its share of the device's memory)")
        self._add_pool(kind, num)
        return num

    def _add_pool(self, kind: str, num_blocks: int, provisional: bool = False, pool=None) -> None:
        """Allocate the ``kind`` pool ("kv" or "image") of ``num_blocks`` and its block manager;
        a KV pool that stays (not ``provisional``) limits the context to what it holds.
        ``pool``: the tensor made ahead for it (``pools_to_add``), if any."""
        if kind == "kv":
            self.runner.allocate_kv_cache(num_blocks, pool)
            self.kv_manager = BlockManager(num_blocks, self.kv_block_size, "kv")
            if not provisional:
                self._limit_context(num_blocks)
                self.scheduler.max_model_len = self.max_model_len
        else:
            self.runner.allocate_image_cache(num_blocks, pool)
            self.image_manager = BlockManager(num_blocks, self.runner.image_block_size, "image")

    def _drop_pool(self, kind: str) -> None:
        """Free the ``kind`` pool and its block manager."""
        if kind == "kv":
            self.runner.free_kv_cache()
            self.kv_manager = None
        else:
            self.runner.free_image_cache()
            self.image_manager = None

    def geometry(self, image_block_size: int | None = None) -> PoolGeometry:
        """This instance's blocks (for a pool it does not hold: what such a block would be)."""
        if image_block_size is None:
            image_block_size = self.runner.image_block_size
        return PoolGeometry(
            self.kv_block_size, math.prod(self.model.kv_cache_shape(1, self.kv_block_size)) * self.dtype.itemsize,
            image_block_size, image_block_size * self.model.image_hidden_size * self.dtype.itemsize,
            self.pool_bytes)

    def image_cache(self) -> tuple[int, int] | None:
        """The image cache's (blocks, slots per block); None: this instance holds none."""
        pool = self.image_manager
        return (pool.num_blocks, pool.block_size) if pool is not None else None

    # -- role changes (live redeploy) ------------------------------------------------------------
    def pools_to_add(self, role: str) -> dict[str, tuple[int, ...]]:
        """The shapes of the pools ``expand(role)`` will allocate that can be made ahead, on
        another thread while this instance steps (``ModelRunner.new_pool``), by kind: on a CPU,
        of fixed sizes ([cache]), where their shape does not wait for the parts to load (a KV
        pool of an instance without a language model yet takes its block size from the
        attention backend). Under load, making a few hundred MiB in shared memory took a
        busy worker a second, every stream of the instance waiting."""
        if self.pool_bytes is not None or self.device.type != "cpu":
            return {}
        has_kv, has_image_cache = role_caches(normalize_role(self.role + role))
        num_kv, num_image = self._pool_sizes(has_kv, has_image_cache, self.runner.image_block_size)
        shapes = {}
        if has_kv and self.kv_manager is None and self.model.has_language:
            shapes["kv"] = tuple(self.model.kv_cache_shape(num_kv, self.kv_block_size))
        if has_image_cache and self.image_manager is None:
            shapes["image"] = self.runner.image_cache_shape(num_image)
        return shapes

    def expand(self, role: str, pools: dict | None = None) -> str:
        """Take on the stages of ``role`` too, while serving the current ones: build the model
        parts and allocate the pools they need (pools already held keep their size; ``pools``:
        those made ahead, by kind, from ``pools_to_add``). Returns the instance's new role.
        The caller shares new pools with the peers."""
        from hydrad.models.loader import iter_weights

        role = normalize_role(self.role + role)
        needs_vision = "E" in role and not self.model.has_vision
        needs_language = ("P" in role or "D" in role) and not self.model.has_language
        if needs_vision or needs_language:
            backend = get_attn_backend(self.device, self.attention_backend, self.dtype) if needs_language else None
            if backend is not None and self.kv_manager is None:
                # An instance that held no KV cache yet takes its block size from the backend.
                self.kv_block_size = _kv_block_size(self.config.cache, backend)
                self.runner.kv_block_size = self.kv_block_size
            self.model.add_parts(vision=needs_vision, language=needs_language, attn_backend=backend)
            prefixes = (_VISION_PREFIXES if needs_vision else ()) + (_LANGUAGE_PREFIXES if needs_language else ())
            self.model.load_weights(iter_weights(self.model_path, self.dtype, prefixes=prefixes),
                                    vision=needs_vision, language=needs_language)
        has_kv, has_image_cache = role_caches(role)
        image_block_size = self.runner.image_block_size
        if self.pool_bytes is not None:
            # Sized from the GPU: a new pool takes its share of the budget measured at start
            # (left free for it), at most what the device has left now that the parts are loaded.
            new_kv, new_image = has_kv and self.kv_manager is None, has_image_cache and self.image_manager is None
            self._measure_new_parts(needs_vision and new_image, needs_language and new_kv, new_kv, new_image)
            for kind, new in (("kv", new_kv), ("image", new_image)):
                if new:
                    self._allocate_from_device(kind, self._device_room())
        else:
            num_kv, num_image = self._pool_sizes(has_kv, has_image_cache, image_block_size)
            pools = pools or {}
            if has_kv and self.kv_manager is None:
                self._add_pool("kv", num_kv, pool=pools.get("kv"))
            if has_image_cache and self.image_manager is None:
                self._add_pool("image", num_image, pool=pools.get("image"))
        self.role = role
        self.scheduler.set_role(role, self.kv_manager, self.image_manager)
        self._stalled = False
        return role

    def retire(self, stages: str) -> None:
        """Hand ``stages`` over to other instances (see ``Scheduler.retire``); ``shrink`` drops
        them once ``drained``."""
        self.scheduler.retire(stages)
        self._stalled = False

    def _kept_role(self) -> str:
        return "".join(s for s in self.role if s not in self.scheduler.retiring)

    def drained(self) -> bool:
        kept = self._kept_role()
        return self.scheduler.drained(keep_kv="P" in kept or "D" in kept, keep_images="E" in kept or "P" in kept)

    def shrink(self) -> str:
        """Drop the retired stages (``drained()`` must hold): their model parts and pools go.
        Returns the new role."""
        role = self._kept_role()
        if not role:
            raise ValueError("an instance keeps at least one stage")
        keep_language, keep_vision = "P" in role or "D" in role, "E" in role
        if not keep_language and self.kv_manager is not None:
            self._drop_pool("kv")
        if not ("E" in role or "P" in role) and self.image_manager is not None:
            self._drop_pool("image")
        self.model.drop_parts(vision=not keep_vision, language=not keep_language)
        self.role = role
        self.scheduler.set_role(role, self.kv_manager, self.image_manager)
        self._stalled = False
        return role

    # -- requests ---------------------------------------------------------------------------
    def grammar_pending(self, req: EngineRequest | MigrationOffer) -> Future | None:
        """Where ``req`` has structured outputs whose grammar this instance has not built: the
        future of that build, started on a thread of its own (``add_request`` would otherwise
        build it on the calling thread: up to a few hundred milliseconds for the largest
        grammars, on a worker its step thread). None: nothing to wait for."""
        params = req.sampling_params.structured_outputs
        if params is None:
            return None
        return self.runner.grammars.prepare(params, req.eos_token_ids)

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request; ValueError if it could never fit this instance."""
        if req.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        if req.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {req.num_prompt_tokens} tokens; this model's context is {self.max_model_len}"
            )
        for image in req.images:
            if not 0 <= image.offset <= image.offset + image.length <= req.num_prompt_tokens:
                raise ValueError(f"image placeholder range {image.offset}+{image.length} is outside the prompt")
        if req.mrope_positions is not None and tuple(req.mrope_positions.shape) != (3, req.num_prompt_tokens):
            raise ValueError(f"mrope_positions has shape {tuple(req.mrope_positions.shape)}, expected "
                             f"(3, {req.num_prompt_tokens})")
        if self.model.uses_mrope and req.images and req.mrope_positions is None:
            # A flat arange would be wrong from the first image on: the processor computes them.
            raise ValueError("a request with images to an M-RoPE model needs its mrope_positions")
        self._check_token_ids(req)
        request = Request(req)
        if req.sampling_params.structured_outputs is not None:
            # Its grammar with this model's tokenizer, checked before it is queued (RequestError).
            request.matcher = self.runner.grammars.matcher(request)
        self.scheduler.add(request)
        self._stalled = False

    def _check_token_ids(self, req: EngineRequest) -> None:
        """Token ids the sampler indexes by must exist (checked here, not in a step)."""
        params = req.sampling_params
        for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise RequestError(f"{name} names token {bad[0]}, the vocabulary has {self.vocab_size} tokens", name)

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.scheduler.abort(req_id)
        self._stalled = False

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def has_work(self) -> bool:
        """Whether step() can advance anything: not when only offered requests remain (they
        wait for a target), nor after a step that found nothing runnable and nothing changed."""
        return self.copier.busy or (self.scheduler.has_work() and not self._stalled)

    # -- migration ----------------------------------------------------------------------------
    def pools(self) -> dict[str, torch.Tensor | None]:
        """This instance's cache pools, for peers to pull from (shared once at start)."""
        return {"kv": self.runner.kv_cache, "image": self.runner.image_cache}

    def attach_peer(self, instance_id: int, pools: dict[str, torch.Tensor | None]) -> None:
        kv = pools.get("kv")
        if kv is not None and self.kv_manager is not None and kv.shape[3] != self.kv_block_size:
            # A pull copies whole blocks: peers must cut the KV cache the same way.
            raise ConfigError(
                f"instance {instance_id} has KV blocks of {kv.shape[3]} tokens and instance "
                f"{self.instance_id} of {self.kv_block_size}; set cache.kv_block_size for all"
            )
        self.copier.peers[instance_id] = pools

    def share_pools(self) -> int:
        """Put the pools in shared memory if they are not yet (on CPU; a deployment that did
        not migrate allocated them private where /dev/shm lacked room for them, and a redeploy
        may make it migrate). Returns the bytes moved: copied while no step runs."""
        return self.runner.share_pools()

    def detach_peer(self, instance_id: int) -> None:
        self.copier.peers.pop(instance_id, None)

    def add_migration(self, offer: MigrationOffer) -> None:
        """Queue a request migrating in; it is pulled when this instance schedules it (one that
        had not started elsewhere goes to the head of the waiting queue)."""
        if offer.kind != "prompt" and offer.source == self.instance_id:
            # Our own offer, passed back by an instance that no longer runs its stage: it goes on
            # here from our blocks. Reported as pulled, so the daemon forgets the hand-over.
            if self.scheduler.reclaim(offer.req_id):
                self._pulled.append(Pulled(offer.req_id, self.instance_id))
            self._stalled = False
            return
        if offer.kind != "prompt" and offer.source not in self.copier.peers:
            raise ValueError(f"instance {offer.source} is not attached as a peer")
        self.scheduler.add(Request.from_offer(offer), front=offer.kind == "prompt")
        self._stalled = False

    def release(self, req_ids: Iterable[str]) -> None:
        """Targets have copied these requests' blocks: free them here."""
        for req_id in req_ids:
            self.scheduler.release(req_id)
        self._stalled = False

    def take_offers(self) -> list[MigrationOffer]:
        """Requests whose next stage runs elsewhere, offered since the last call."""
        offers = [offer_for(req, kind, self.instance_id) for req, kind in self.scheduler.new_offers]
        self.scheduler.new_offers.clear()
        return offers

    def take_pulled(self) -> list[Pulled]:
        """Every copy finished since the last call."""
        pulled, self._pulled = self._pulled, []
        return pulled

    def _collect_pulls(self, block: bool) -> None:
        for pull in self.copier.finished(block):
            aborted = pull.req.finish_reason == "abort"
            self.scheduler.finish_pull(pull.req)
            if not aborted:
                self._pulled.append(Pulled(pull.req.req_id, pull.source))

    # -- the step ------------------------------------------------------------------------------
    def _pull_first(self) -> None:
        """Start the pulls of migrated requests before the step is built; when the copier
        was idle and the copies are predicted to be quick, wait for them, so that the
        requests run in this step rather than the next."""
        if not self.scheduler.incoming:
            return
        idle = not self.copier.busy
        pulls = self.scheduler.admit_pulls()
        for pull in pulls:
            self.copier.start(pull)
        if not pulls or not idle or not self.copy_bandwidth or self.scheduler.latency_model is None:
            return
        geometry = self.geometry()
        size = {"kv": geometry.kv_block_bytes, "image": geometry.image_block_bytes}
        seconds = sum(len(p.src_block_ids) * size[p.kind] for p in pulls) / self.copy_bandwidth
        if seconds <= quick_pull_seconds(self.scheduler.latency_bound):
            self.copier.wait_all()
            self._collect_pulls(block=False)

    def step(self) -> EngineOutput:
        self._collect_pulls(block=False)
        self._pull_first()
        out = self.scheduler.schedule()
        if out.dropped and self.runner.batch is not None:
            self.runner.drop(out.dropped)
        for pull in out.pulls:
            self.copier.start(pull)
        if not out.encodes and not out.chunks:
            if not self.copier.busy:
                self._stalled = True
            self._collect_pulls(block=True)
            return EngineOutput()
        vision = (lambda: self.runner.encode(out.encodes)) if out.encodes else None
        language = (lambda: self.runner.execute(out.chunks, out.num_decodes)) if out.chunks else None
        debug = logger.isEnabledFor(logging.DEBUG)
        # The step thread's own CPU time, at debug level: against the wall time it tells
        # waiting for a core from computing slower (on a CPU both parts run on this thread
        # unless dual streams are on).
        cpu_start = time.thread_time() if debug else 0.0
        start = time.perf_counter()
        (_, encode_secs), (sampled, language_secs) = self.streams.run(vision, language)
        model = self.scheduler.latency_model
        if model is not None:
            seconds = time.perf_counter() - start
            predicted = model.combine(out.predicted_vision, out.predicted_language)
            self.live_speed.add(out.predicted_vision, out.predicted_prefill, out.predicted_language, predicted,
                                seconds)
            if out.num_decodes:
                self._calibrate(predicted, seconds)
        timing = StepTiming(out.predicted_vision, encode_secs, out.predicted_language, language_secs)
        if debug:
            # bench/step_log.py reads this line.
            logger.debug("step: %d images, %d tokens in %d chunks (%d decodes); vision %.1f ms (predicted %.1f), "
                         "language %.1f ms (predicted %.1f); step thread's CPU %.1f ms", len(out.encodes),
                         out.num_tokens, len(out.chunks), out.num_decodes, 1e3 * encode_secs,
                         1e3 * out.predicted_vision, 1e3 * language_secs, 1e3 * out.predicted_language,
                         1e3 * (time.thread_time() - cpu_start))
        if out.encodes:
            self.scheduler.update_after_encode(out, encode_secs, language_secs)
        if not out.chunks:
            return EngineOutput(timing=timing)
        result = self.scheduler.update_after_language(out, sampled.token_ids, language_secs)
        logprobs = None
        if sampled.logprobs is not None:
            logprobs = [sampled.logprobs[i] for i in result.sample_index]
        finished = []
        if result.finished:
            now = time.monotonic()
            finished = [FinishedRequest(r.req_id, r.finish_reason, r.stage_times(now), r.num_cached_tokens or 0)
                        for r in result.finished]
        return EngineOutput(result.req_ids, result.token_ids, logprobs, finished, timing)

    def _calibrate(self, predicted: float, seconds: float) -> None:
        """A step that carried decodes, predicted at ``predicted`` seconds, took ``seconds``: keep
        such steps within their bound as the machine runs now (``latency_model.Calibration``)."""
        if self.calibration.add(predicted, seconds):
            c = self.calibration
            self.scheduler.set_calibration(c.factor, c.guard_factor)
            logger.debug("steps with decodes run %.2fx their prediction (%.2fx at their 98th percentile): filled to "
                         "%.1f ms (guarded: %.1f ms)", c.factor, c.guard_factor, 1e3 * self.scheduler.latency_bound / c.factor,
                         1e3 * self.scheduler.latency_bound / c.guard_factor)

    def set_latency_model(self, model: LatencyModel | None, bound: float) -> None:
        """Fill steps by predicted latency up to ``bound`` seconds, and steps that carry no
        decode up to the prefill share of the TTFT (between steps only)."""
        slo = self.config.slo
        if model is not self.scheduler.latency_model:  # a new model starts uncalibrated
            self.calibration = Calibration()
            self.scheduler.set_calibration(1.0)
        self.scheduler.set_latency_model(model, bound, idle_bound=idle_bound(slo), handoff_wait=handoff_wait(slo)
                                         if self.config.scheduler.handoff_backpressure else None)

    def get_stats(self) -> EngineStats:
        s = self.scheduler
        kv, img = self.kv_manager, self.image_manager
        return EngineStats(
            num_running=len(s.running) + len(s.pulling),
            num_waiting=len(s.waiting) + len(s.incoming) + len(s.encoding),
            kv_usage=kv.usage if kv else 0.0,
            image_usage=img.usage if img else 0.0,
            num_kv_blocks_used=kv.num_used_blocks if kv else 0,
            num_image_blocks_used=img.num_used_blocks if img else 0,
            num_preemptions=s.num_preemptions,
            num_overrun_steps=s.num_overrun_steps,
            num_slack_steps=s.num_slack_steps,
            num_guarded_steps=s.num_guarded_steps,
            num_held_steps=s.num_held_steps,
            prefix_cache_queries=s.prefix_queries,
            prefix_cache_hits=s.prefix_hits,
            images_cached=s.images_cached,
            num_kv_blocks_cached=kv.num_cached_blocks if kv else 0,
            latency_calibration=s.calibration,
            live_speed=self.live_speed.parts(),
            live_speed_steps=self.live_speed.counts(),
            live_speed_spread=self.live_speed.spread(),
        )

    def shutdown(self) -> None:
        self.streams.shutdown()
        self.copier.shutdown()
        self.runner.grammars.close()
