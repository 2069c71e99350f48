"""The latency model of an instance: predicted seconds of one step from what it holds.

One model, three users: the scheduler fills each step up to its SLO bound with it
(Algorithm 1 made context-aware), the simulator replays traces with it, and the
planner searches deployments with it. It is linear in a few features of the step,
with separate vision and language parts:

    vision   = v_fixed + v_image * images + v_patch * patches + v_patch2 * sum(patches_i^2) / 1e3
               + v_token * image_tokens
    language = l_fixed + l_prefill * prefill_tokens + l_attn * prefill_pairs / 1e3
               + l_decode * decodes + l_ctx * decode_context / 1e3 + l_logit * priced_tokens
    step     = max(vision, language) + overlap * min(vision, language)

An image's encode cost follows its *patches*, the positions the vision tower runs
over (``ImageInput.num_patches``: LLaVA-NeXT's tiles and base image, Qwen2-VL's
patches before the 2x2 merge), with a square term for towers whose layers attend over
a whole image (``patches * span``, where the tower attends within parts of ``span``
patches: Qwen2-VL's videos, each group of frames alone); its tokens in the language
model (what prefill reads) add the projector's or merger's share. ``prefill_pairs``
counts the (query, key) pairs of the prefill chunks' attention, a chunk of q tokens after
c cached ones reading q*c + q(q+1)/2 pairs; ``decode_context`` is the total KV context
the decodes read; ``priced_tokens`` the prompt positions whose log-probabilities the step
computes (``SamplingParams.prompt_logprobs``: the language model head over the vocabulary at
each, where a prefill otherwise computes it at its last position only). The fixed parts
count only when the step has work of that kind.
``overlap`` is how much of the shorter part the longer one does not hide: 0 when vision
and language run fully in parallel (two CUDA streams), about 1 when they share the same
cores (two threads on a CPU).

The coefficients are fitted by least squares on relative error to probe batches run
through the real runner (``hydrad.engine.profiler``), and saved as JSON (format in
``docs/latency-model.md``). This module imports no torch: the scheduler and the
planner take the model as plain numbers.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hydrad.config import SLOConfig

VISION_TERMS = ("v_fixed", "v_image", "v_patch", "v_patch2", "v_token")
LANGUAGE_TERMS = ("l_fixed", "l_prefill", "l_attn", "l_decode", "l_ctx", "l_logit")
FORMAT_VERSION = 3
# The kinds of work a step's time splits into (``LatencyModel.scaled_parts``): its vision
# terms, its prefill terms, and its decode terms with the language step's fixed cost.
KINDS = ("images", "prefills", "decodes")
# The median of |z| for a standard normal z: a spread from a median absolute deviation.
NORMAL_MEDIAN_ABS = 0.6745


def log_spread(groups) -> float:
    """The standard deviation of log ratios about their group's median (each of ``groups`` a
    collection of ratios), from the median absolute deviation: one ratio taken while another
    tenant held the core does not set it. 0 without ratios."""
    deviations = []
    for ratios in groups:
        logs = [math.log(r) for r in ratios]
        if logs:
            mid = statistics.median(logs)
            deviations += [abs(x - mid) for x in logs]
    return statistics.median(deviations) / NORMAL_MEDIAN_ABS if deviations else 0.0


def latency_bound(slo: SLOConfig, role: str) -> float:
    """The step bound of a role: TBT for roles that decode (every step carries decodes),
    the share alpha of the TTFT one batch may take otherwise; less the SLO's headroom."""
    return (slo.tbt if "D" in role else slo.alpha * slo.ttft) * (1.0 - slo.headroom)


def idle_bound(slo: SLOConfig) -> float:
    """The bound of a step that carries no decode, whatever the role: alpha * TTFT, less the
    headroom."""
    return slo.alpha * slo.ttft * (1.0 - slo.headroom)


def handoff_wait(slo: SLOConfig) -> float:
    """How long a first token handed over to another instance may wait for it to take the
    stream's decodes before the instance that sampled it holds its new prompts
    (``Scheduler._hold_new``): the TBT, the gap that wait opens."""
    return slo.tbt


def at_threads(models: Mapping[int, LatencyModel], threads: int) -> LatencyModel:
    """The model of a CPU instance on ``threads`` torch threads, from ``models`` measured at
    other counts (by count): the one measured at ``threads``; else each coefficient as
    ``a + b / threads`` (Amdahl's law) through the two measured counts nearest to it (never
    below 0), the overlap of the nearer; with one count measured, that count's model."""
    if threads in models:
        return models[threads]
    counts = sorted(models, key=lambda n: (abs(n - threads), n))
    if len(counts) == 1:
        return models[counts[0]]
    (n1, m1), (n2, m2) = ((n, models[n]) for n in counts[:2])
    weight = (1 / threads - 1 / n2) / (1 / n1 - 1 / n2)  # 1 at n1, 0 at n2

    def value(name: str) -> float:
        return max(0.0, getattr(m2, name) + weight * (getattr(m1, name) - getattr(m2, name)))

    meta = {**m1.meta, "threads": threads, "interpolated_from": [n1, n2]}
    return LatencyModel(**{name: value(name) for name in (*VISION_TERMS, *LANGUAGE_TERMS)}, overlap=m1.overlap,
                        meta=meta)


def role_parts(role: str) -> str:
    """The parts of the model a role runs: ``vision``, ``language`` or ``vision+language``."""
    has_language = "P" in role or "D" in role
    return ("vision" if "E" in role else "") + ("+language" if has_language else "")


@dataclass(frozen=True)
class StepShape:
    """What one step holds, in the model's features."""

    num_images: int = 0
    num_patches: int = 0  # over images, the positions the vision tower runs over
    patches_sq: int = 0  # sum over images of patches * attention span (patches^2 for a whole image)
    num_image_tokens: int = 0
    num_prefill_tokens: int = 0
    prefill_pairs: int = 0
    num_decodes: int = 0
    decode_context: int = 0
    num_priced_tokens: int = 0  # prompt positions whose log-probabilities the step computes

    @staticmethod
    def of(*, images: list[tuple[int, ...]] = (), prefills: list[tuple[int, int]] = (),
           decodes: list[int] = (), priced: int = 0) -> StepShape:
        """``images``: (patches, tokens) or (patches, tokens, attention span) per image (a span
        of 0 or none: the whole image); ``prefills``: (context before, chunk tokens);
        ``decodes``: context each decode reads (its tokens before the new one, plus one);
        ``priced``: prefill tokens whose prompt log-probabilities the step computes."""
        return StepShape(
            num_images=len(images),
            num_patches=sum(image[0] for image in images),
            patches_sq=sum(image[0] * ((image[2] if len(image) > 2 else 0) or image[0]) for image in images),
            num_image_tokens=sum(image[1] for image in images),
            num_prefill_tokens=sum(q for _, q in prefills),
            prefill_pairs=sum(prefill_pairs(c, q) for c, q in prefills),
            num_decodes=len(decodes),
            decode_context=sum(decodes),
            num_priced_tokens=priced,
        )

    def vision_features(self) -> list[float]:
        if not self.num_images:
            return [0.0] * len(VISION_TERMS)
        return [1.0, self.num_images, self.num_patches, self.patches_sq / 1e3, self.num_image_tokens]

    def language_features(self) -> list[float]:
        if not self.num_prefill_tokens and not self.num_decodes:
            return [0.0] * len(LANGUAGE_TERMS)
        return [1.0, self.num_prefill_tokens, self.prefill_pairs / 1e3, self.num_decodes, self.decode_context / 1e3,
                self.num_priced_tokens]


def prefill_pairs(context: int, num_tokens: int) -> int:
    """(query, key) pairs read by a chunk of ``num_tokens`` after ``context`` cached tokens."""
    return num_tokens * context + num_tokens * (num_tokens + 1) // 2


@dataclass(frozen=True)
class FitError:
    """Relative prediction error on probes the model was not fitted on."""

    median: float
    max: float
    num_probes: int


@dataclass(frozen=True)
class LatencyModel:
    v_fixed: float = 0.0
    v_image: float = 0.0
    v_patch: float = 0.0
    v_patch2: float = 0.0
    v_token: float = 0.0
    l_fixed: float = 0.0
    l_prefill: float = 0.0
    l_attn: float = 0.0
    l_decode: float = 0.0
    l_ctx: float = 0.0
    l_logit: float = 0.0
    overlap: float = 1.0
    # Where and how it was measured; the cache key of the file it is stored in.
    meta: dict = field(default_factory=dict, compare=False)
    error: FitError | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in (*VISION_TERMS, *LANGUAGE_TERMS):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"latency model coefficient {name} must be finite and >= 0, got {value}")
        if not 0.0 <= self.overlap <= 2.0:
            raise ValueError(f"latency model overlap must be in [0, 2], got {self.overlap}")

    # -- prediction ------------------------------------------------------------------------
    def vision_seconds(self, shape: StepShape) -> float:
        if not shape.num_images:
            return 0.0
        return (self.v_fixed + self.v_image * shape.num_images + self.v_patch * shape.num_patches
                + self.v_patch2 * shape.patches_sq / 1e3 + self.v_token * shape.num_image_tokens)

    def image_seconds(self, num_patches: int, num_tokens: int, span: int = 0) -> float:
        """What one image adds to a step's vision work (the fixed part not included); ``span``:
        its attention span (``ImageInput.attention_span``; 0: the whole image)."""
        return (self.v_image + self.v_patch * num_patches + self.v_patch2 * num_patches * (span or num_patches) / 1e3
                + self.v_token * num_tokens)

    def prompt_seconds(self, images, num_tokens: int, encode: bool = True, prefill: bool = True,
                       priced: bool = False) -> float:
        """A whole prompt's work alone in one step: its ``images`` (``ImageInput``s) encoded
        where ``encode``, and its ``num_tokens`` prefilled where ``prefill`` (each position
        priced for its log-probabilities where ``priced``)."""
        prefills = [(0, num_tokens)] if prefill and num_tokens else []
        return self.step_seconds(StepShape.of(
            images=[(i.num_patches, i.length, i.attention_span) for i in images] if encode else [],
            prefills=prefills, priced=num_tokens if prefills and priced else 0))

    def language_seconds(self, shape: StepShape) -> float:
        if not shape.num_prefill_tokens and not shape.num_decodes:
            return 0.0
        return (self.l_fixed + self.l_prefill * shape.num_prefill_tokens + self.l_attn * shape.prefill_pairs / 1e3
                + self.l_decode * shape.num_decodes + self.l_ctx * shape.decode_context / 1e3
                + self.l_logit * shape.num_priced_tokens)

    def combine(self, vision: float, language: float) -> float:
        return max(vision, language) + self.overlap * min(vision, language)

    def step_seconds(self, shape: StepShape) -> float:
        return self.combine(self.vision_seconds(shape), self.language_seconds(shape))

    def max_language(self, vision: float, bound: float) -> float:
        """The largest language time a step with ``vision`` seconds of vision work may
        hold and stay within ``bound`` (negative when the vision work alone is over)."""
        if vision <= 0.0:
            return bound
        # language >= vision: language + overlap * vision <= bound
        longer = bound - self.overlap * vision
        if longer >= vision:
            return longer
        # language < vision: vision + overlap * language <= bound
        if self.overlap == 0.0:
            return vision if vision <= bound else -1.0
        return (bound - vision) / self.overlap

    def scaled(self, factor: float) -> LatencyModel:
        """This model with every step ``factor`` times as long (the machine runs slower or
        faster than when it was fitted: ``machine_speed.measure_speed``)."""
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"latency model scale must be finite and > 0, got {factor}")
        if factor == 1.0:
            return self
        return LatencyModel(**{name: getattr(self, name) * factor for name in (*VISION_TERMS, *LANGUAGE_TERMS)},
                            overlap=self.overlap, meta={**self.meta, "scaled": factor}, error=self.error)

    def scaled_parts(self, images: float, prefills: float, decodes: float) -> LatencyModel:
        """This model with each kind of work as many times as long: vision by ``images``, the
        prefill terms by ``prefills``, the decode terms and the language step's fixed cost by
        ``decodes`` (a decode step is mostly that cost; ``machine_speed.Speed.parts``)."""
        factors = (images, prefills, decodes)
        if any(not math.isfinite(f) or f <= 0 for f in factors):
            raise ValueError(f"latency model scales must be finite and > 0, got {factors}")
        scale = {**{name: images for name in VISION_TERMS}, "l_prefill": prefills, "l_attn": prefills,
                 "l_logit": prefills, "l_decode": decodes, "l_ctx": decodes, "l_fixed": decodes}
        return LatencyModel(**{name: getattr(self, name) * f for name, f in scale.items()}, overlap=self.overlap,
                            meta={**self.meta, "scaled": dict(zip(KINDS, factors))},
                            error=self.error)

    # -- persistence -------------------------------------------------------------------------
    def to_json(self) -> dict:
        body = {"version": FORMAT_VERSION, "coefficients": {k: getattr(self, k) for k in
                                                            (*VISION_TERMS, *LANGUAGE_TERMS, "overlap")}}
        body["meta"] = dict(self.meta)
        body["error"] = asdict(self.error) if self.error is not None else None
        return body

    @classmethod
    def from_json(cls, body: dict) -> LatencyModel:
        if body.get("version") != FORMAT_VERSION:
            raise ValueError(f"latency model format {body.get('version')!r}, expected {FORMAT_VERSION}")
        error = body.get("error")
        return cls(**body["coefficients"], meta=body.get("meta") or {},
                   error=FitError(**error) if error else None)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> LatencyModel:
        return cls.from_json(json.loads(Path(path).read_text()))

    def summary(self) -> str:
        parts = []
        images = self.meta.get("images") or []
        if images and any(getattr(self, name) for name in VISION_TERMS):
            # The per-image cost at the smallest and the largest image the probes encoded.
            costs = sorted(1e3 * self.image_seconds(*image) for image in images)
            per_image = f"{costs[0]:.1f}" if costs[-1] - costs[0] < 0.05 else f"{costs[0]:.1f}-{costs[-1]:.1f}"
            parts.append(f"encode {1e3 * self.v_fixed:.1f} ms + {per_image} ms/image")
        if self.l_fixed or self.l_prefill or self.l_decode:
            parts.append(f"step {1e3 * self.l_fixed:.1f} ms + {1e6 * self.l_prefill:.0f} us/prefill token"
                         f" + {1e6 * self.l_decode:.0f} us/decode + {1e6 * self.l_ctx:.1f} us/1k ctx")
            if self.l_logit:
                parts[-1] += f" + {1e6 * self.l_logit:.0f} us/priced prompt token"
        if self.error is not None:
            parts.append(f"error median {100 * self.error.median:.1f}%, max {100 * self.error.max:.1f}% "
                         f"on {self.error.num_probes} held-out probes")
        return "; ".join(parts)


class Calibration:
    """How the steps that carry decodes run against their prediction on the machine as it is
    now, to keep their length within the TBT bound when it is slower (or faster) than when
    the model was fitted: another process takes the cores, the clock drops.

    ``factor`` is the ``quantile`` of measured / predicted seconds over the last ``window``
    such steps, recomputed every ``every`` steps once ``every`` are known, within
    [``low``, ``high``]. The scheduler divides the bound of a step that carries decodes by it
    (``Scheduler.set_calibration``), so that that share of steps ends within the bound: the
    SLO holds each request's p90 inter-token gap, which one step in ten over the TBT breaks.
    ``guard_factor`` is the same at ``guard_quantile`` (at least ``factor``): the bound of a
    step that carries a stream with no gap past the bound left to spend (``Scheduler``'s
    guarded steps), so that nearly every such step ends within it.
    """

    def __init__(self, window: int = 64, every: int = 16, quantile: float = 0.9, low: float = 0.8,
                 high: float = 2.0, min_seconds: float = 0.002, guard_quantile: float = 0.98):
        if not 0 < quantile <= guard_quantile <= 1 or not 0 < low <= 1 <= high or every < 1 or window < every:
            raise ValueError("calibration: 0 < quantile <= guard_quantile <= 1, 0 < low <= 1 <= high, "
                             "1 <= every <= window")
        self.window, self.every, self.quantile, self.low, self.high = window, every, quantile, low, high
        self.guard_quantile = guard_quantile
        self.min_seconds = min_seconds
        self.ratios: deque[float] = deque(maxlen=window)
        self.factor = self.guard_factor = 1.0
        self._since = 0

    def add(self, predicted: float, measured: float) -> bool:
        """One step's predicted and measured seconds; True when ``factor`` or ``guard_factor``
        changed."""
        if predicted < self.min_seconds:  # too short to tell the machine from the timer
            return False
        self.ratios.append(measured / predicted)
        self._since += 1
        if self._since < self.every:
            return False
        self._since = 0
        ordered = sorted(self.ratios)
        last = len(ordered) - 1
        factor = min(self.high, max(self.low, ordered[min(last, int(self.quantile * len(ordered)))]))
        guard = min(self.high, max(self.low, ordered[min(last, int(self.guard_quantile * len(ordered)))]))
        changed = (factor, guard) != (self.factor, self.guard_factor)
        self.factor, self.guard_factor = factor, guard
        return changed


class LiveSpeed:
    """How many times their prediction an instance's steps take now, per kind of work:
    the machine's speed against the latency model as the instance runs under load, the
    figure ``machine_speed.measure_speed`` estimates from idle probes before a plan (same kinds,
    same meaning: ``LatencyModel.scaled_parts``). Under load the steps share the machine's
    memory bandwidth and caches with the other workers, the daemon and its clients; an idle
    probe shares them with nothing.

    A step counts for the kind that holds at least ``dominant`` of its predicted work
    (vision: its images; language: its prefill terms, or its decodes with the language
    step's fixed cost), as its measured / predicted seconds; a step of mixed work counts
    for none, and nor does one predicted under ``min_seconds`` (the timer's noise). Each
    kind's factor is the median of its last ``window`` steps, once ``min_steps`` are known.
    Plain numbers, kept by the worker's engine (``EngineCore``) and reported in its stats.
    """

    def __init__(self, window: int = 128, min_steps: int = 8, dominant: float = 0.75, min_seconds: float = 0.002):
        if window < min_steps or min_steps < 1 or not 0.5 < dominant <= 1:
            raise ValueError("live speed: 1 <= min_steps <= window, 0.5 < dominant <= 1")
        self.min_steps, self.dominant, self.min_seconds = min_steps, dominant, min_seconds
        self.ratios: dict[str, deque[float]] = {kind: deque(maxlen=window) for kind in KINDS}

    def add(self, vision: float, prefill: float, language: float, predicted: float, measured: float) -> None:
        """One step: its predicted vision seconds, prefill-term seconds and language seconds
        (prefill terms included), the predicted step (``LatencyModel.combine``) and the
        measured one."""
        if predicted < self.min_seconds or measured <= 0:
            return
        work = vision + language
        if vision >= self.dominant * work:
            kind = "images"
        elif prefill >= self.dominant * work:
            kind = "prefills"
        elif language - prefill >= self.dominant * work:
            kind = "decodes"
        else:
            return
        self.ratios[kind].append(measured / predicted)

    def parts(self) -> dict[str, float]:
        """The factor of each kind with at least ``min_steps`` steps measured."""
        return {kind: statistics.median(ratios) for kind, ratios in self.ratios.items()
                if len(ratios) >= self.min_steps}

    def counts(self) -> dict[str, int]:
        return {kind: len(ratios) for kind, ratios in self.ratios.items()}

    def spread(self) -> float:
        """The standard deviation of log(measured / predicted) about each kind's median, from
        their median absolute deviation (as ``machine_speed.Speed.spread``), over the kinds with
        at least ``min_steps`` steps; 0 when there are none."""
        return log_spread(r for r in self.ratios.values() if len(r) >= self.min_steps)


class StepBudget:
    """The step the scheduler is building, against its latency bound and hard caps.

    Each ``add_*`` admits one unit of work if the predicted step stays within
    ``bound``; the first unit of an empty step is always admitted (a step must make
    progress even when the bound cannot be met). Without a model only the caps bind.
    """

    def __init__(self, model: LatencyModel | None, bound: float, token_cap: int, image_cap: int):
        self.model = model
        self.bound = bound
        self.tokens_left = token_cap
        self.images_left = image_cap
        self._image_cap = image_cap
        self.vision = 0.0
        self.language = 0.0
        self.prefill = 0.0  # the prefill terms of ``language`` (its fixed cost not included)
        self.empty = True
        self._num_language_units = 0
        if model is not None:
            self._decode_cost = model.l_decode
            self._ctx_cost = model.l_ctx / 1e3
            # Largest language time with no vision work, refined when images join.
            self._language_room = model.max_language(0.0, bound)

    def predicted(self) -> float:
        return self.model.combine(self.vision, self.language) if self.model is not None else 0.0

    def set_bound(self, bound: float) -> None:
        """Fill the rest of the step up to ``bound`` instead: higher for a step that turned out
        to carry no decode, lower for one whose streams have less time left."""
        self.bound = bound
        if self.model is not None:
            self._language_room = self.model.max_language(self.vision, bound)

    def add_decode(self, context: int) -> bool:
        """One decode reading ``context`` tokens of KV (its cached tokens plus the new one)."""
        if self.tokens_left < 1:
            return False
        if self.model is not None:
            cost = self._decode_cost + self._ctx_cost * context
            if self.language == 0.0:
                cost += self.model.l_fixed
            if self.language + cost > self._language_room and not self.empty:
                return False
            self.language += cost
        self.tokens_left -= 1
        self.empty = False
        self._num_language_units += 1
        return True

    def add_decodes(self, count: int, contexts: int) -> None:
        """Account ``count`` decodes reading ``contexts`` tokens of KV in all, whatever the
        bound: decodes the step carries before anything else is weighed."""
        if count < 1:
            return
        if self.model is not None:
            self.language += ((self.model.l_fixed if self.language == 0.0 else 0.0) + count * self._decode_cost
                              + self._ctx_cost * contexts)
        self.tokens_left -= count
        self.empty = False
        self._num_language_units += count

    def undo_decode(self, context: int) -> None:
        """Take back the last ``add_decode`` (the decode could not get its KV block)."""
        self.tokens_left += 1
        self._num_language_units -= 1
        if self.model is not None:
            if self._num_language_units == 0:
                self.language = 0.0
            else:
                self.language -= self._decode_cost + self._ctx_cost * context
        self.empty = self._num_language_units == 0 and self.vision == 0.0 and self.images_left == self._image_cap

    def fit_prefill(self, context: int, num_tokens: int, min_tokens: int = 1, force: bool = False,
                    priced: bool = False) -> int:
        """The largest chunk (<= ``num_tokens``) of a prefill after ``context`` cached tokens
        that fits; at least ``min_tokens`` in an empty step, or in any with ``force`` (work
        that must advance every step: a stage being handed over); 0 when none fits.
        ``priced``: the chunk computes its positions' log-probabilities (``l_logit`` each)."""
        n = min(num_tokens, self.tokens_left)
        if n < 1:
            return 0
        if self.model is not None:
            m = self.model
            room = self._language_room - self.language - (m.l_fixed if self.language == 0.0 else 0.0)
            a, b = m.l_prefill + (m.l_logit if priced else 0.0), m.l_attn / 1e3
            # cost(q) = a*q + b*(q*c + q(q+1)/2) <= room, increasing in q
            if room <= 0:
                fit = 0
            elif b > 0:
                lin = a + b * (context + 0.5)
                fit = int((-lin + math.sqrt(lin * lin + 2.0 * b * room)) / b)
            elif a > 0:
                fit = int(room / a)
            else:
                fit = n
            fit = min(n, max(0, fit))
            while fit > 0 and a * fit + b * prefill_pairs(context, fit) > room:
                fit -= 1  # float rounding at the edge
            if fit == 0 and (self.empty or force):
                fit = min(n, max(1, min_tokens))
            n = fit
        return n

    def add_prefill(self, context: int, num_tokens: int, priced: bool = False) -> None:
        """Account a chunk returned by ``fit_prefill`` (with the same ``priced``)."""
        if self.model is not None:
            m = self.model
            cost = ((m.l_prefill + (m.l_logit if priced else 0.0)) * num_tokens
                    + m.l_attn * prefill_pairs(context, num_tokens) / 1e3)
            self.language += (m.l_fixed if self.language == 0.0 else 0.0) + cost
            self.prefill += cost
        self.tokens_left -= num_tokens
        self.empty = False
        self._num_language_units += 1

    def add_image(self, num_patches: int, num_tokens: int, force: bool = False, span: int = 0) -> bool:
        """One image to encode: ``num_patches`` positions through the vision tower (its
        ``ImageInput.num_patches``), ``num_tokens`` image tokens out, ``span`` its attention
        span (``ImageInput.attention_span``); with ``force`` past the bound (not past the image
        cap), as ``fit_prefill``'s."""
        if self.images_left < 1:
            return False
        if self.model is not None:
            m = self.model
            vision = (self.vision + (m.v_fixed if self.vision == 0.0 else 0.0)
                      + m.image_seconds(num_patches, num_tokens, span))
            if m.combine(vision, self.language) > self.bound and not (self.empty or force):
                return False
            self.vision = vision
            self._language_room = m.max_language(vision, self.bound)
        self.images_left -= 1
        self.empty = False
        return True


def fit_least_squares(rows: list[list[float]], seconds: list[float]) -> list[float]:
    """Non-negative coefficients minimizing the relative error of ``rows @ coef`` to
    ``seconds``: weighted least squares, dropping terms that come out negative."""
    import numpy as np

    x = np.asarray(rows, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if x.ndim != 2 or len(t) != x.shape[0] or not len(t):
        raise ValueError("one row of features per measured time is needed")
    if (t <= 0).any():
        raise ValueError("measured times must be > 0")
    w = 1.0 / t
    active = [j for j in range(x.shape[1]) if np.any(x[:, j] != 0)]
    coef = np.zeros(x.shape[1])
    while active:
        sub = x[:, active] * w[:, None]
        scale = np.linalg.norm(sub, axis=0)
        scale[scale == 0] = 1.0
        sol, *_ = np.linalg.lstsq(sub / scale, t * w, rcond=None)
        sol = sol / scale
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        # Drop the most negative term and solve again (an active-set step of NNLS).
        active.pop(int(np.argmin(sol)))
    return [float(c) for c in coef]
