"""SLO-derived scheduler budgets (HydraInfer §4): τ_e and τ_t from measured batch latency.

At worker start each budget is the largest batch whose latency on this device stays
within the instance's bound:

* roles that decode (D, ED, PD, EPD): ``slo.tbt`` — every step carries the decodes;
* the others (E, P, EP): ``slo.alpha * slo.ttft``, the share of the TTFT one batch may take.

τ_e (roles with E) counts images per encode batch, τ_t (roles with P or D) tokens per
language batch. The scheduler fills a step with every running decode before any prefill,
so the heaviest batch a token budget of n admits is as many decodes as can run, topped up
with prefill tokens. Those decodes are probed at a long context (``context_len``, by default
a quarter of ``max_model_len``): a decode's attention reads its whole KV context, and
probing empty-context decodes (as HydraInfer's profiler does) overestimates τ_t for exactly
the instances whose TBT it is meant to protect.

Probes are batches of synthetic requests run through the engine's own runner over blocks
borrowed from its pools and returned afterwards; the scheduler is never involved. A probe's
latency is the median of a few timed runs after one warm-up run, so that one-off costs
(allocator growth, kernel selection) and scheduling noise do not break the monotonicity the
binary search relies on. Results are cached on disk per model, device, role, SLO and cache
layout, so a restart does not measure again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from hydrad.config import SchedulerConfig, SLOConfig
from hydrad.engine.inputs import EngineRequest, ImageInput
from hydrad.engine.request import Request
from hydrad.errors import ConfigError
from hydrad.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MIN_TOKEN_BUDGET = 16
MAX_TOKEN_BUDGET = 16384
MAX_IMAGE_BUDGET = 64
# Bump when the probe batches or the file layout change: older files then miss.
_CACHE_VERSION = 1


@dataclass(frozen=True)
class Probe:
    """One batch shape to time: images to encode, or prefill tokens plus decodes."""

    num_images: int = 0
    num_prefill_tokens: int = 0
    num_decodes: int = 0
    # KV context each decode attends over (its tokens before the one it computes).
    context_len: int = 0

    @property
    def kind(self) -> str:
        return "encode" if self.num_images else "language"

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decodes


LatencyFn = Callable[[Probe], float]


@dataclass(frozen=True)
class Budgets:
    """The budgets of one instance and the batch latencies they were chosen at."""

    # None: the role has no stage that uses this budget.
    token_budget: int | None
    image_budget: int | None
    # False: loaded from the disk cache.
    measured: bool
    # Seconds: slo.tbt for roles that decode, slo.alpha * slo.ttft otherwise.
    latency_bound: float
    role: str
    # Seconds, the probe latency at the chosen budget.
    token_latency: float | None = None
    image_latency: float | None = None
    # Context of the decodes in the token probes (None for roles without D).
    context_len: int | None = None

    @property
    def bound_name(self) -> str:
        return "TBT" if "D" in self.role else "alpha*TTFT"

    @property
    def within_bound(self) -> bool:
        """False when even the smallest budget misses the bound: the SLO cannot be met here."""
        return all(t is None or t <= self.latency_bound for t in (self.token_latency, self.image_latency))

    def apply(self, config: SchedulerConfig) -> SchedulerConfig:
        """``config`` with the budgets this role uses replaced by the derived ones."""
        changes = {}
        if self.token_budget is not None:
            changes["token_budget"] = self.token_budget
        if self.image_budget is not None:
            changes["image_budget"] = self.image_budget
        return dataclasses.replace(config, **changes)

    def summary(self) -> str:
        parts = []
        if self.token_budget is not None:
            parts.append(f"tau_t {self.token_budget} tokens ({self.token_latency * 1e3:.1f} ms)")
        if self.image_budget is not None:
            parts.append(f"tau_e {self.image_budget} images ({self.image_latency * 1e3:.1f} ms)")
        verdict = "within" if self.within_bound else "OVER"
        origin = "measured" if self.measured else "cached"
        return f"{', '.join(parts)}; {verdict} {self.bound_name} {self.latency_bound * 1e3:.1f} ms ({origin})"


def search_budget(latency_of: Callable[[int], float], bound: float, lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with ``latency_of(n) <= bound``, for a non-decreasing
    ``latency_of``; ``lo`` when even ``lo`` is over. Each n is evaluated at most once."""
    if lo > hi:
        raise ValueError(f"empty search range [{lo}, {hi}]")
    if latency_of(lo) > bound or lo == hi:
        return lo
    # Generous SLOs end here, after two probes.
    if latency_of(hi) <= bound:
        return hi
    good, bad = lo, hi
    while bad - good > 1:
        mid = (good + bad) // 2
        if latency_of(mid) <= bound:
            good = mid
        else:
            bad = mid
    return good


def _max_probes(lo: int, hi: int) -> int:
    return 1 if lo == hi else 2 + (hi - lo - 1).bit_length()


# -- probe shapes and how far they fit ----------------------------------------------------------
@dataclass(frozen=True)
class _Space:
    """The probes of one role on one engine, and the largest that fit its pools."""

    role: str
    context_len: int
    max_decodes: int
    token_hi: int
    image_hi: int

    def language_probe(self, num_tokens: int) -> Probe:
        num_decodes = min(num_tokens, self.max_decodes)
        return Probe(num_prefill_tokens=num_tokens - num_decodes, num_decodes=num_decodes,
                     context_len=self.context_len)


def _search_space(engine, role: str, context_len: int) -> _Space:
    kv, images = engine.kv_manager, engine.image_manager
    image_hi = prefill_hi = max_decodes = 0
    if "E" in role:
        per_image = images.num_blocks_for(engine.model.num_image_tokens_per_image)
        image_hi = min(MAX_IMAGE_BUDGET, images.num_free_blocks // per_image)
        if image_hi == 0:
            raise ConfigError(f"the image cache has {images.num_free_blocks} free blocks: not one image fits")
    if "P" in role:
        prefill_hi = min(MAX_TOKEN_BUDGET, engine.max_model_len, kv.num_free_blocks * kv.block_size)
        if prefill_hi == 0:
            raise ConfigError("the KV cache has no free block")
    if "D" in role:
        # The decodes share the pool with the largest prefill chunk the search may probe, and
        # with prefill in the role the heaviest step leaves one sequence to that chunk.
        room = kv.num_free_blocks - kv.num_blocks_for(prefill_hi)
        seqs = engine.config.scheduler.max_num_seqs - ("P" in role)
        max_decodes = min(seqs, room // kv.num_blocks_for(context_len + 1))
        if max_decodes == 0 and "P" not in role:
            raise ConfigError(
                f"the KV cache has {kv.num_free_blocks} free blocks: not one decode at context {context_len} fits"
            )
    token_hi = prefill_hi if "P" in role else max_decodes
    return _Space(role, context_len, max_decodes, token_hi, image_hi)


# -- timing probes on the engine ---------------------------------------------------------------
_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


class EngineTimer:
    """Times probes with the engine's runner over blocks borrowed from its pools."""

    def __init__(self, engine, *, repeats: int = 3, seed: int = 0):
        from hydrad.models.loader import load_config

        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.engine = engine
        self.repeats = repeats
        hf_config = load_config(engine.model_path)
        self.vocab_size = hf_config.text_config.vocab_size
        self.num_image_tokens = engine.model.num_image_tokens_per_image
        side = hf_config.vision_config.image_size
        self.generator = torch.Generator().manual_seed(seed)
        # Content does not change the cost of a dense forward; one image serves every slot.
        self.pixel_values = torch.randn(3, side, side, generator=self.generator)

    def __call__(self, probe: Probe) -> float:
        used = self._num_used_blocks()
        with self._batch(probe) as (encodes, chunks):
            runner = self.engine.runner
            try:
                seconds = self._median_seconds(lambda: runner.encode(encodes) if encodes else runner.execute(chunks))
            except torch.OutOfMemoryError:
                # A batch the device cannot hold is over any bound, and so is every larger one.
                torch.cuda.empty_cache()
                seconds = math.inf
        if self._num_used_blocks() != used:
            raise AssertionError(f"probe {probe} did not return its blocks")
        return seconds

    def _num_used_blocks(self) -> tuple[int, int]:
        pools = (self.engine.kv_manager, self.engine.image_manager)
        return tuple(pool.num_used_blocks if pool is not None else 0 for pool in pools)

    def _median_seconds(self, run: Callable[[], object]) -> float:
        sync = torch.cuda.synchronize if self.engine.device.type == "cuda" else (lambda device: None)
        run()
        times = []
        for _ in range(self.repeats):
            sync(self.engine.device)
            start = time.perf_counter()
            run()
            sync(self.engine.device)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def _request(self, req_id: str, num_prompt: int, num_output: int = 0, images=()) -> Request:
        token_ids = torch.randint(self.vocab_size, (num_prompt + num_output,), generator=self.generator).tolist()
        req = Request(EngineRequest(f"probe-{req_id}", token_ids[:num_prompt], _GREEDY, images=list(images)))
        req.output_token_ids = token_ids[num_prompt:]
        return req

    @contextmanager
    def _batch(self, probe: Probe) -> Iterator[tuple[list, list]]:
        kv, image_pool = self.engine.kv_manager, self.engine.image_manager
        reqs: list[Request] = []
        encodes, chunks = [], []
        try:
            if probe.num_images:
                length = self.num_image_tokens
                images = [ImageInput(self.pixel_values, i * length, length) for i in range(probe.num_images)]
                req = self._request("encode", probe.num_images * length, images=images)
                reqs.append(req)
                for i in range(probe.num_images):
                    req.image_block_ids[i] = image_pool.allocate(image_pool.num_blocks_for(length))
                    encodes.append((req, i))
            # Decodes first, as the scheduler orders a step.
            for i in range(probe.num_decodes):
                req = self._request(f"decode-{i}", probe.context_len, num_output=1)
                reqs.append(req)
                req.num_computed_tokens = probe.context_len
                req.kv_block_ids = kv.allocate(kv.num_blocks_for(probe.context_len + 1))
                chunks.append((req, 1))
            if probe.num_prefill_tokens:
                req = self._request("prefill", probe.num_prefill_tokens)
                reqs.append(req)
                req.kv_block_ids = kv.allocate(kv.num_blocks_for(probe.num_prefill_tokens))
                chunks.append((req, probe.num_prefill_tokens))
            yield encodes, chunks
        finally:
            for req in reqs:
                if req.kv_block_ids:
                    kv.free(req.kv_block_ids)
                for block_ids in req.image_block_ids:
                    if block_ids:
                        image_pool.free(block_ids)


# -- the disk cache ---------------------------------------------------------------------------
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    # CPU latency scales with the threads the worker was given.
    return f"{device.type}:{platform.machine()}:{torch.get_num_threads()}threads"


def _cache_key(engine, slo: SLOConfig, space: _Space) -> dict:
    config_json = (Path(engine.model_path) / "config.json").read_bytes()
    return {
        "version": _CACHE_VERSION,
        "model": str(Path(engine.model_path).resolve()),
        "config_sha256": hashlib.sha256(config_json).hexdigest(),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": _device_name(engine.device),
        "role": space.role,
        "slo": {"ttft": slo.ttft, "tbt": slo.tbt, "alpha": slo.alpha},
        "kv_block_size": engine.kv_manager.block_size if engine.kv_manager else None,
        "image_block_size": engine.image_manager.block_size if engine.image_manager else None,
        # The search ranges follow from the pools and limits; a larger pool may allow larger budgets.
        "search": {"context_len": space.context_len, "max_decodes": space.max_decodes,
                   "token_hi": space.token_hi, "image_hi": space.image_hi},
    }


def cache_path(key: dict) -> Path:
    from hydrad.models.default import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "budgets" / f"{Path(key['model']).name}-{key['role']}-{digest}.json"


def _load(path: Path, key: dict) -> Budgets | None:
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            return None
        return Budgets(**data["budgets"], measured=False)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("ignoring unreadable budgets cache %s: %s", path, e)
        return None


def _store(path: Path, key: dict, budgets: Budgets) -> None:
    fields = {k: v for k, v in dataclasses.asdict(budgets).items() if k != "measured"}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Rename into place: a concurrent reader sees the old file or the new one, never half.
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            tmp = Path(f.name)
            json.dump({"key": key, "budgets": fields}, f, indent=2)
        os.replace(tmp, path)
    except OSError as e:
        # Serving goes on with the measured budgets; the next start measures again.
        logger.warning("could not write budgets cache %s: %s", path, e)
        if tmp is not None:
            tmp.unlink(missing_ok=True)


# -- derive ------------------------------------------------------------------------------------
def derive_budgets(
    engine,
    slo: SLOConfig,
    *,
    role: str,
    force: bool = False,
    latency_fn: LatencyFn | None = None,
    context_len: int | None = None,
    repeats: int = 3,
) -> Budgets:
    """The budgets of an instance with ``role`` on ``engine``'s device, from the disk cache
    unless ``force`` or absent. ``latency_fn(probe) -> seconds`` replaces measuring on the
    engine (its results are cached the same way); ``context_len`` is the decode context of the
    token probes, by default ``engine.max_model_len // 4``."""
    from hydrad.engine.core import normalize_role

    role = normalize_role(role)
    if not set(role) <= set(engine.role):
        raise ConfigError(f"a {engine.role} instance cannot run the stages of role {role}")
    if context_len is None:
        context_len = slo.decode_context_len if slo.decode_context_len is not None else engine.max_model_len // 4
    if not 0 <= context_len < engine.max_model_len:
        raise ConfigError(f"context_len must be in [0, {engine.max_model_len}), got {context_len}")
    if "D" not in role:
        # No decodes are probed: keep the cache key independent of it.
        context_len = 0
    bound = slo.tbt if "D" in role else slo.alpha * slo.ttft
    space = _search_space(engine, role, context_len)
    key = _cache_key(engine, slo, space)
    path = cache_path(key)
    if not force and (cached := _load(path, key)) is not None:
        logger.info("budgets of %s from %s: %s", role, path, cached.summary())
        return cached

    if latency_fn is None:
        if engine.has_unfinished_requests():
            raise RuntimeError("budgets are measured on an idle engine")
        latency_fn = EngineTimer(engine, repeats=repeats)
    token_budget = image_budget = token_latency = image_latency = None
    with _progress() as progress:
        if space.image_hi:
            image_budget, image_latency = _search(progress, f"{role} tau_e", "images",
                                                  lambda n: Probe(num_images=n), latency_fn, bound, 1, space.image_hi)
        if space.token_hi:
            lo = min(MIN_TOKEN_BUDGET, space.token_hi)
            token_budget, token_latency = _search(progress, f"{role} tau_t", "tokens",
                                                  space.language_probe, latency_fn, bound, lo, space.token_hi)
    budgets = Budgets(
        token_budget=token_budget,
        image_budget=image_budget,
        measured=True,
        latency_bound=bound,
        role=role,
        token_latency=token_latency,
        image_latency=image_latency,
        context_len=context_len if "D" in role else None,
    )
    if budgets.within_bound:
        _store(path, key, budgets)
        logger.info("budgets of %s: %s", role, budgets.summary())
    else:
        # Most often a machine busy with other work while measuring: never keep such a result.
        logger.warning("budgets of %s: %s; not cached, measured again at the next start", role, budgets.summary())
    return budgets


@contextmanager
def _progress():
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from hydrad.cli.common import console

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        yield progress


def _search(progress, label: str, unit: str, make_probe: Callable[[int], Probe], latency_fn: LatencyFn,
            bound: float, lo: int, hi: int) -> tuple[int, float]:
    total = _max_probes(lo, hi)
    task = progress.add_task(label, total=total)
    seen: dict[int, float] = {}

    def latency_of(n: int) -> float:
        progress.update(task, description=f"{label}: {n} {unit}")
        seen[n] = latency_fn(make_probe(n))
        progress.advance(task)
        return seen[n]

    n = search_budget(latency_of, bound, lo, hi)
    progress.update(task, completed=total, description=f"{label} = {n} {unit}")
    return n, seen[n]
