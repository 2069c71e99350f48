"""Stage-level scheduling (HydraInfer, Algorithm 1), with pull-based migration.

Each step fills one batch, in this order, within a token budget τ_t and an image
budget τ_e:

1. every running decode (one token each);
2. unfinished prefill chunks (a chunk may stop anywhere, inside image tokens too);
3. unfinished encodes (images of admitted requests);
4. requests migrating in from another instance (the head of the queue): blocks are
   allocated here and the copy from the source's pool is handed to the copy thread;
5. new requests, first come first served: those with images are admitted to
   encoding (image blocks for all their images are taken at once, so two requests
   can never each hold half of what they need), text-only ones straight to prefill.

A request's prefill starts only after all its images are encoded. A stage this
instance does not hold is offered to another instance: the request keeps its blocks
until the target has pulled them. When the KV pool runs dry, the latest-arrived
running request not yet in this batch is preempted: it gives back everything and
is recomputed later from its prompt and the tokens it has produced. The scheduler
imports no torch: it is tested with synthetic outputs.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from hydrad.config import SchedulerConfig
from hydrad.engine.block_manager import BlockManager
from hydrad.engine.request import Request, RequestStatus


@dataclass
class Pull:
    """Copy ``src_block_ids`` of instance ``source``'s pool into our ``dst_block_ids``."""

    req: Request
    kind: str  # "image" or "kv"
    source: int
    src_block_ids: list[int]
    dst_block_ids: list[int]


@dataclass
class SchedulerOutput:
    # (request, image index): images to encode into their image-cache blocks.
    encodes: list[tuple[Request, int]] = field(default_factory=list)
    # (request, num_new_tokens): decodes first, then prefill chunks.
    chunks: list[tuple[Request, int]] = field(default_factory=list)
    pulls: list[Pull] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.encodes and not self.chunks and not self.pulls

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
        kv_manager: BlockManager | None,
        image_manager: BlockManager | None,
        max_model_len: int,
        role: str = "EPD",
    ):
        self.config = config
        self.kv = kv_manager
        self.images = image_manager
        self.max_model_len = max_model_len
        self.role = role
        self.waiting: deque[Request] = deque()
        self.incoming: deque[Request] = deque()  # migrating in, not yet admitted
        self.encoding: list[Request] = []
        self.running: list[Request] = []
        self.pulling: list[Request] = []
        self.offered: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        # (request, kind) offered since the engine last looked; the engine drains it.
        self.new_offers: list[tuple[Request, str]] = []
        self.num_preemptions = 0

    # -- admission ---------------------------------------------------------------------
    def check_fits(self, req: Request) -> None:
        """Refuse (ValueError) a request that could never run here, even alone."""
        if req.images and "E" not in self.role and req.pull is None:
            raise ValueError(f"a {self.role} instance cannot encode images")
        if not req.images and "P" not in self.role and req.pull is None:
            raise ValueError(f"a {self.role} instance cannot prefill")
        if self.kv is not None:
            need = self.kv.num_blocks_for(min(self.max_model_len, req.max_num_tokens))
            if need > self.kv.num_blocks:
                raise ValueError(
                    f"request needs {need} KV blocks for {req.max_num_tokens} tokens but the KV cache holds "
                    f"{self.kv.num_blocks}; lower max_tokens or enlarge the cache"
                )
        if req.images and self.images is not None:
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
        (self.incoming if req.pull is not None else self.waiting).append(req)

    def abort(self, req_id: str) -> Request | None:
        req = self.requests.get(req_id)
        if req is None:
            return None
        if req.status is RequestStatus.PULLING:
            # The copy thread is writing into its blocks: they are freed when it is done.
            self.requests.pop(req_id)
            req.status, req.finish_reason = RequestStatus.FINISHED, "abort"
            return req
        self._remove(req)
        self._finish(req, "abort")
        return req

    def release(self, req_id: str) -> None:
        """The target of an offer has copied its blocks: let them go."""
        req = self.offered.get(req_id)
        if req is not None:
            self._remove(req)
            self._finish(req, "migrated")

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_work(self) -> bool:
        """Anything a step can advance (offered requests only wait for their target)."""
        return bool(self.waiting or self.incoming or self.encoding or self.running or self.pulling)

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
        self._admit_incoming(out)
        if not self.incoming:
            self._admit_new(out, token_budget, image_budget, scheduled)
        return out

    def _schedule_decodes(self, out: SchedulerOutput, budget: int, scheduled: set[str]) -> int:
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING or not req.is_decode:
                continue
            if self._reserve_kv(req, req.num_computed_tokens + 1, out, scheduled):
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
            if not req.preemptible and not req.kv_block_ids:
                # It cannot be recomputed here, so it never waits on KV mid-way: reserve it all.
                if not self._reserve_kv(req, self._full_len(req), out, scheduled):
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

    def _admit_incoming(self, out: SchedulerOutput) -> None:
        """Migrating requests go first; a target never pulls what it has no room for."""
        while self.incoming:
            req = self.incoming[0]
            kind, source, src_block_ids, num_computed = req.pull
            if kind == "image":
                need = self._image_blocks_needed(req)
                if not self.images.can_allocate(need):
                    return
                for i, image in enumerate(req.images):
                    req.image_block_ids[i] = self.images.allocate(self.images.num_blocks_for(image.length))
                src = [b for ids in src_block_ids for b in ids]
                dst = [b for ids in req.image_block_ids for b in ids]
            else:
                req.preemptible = self._can_recompute(req)
                slots = num_computed + 1 if req.preemptible else self._full_len(req)
                need = self.kv.num_blocks_for(slots)
                if not self.kv.can_allocate(need):
                    return
                req.kv_block_ids = self.kv.allocate(need)
                src = list(src_block_ids)
                dst = req.kv_block_ids[: len(src)]
            self.incoming.popleft()
            req.status = RequestStatus.PULLING
            self.pulling.append(req)
            out.pulls.append(Pull(req, kind, source, src, dst))

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

    def finish_pull(self, req: Request) -> None:
        """The copy into req's blocks is done: it runs its next stage here."""
        self.pulling.remove(req)
        kind, _, _, num_computed = req.pull
        req.pull = None
        if req.status is RequestStatus.FINISHED:  # aborted while copying
            self._free_blocks(req)
            return
        if kind == "image":
            req.num_encoded_images = req.num_images
            req.preemptible = self._can_recompute(req)
            req.mark("image_pulled")
        else:
            req.num_computed_tokens = num_computed
            req.mark("kv_pulled")
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    # -- KV pressure ---------------------------------------------------------------------
    def _can_recompute(self, req: Request) -> bool:
        return "P" in self.role and (not req.images or "E" in self.role)

    def _full_len(self, req: Request) -> int:
        return min(self.max_model_len, req.max_num_tokens)

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

    def _reserve_kv(self, req: Request, num_slots: int, out: SchedulerOutput, scheduled: set[str]) -> bool:
        while not self.kv.grow(req.kv_block_ids, num_slots):
            if self._preempt_victim(req, out, scheduled):
                continue
            if req.preemptible and req.is_decode:
                self._preempt(req, out)
            return False
        return True

    def _preempt_victim(self, req: Request, out: SchedulerOutput, scheduled: set[str]) -> bool:
        for victim in reversed(self.running):
            if victim is not req and victim.preemptible and victim.req_id not in scheduled:
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
            req.timeline["encode_exec"] += exec_time
            if req.images_done and req.status is RequestStatus.ENCODING:
                req.mark("encode_done", now)
                if "P" in self.role:
                    self.encoding.remove(req)
                    req.status = RequestStatus.RUNNING
                    self.running.append(req)
                else:
                    self._offer(req, "image")

    def update_after_language(
        self, out: SchedulerOutput, sampled: dict[str, int], exec_time: float = 0.0
    ) -> list[FinishedStep]:
        """Advance every chunk; append the sampled token of each request that caught up."""
        now = time.monotonic()
        steps = []
        for req, num_new in out.chunks:
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the batch ran
            req.timeline["decode_exec" if req.is_decode else "prefill_exec"] += exec_time
            req.num_computed_tokens += num_new
            for i in req.images_fully_read():
                self.images.free(req.image_block_ids[i])
                req.image_block_ids[i] = []
            if req.num_computed_tokens < req.num_tokens:
                steps.append(FinishedStep(req, None))
                continue
            token_id = sampled[req.req_id]
            req.output_token_ids.append(token_id)
            req.mark("first_token", now)
            reason = self._finish_reason(req, token_id)
            if reason is not None:
                self._remove(req)
                self._finish(req, reason)
            elif "D" not in self.role:
                self._offer(req, "kv")
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

    def _offer(self, req: Request, kind: str) -> None:
        (self.encoding if req.status is RequestStatus.ENCODING else self.running).remove(req)
        req.status = RequestStatus.OFFERED
        req.mark(f"{kind}_offered")
        self.offered[req.req_id] = req
        self.new_offers.append((req, kind))

    # -- bookkeeping -------------------------------------------------------------------------
    def _image_blocks_needed(self, req: Request) -> int:
        return sum(self.images.num_blocks_for(img.length) for img in req.images)

    def _remove(self, req: Request) -> None:
        """Take req out of its queue and give back every block it holds."""
        queue = {
            RequestStatus.WAITING: self.incoming if req.pull is not None else self.waiting,
            RequestStatus.ENCODING: self.encoding,
            RequestStatus.RUNNING: self.running,
        }.get(req.status)
        if queue is not None:
            queue.remove(req)
        elif req.status is RequestStatus.OFFERED:
            del self.offered[req.req_id]
        self._free_blocks(req)

    def _free_blocks(self, req: Request) -> None:
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
        """Every block is free or held by exactly one request; queues match statuses."""
        holders = list(self.requests.values()) + [r for r in self.pulling if r.status is RequestStatus.FINISHED]
        if self.kv is not None:
            self.kv.check_integrity([r.kv_block_ids for r in holders])
        if self.images is not None:
            self.images.check_integrity([b for r in holders for b in r.image_block_ids])
        queues = {
            RequestStatus.WAITING: list(self.waiting) + list(self.incoming),
            RequestStatus.ENCODING: self.encoding,
            RequestStatus.RUNNING: self.running,
            RequestStatus.PULLING: [r for r in self.pulling if r.status is not RequestStatus.FINISHED],
            RequestStatus.OFFERED: list(self.offered.values()),
        }
        queued = [r.req_id for q in queues.values() for r in q]
        if sorted(queued) != sorted(self.requests):
            raise AssertionError("scheduler queues and the request table disagree")
        for status, queue in queues.items():
            for r in queue:
                if r.status is not status:
                    raise AssertionError(f"{r} sits in the {status.value} queue")
                if status is RequestStatus.WAITING and (r.kv_block_ids or any(r.image_block_ids)):
                    raise AssertionError(f"waiting {r} holds blocks")
