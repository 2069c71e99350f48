"""Fitting an instance's latency model on its device (``hydrad.engine.latency_model``).

At worker start, a designed set of probe batches runs through the engine's own runner
(vision and language work through the same dual-stream executor as real steps, sampled
rows through the real sampler at the API's default temperature, and prompts priced as
``prompt_logprobs`` prices them), and the model's
coefficients are fitted to their measured times by least squares on relative error. A
second, randomized set of probes that the fit never sees measures the model's error;
the result is cached on disk per model, dtype, device, thread count and the parts the
role uses, so a restart loads it in milliseconds.

A probe's time is the median of a few timed runs after a warm-up run. Probes borrow
blocks from the engine's pools and give them back; the scheduler is never involved.
Probe images are synthetic pictures of a few sizes passed through the checkpoint's own
image processor, so each family's images take the shapes (tiles, patch grids) and costs
that requests' images take; sizes that come out alike are probed once.
"""

from __future__ import annotations

import dataclasses
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
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hydrad.engine.inputs import EngineRequest, ImageInput
from hydrad.engine.latency_model import (
    LANGUAGE_TERMS,
    VISION_TERMS,
    FitError,
    LatencyModel,
    StepShape,
    fit_least_squares,
    role_parts,
)
from hydrad.engine.probe_lock import ProbingElsewhere, cpu_probes
from hydrad.engine.request import Request
from hydrad.errors import ConfigError, HydradError
from hydrad.models.linear import packing_supported
from hydrad.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Bump when the probes, the features, the file layout or what a step costs change (the model
# code: 5, the CLIP tower stops at its feature layer; 6, linear layers packed for oneDNN on a
# CPU and KV blocks gathered as rows; 7, decodes gathered in groups into a kept buffer on a
# CPU; 8, CPU engines keep freed memory, engine.allocator; 9, steps of several prompts among
# the probes; 10, no overlap fitted where vision and language run one after the other; 11,
# prompts priced for their log-probabilities): older files then miss.
_CACHE_VERSION = 11
_REPEATS = 2
# Fast probes are repeated until this many seconds were timed, at most _MAX_REPEATS times.
_MIN_TIMED = 0.05
_MAX_REPEATS = 9
# The first probe's timings that tell whether the machine changed speed (``_time_probes``)
# are each the fastest of at least _MARK_RUNS runs and _MARK_TIMED seconds (at most
# _MAX_MARK_RUNS): a median of a few runs of a 14 ms probe moved by 20-90% here on a quiet
# machine and set off measuring again; the fastest of ten moved by 10-30% over a minute, and
# doubled while another process spun on one of the two cores.
_MARK_RUNS = 5
_MARK_TIMED = 0.1
_MAX_MARK_RUNS = 30
# (width, height) in pixels of the probe pictures: from a thumbnail to a large photo. The image
# processor resizes them as it resizes requests' images (LLaVA-1.5: all to one crop; LLaVA-NeXT:
# to its tile grids; Qwen2-VL: within [min_pixels, max_pixels]).
PROBE_PICTURE_SIZES = ((64, 64), (224, 168), (448, 448), (672, 336), (336, 1008), (1024, 768))
# Most images one probe encodes.
_MAX_PROBE_IMAGES = 8


class NoProbeRoom(ConfigError):
    """The pools hold no room for the probes. On an idle engine the pools are too small; on a
    busy one (a live redeploy) the requests in them hold it, and it comes back as they finish."""


@dataclass(frozen=True)
class Probe:
    """One batch to time: (patches, tokens) per image, (context, tokens) per prefill chunk,
    context per decode (its cached tokens); ``priced``: its prefills compute their prompt
    log-probabilities (each from the start of its prompt: context 0)."""

    images: tuple[tuple[int, int], ...] = ()
    prefills: tuple[tuple[int, int], ...] = ()
    decodes: tuple[int, ...] = ()
    priced: bool = False

    def __post_init__(self) -> None:
        if self.priced and any(c for c, _ in self.prefills):
            raise ValueError("a priced probe's prefills start their prompts (context 0)")

    def shape(self) -> StepShape:
        return StepShape.of(images=list(self.images), prefills=list(self.prefills),
                            decodes=[c + 1 for c in self.decodes],
                            priced=sum(q - 1 for _, q in self.prefills) if self.priced else 0)

    @property
    def has_vision(self) -> bool:
        return bool(self.images)

    @property
    def has_language(self) -> bool:
        return bool(self.prefills or self.decodes)


@dataclass(frozen=True)
class Limits:
    """How large a probe this engine can hold."""

    # (patches, tokens) of the probe images, smallest first ((): no vision part)
    images: tuple[tuple[int, int], ...]
    image_blocks: int  # free image-cache blocks
    image_block_size: int
    kv_tokens: int  # KV slots in the pool (0: no language part)
    max_model_len: int
    max_seqs: int
    block_size: int

    def kv_fits(self, probe: Probe) -> bool:
        bs = self.block_size
        need = sum(-(-(c + 1) // bs) for c in probe.decodes) + sum(-(-(c + q) // bs) for c, q in probe.prefills)
        return need * bs <= self.kv_tokens and len(probe.decodes) + len(probe.prefills) <= self.max_seqs

    def images_fit(self, probe: Probe) -> bool:
        need = sum(-(-tokens // self.image_block_size) for _, tokens in probe.images)
        return need <= self.image_blocks and len(probe.images) <= _MAX_PROBE_IMAGES


def design_probes(limits: Limits, seed: int = 0) -> tuple[list[Probe], list[Probe]]:
    """(probes to fit on, held-out probes to measure the error on)."""
    fit: list[Probe] = []
    check: list[Probe] = []
    rng = random.Random(seed)
    kinds = limits.images
    if kinds:
        smallest, largest, middle = kinds[0], kinds[-1], kinds[len(kinds) // 2]
        # One image of every size (per-patch, per-patch^2 and per-token costs), and more of the
        # smallest (the fixed cost apart from the per-image one).
        vision = [Probe(images=(k,)) for k in kinds] + [Probe(images=(smallest,) * n) for n in (2, 4)]
        fit += [p for p in (_fit_images(p, limits) for p in vision) if p.images]
        held_out = [Probe(images=(smallest,) * 3)] + ([Probe(images=(middle, largest))] if len(kinds) > 1 else [])
        check += [p for p in (_fit_images(p, limits) for p in held_out) if p.images]
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
            # Several prompts in one step, as a prefill-only instance's long steps hold: per
            # token they cost more than one chunk (the activations outgrow the caches).
            Probe(prefills=((0, max(8, chunk // 2)),) * 4),
            # Prompts priced position by position (``prompt_logprobs``: scoring requests).
            Probe(prefills=((0, max(8, chunk // 2)),), priced=True),
            Probe(prefills=((0, chunk),), priced=True),
        ]
        fit += [_shrink(p, limits) for p in language]
        check.append(_shrink(Probe(prefills=((0, max(8, chunk * 3 // 5)),) * 2), limits))
        check.append(_shrink(Probe(prefills=((0, max(8, chunk // 8)),), decodes=(low,) * 8, priced=True), limits))
        for _ in range(6):
            num_decodes = rng.randint(0, 48)
            context = rng.randint(low, top)
            prefill = rng.choice((0, rng.randint(8, chunk)))
            decodes = tuple(max(1, int(context * rng.uniform(0.5, 1.5))) for _ in range(num_decodes))
            prefills = ((rng.randint(0, mid), prefill),) if prefill or not decodes else ()
            check.append(_shrink(Probe(prefills=prefills or ((0, 16),), decodes=decodes), limits))
        if kinds:  # vision and language together: how much they overlap
            t = kinds[len(kinds) // 2]
            fit += [_shrink(_fit_images(Probe(images=(t,) * 2, decodes=(mid,) * 16), limits), limits),
                    _shrink(Probe(images=(t,), prefills=((0, max(8, chunk // 4)),)), limits)]
            check += [_shrink(Probe(images=(t,), decodes=(low,) * 8, prefills=((0, max(8, chunk // 8)),)), limits)]
    return fit, check


def _fit_images(probe: Probe, limits: Limits) -> Probe:
    """The probe with its last images dropped until the image cache holds them."""
    while probe.images and not limits.images_fit(probe):
        probe = Probe(probe.images[:-1], probe.prefills, probe.decodes)
    return probe


def _shrink(probe: Probe, limits: Limits) -> Probe:
    """The probe, halved until the pools hold it."""
    while not limits.kv_fits(probe):
        decodes = tuple(max(1, c // 2) for c in probe.decodes[: max(1, len(probe.decodes) // 2)]) \
            if probe.decodes else ()
        prefills = tuple((c // 2, max(1, q // 2)) for c, q in probe.prefills)
        shrunk = Probe(probe.images, prefills, decodes)
        if shrunk == probe:
            raise NoProbeRoom("the KV cache is too small to measure a single decode")
        probe = shrunk
    return probe


def fit_model(fit: list[tuple[Probe, float]], check: list[tuple[Probe, float]], meta: dict) -> LatencyModel:
    """Coefficients from timed probes; the error from the held-out ones.

    ``overlap`` is fitted only where the two parts ran at once (``meta["key"]["dual_streams"]``,
    true when absent). One after the other on one thread, a step takes its vision part and then
    its language part: the overlap is 1, and the probes of both parts are held out too.
    Fitted there from two such probes, it absorbed their parts' errors and came out anywhere
    from 0 to 2 on one machine: at 1.8 a step that encodes an image had its language
    work cut by nearly twice its vision time; at 0 its vision time was not counted at all."""
    concurrent = meta.get("key", {}).get("dual_streams", True)
    alone = [(p, t) for p, t in fit if p.has_vision != p.has_language]
    vision = [(p.shape().vision_features(), t) for p, t in alone if p.has_vision]
    language = [(p.shape().language_features(), t) for p, t in alone if p.has_language]
    coef = {}
    if vision:
        # Terms the probes cannot tell from earlier ones are left to those: with one image size
        # (LLaVA-1.5) the per-image term carries every per-patch and per-token cost; where tokens
        # are a fixed share of patches (Qwen2-VL: 4 patches a token) the per-patch term carries both.
        rows = [f for f, _ in vision]
        keep = _independent_columns(rows)
        rows = [[x if j in keep else 0.0 for j, x in enumerate(row)] for row in rows]
        coef.update(zip(VISION_TERMS, fit_least_squares(rows, [t for _, t in vision])))
    if language:
        coef.update(zip(LANGUAGE_TERMS, fit_least_squares([f for f, _ in language], [t for _, t in language])))
    model = LatencyModel(**coef)
    both = [(p, t) for p, t in fit if p.has_vision and p.has_language]
    overlap = 1.0
    if not concurrent:
        check = [*check, *both]
    elif both:
        shares = []
        for probe, seconds in both:
            v, lang = model.vision_seconds(probe.shape()), model.language_seconds(probe.shape())
            shares.append((seconds - max(v, lang)) / max(min(v, lang), 1e-9))
        overlap = min(2.0, max(0.0, statistics.median(shares)))
    errors = [abs(LatencyModel(**coef, overlap=overlap).step_seconds(p.shape()) - t) / t for p, t in check]
    error = FitError(statistics.median(errors), max(errors), len(errors)) if errors else None
    return LatencyModel(**coef, overlap=overlap, meta=meta, error=error)


def _independent_columns(rows: list[list[float]]) -> set[int]:
    """Indices of the columns that, taken in order, each add to the rank of the columns before."""
    x = np.asarray(rows, dtype=np.float64)
    x = x / np.maximum(np.abs(x).max(axis=0), 1e-300)  # rank on a common scale
    keep: list[int] = []
    for j in range(x.shape[1]):
        if np.linalg.matrix_rank(x[:, keep + [j]], tol=1e-9) > len(keep):
            keep.append(j)
    return set(keep)


# -- timing probes on the engine ---------------------------------------------------------------
_SAMPLED = SamplingParams(max_tokens=1, temperature=1.0)  # the API's default: sampled rows
# A scoring request's: its prompt priced, the most likely token beside each (as `echo` with
# `logprobs` 1 asks).
_PRICED = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=1)


class EngineTimer:
    """Times probes with the engine's runner over blocks borrowed from its pools."""

    def __init__(self, engine, *, images: list[ImageInput] | None = None, repeats: int = _REPEATS, seed: int = 0):
        """``images``: the probe images (``probe_images``; made here when the role encodes and
        none are given)."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.engine = engine
        self.repeats = repeats
        self.vocab_size = engine.hf_config.text_config.vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        if images is None:
            images = probe_images(engine) if "E" in engine.role else []
        # Content does not change the cost of a dense forward: one image per (patches, tokens).
        self.images = {(image.num_patches, image.length): image for image in images}

    def __call__(self, probe: Probe) -> float:
        """The probe's median time over a warm-up run and ``repeats`` or more timed ones."""
        return self._time(probe, self._median_seconds)

    def once(self, probe: Probe) -> float:
        """One run's time, on blocks borrowed for it alone (``_ProbeTurns`` times each run
        of a probe apart, between a busy instance's steps)."""
        return self._time(probe, self._seconds)

    def fastest(self, probe: Probe) -> float:
        """The probe's fastest time over a warm-up run and several timed ones (``more``'s
        ``mark``): how fast the machine runs it now, which a slow run or two do not move."""
        return self._time(probe, self._least_seconds)

    def more(self, times: list[float], mark: bool = False) -> bool:
        """Whether a probe timed ``times`` (after its warm-up) wants another run: at least
        ``repeats``, and a fast one more often (up to ``_MAX_REPEATS``, until ``_MIN_TIMED``
        seconds were timed), so that one run slowed by the machine cannot move a millisecond
        probe's median. ``mark``: timed for its fastest run (``fastest``), at least
        ``_MARK_RUNS`` and ``_MARK_TIMED`` seconds (at most ``_MAX_MARK_RUNS`` runs)."""
        if mark:
            return len(times) < _MARK_RUNS or (sum(times) < _MARK_TIMED and len(times) < _MAX_MARK_RUNS)
        return len(times) < self.repeats or (sum(times) < _MIN_TIMED and len(times) < _MAX_REPEATS)

    def _time(self, probe: Probe, how: Callable[[Callable[[], object]], float]) -> float:
        used = self._num_used_blocks()
        with self._batch(probe) as (encodes, chunks):
            runner, streams = self.engine.runner, self.engine.streams
            vision = (lambda: runner.encode(encodes)) if encodes else None
            language = (lambda: self._execute(chunks, probe.priced)) if chunks else None
            try:
                seconds = how(lambda: streams.run(vision, language))
            except torch.OutOfMemoryError:
                # A batch the device cannot hold is over any bound.
                torch.cuda.empty_cache()
                seconds = math.inf
        if self._num_used_blocks() != used:
            raise AssertionError(f"probe {probe} did not return its blocks")
        return seconds

    def _execute(self, chunks: list, priced: bool) -> None:
        if priced:  # each run prices the prompts again, from their start
            for req, _ in chunks:
                if req.prompt_logprobs is not None:
                    req.prompt_logprobs.clear()
        self.engine.runner.execute(chunks)

    def _num_used_blocks(self) -> tuple[int, int]:
        pools = (self.engine.kv_manager, self.engine.image_manager)
        return tuple(pool.num_used_blocks if pool is not None else 0 for pool in pools)

    def _median_seconds(self, run: Callable[[], object]) -> float:
        return statistics.median(self._timed_runs(run))

    def _least_seconds(self, run: Callable[[], object]) -> float:
        return min(self._timed_runs(run, mark=True))

    def _timed_runs(self, run: Callable[[], object], mark: bool = False) -> list[float]:
        """The times of ``run`` after a warm-up run, as many as ``more`` wants."""
        run()
        times: list[float] = []
        while self.more(times, mark):
            times.append(self._seconds(run))
        return times

    def _seconds(self, run: Callable[[], object]) -> float:
        sync = torch.cuda.synchronize if self.engine.device.type == "cuda" else (lambda device: None)
        sync(self.engine.device)
        start = time.perf_counter()
        run()
        sync(self.engine.device)
        return time.perf_counter() - start

    def _request(self, name: str, num_prompt: int, num_output: int = 0, images=(), priced: bool = False) -> Request:
        token_ids = torch.randint(self.vocab_size, (num_prompt + num_output,), generator=self.generator).tolist()
        req = Request(EngineRequest(f"probe-{name}", token_ids[:num_prompt], _PRICED if priced else _SAMPLED,
                                    images=list(images)))
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
                for kind in probe.images:
                    images.append(dataclasses.replace(self.images[kind], offset=offset))
                    offset += images[-1].length
                req = self._request("encode", offset, images=images)
                reqs.append(req)
                for i, image in enumerate(images):
                    req.image_block_ids[i] = image_pool.allocate(image_pool.num_blocks_for(image.length))
                    encodes.append((req, i))
            # Decodes first, as the scheduler orders a step.
            for i, context in enumerate(probe.decodes):
                req = self._request(f"decode-{i}", context, num_output=1)
                reqs.append(req)
                req.num_computed_tokens = context
                req.kv_block_ids = kv.allocate(kv.num_blocks_for(context + 1))
                chunks.append((req, 1))
            for i, (context, tokens) in enumerate(probe.prefills):
                req = self._request(f"prefill-{i}", context + tokens, priced=probe.priced)
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


def probe_images(engine, sizes: tuple[tuple[int, int], ...] = PROBE_PICTURE_SIZES) -> list[ImageInput]:
    """The probe images of ``engine``'s model: pictures of ``sizes`` (width, height) through the
    checkpoint's image processor and the family's ``image_inputs``, one per distinct
    (patches, tokens), smallest first."""
    from PIL import Image

    from hydrad.models.hf_processor import load_hf_processor

    hf_config = engine.hf_config
    image_processor = load_hf_processor(engine.model_path, hf_config.model_type).image_processor
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
                for width, height in sizes]
    kinds: dict[tuple[int, int], ImageInput] = {}
    for image in type(engine.model).image_inputs(hf_config, image_processor(images=pictures, return_tensors="pt")):
        image.offset = 0
        kinds.setdefault((image.num_patches, image.length), image)
    return [kinds[kind] for kind in sorted(kinds)]


def engine_limits(engine, images: list[ImageInput] = (), *, idle: bool = False) -> Limits:
    """How large a probe ``engine`` holds now (``idle``: with nothing in its pools);
    ``images``: its probe images (those that do not fit the image cache are left out)."""
    kv, image_pool = engine.kv_manager, engine.image_manager
    room = (lambda pool: pool.num_blocks) if idle else (lambda pool: pool.num_free_blocks)
    kinds = ()
    has_language = "P" in engine.role or "D" in engine.role
    if "E" in engine.role:
        kinds = tuple(sorted({(image.num_patches, image.length) for image in images
                              if image_pool.num_blocks_for(image.length) <= room(image_pool)}))
        if not kinds:
            raise NoProbeRoom(f"the image cache has {room(image_pool)} free blocks: not one image fits")
    if has_language and room(kv) == 0:
        raise NoProbeRoom("the KV cache has no free block: not one decode fits")
    return Limits(
        images=kinds,
        image_blocks=room(image_pool) if image_pool is not None else 0,
        image_block_size=image_pool.block_size if image_pool is not None else 1,
        kv_tokens=room(kv) * kv.block_size if has_language else 0,
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


def cache_key(engine, parts: str | None = None) -> dict:
    """What the measured model depends on: the checkpoint (and its image processor, which shapes
    the probe images), dtype, device, the parts the role uses (``parts``: others), how they run."""
    model_path = Path(engine.model_path)
    image_processor = model_path / "preprocessor_config.json"
    return {
        "version": _CACHE_VERSION,
        "model": str(model_path.resolve()),
        "config_sha256": hashlib.sha256((model_path / "config.json").read_bytes()).hexdigest(),
        "image_processor_sha256": hashlib.sha256(image_processor.read_bytes()).hexdigest()
        if image_processor.is_file() else None,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": device_name(engine.device),
        "parts": (parts or role_parts(engine.role)).strip("+"),
        "dual_streams": engine.streams.enabled,
        "packed_linear": packing_supported(engine.device, engine.dtype),
        "kv_block_size": engine.kv_manager.block_size if engine.kv_manager is not None else 16,
        "attention_backend": engine.attention_backend,
    }


def cache_path(key: dict) -> Path:
    from hydrad.paths import cache_dir

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


# -- copy bandwidth ----------------------------------------------------------------------------
def measure_bandwidth(engine, *, repeats: int = 5) -> float:
    """Bytes per second of the runner's block copy (``copy_in``, as a pull runs it), between
    blocks of the engine's own KV pool; cached on disk per machine, threads, device and
    block size."""
    from hydrad.paths import cache_dir

    pool = engine.runner.kv_cache
    block_bytes = engine.geometry().kv_block_bytes
    key = {"machine": platform.machine(), "processor": platform.processor(), "threads": torch.get_num_threads(),
           "device": str(engine.device), "block_bytes": block_bytes}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / "bandwidth" / f"bandwidth-{digest}.json"
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return float(cached["bytes_per_second"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    engine.runner.backing.wait()  # nothing backing pages beside the copies timed
    num_blocks = pool.shape[2]
    count = max(1, min(64, num_blocks // 2))
    src, dst = list(range(count)), list(range(num_blocks - count, num_blocks))
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        engine.runner.copy_in("kv", pool, src, dst)
        times.append(time.perf_counter() - start)
    bandwidth = count * block_bytes / max(statistics.median(times[1:]), 1e-9)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "bytes_per_second": bandwidth}))
    except OSError as e:
        logger.warning("could not cache the copy bandwidth in %s: %s", path, e)
    return bandwidth


# -- fit ---------------------------------------------------------------------------------------
def fit_latency_model(engine, *, force: bool = False, timer: Callable[[Probe], float] | None = None,
                      show_progress: bool = True, allow_busy: bool = False, block: bool = True,
                      once: bool = False) -> LatencyModel:
    """The latency model of ``engine``'s instance, from the disk cache unless ``force`` or
    absent. ``timer(probe) -> seconds`` replaces measuring on the engine. ``block``: wait
    while another worker probes on these cores (else ``ProbingElsewhere``). ``once``: the
    probes run once; where the machine's speed moved meanwhile the model is returned
    uncached (``unsteady``) for the caller to measure again (a starting worker: between its
    steps, once it serves), instead of running them again at once."""
    key = cache_key(engine)
    path = cache_path(key)
    if not force and timer is None and (known := _known(engine, key, path)) is not None:
        return known
    with probing(engine.device if timer is None else None, block=block):
        # Another worker may have measured it while this one waited.
        if not force and timer is None and (known := _known(engine, key, path)) is not None:
            return known
        return _measure(engine, key, path, timer, show_progress, allow_busy, once)


# What a probe of a measurement in steps waits for: room in the pools (``NoProbeRoom``), or
# the end of another worker's probes on these cores (``ProbingElsewhere``); None: a probe ran.
Wait = HydradError | None


def measuring_latency_model(engine, *, timer: Callable[[Probe], float] | None = None,
                            cache: bool | Callable[[], bool] = True) -> Generator[Wait, None, LatencyModel]:
    """``fit_latency_model`` a run of a probe at a time, for a busy instance that serves
    between them (a live redeploy): its streams then wait for the runs between two steps, not
    for the whole measurement. Yields after each run (None) or with what the next one waits
    for: room in the pools that its requests hold (``NoProbeRoom``; the pools may also lack
    room for the design itself), or the end of another worker's probes
    (``ProbingElsewhere``); returns the model (stored in the cache where ``cache`` (or what
    it returns at the end, where a function), the probes were not cut down and the machine
    held still; where another worker stored it meanwhile, that one). Each run takes its
    cores (``probing``) for itself alone, so no call blocks. The caller sets the thread
    count the model is for before each step."""
    key = cache_key(engine)
    path = cache_path(key)
    # (The cache is written by renames: read without the lock. A model another worker is
    # measuring now is looked for again once its probes let this one's run.)
    if timer is None and (known := _known(engine, key, path)) is not None:
        return known
    try:
        return (yield from _measuring(engine, key, path if cache is not False else None, timer,
                                      show_progress=False, allow_busy=True, sliced=True,
                                      keep=cache if callable(cache) else None))
    except _MeasuredElsewhere as e:
        logger.info("latency model from %s, measured meanwhile by another worker: %s", path, e.model.summary())
        return e.model


class _MeasuredElsewhere(Exception):
    """Another worker stored the model being measured (``_ProbeTurns``)."""

    def __init__(self, model: LatencyModel):
        super().__init__()
        self.model = model


def drain(steps: Generator[Wait, None, object]) -> object:
    """What a measurement in steps returns, run to its end at once (one that waits raises
    what it waits for)."""
    try:
        while True:
            waits = next(steps)
            if waits is not None:
                steps.close()
                raise waits
    except StopIteration as stop:
        return stop.value


def known_latency_model(engine) -> LatencyModel | None:
    """The model of ``engine``'s instance at torch's thread count from the cache (or derived
    from one of more parts), without measuring: None where there is none."""
    key = cache_key(engine)
    return _known(engine, key, cache_path(key))


def _known(engine, key: dict, path: Path) -> LatencyModel | None:
    """The model of ``key`` from the cache, or derived from one of more parts."""
    if (cached := load_cached(path, key)) is not None:
        logger.info("latency model from %s: %s", path, cached.summary())
        return cached
    if (derived := derive_from_known(engine, key)) is not None:
        store(path, derived)
        logger.info("latency model of the %s part from the %s model: %s", key["parts"],
                    derived.meta["derived_from"], derived.summary())
        return derived
    return None


@contextmanager
def probing(device: torch.device | None, block: bool = True) -> Iterator[None]:
    """Probes on a CPU hold a core for each of torch's threads (``probe_lock``): probes on
    the same cores would otherwise time each other, not themselves. ``block``: wait for the
    cores, else raise ``ProbingElsewhere`` where too few are free."""
    if device is None or device.type != "cpu":
        yield
        return
    with cpu_probes(block, torch.get_num_threads()):
        yield


def _measure(engine, key: dict, path: Path, timer: Callable[[Probe], float] | None, show_progress: bool,
             allow_busy: bool, once: bool = False) -> LatencyModel:
    return drain(_measuring(engine, key, path, timer, show_progress, allow_busy, sliced=False, once=once))


def unsteady(model: LatencyModel) -> bool:
    """Whether ``model`` was fitted, and not cached, while the machine's speed moved by more
    than the probes allow (``fit_latency_model(once=True)``, measurements between steps)."""
    return bool(model.meta.get("unsteady"))


def _measuring(engine, key: dict, path: Path | None, timer: Callable[[Probe], float] | None, show_progress: bool,
               allow_busy: bool, sliced: bool, keep: Callable[[], bool] | None = None, once: bool = False
               ) -> Generator[Wait, None, LatencyModel]:
    """Design the probes, time them, fit and cache the model (at ``path``, where given and
    ``keep()``, where given, says so at the end).
    ``sliced``: a run at a time, each once the pools hold it and no other worker probes
    (yielding as ``measuring_latency_model`` says); else all at once (never yielding; the
    caller holds the probe lock)."""
    engine.runner.backing.wait()  # nothing backing pages beside the probes timed
    images = probe_images(engine) if "E" in engine.role else []
    while True:
        try:
            limits = engine_limits(engine, images)
        except NoProbeRoom as e:
            if not sliced:
                raise
            yield e
            continue
        break
    if timer is None:
        # Probes run between steps with blocks borrowed from the pools: on a busy instance
        # (a live redeploy) they only delay its next step, but at start it must be idle.
        if engine.has_unfinished_requests() and not allow_busy:
            raise RuntimeError("the latency model is measured on an idle engine")
        timer = EngineTimer(engine, images=images)
    fit_probes, check_probes = design_probes(limits)
    # On a busy instance the requests hold part of the pools: probes cut down to the rest fit
    # a model that extrapolates further. It serves until the next start, which measures anew.
    cut = engine.has_unfinished_requests() and design_probes(engine_limits(engine, images, idle=True)) != (
        fit_probes, check_probes)
    if sliced:
        timer = _ProbeTurns(engine, images, timer, key, path)
    start = time.monotonic()
    best: tuple[float, list] | None = None
    # Between a busy machine's steps the speed moves with what the other workers run: a
    # second run would not hold stiller, and each one pauses the streams again.
    # A starting worker measures again between its steps (``once``): it serves meanwhile.
    attempts = 1 if sliced or once else _MAX_ATTEMPTS
    for attempt in range(1, attempts + 1):
        measured, marks = yield from _time_probes(fit_probes + check_probes, timer, show_progress)
        drift = _drift(marks)
        if best is None or drift < best[0]:
            best = (drift, measured)
        if drift <= _MAX_DRIFT:
            break
        logger.warning("the machine's speed changed by %.0f%% while the latency model's probes ran (the first "
                       "probe took %s ms before, halfway and after; another process on these cores?): %s",
                       (drift - 1) * 100, ", ".join(f"{m * 1000:.3g}" for m in marks),
                       "measuring again" if attempt < attempts else
                       f"keeping the steadiest of {attempt} runs ({(best[0] - 1) * 100:.0f}%)" if attempt > 1 else
                       "keeping it until it is measured again between steps" if once else "keeping it")
    drift, measured = best
    fit = measured[: len(fit_probes)]
    check = measured[len(fit_probes):]
    meta = {"key": key, "images": [list(kind) for kind in limits.images],
            "seconds": round(time.monotonic() - start, 2), "drift": round(drift, 3), "attempts": attempt,
            "probes": [{"images": [list(x) for x in p.images], "prefills": [list(x) for x in p.prefills],
                        "decodes": list(p.decodes), **({"priced": True} if p.priced else {}), "seconds": t}
                       for p, t in measured]}
    if sliced:
        meta["probe_seconds"] = round(timer.seconds, 2)
    # Between a busy instance's steps, a machine that never held still: the next start's
    # probes on idle cores are a better model to keep (a starting worker's: its next
    # measurement, between its steps).
    moved = (sliced or once) and drift > _MAX_DRIFT
    if moved:
        meta["unsteady"] = True
    model = fit_model(fit, check, meta)
    how = f" between steps ({timer.seconds:.1f} s of probes)" if sliced else ""
    kept = path is not None and (keep is None or keep())
    if cut or moved or not kept:
        why = (" on probes cut down to the room the requests in flight leave" if cut else
               " on a machine whose speed kept changing" if moved else
               " while other instances had work on its cores" if path is not None else "")
        logger.info("latency model fitted in %.1f s%s%s (not cached): %s", time.monotonic() - start, how, why,
                    model.summary())
        return model
    store(path, model)
    logger.info("latency model fitted in %.1f s%s: %s", time.monotonic() - start, how, model.summary())
    return model


class _ProbeTurns:
    """A timer for probes between a busy instance's steps: ``turn(probe)`` times ``probe``,
    each run once the pools hold it and the cores' probe lock is free, yielding what it
    waits for meanwhile and None after each run."""

    def __init__(self, engine, images: list[ImageInput], timer: Callable[[Probe], float], key: dict,
                 path: Path | None):
        self.engine, self.images, self.timer = engine, images, timer
        self.device = engine.device if isinstance(timer, EngineTimer) else None
        self.key, self.path = key, path
        self.seconds = 0.0  # spent timing probes
        self.waited = False  # for another worker's probes since the last look in the cache

    def turn(self, probe: Probe, mark: bool = False) -> Generator[Wait, None, float]:
        """The probe's median time; ``mark``: its fastest (``EngineTimer.fastest``)."""
        if not isinstance(self.timer, EngineTimer):
            return (yield from self._run(probe, lambda: self.timer(probe)))
        # Each run apart (its warm-up too), on blocks borrowed for it alone: the longest probes
        # (several prompts a step) pause the streams for one run, not three.
        yield from self._run(probe, lambda: self.timer.once(probe))
        times: list[float] = []
        while self.timer.more(times, mark):
            times.append((yield from self._run(probe, lambda: self.timer.once(probe))))
        return min(times) if mark else statistics.median(times)

    def _run(self, probe: Probe, run: Callable[[], float]) -> Generator[Wait, None, float]:
        """``run()``'s time, once the pools hold ``probe`` and the probe lock is free."""
        while True:
            waits = self._room_for(probe)
            if waits is None:
                try:
                    with probing(self.device, block=False):
                        if self.waited and self.path is not None:
                            # The other worker may have been measuring this very model.
                            self.waited = False
                            if (known := load_cached(self.path, self.key)) is not None:
                                raise _MeasuredElsewhere(known)
                        start = time.monotonic()
                        seconds = run()
                        self.seconds += time.monotonic() - start
                except ProbingElsewhere as e:
                    waits, self.waited = e, True
                else:
                    yield None
                    return seconds
            yield waits

    def _room_for(self, probe: Probe) -> NoProbeRoom | None:
        try:
            limits = engine_limits(self.engine, self.images)
        except NoProbeRoom as e:
            return e
        if limits.kv_fits(probe) and limits.images_fit(probe):
            return None
        return NoProbeRoom("the requests in flight hold the blocks the next probe needs")


# The first probe is timed again halfway and at the end: a run of probes in which its times
# differ by more than this factor (the machine slowed down or sped up meanwhile: another
# process on the cores, the host's neighbours) is measured again, up to _MAX_ATTEMPTS times
# in all. A fit is cached for every later start: one made while the machine ran at half
# speed for a second would mislead every step after it. (On the tiny model, probes of a few
# milliseconds, one such run gave a held-out error of 52%; steady runs 6-20%.) Not less:
# this 2-core virtual machine, quiet, moves by up to 30-37% within a fit's ten seconds (the
# first probe's fastest runs), as much as it moves within the hour its fits are used in;
# another process spinning on one of the cores doubles the times.
_MAX_DRIFT = 1.5
_MAX_ATTEMPTS = 3


def _time_probes(probes: list[Probe], timer: Callable[[Probe], float] | _ProbeTurns,
                 show_progress: bool) -> Generator[Wait, None, tuple[list[tuple[Probe, float]], list[float]]]:
    """Each probe's time, and three timings of the first probe (before, halfway, after; each
    its fastest run, where the timer is the engine's) that tell how far the machine's speed
    moved meanwhile (``_drift``). A ``_ProbeTurns`` timer yields between probes."""
    def timed(probe: Probe, mark: bool = False) -> Generator[Wait, None, float]:
        if isinstance(timer, _ProbeTurns):
            return (yield from timer.turn(probe, mark))
        if mark and isinstance(timer, EngineTimer):
            return timer.fastest(probe)
        return timer(probe)

    sentinel, half = probes[0], len(probes) // 2
    marks = [(yield from timed(sentinel, mark=True))]
    measured = []
    with _progress(show_progress, len(probes)) as advance:
        for i, probe in enumerate(probes):
            if i == half:
                marks.append((yield from timed(sentinel, mark=True)))
            measured.append((probe, (yield from timed(probe))))
            advance()
    marks.append((yield from timed(sentinel, mark=True)))
    return measured, marks


def _drift(marks: list[float]) -> float:
    """How far the machine's speed moved: the largest ratio between the timings."""
    finite = [m for m in marks if 0 < m < math.inf]
    return max(finite) / min(finite) if len(finite) == len(marks) else 1.0


def derive(model: LatencyModel, key: dict) -> LatencyModel:
    """The model of ``key``'s parts taken from a model of more parts. Vision and language
    coefficients are fitted from separate probes (``fit_model``), so each part's stand alone;
    only the overlap of the two needs both."""
    parts = key["parts"].split("+")
    terms = (VISION_TERMS if "vision" in parts else ()) + (LANGUAGE_TERMS if "language" in parts else ())
    meta = {**model.meta, "key": key, "derived_from": model.meta["key"]["parts"]}
    return LatencyModel(**{name: getattr(model, name) for name in terms}, meta=meta)


def derive_from_known(engine, key: dict) -> LatencyModel | None:
    """``key``'s model from one this engine holds or the cache has for more parts, so a role
    change (EPD -> D -> PD) or a restart in a new role measures nothing it measured before."""
    wanted = set(key["parts"].split("+"))

    def covers(model: LatencyModel | None) -> bool:
        other = (model.meta.get("key") or {}) if model is not None else {}
        same = {k: v for k, v in other.items() if k != "parts"} == {k: v for k, v in key.items() if k != "parts"}
        return same and wanted < set(str(other.get("parts", "")).split("+"))

    held = engine.scheduler.latency_model
    if covers(held):
        return derive(held, key)
    full = cache_key(engine, "vision+language")
    cached = load_cached(cache_path(full), full)
    return derive(cached, key) if covers(cached) else None


@contextmanager
def _progress(show: bool, total: int) -> Iterator[Callable[[], None]]:
    if not show:
        yield lambda: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from hydrad.console import console

    if not console.is_terminal:  # a pipe, a file, the journal: a log line says what runs
        logger.info("fitting the latency model: %d probe batches", total)
        yield lambda: None
        return
    with Progress(TextColumn("latency model"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("probes", total=total)
        yield lambda: progress.advance(task)
