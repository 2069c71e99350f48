"""A request's state inside one engine instance.

Progress is numbers, not phase flags: ``num_computed_tokens`` catches up with
``num_tokens`` (prompt + generated). A step gives a request some of the missing
tokens (a prefill chunk, or the one token of a decode); once it has caught up, a
new token is sampled. Images are encoded, in order, before prefill starts.
"""

from __future__ import annotations

import enum
import time

from hydrad.engine.inputs import EngineRequest, ImageInput
from hydrad.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # holds nothing
    ENCODING = "encoding"  # admitted: images being encoded into the image cache
    RUNNING = "running"  # images encoded; prefilling or decoding over the KV cache
    PULLING = "pulling"  # migrated in: blocks allocated here, copy from the source in flight
    OFFERED = "offered"  # stage done here, next stage elsewhere: blocks held until pulled
    FINISHED = "finished"


class Request:
    def __init__(self, req: EngineRequest):
        self.req_id = req.req_id
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.output_token_ids: list[int] = list(req.output_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # Prompt + output: kept as a number, read several times per request per step.
        self.num_tokens = self.num_prompt_tokens + len(self.output_token_ids)
        self.sampling_params: SamplingParams = req.sampling_params
        # As encoded here: a video whose frame groups encode independently is one input per
        # group (``ImageInput.groups``), each scheduled as an image.
        self.images: list[ImageInput] = [part for image in req.images for part in image.groups()]
        # M-RoPE: the prompt's 3-D positions ([3, num_prompt_tokens], None for the flat arange) and
        # the offset of generated tokens, computed once by the processor; every chunk, recompute and
        # migration reads its positions from these.
        self.mrope_positions = req.mrope_positions
        self.mrope_delta = req.mrope_delta
        # One of a prompt's ``n`` completions: the first one's id (``EngineRequest.group``).
        self.group = req.group
        self.eos_token_ids = frozenset(req.eos_token_ids)
        # Token ids that finish the request: EOS unless ignore_eos, and the stop token ids.
        params = req.sampling_params
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        # Structured outputs: its llguidance matcher on this instance, past its tokens so far
        # (``engine.grammar_mask``; None until it first samples here).
        self.matcher = None
        # Where it asked for them (``SamplingParams.prompt_logprobs``), its prompt tokens' log-
        # probabilities computed so far (``inputs.PromptLogprobs.entries``), else None.
        self.prompt_logprobs: list | None = None if params.prompt_logprobs is None else []

        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_encoded_images = 0
        self.kv_block_ids: list[int] = []
        # One list per image; emptied once prefill has read past that image.
        self.image_block_ids: list[list[int]] = [[] for _ in self.images]
        # Images whose blocks are still held (prefill has not read past them).
        self.num_held_images = 0
        # Images whose features were found in the image cache when their blocks were taken
        # (encoded before, here): they are not encoded. Set with the blocks, read past
        # ``num_encoded_images`` only.
        self.found_images: list[bool] = [False] * len(self.images)
        # Prefix caching (``prefix_cache``): the digests of its full blocks computed so far (they
        # stop, ``digests_stopped``, at an image of unknown content), and how many of the blocks
        # it holds were registered in its instance's pool (or found there).
        self.block_digests: list[bytes] = []
        self.digests_stopped = False
        self.num_registered_blocks = 0
        # Prompt tokens found cached when its prefill first started (None: not looked up yet);
        # a recompute after preemption that finds its own blocks does not change it.
        self.num_cached_tokens: int | None = None
        # The runner's persistent batch row while the request runs language steps (-1: none).
        self.row = -1
        # The scheduler step that last scheduled it (guards it against preemption in that step).
        self.scheduled_step = -1
        # Preemption recomputes from the prompt: only possible where the images can be
        # encoded again (an encoder, and the pixels: ``has_pixels``). Others get their whole
        # KV reservation up front instead.
        self.preemptible = True
        self.num_preemptions = 0
        # Its prompt takes more than one step's bound here (``Scheduler._classify``): shorter
        # prompts go ahead of it, within a share of each step.
        self.long_prompt = False
        self.finish_reason: str | None = None
        # Monotonic timestamps (system-wide clock, so they survive migration) and exec seconds.
        self.timeline: dict[str, float] = {
            "arrival": req.arrival_time or time.monotonic(),
            "encode_exec": 0.0,
            "prefill_exec": 0.0,
            "decode_exec": 0.0,
        }
        # torch.Generator for seeded sampling, created by the sampler on first use.
        self.generator = None
        # When its latest token was sampled, on the scheduler's clock (carried across migration):
        # its next one is due a TBT later. None until the first.
        self.last_token_time: float | None = None
        # How many of its gaps between two tokens passed the step bound (on the scheduler's
        # clock, carried across migration): a step may go past the bound only while every
        # stream in it keeps its p90 gap within the TBT (``Scheduler._streams_have_slack``).
        self.num_long_gaps = 0
        # Set while migrating in: (kind, source instance, source block ids, num computed tokens).
        self.pull: tuple[str, int, list, int] | None = None

    @classmethod
    def from_offer(cls, offer) -> "Request":
        """The request a ``migration.MigrationOffer`` describes, as its target holds it."""
        req = cls(
            EngineRequest(
                req_id=offer.req_id,
                prompt_token_ids=offer.prompt_token_ids,
                sampling_params=offer.sampling_params,
                images=offer.images,
                eos_token_ids=offer.eos_token_ids,
                mrope_positions=offer.mrope_positions,
                mrope_delta=offer.mrope_delta,
                group=offer.group,
            )
        )
        req.set_output(offer.output_token_ids)
        req.timeline = dict(offer.timeline)
        req.last_token_time = offer.last_token_time
        req.num_long_gaps = offer.num_long_gaps
        req.num_cached_tokens = offer.num_cached_tokens
        # A request that had not started moves whole: nothing to pull, it starts here.
        req.pull = None if offer.kind == "prompt" else (offer.kind, offer.source, offer.block_ids,
                                                       offer.num_computed_tokens)
        if offer.generator_state is not None:
            import torch

            req.generator = torch.Generator()
            req.generator.set_state(offer.generator_state)
        return req

    @property
    def arrival_time(self) -> float:
        return self.timeline["arrival"]

    def mark(self, event: str, now: float | None = None) -> None:
        """Record the first time ``event`` happened."""
        self.timeline.setdefault(event, now if now is not None else time.monotonic())

    # -- token accounting --------------------------------------------------------------
    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.num_tokens += 1

    def set_output(self, token_ids) -> None:
        self.output_token_ids = list(token_ids)
        self.num_tokens = self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without joining the two lists (hot path)."""
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def num_missing_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_tokens - self.num_computed_tokens == 1 and self.num_tokens > self.num_prompt_tokens

    # -- images ----------------------------------------------------------------------------
    @property
    def num_images(self) -> int:
        return len(self.images)

    @property
    def has_pixels(self) -> bool:
        """Its images' pixels are here (a request pulled for its prefill or decode has their
        layouts only: it cannot be encoded again)."""
        return all(image.pixel_values is not None for image in self.images)

    @property
    def images_done(self) -> bool:
        return self.num_encoded_images == len(self.images)

    def images_fully_read(self) -> list[int]:
        """Indices of encoded images whose tokens prefill has consumed: their blocks can go."""
        return [
            i
            for i, img in enumerate(self.images)
            if self.image_block_ids[i] and img.offset + img.length <= self.num_computed_tokens
        ]

    def image_tokens(self, index: int) -> int:
        return self.images[index].length

    # -- timing ----------------------------------------------------------------------------
    def stage_times(self, now: float) -> dict[str, float]:
        """Seconds per stage. Queue time = time in the stage minus time in batches that ran
        it; migration = from the source's offer to the target's finished copy."""
        t = self.timeline
        times: dict[str, float] = {}
        start = t["arrival"]
        if self.images and "encode_done" in t:
            times["encode_queue"] = max(0.0, t["encode_done"] - start - t["encode_exec"])
            times["encode_exec"] = t["encode_exec"]
            start = t["encode_done"]
            if "image_pulled" in t:
                times["encode_to_prefill_migration"] = t["image_pulled"] - start
                start = t["image_pulled"]
        first = t.get("first_token", now)
        times["prefill_queue"] = max(0.0, first - start - t["prefill_exec"])
        times["prefill_exec"] = t["prefill_exec"]
        start = first
        if "kv_pulled" in t:
            times["prefill_to_decode_migration"] = t["kv_pulled"] - start
            start = t["kv_pulled"]
        times["decode_queue"] = max(0.0, now - start - t["decode_exec"])
        times["decode_exec"] = t["decode_exec"]
        return times

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, images={self.num_encoded_images}/{self.num_images})"
        )
