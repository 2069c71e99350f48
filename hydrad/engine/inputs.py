"""What crosses the boundary between a frontend (``LLM``, the daemon) and an engine.

These are the payloads of the cross-process messages too, so they hold ids,
token ids and tensors only: no tokenizer, no model objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hydrad.sampling_params import SamplingParams


@dataclass
class ImageInput:
    """One image of a request, preprocessed, and where its tokens sit in the prompt."""

    # The image processor's output for this image (model dtype not applied yet): LLaVA-1.5
    # [3, H, W]; LLaVA-NeXT [num_tiles, 3, H, W] (the resized whole image, then the tiles);
    # Qwen2-VL [num_patches, channels * temporal_patch * patch * patch].
    # None once encoded elsewhere (a migrated request carries only the placement).
    pixel_values: torch.Tensor | None
    # First placeholder position in the prompt and the number of placeholders (= image tokens).
    offset: int
    length: int
    # What a variable-resolution encoder needs besides the pixels, as plain ints (they travel in
    # messages): LLaVA-NeXT's original (height, width), which fixes the tile grid and the unpadding;
    # Qwen2-VL's patch grid (t, h, w) before the 2x2 merge.
    image_size: tuple[int, int] | None = None
    grid_thw: tuple[int, int, int] | None = None
    # What encoding it costs: the patch positions the vision tower runs over (the family's
    # ``num_vision_patches``), filled by the processor so that the scheduler and the latency model
    # read a plain number; 0 when unknown (the image is then costed by its tokens alone).
    num_patches: int = 0


@dataclass
class EngineRequest:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    images: list[ImageInput] = field(default_factory=list)
    # Token ids that end generation unless ignore_eos (the model's EOS and any extras).
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    # M-RoPE models (Qwen2-VL): the prompt's positions, [3, num_prompt_tokens] int64, computed once
    # from its token and image layout; None means the flat arange in all three (a text-only
    # prompt). A token at sequence index i >= num_prompt_tokens (generated) sits at i + mrope_delta
    # in all three.
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class RequestDelta:
    """What one step produced for one request: new tokens and, at the end, why it finished."""

    req_id: str
    new_token_ids: list[int]
    # None while running; "stop" (EOS / stop token), "length" (max_tokens / context), "abort".
    finish_reason: str | None = None
    # One entry per new token, when the request asked for logprobs.
    logprobs: list[TokenLogprobs] | None = None
    # With the final delta: seconds spent per stage, keys "<stage>_queue" / "<stage>_exec"
    # for stage in encode, prefill, decode (and "<a>_to_<b>_migration" across instances).
    stage_times: dict[str, float] | None = None


@dataclass
class TokenLogprobs:
    """The sampled token's log-probability and rank, and the most likely tokens."""

    logprob: float
    rank: int  # 1 for the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class FinishedRequest:
    """A request that ended in a step, with or without a last token."""

    req_id: str
    # "stop" (EOS / stop token), "length" (max_tokens / context), "abort".
    finish_reason: str
    # Seconds per stage, keys "<stage>_queue" / "<stage>_exec" for stage in encode,
    # prefill, decode (and "<a>_to_<b>_migration" across instances).
    stage_times: dict[str, float] | None = None


@dataclass
class StepTiming:
    """Predicted (latency model) and measured seconds of one step's vision and language work."""

    predicted_vision: float
    vision: float
    predicted_language: float
    language: float


@dataclass
class EngineOutput:
    """What one engine step produced, as columns: ``token_ids[i]`` is the new token of
    request ``req_ids[i]`` (one per request per step), ``logprobs[i]`` its log-probabilities
    when any request of the step asked for them. ``finished`` lists the requests that
    ended in this step (a finishing request's last token is in the columns)."""

    req_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] | None = None
    finished: list[FinishedRequest] = field(default_factory=list)
    timing: StepTiming | None = None

    def __bool__(self) -> bool:
        return bool(self.req_ids or self.finished)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    image_usage: float
    num_kv_blocks_used: int
    num_image_blocks_used: int
    num_preemptions: int


@dataclass
class MigrationOffer:
    """A request whose next stage runs on another instance (pull-based migration).

    The source keeps the blocks until the target has copied them and says so; the
    target allocates its own blocks when it schedules the request, then copies
    ``block_ids`` straight out of the source's pool.
    """

    req_id: str
    source: int  # instance id of the source
    kind: str  # "image" (encode -> prefill) or "kv" (prefill -> decode)
    # kind "image": one block list per image; kind "kv": the KV blocks of num_computed_tokens.
    block_ids: list
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    images: list[ImageInput]  # placements and layouts only (pixel_values None)
    eos_token_ids: tuple[int, ...]
    # Seeded sampling continues where it stopped: torch.Generator.get_state().
    generator_state: torch.Tensor | None
    # Monotonic timestamps (system-wide clock) and exec seconds so far, for the latency breakdown.
    timeline: dict[str, float]
    # M-RoPE models: the prompt's positions and the generated tokens' delta, as computed once by
    # the processor (``EngineRequest.mrope_positions``); they travel, never recomputed.
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0

    @property
    def next_stage(self) -> str:
        return "P" if self.kind == "image" else "D"
