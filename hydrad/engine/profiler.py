"""Fitting an instance's latency model on its device (``hydrad.engine.latency_model``).

At worker start, a designed set of probe batches runs through the engine's own runner
(vision and language work through the same dual-stream executor as real steps, sampled
rows through the real sampler at the API's default temperature), and the model's
coefficients are fitted to their measured times by least squares on relative error. A
second, randomized set of probes that the fit never sees measures the model's error;
the result is cached on disk per model, dtype, device, thread count and the parts the
role uses, so a restart loads it in milliseconds.

A probe's time is the median of a few timed runs after a warm-up run. Probes borrow
blocks from the engine's pools and give them back; the scheduler is never involved.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from hydrad.config import SLOConfig
from hydrad.engine.inputs import EngineRequest, ImageInput
from hydrad.engine.latency_model import FitError, LatencyModel, StepShape, fit_least_squares
from hydrad.engine.request import Request
from hydrad.errors import ConfigError
from hydrad.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Bump when the probes, the features or the file layout change: older files then miss.
_CACHE_VERSION = 3
_REPEATS = 2


def latency_bound(slo: SLOConfig, role: str) -> float:
    """The step bound of a role: TBT for roles that decode (every step carries decodes),
    the share alpha of the TTFT one batch may take otherwise."""
    return slo.tbt if "D" in role else slo.alpha * slo.ttft


@dataclass(frozen=True)
class Probe:
    """One batch to time: image tokens per image, (context, tokens) per prefill chunk,
    context per decode (its cached tokens)."""

    images: tuple[int, ...] = ()
    prefills: tuple[tuple[int, int], ...] = ()
    decodes: tuple[int, ...] = ()

    def shape(self) -> StepShape:
        return StepShape.of(images=list(self.images), prefills=list(self.prefills),
                            decodes=[c + 1 for c in self.decodes])

    @property
    def has_vision(self) -> bool:
        return bool(self.images)

    @property
    def has_language(self) -> bool:
        return bool(self.prefills or self.decodes)


@dataclass(frozen=True)
class Limits:
    """How large a probe this engine can hold."""

    image_tokens: int  # tokens of one image (0: no vision part)
    max_images: int
    kv_tokens: int  # KV slots in the pool (0: no language part)
    max_model_len: int
    max_seqs: int
    block_size: int

    def kv_fits(self, probe: Probe) -> bool:
        bs = self.block_size
        need = sum(-(-(c + 1) // bs) for c in probe.decodes) + sum(-(-(c + q) // bs) for c, q in probe.prefills)
        return need * bs <= self.kv_tokens and len(probe.decodes) + len(probe.prefills) <= self.max_seqs


def design_probes(limits: Limits, seed: int = 0) -> tuple[list[Probe], list[Probe]]:
    """(probes to fit on, held-out probes to measure the error on)."""
    fit: list[Probe] = []
    check: list[Probe] = []
    rng = random.Random(seed)
    if limits.image_tokens:
        t = limits.image_tokens
        fit += [Probe(images=(t,) * n) for n in (1, 2, 4) if n <= limits.max_images]
        check += [Probe(images=(t,) * n) for n in (3,) if n <= limits.max_images]
    if limits.kv_tokens:
        top = max(32, limits.max_model_len // 4)
        mid, low = max(16, top // 3), max(8, top // 12)
        chunk = min(512, limits.max_model_len // 2)
        language = [
            Probe(decodes=(low,)),
            Probe(decodes=(low,) * 16),
            Probe(decodes=(low,) * 64),
            Probe(decodes=(top,) * 8),
            Probe(decodes=(top,) * 32),
            Probe(prefills=((0, max(8, chunk // 16)),)),
            Probe(prefills=((0, max(8, chunk // 4)),)),
            Probe(prefills=((0, chunk),)),
            Probe(prefills=((mid, max(8, chunk // 4)),)),
            Probe(prefills=((top, max(8, chunk // 2)),)),
            Probe(decodes=(mid,) * 16, prefills=((0, max(8, chunk // 2)),)),
        ]
        fit += [_shrink(p, limits) for p in language]
        for _ in range(6):
            num_decodes = rng.randint(0, 48)
            context = rng.randint(low, top)
            prefill = rng.choice((0, rng.randint(8, chunk)))
            decodes = tuple(max(1, int(context * rng.uniform(0.5, 1.5))) for _ in range(num_decodes))
            prefills = ((rng.randint(0, mid), prefill),) if prefill or not decodes else ()
            check.append(_shrink(Probe(prefills=prefills or ((0, 16),), decodes=decodes), limits))
        if limits.image_tokens:  # vision and language together: how much they overlap
            t = limits.image_tokens
            fit += [_shrink(Probe(images=(t,) * min(2, limits.max_images), decodes=(mid,) * 16), limits),
                    _shrink(Probe(images=(t,), prefills=((0, max(8, chunk // 4)),)), limits)]
            check += [_shrink(Probe(images=(t,), decodes=(low,) * 8, prefills=((0, max(8, chunk // 8)),)), limits)]
    return fit, check


def _shrink(probe: Probe, limits: Limits) -> Probe:
    """The probe, halved until the pools hold it."""
    while not limits.kv_fits(probe):
        decodes = tuple(max(1, c // 2) for c in probe.decodes[: max(1, len(probe.decodes) // 2)]) \
            if probe.decodes else ()
        prefills = tuple((c // 2, max(1, q // 2)) for c, q in probe.prefills)
        shrunk = Probe(probe.images, prefills, decodes)
        if shrunk == probe:
            raise ConfigError("the KV cache is too small to measure a single decode")
        probe = shrunk
    return probe


def fit_model(fit: list[tuple[Probe, float]], check: list[tuple[Probe, float]], meta: dict) -> LatencyModel:
    """Coefficients from timed probes; the error from the held-out ones."""
    alone = [(p, t) for p, t in fit if p.has_vision != p.has_language]
    vision = [(p.shape().vision_features(), t) for p, t in alone if p.has_vision]
    language = [(p.shape().language_features(), t) for p, t in alone if p.has_language]
    coef = {}
    if vision:
        rows = [f for f, _ in vision]
        if len({t for p, _ in alone for t in p.images}) == 1:
            # Every image has the same token count (LLaVA-1.5): the per-token terms cannot be
            # told from the per-image one, so the per-image term carries them.
            rows = [f[:2] + [0.0, 0.0] for f in rows]
        coef.update(zip(("v_fixed", "v_image", "v_token", "v_token2"),
                        fit_least_squares(rows, [t for _, t in vision])))
    if language:
        coef.update(zip(("l_fixed", "l_prefill", "l_attn", "l_decode", "l_ctx"),
                        fit_least_squares([f for f, _ in language], [t for _, t in language])))
    model = LatencyModel(**coef)
    both = [(p, t) for p, t in fit if p.has_vision and p.has_language]
    overlap = 1.0
    if both:
        shares = []
        for probe, seconds in both:
            v, lang = model.vision_seconds(probe.shape()), model.language_seconds(probe.shape())
            shares.append((seconds - max(v, lang)) / max(min(v, lang), 1e-9))
        overlap = min(2.0, max(0.0, statistics.median(shares)))
    errors = [abs(LatencyModel(**coef, overlap=overlap).step_seconds(p.shape()) - t) / t for p, t in check]
    error = FitError(statistics.median(errors), max(errors), len(errors)) if errors else None
    return LatencyModel(**coef, overlap=overlap, meta=meta, error=error)


# -- timing probes on the engine ---------------------------------------------------------------
_SAMPLED = SamplingParams(max_tokens=1, temperature=1.0)  # the API's default: sampled rows


class EngineTimer:
    """Times probes with the engine's runner over blocks borrowed from its pools."""

    def __init__(self, engine, *, repeats: int = _REPEATS, seed: int = 0):
        from hydrad.models.loader import load_config

        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.engine = engine
        self.repeats = repeats
        hf_config = load_config(engine.model_path)
        self.vocab_size = hf_config.text_config.vocab_size
        side = hf_config.vision_config.image_size
        self.generator = torch.Generator().manual_seed(seed)
        # Content does not change the cost of a dense forward; one image serves every slot.
        self.pixel_values = torch.randn(3, side, side, generator=self.generator)

    def __call__(self, probe: Probe) -> float:
        used = self._num_used_blocks()
        with self._batch(probe) as (encodes, chunks):
            runner, streams = self.engine.runner, self.engine.streams
            vision = (lambda: runner.encode(encodes)) if encodes else None
            language = (lambda: runner.execute(chunks)) if chunks else None
            try:
                seconds = self._median_seconds(lambda: streams.run(vision, language))
            except torch.OutOfMemoryError:
                # A batch the device cannot hold is over any bound.
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

    def _request(self, name: str, num_prompt: int, num_output: int = 0, images=()) -> Request:
        token_ids = torch.randint(self.vocab_size, (num_prompt + num_output,), generator=self.generator).tolist()
        req = Request(EngineRequest(f"probe-{name}", token_ids[:num_prompt], _SAMPLED, images=list(images)))
        req.set_output(token_ids[num_prompt:])
        return req

    @contextmanager
    def _batch(self, probe: Probe) -> Iterator[tuple[list, list]]:
        kv, image_pool = self.engine.kv_manager, self.engine.image_manager
        reqs: list[Request] = []
        encodes, chunks = [], []
        try:
            if probe.images:
                offset, images = 0, []
                for length in probe.images:
                    images.append(ImageInput(self.pixel_values, offset, length))
                    offset += length
                req = self._request("encode", offset, images=images)
                reqs.append(req)
                for i, length in enumerate(probe.images):
                    req.image_block_ids[i] = image_pool.allocate(image_pool.num_blocks_for(length))
                    encodes.append((req, i))
            # Decodes first, as the scheduler orders a step.
            for i, context in enumerate(probe.decodes):
                req = self._request(f"decode-{i}", context, num_output=1)
                reqs.append(req)
                req.num_computed_tokens = context
                req.kv_block_ids = kv.allocate(kv.num_blocks_for(context + 1))
                chunks.append((req, 1))
            for i, (context, tokens) in enumerate(probe.prefills):
                req = self._request(f"prefill-{i}", context + tokens)
                reqs.append(req)
                req.num_computed_tokens = context
                req.kv_block_ids = kv.allocate(kv.num_blocks_for(context + tokens))
                chunks.append((req, tokens))
            yield encodes, chunks
        finally:
            if self.engine.runner.batch is not None:
                self.engine.runner.drop(reqs)
            for req in reqs:
                if req.kv_block_ids:
                    kv.free(req.kv_block_ids)
                for block_ids in req.image_block_ids:
                    if block_ids:
                        image_pool.free(block_ids)


def engine_limits(engine) -> Limits:
    kv, images = engine.kv_manager, engine.image_manager
    image_tokens = engine.model.num_image_tokens_per_image if "E" in engine.role else 0
    max_images = images.num_free_blocks // images.num_blocks_for(image_tokens) if image_tokens else 0
    if image_tokens and max_images < 1:
        raise ConfigError(f"the image cache has {images.num_free_blocks} free blocks: not one image fits")
    has_language = "P" in engine.role or "D" in engine.role
    return Limits(
        image_tokens=image_tokens,
        max_images=min(max_images, 8),
        kv_tokens=kv.num_free_blocks * kv.block_size if has_language else 0,
        max_model_len=engine.max_model_len,
        max_seqs=max(engine.config.scheduler.max_num_seqs, 64),
        block_size=kv.block_size if kv is not None else 16,
    )


# -- the disk cache ---------------------------------------------------------------------------
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    # CPU latency scales with the threads the worker was given.
    return f"{device.type}:{platform.machine()}:{torch.get_num_threads()}threads"


def cache_key(engine, limits: Limits) -> dict:
    config_json = (Path(engine.model_path) / "config.json").read_bytes()
    return {
        "version": _CACHE_VERSION,
        "model": str(Path(engine.model_path).resolve()),
        "config_sha256": hashlib.sha256(config_json).hexdigest(),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": device_name(engine.device),
        "parts": ("vision" if limits.image_tokens else "") + ("+language" if limits.kv_tokens else ""),
        "dual_streams": engine.streams.enabled,
        "kv_block_size": limits.block_size,
        "image_tokens": limits.image_tokens,
    }


def cache_path(key: dict) -> Path:
    from hydrad.models.default import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "latency" / f"{Path(key['model']).name}-{key['parts'].strip('+')}-{digest}.json"


def load_cached(path: Path, key: dict) -> LatencyModel | None:
    try:
        model = LatencyModel.load(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("ignoring unreadable latency model %s: %s", path, e)
        return None
    return model if model.meta.get("key") == key else None


def store(path: Path, model: LatencyModel) -> None:
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Rename into place: a concurrent reader sees the old file or the new one, never half.
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            tmp = Path(f.name)
            json.dump(model.to_json(), f, indent=2)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not write latency model %s: %s", path, e)
        if tmp is not None:
            tmp.unlink(missing_ok=True)


# -- fit ---------------------------------------------------------------------------------------
def fit_latency_model(engine, *, force: bool = False, timer: Callable[[Probe], float] | None = None,
                      show_progress: bool = True) -> LatencyModel:
    """The latency model of ``engine``'s instance, from the disk cache unless ``force`` or
    absent. ``timer(probe) -> seconds`` replaces measuring on the engine."""
    limits = engine_limits(engine)
    key = cache_key(engine, limits)
    path = cache_path(key)
    if not force and timer is None and (cached := load_cached(path, key)) is not None:
        logger.info("latency model from %s: %s", path, cached.summary())
        return cached
    if timer is None:
        if engine.has_unfinished_requests():
            raise RuntimeError("the latency model is measured on an idle engine")
        timer = EngineTimer(engine)
    fit_probes, check_probes = design_probes(limits)
    start = time.monotonic()
    measured = []
    with _progress(show_progress, len(fit_probes) + len(check_probes)) as advance:
        for probe in fit_probes + check_probes:
            measured.append((probe, timer(probe)))
            advance()
    fit = measured[: len(fit_probes)]
    check = measured[len(fit_probes):]
    meta = {"key": key, "image_tokens": limits.image_tokens, "seconds": round(time.monotonic() - start, 2),
            "probes": [{"images": list(p.images), "prefills": [list(x) for x in p.prefills],
                        "decodes": list(p.decodes), "seconds": t} for p, t in measured]}
    model = fit_model(fit, check, meta)
    store(path, model)
    logger.info("latency model fitted in %.1f s: %s", time.monotonic() - start, model.summary())
    return model


@contextmanager
def _progress(show: bool, total: int) -> Iterator[Callable[[], None]]:
    if not show:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("latency model"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("probes", total=total)
        yield lambda: progress.advance(task)
