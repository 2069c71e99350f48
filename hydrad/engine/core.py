"""One engine instance: model, caches, scheduler, runner — the loop body of a worker.

The frontend (``hydrad.LLM`` in process, or the daemon through a worker process)
adds requests, calls ``step()`` and receives per-request token diffs.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Iterable

import torch

from hydrad.config import EngineConfig
from hydrad.engine.attention import get_attn_backend
from hydrad.engine.block_manager import BlockManager
from hydrad.engine.inputs import EngineRequest, EngineStats, RequestDelta
from hydrad.engine.model_runner import ModelRunner
from hydrad.engine.request import Request
from hydrad.engine.sampler import Sampler
from hydrad.engine.scheduler import Scheduler
from hydrad.engine.streams import StageStreams
from hydrad.errors import ConfigError

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def _num_blocks(explicit: int | None, memory_mb: int, bytes_per_block: int) -> int:
    if explicit is not None:
        return explicit
    return max(1, (memory_mb << 20) // bytes_per_block)


class EngineCore:
    def __init__(self, config: EngineConfig, *, role: str = "EPD", device: str = "cpu"):
        from hydrad.models.default import resolve_model_path
        from hydrad.models.loader import iter_weights, load_config
        from hydrad.models.registry import get_model_class

        if role != "EPD":
            raise ConfigError(f"role {role!r}: only EPD instances are supported by this engine")
        self.config = config
        self.role = role
        self.device = torch.device(device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.model_path = resolve_model_path(config.model.path)

        hf_config = load_config(self.model_path)
        model_cls = get_model_class(hf_config)
        attn_backend = get_attn_backend(self.device)
        attn_backend.check_block_size(config.cache.kv_block_size)
        self.model = model_cls(hf_config, attn_backend=attn_backend, dtype=self.dtype, device=self.device)
        self.model.load_weights(iter_weights(self.model_path, self.dtype))
        self.model.eval()

        text_config = hf_config.text_config
        self.max_model_len = config.model.max_model_len or text_config.max_position_embeddings
        cache = config.cache
        kv_block_bytes = math.prod(self.model.kv_cache_shape(1, cache.kv_block_size)) * self.dtype.itemsize
        num_kv_blocks = _num_blocks(cache.num_kv_blocks, cache.kv_cache_memory_mb, kv_block_bytes)
        image_block_size = cache.image_block_size or self.model.num_image_tokens_per_image
        image_block_bytes = image_block_size * self.model.image_hidden_size * self.dtype.itemsize
        num_image_blocks = _num_blocks(cache.num_image_blocks, cache.image_cache_memory_mb, image_block_bytes)

        self.kv_manager = BlockManager(num_kv_blocks, cache.kv_block_size, "kv")
        self.image_manager = BlockManager(num_image_blocks, image_block_size, "image")
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.image_manager, self.max_model_len)
        self.runner = ModelRunner(
            self.model,
            device=self.device,
            dtype=self.dtype,
            num_kv_blocks=num_kv_blocks,
            kv_block_size=cache.kv_block_size,
            num_image_blocks=num_image_blocks,
            image_block_size=image_block_size,
            sampler=Sampler(config.seed),
        )
        self.streams = StageStreams(self.device, config.parallel.dual_streams)
        self.num_image_tokens_per_image = self.model.num_image_tokens_per_image
        logger.info(
            "engine ready: %s on %s (%s), %d KV blocks x %d tokens, %d image blocks x %d slots",
            self.model_path.name, self.device, str(self.dtype).removeprefix("torch."),
            num_kv_blocks, cache.kv_block_size, num_image_blocks, image_block_size,
        )

    # -- requests ---------------------------------------------------------------------------
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
        self.scheduler.add(Request(req))

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.scheduler.abort(req_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        vision = (lambda: self.runner.encode(out.encodes)) if out.encodes else None
        language = (lambda: self.runner.execute(out.chunks)) if out.chunks else None
        (_, encode_secs), (sampled, language_secs) = self.streams.run(vision, language)
        if out.encodes:
            self.scheduler.update_after_encode(out, encode_secs)
        if not out.chunks:
            return []
        now = time.monotonic()
        deltas = []
        for step in self.scheduler.update_after_language(out, sampled, language_secs):
            req = step.req
            if step.new_token_id is None:
                continue
            finished = req.finish_reason is not None
            deltas.append(
                RequestDelta(
                    req_id=req.req_id,
                    new_token_ids=[step.new_token_id],
                    finish_reason=req.finish_reason,
                    num_prompt_tokens=req.num_prompt_tokens if req.num_output_tokens == 1 else None,
                    stage_times=req.stage_times(now) if finished else None,
                )
            )
        return deltas

    def get_stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting) + len(s.encoding),
            kv_usage=self.kv_manager.usage,
            image_usage=self.image_manager.usage,
            num_kv_blocks_used=self.kv_manager.num_used_blocks,
            num_image_blocks_used=self.image_manager.num_used_blocks,
            num_preemptions=s.num_preemptions,
        )

    def shutdown(self) -> None:
        self.streams.shutdown()
