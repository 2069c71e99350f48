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
    FINISHED = "finished"


class Request:
    def __init__(self, req: EngineRequest):
        self.req_id = req.req_id
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params: SamplingParams = req.sampling_params
        self.images: list[ImageInput] = req.images
        self.eos_token_ids = frozenset(req.eos_token_ids)
        self.arrival_time = req.arrival_time or time.monotonic()

        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_encoded_images = 0
        self.kv_block_ids: list[int] = []
        # One list per image; emptied once prefill has read past that image.
        self.image_block_ids: list[list[int]] = [[] for _ in self.images]
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        # Per-stage accounting, see stage_times().
        self.encode_exec = 0.0
        self.prefill_exec = 0.0
        self.decode_exec = 0.0
        self.encode_done_time: float | None = None
        self.first_token_time: float | None = None
        # torch.Generator for seeded sampling, created by the sampler on first use.
        self.generator = None

    # -- token accounting --------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def num_missing_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_missing_tokens == 1 and self.num_output_tokens > 0

    # -- images ----------------------------------------------------------------------------
    @property
    def num_images(self) -> int:
        return len(self.images)

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

    # -- timing ----------------------------------------------------------------------------
    def stage_times(self, now: float) -> dict[str, float]:
        """Queue time = time in the stage minus time in batches that ran it."""
        encode_end = self.encode_done_time if self.images else self.arrival_time
        encode_end = encode_end or now
        first = self.first_token_time or now
        times = {
            "prefill_queue": max(0.0, first - encode_end - self.prefill_exec),
            "prefill_exec": self.prefill_exec,
            "decode_queue": max(0.0, now - first - self.decode_exec),
            "decode_exec": self.decode_exec,
        }
        if self.images:
            times["encode_queue"] = max(0.0, encode_end - self.arrival_time - self.encode_exec)
            times["encode_exec"] = self.encode_exec
        return times

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, images={self.num_encoded_images}/{self.num_images})"
        )
