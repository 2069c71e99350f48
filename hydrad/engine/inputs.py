"""What crosses the boundary between a frontend (``LLM``, the daemon) and an engine.

These are the payloads of the cross-process messages too, so they hold ids,
token ids and tensors only: no tokenizer, no model objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hydrad.models.inputs import ImageInput  # noqa: F401  (part of the engine's inputs too)
from hydrad.sampling_params import SamplingParams

if TYPE_CHECKING:  # plain records: the scheduler and the planner use them without torch
    import torch


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
    # Tokens generated already, elsewhere: a request that runs again after the instance running
    # it died. They are computed with the prompt (as after a preemption), count towards its
    # max_tokens, min_tokens and penalties, are not output again, and a seeded request's
    # generator goes on after their draws.
    output_token_ids: list[int] = field(default_factory=list)
    # One of the ``n`` completions of a prompt (n > 1): the id of the first of them. The
    # router places them all on one instance, which prefills their prompt once
    # (``Scheduler._waits_for_prefix``).
    group: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class TokenLogprobs:
    """The sampled token's log-probability and rank, and the most likely tokens."""

    token_id: int
    logprob: float
    rank: int  # 1 for the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]
    # With a request's first token, where it asked for them (``SamplingParams.prompt_logprobs``).
    prompt: PromptLogprobs | None = None


@dataclass
class PromptLogprobs:
    """A prompt's log-probabilities: ``entries[i]`` is prompt token ``i + 1``'s, given the
    tokens before it, with the most likely tokens there; nothing predicts the first token."""

    first_token_id: int
    entries: list[TokenLogprobs]


@dataclass
class FinishedRequest:
    """A request that ended in a step, with or without a last token."""

    req_id: str
    # "stop" (EOS / stop token), "length" (max_tokens / context), "abort".
    finish_reason: str
    # Seconds per stage, keys "<stage>_queue" / "<stage>_exec" for stage in encode,
    # prefill, decode (and "<a>_to_<b>_migration" across instances).
    stage_times: dict[str, float] | None = None
    # Prompt tokens found in a prefix cache when its prefill started (usage's cached_tokens).
    num_cached_tokens: int = 0


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
    # Prefix caching: tokens of the requests that looked for a cached prefix, tokens found, images
    # not encoded for it (totals since the instance started), and registered KV blocks now.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    images_cached: int = 0
    num_kv_blocks_cached: int = 0
    # Measured / predicted length of recent steps with decodes (``latency_model.Calibration``).
    latency_calibration: float = 1.0
    # Measured / predicted seconds of recent steps by kind of work ("images", "prefills",
    # "decodes"; ``latency_model.LiveSpeed``): kinds with too few steps measured are absent.
    live_speed: dict[str, float] = field(default_factory=dict)
    live_speed_steps: dict[str, int] = field(default_factory=dict)
    live_speed_spread: float = 0.0  # of log(measured / predicted) about each kind's median
    # Steps built past their bound for images that could not fit beside their decodes
    # (``scheduler.OVERRUN_STEPS``), since the instance started.
    num_overrun_steps: int = 0
    # Steps with decodes built past the TBT bound for long prompts on the streams' p90 slack
    # (``SchedulerConfig.tbt_slack``), since the instance started.
    num_slack_steps: int = 0
    # Steps with decodes filled by the calibration's higher quantile while a stream had no gap
    # past the bound left to spend (``SchedulerConfig.tbt_guard``), since the instance started.
    num_guarded_steps: int = 0
    # Steps that admitted no new prompt while a first token handed over waited to be taken
    # (``SchedulerConfig.handoff_backpressure``), since the instance started.
    num_held_steps: int = 0
