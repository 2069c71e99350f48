"""Stage-level scheduling (HydraInfer, Algorithm 1).

Each step fills one batch, in this order, within a token budget τ_t and an image
budget τ_e:

1. every running decode (one token each);
2. unfinished prefill chunks (a chunk may stop anywhere, inside image tokens too);
3. unfinished encodes (images of admitted requests);
4. new requests, first come first served: those with images are admitted to
   encoding (image blocks for all their images are taken at once, so two requests
   can never each hold half of what they need), text-only ones straight to prefill.

A request's prefill starts only after all its images are encoded. When the KV pool
runs dry, the latest-arrived running request not yet in this batch is preempted:
it gives back everything and is recomputed later from its prompt and the tokens it
has produced. The scheduler imports no torch: it is tested with synthetic outputs.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from hydrad.config import SchedulerConfig
from hydrad.engine.block_manager import BlockManager
from hydrad.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    # (request, image index): images to encode into their image-cache blocks.
    encodes: list[tuple[Request, int]] = field(default_factory=list)
    # (request, num_new_tokens): decodes first, then prefill chunks.
    chunks: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.encodes and not self.chunks

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


@dataclass
class FinishedStep:
    """What a language step did to one request: the sampled token, if any."""

    req: Request
    new_token_id: int | None


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: BlockManager,
        image_manager: BlockManager | None,
        max_model_len: int,
    ):
        self.config = config
        self.kv = kv_manager
        self.images = image_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.encoding: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- admission ---------------------------------------------------------------------
    def check_fits(self, req: Request) -> None:
        """Refuse (ValueError) a request that could never run, even alone."""
        max_len = min(self.max_model_len, req.num_prompt_tokens + req.sampling_params.max_tokens)
        need = self.kv.num_blocks_for(max_len)
        if need > self.kv.num_blocks:
            raise ValueError(
                f"request needs {need} KV blocks for {max_len} tokens but the KV cache holds "
                f"{self.kv.num_blocks}; lower max_tokens or enlarge the cache"
            )
        if req.images:
            if self.images is None:
                raise ValueError("this instance has no image cache: it cannot take requests with images")
            need = self._image_blocks_needed(req)
            if need > self.images.num_blocks:
                raise ValueError(
                    f"request's {req.num_images} images need {need} image-cache blocks, the cache holds "
                    f"{self.images.num_blocks}"
                )

    def add(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        self.check_fits(req)
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def abort(self, req_id: str) -> Request | None:
        req = self.requests.get(req_id)
        if req is None:
            return None
        self._remove(req)
        self._finish(req, "abort")
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- scheduling ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        token_budget = self.config.token_budget
        image_budget = self.config.image_budget
        scheduled: set[str] = set()

        token_budget = self._schedule_decodes(out, token_budget, scheduled)
        token_budget = self._schedule_prefills(out, token_budget, scheduled)
        for req in self.encoding:
            image_budget = self._schedule_images(req, image_budget, out)
        self._admit_new(out, token_budget, image_budget, scheduled)
        return out

    def _schedule_decodes(self, out: SchedulerOutput, budget: int, scheduled: set[str]) -> int:
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING or not req.is_decode:
                continue
            if self._reserve_kv(req, req.num_computed_tokens + 1, out, scheduled, preempt_self=True):
                out.chunks.append((req, 1))
                scheduled.add(req.req_id)
                budget -= 1
        return budget

    def _schedule_prefills(self, out: SchedulerOutput, budget: int, scheduled: set[str]) -> int:
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING or req.req_id in scheduled:
                continue
            num_new = self._fit_chunk(req, min(req.num_missing_tokens, budget), out, scheduled)
            if num_new == 0:
                continue
            out.chunks.append((req, num_new))
            scheduled.add(req.req_id)
            budget -= num_new
        return budget

    def _schedule_images(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        end = min(req.num_images, req.num_encoded_images + budget)
        for index in range(req.num_encoded_images, end):
            out.encodes.append((req, index))
        return budget - max(0, end - req.num_encoded_images)

    def _admit_new(self, out: SchedulerOutput, token_budget: int, image_budget: int, scheduled: set[str]) -> None:
        while self.waiting and len(self.running) + len(self.encoding) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.images:
                need = self._image_blocks_needed(req)
                if image_budget == 0 or not self.images.can_allocate(need):
                    return
                self.waiting.popleft()
                for i, img in enumerate(req.images):
                    req.image_block_ids[i] = self.images.allocate(self.images.num_blocks_for(img.length))
                req.status = RequestStatus.ENCODING
                self.encoding.append(req)
                image_budget = self._schedule_images(req, image_budget, out)
            else:
                num_new = min(req.num_missing_tokens, token_budget)
                if num_new == 0 or not self.kv.can_allocate(self.kv.num_blocks_for(num_new)):
                    return
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                self.kv.grow(req.kv_block_ids, num_new)
                out.chunks.append((req, num_new))
                scheduled.add(req.req_id)
                token_budget -= num_new

    # -- KV pressure ---------------------------------------------------------------------
    def _fit_chunk(self, req: Request, num_new: int, out: SchedulerOutput, scheduled: set[str]) -> int:
        """Grow req's KV blocks for up to num_new tokens; shrink the chunk to what fits, and
        preempt later requests only when not a single token fits."""
        bs = self.kv.block_size
        while True:
            room = (len(req.kv_block_ids) + self.kv.num_free_blocks) * bs - req.num_computed_tokens
            if room > 0:
                num_new = min(num_new, room)
                self.kv.grow(req.kv_block_ids, req.num_computed_tokens + num_new)
                return num_new
            if not self._preempt_victim(req, out, scheduled):
                return 0

    def _reserve_kv(
        self, req: Request, num_slots: int, out: SchedulerOutput, scheduled: set[str], preempt_self: bool
    ) -> bool:
        while not self.kv.grow(req.kv_block_ids, num_slots):
            if self._preempt_victim(req, out, scheduled):
                continue
            if preempt_self:
                self._preempt(req, out)
            return False
        return True

    def _preempt_victim(self, req: Request, out: SchedulerOutput, scheduled: set[str]) -> bool:
        for victim in reversed(self.running):
            if victim is not req and victim.req_id not in scheduled:
                self._preempt(victim, out)
                return True
        return False

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self._remove(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_encoded_images = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    # -- results ----------------------------------------------------------------------------
    def update_after_encode(self, out: SchedulerOutput, exec_time: float = 0.0) -> None:
        now = time.monotonic()
        for req, _ in out.encodes:
            req.num_encoded_images += 1
        for req in {id(r): r for r, _ in out.encodes}.values():
            req.encode_exec += exec_time
            if req.images_done and req.status is RequestStatus.ENCODING:
                self.encoding.remove(req)
                req.status = RequestStatus.RUNNING
                req.encode_done_time = req.encode_done_time or now
                self.running.append(req)

    def update_after_language(
        self, out: SchedulerOutput, sampled: dict[str, int], exec_time: float = 0.0
    ) -> list[FinishedStep]:
        """Advance every chunk; append the sampled token of each request that caught up."""
        now = time.monotonic()
        steps = []
        for req, num_new in out.chunks:
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the batch ran
            if req.is_decode:
                req.decode_exec += exec_time
            else:
                req.prefill_exec += exec_time
            req.num_computed_tokens += num_new
            for i in req.images_fully_read():
                self.images.free(req.image_block_ids[i])
                req.image_block_ids[i] = []
            if req.num_computed_tokens < req.num_tokens:
                steps.append(FinishedStep(req, None))
                continue
            token_id = sampled[req.req_id]
            req.output_token_ids.append(token_id)
            req.first_token_time = req.first_token_time or now
            reason = self._finish_reason(req, token_id)
            if reason is not None:
                self._remove(req)
                self._finish(req, reason)
            steps.append(FinishedStep(req, token_id))
        return steps

    def _finish_reason(self, req: Request, token_id: int) -> str | None:
        params = req.sampling_params
        if not params.ignore_eos and token_id in req.eos_token_ids:
            return "stop"
        if token_id in params.stop_token_ids:
            return "stop"
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    # -- bookkeeping -------------------------------------------------------------------------
    def _image_blocks_needed(self, req: Request) -> int:
        return sum(self.images.num_blocks_for(img.length) for img in req.images)

    def _remove(self, req: Request) -> None:
        """Take req out of its queue and give back every block it holds."""
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.ENCODING:
            self.encoding.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        if req.kv_block_ids:
            self.kv.free(req.kv_block_ids)
            req.kv_block_ids = []
        for i, block_ids in enumerate(req.image_block_ids):
            if block_ids:
                self.images.free(block_ids)
                req.image_block_ids[i] = []

    def _finish(self, req: Request, reason: str) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.req_id, None)

    def check_integrity(self) -> None:
        """Every block is free or held by exactly one live request; queues match statuses."""
        live = list(self.requests.values())
        self.kv.check_integrity([r.kv_block_ids for r in live])
        if self.images is not None:
            self.images.check_integrity([b for r in live for b in r.image_block_ids])
        queued = list(self.waiting) + self.encoding + self.running
        if sorted(r.req_id for r in queued) != sorted(self.requests):
            raise AssertionError("scheduler queues and the request table disagree")
        for status, queue in (
            (RequestStatus.WAITING, self.waiting),
            (RequestStatus.ENCODING, self.encoding),
            (RequestStatus.RUNNING, self.running),
        ):
            for r in queue:
                if r.status is not status:
                    raise AssertionError(f"{r} sits in the {status.value} queue")
                if status is RequestStatus.WAITING and (r.kv_block_ids or any(r.image_block_ids)):
                    raise AssertionError(f"waiting {r} holds blocks")
