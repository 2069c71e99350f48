"""Per-request sampling options (the shape users know from vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Below this temperature, logits / temperature overflow float32: sample greedily, as vLLM does.
GREEDY_BELOW = 1e-5
# torch.Generator seeds are 64-bit.
SEED_RANGE = (-(2**63), 2**63 - 1)


@dataclass
class SamplingParams:
    """How to sample one request's output.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those
    filters. ``seed`` makes sampling reproducible per request, independent of batching.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]
        ):
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed!r}")
        if len(self.stop) > 16:
            raise ValueError("at most 16 stop strings are allowed")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
