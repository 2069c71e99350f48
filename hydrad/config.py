"""Configuration: frozen dataclasses, composed, validated in ``__post_init__``.

Every option here can be set in ``etc/hydrad.toml`` (section = dataclass) and, for
the common ones, overridden by ``hydrad start`` flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hydrad.dtypes import DTYPE_NAMES
from hydrad.errors import ConfigError

_DTYPES = (*DTYPE_NAMES, "auto")
# hydrad.models.attention.BACKENDS, and "auto"
_ATTENTION_BACKENDS = ("auto", "sdpa", "flash_attn")


@dataclass(frozen=True)
class ModelConfig:
    # None: the built-in default model (built into the user cache dir on first use).
    path: str | None = None
    # "auto": bfloat16 on CUDA; on a CPU float32, or bfloat16 for a checkpoint stored in half
    # precision where the CPU has native bfloat16 (``hydrad.dtypes``).
    dtype: str = "auto"
    # Cap on prompt + output tokens; None: the checkpoint's max_position_embeddings.
    max_model_len: int | None = None
    # The language model's paged attention: "sdpa", "flash_attn" (CUDA, float16 or bfloat16,
    # KV blocks of a multiple of 256 tokens), or "auto": flash-attn where it can run and is
    # installed, else SDPA.
    attention_backend: str = "auto"
    # A Jinja chat template file used instead of the checkpoint's (the Request Processor's;
    # one that asks for tool calls as ``<tool_call>`` blocks serves tool_choice "auto").
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ConfigError(f"model.chat_template: no such file: {self.chat_template}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"model.dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in _ATTENTION_BACKENDS:
            raise ConfigError(f"model.attention_backend must be one of {', '.join(_ATTENTION_BACKENDS)}, "
                              f"got {self.attention_backend!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"model.max_model_len must be >= 2, got {self.max_model_len}")


# The pools' sizes on a CPU when [cache] leaves them unset (``hydrad.engine.memory``).
CPU_KV_MB = 512
CPU_IMAGE_MB = 256


@dataclass(frozen=True)
class CacheConfig:
    # Tokens per KV-cache block; None: the attention backend's default (16 for SDPA, 256 for
    # flash-attn, whose paged kernel needs a multiple of 256).
    kv_block_size: int | None = None
    # Number of KV blocks; None: derived from kv_cache_memory_mb.
    num_kv_blocks: int | None = None
    # MB of KV cache per instance; None: 512 on a CPU, on a GPU what gpu_memory_utilization
    # leaves after the weights and the largest step (hydrad.engine.memory).
    kv_cache_memory_mb: int | None = None
    # Image-token slots per image-cache block; None: the family's default (one image's tokens for
    # LLaVA-1.5, 576 at 336 px; 64 for the families whose images vary in size).
    image_block_size: int | None = None
    # Number of image blocks; None: derived from image_cache_memory_mb.
    num_image_blocks: int | None = None
    # MB of image cache per instance; None: 256 on a CPU, an eighth of the pools' memory on a GPU.
    image_cache_memory_mb: int | None = None
    # Share of a GPU's memory an instance may hold in all (weights, steps, cache pools) when a
    # pool's size is unset, as vLLM's --gpu-memory-utilization; unused on a CPU.
    gpu_memory_utilization: float = 0.9
    # Keep the KV of full blocks after their request for later requests with the same prefix
    # (tokens and images): they skip its prefill, and the encoding of its images.
    prefix_caching: bool = True

    def cpu_pool_mb(self) -> tuple[int, int]:
        """MB of the KV and the image pool on a CPU: as set, else the CPU defaults."""
        return (self.kv_cache_memory_mb if self.kv_cache_memory_mb is not None else CPU_KV_MB,
                self.image_cache_memory_mb if self.image_cache_memory_mb is not None else CPU_IMAGE_MB)

    def cpu_pools_mb(self) -> int | None:
        """MB of an instance's two pools on a CPU (a role holding one pool gives it the other's
        share: the sum is the same); None where a block count sets a size (its bytes follow
        from the model's geometry)."""
        if self.num_kv_blocks is not None or self.num_image_blocks is not None:
            return None
        return sum(self.cpu_pool_mb())

    def __post_init__(self) -> None:
        if self.kv_block_size is not None and self.kv_block_size < 1:
            raise ConfigError(f"cache.kv_block_size must be >= 1, got {self.kv_block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"cache.num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.image_block_size is not None and self.image_block_size < 1:
            raise ConfigError(f"cache.image_block_size must be >= 1, got {self.image_block_size}")
        if self.num_image_blocks is not None and self.num_image_blocks < 1:
            raise ConfigError(f"cache.num_image_blocks must be >= 1, got {self.num_image_blocks}")
        if any(mb is not None and mb < 1 for mb in (self.kv_cache_memory_mb, self.image_cache_memory_mb)):
            raise ConfigError("cache memory sizes must be >= 1 MB")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"cache.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    # τ_t: hard cap on tokens (decode tokens + prefill chunk tokens) per step.
    token_budget: int = 2048
    # τ_e: hard cap on images encoded per step.
    image_budget: int = 4
    # Requests running at once on one instance.
    max_num_seqs: int = 256
    # Fit each instance's latency model at its start (cached on disk) and fill every step up
    # to its [slo] bound by the model's prediction, within the caps above; off: only the
    # caps bind.
    derive_budgets: bool = True
    # Prompts that one step could not carry alone (a long text, a video: their whole prompt
    # work predicted over the instance's step bound) keep at least this share of each step's
    # room left after the decodes while shorter prompts wait; the shorter ones take the rest
    # first, ahead of them (the order within each kind stays first come first served).
    # 1: first come first served whatever a prompt's length. Only with derive_budgets.
    long_prompt_share: float = 0.25
    # While a long prompt waits, a step that carries decodes may go past the TBT bound, up
    # to the TTFT share a step without decodes takes, when every stream in it can take one
    # gap past the TBT with its p90 gap still within it, counted over the gaps it has had
    # (so however soon it ends). false: steps with decodes always keep to the TBT bound.
    tbt_slack: bool = True
    # A step that carries a stream with no gap past the TBT bound left to spend within its p90
    # (over the length of a typical request finished on the instance) fills its prompt work
    # (its decodes go in as always) to the bound over a higher quantile (0.98) of the steps'
    # measured / predicted time than the p90 that fills the others: one more long gap would
    # break that stream's SLO. false: every step with decodes is filled by the p90.
    tbt_guard: bool = True
    # An instance that hands its streams' decodes to another after their first token (EP of
    # EP+D) admits no new prompt while a first token it handed over has waited longer than
    # the [slo] TBT for that instance to take it (its steps are full): the new prompts wait
    # before their first token instead of between their first and second. false: they are
    # admitted, and wait there.
    handoff_backpressure: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.long_prompt_share <= 1.0:
            raise ConfigError(f"scheduler.long_prompt_share must be in [0, 1], got {self.long_prompt_share}")
        if self.token_budget < 1:
            raise ConfigError(f"scheduler.token_budget must be >= 1, got {self.token_budget}")
        if self.image_budget < 1:
            raise ConfigError(f"scheduler.image_budget must be >= 1, got {self.image_budget}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"scheduler.max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass(frozen=True)
class SLOConfig:
    ttft: float = 2.0
    tbt: float = 0.2
    alpha: float = 0.5
    # Share of each bound the scheduler leaves free: the latency model's error and the
    # delivery of a token to the client come out of it (a step predicted at exactly the TBT
    # runs over it about half the time).
    headroom: float = 0.1

    def __post_init__(self) -> None:
        if self.ttft <= 0 or self.tbt <= 0:
            raise ConfigError("slo.ttft and slo.tbt must be > 0 seconds")
        if not 0 < self.alpha <= 1:
            raise ConfigError(f"slo.alpha must be in (0, 1], got {self.alpha}")
        if not 0 <= self.headroom < 1:
            raise ConfigError(f"slo.headroom must be in [0, 1), got {self.headroom}")


@dataclass(frozen=True)
class ParallelConfig:
    # "auto": the planner's choice from a request trace, else one EPD instance per device;
    # devices "auto": every visible GPU, else CPU workers (one, or as many as deploy "auto"'s
    # plan picks: ``planner.auto``).
    deploy: str = "auto"
    devices: str = "auto"
    # Vision and language work of a step at the same time, when the role holds E and P/D:
    # "auto" on CUDA (two streams), not on CPU (two threads there compete for the same cores);
    # true / false force it.
    dual_streams: bool | str = "auto"

    def __post_init__(self) -> None:
        if self.dual_streams not in (True, False, "auto"):
            raise ConfigError(f"parallel.dual_streams must be true, false or \"auto\", got {self.dual_streams!r}")

    def dual_streams_on(self, device_type: str) -> bool:
        return device_type == "cuda" if self.dual_streams == "auto" else bool(self.dual_streams)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)
    seed: int = 0
