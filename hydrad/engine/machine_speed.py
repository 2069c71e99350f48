"""The machine's speed against its fitted latency model: the speed check and its history.

A fitted model (``hydrad.engine.profiler``) can be hours old when a plan is made from it,
and a CPU's speed drifts meanwhile (other tenants, the clock). ``measure_speed`` times a
few of the model's own stored probes again (one of each kind of work) and gives how many
times their fitted time they take now, overall and per kind (``Speed``); each check is
kept in a history beside the model's cache file (``record_speed``, ``recent_speeds``), and
a plan is made at the median of the recent checks, the check just taken and the fit
(``typical_speed``), and on CPU ranks by the mean goodput over all of them
(``speed_sample``). The planner replays at those speeds (``hydrad.planner.profile``);
``docs/planner.md`` says why.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hydrad.engine.latency_model import KINDS, LatencyModel, log_spread
from hydrad.engine.profiler import EngineTimer, Probe, cache_path, probe_images, probing

logger = logging.getLogger(__name__)


# The probes ``measure_speed`` times again: the longest stored one of each kind up to this.
_SPEED_PROBE_SECONDS = 0.15


def speed_probes(model: LatencyModel, image_kinds=None) -> list[tuple[Probe, float]]:
    """A few of the probes ``model`` was fitted on, with their stored seconds: of each kind
    (images only, prefills only, decodes only) the longest one up to ``_SPEED_PROBE_SECONDS``
    (the shortest when none is), among those whose images are of ``image_kinds`` (None: any)."""
    by_kind: dict[str, list[tuple[Probe, float]]] = {}
    for stored in model.meta.get("probes") or []:
        if stored.get("priced"):  # a prompt priced for its log-probabilities: not the kind's own work
            continue
        probe = Probe(images=tuple(tuple(x) for x in stored.get("images", ())),
                      prefills=tuple(tuple(x) for x in stored.get("prefills", ())),
                      decodes=tuple(stored.get("decodes", ())))
        seconds = stored.get("seconds")
        if not seconds or not math.isfinite(seconds) or seconds <= 0:
            continue
        if image_kinds is not None and any(kind not in image_kinds for kind in probe.images):
            continue
        kind = probe_kind(probe)
        if kind is not None:
            by_kind.setdefault(kind, []).append((probe, seconds))
    picked = []
    for kind in KINDS:
        found = by_kind.get(kind, [])
        within = [ps for ps in found if ps[1] <= _SPEED_PROBE_SECONDS]
        if within:  # the longest: the most signal
            picked.append(max(within, key=lambda ps: ps[1]))
        elif found:
            picked.append(min(found, key=lambda ps: ps[1]))
    return picked


@dataclass(frozen=True)
class Speed:
    """How this machine runs a latency model's probes now (``measure_speed``)."""

    factor: float = 1.0  # median of measured / fitted seconds
    # The standard deviation of log(measured / fitted), from their median absolute deviation:
    # one timing taken while another tenant held the core does not set it.
    spread: float = 0.0
    # The median per kind of probe ("images", "prefills", "decodes"; the kinds timed): kinds
    # of work slow down by different amounts (the images' convolutions and the prefills'
    # matmuls against the decodes' gathers of KV).
    parts: dict[str, float] = dataclasses.field(default_factory=dict)


def probe_kind(probe: Probe) -> str | None:
    """``"images"``, ``"prefills"`` or ``"decodes"`` for a probe of only that work, else None."""
    parts = (bool(probe.images), bool(probe.prefills), bool(probe.decodes))
    return {(True, False, False): "images", (False, True, False): "prefills",
            (False, False, True): "decodes"}.get(parts)


def measure_speed(engine, model: LatencyModel, *, timer: Callable[[Probe], float] | None = None,
                  rounds: int = 5) -> Speed:
    """How many times as long as when ``model`` was fitted this machine takes for a step now
    (above 1: slower): the median ratio of a few of the model's own probes (``speed_probes``)
    timed again ``rounds`` times on ``engine``, idle and on the threads the model was fitted
    on, over all and per kind of probe. A CPU's speed drifts (other tenants, the clock:
    15-45% on the 2-core machine this was built on, within an hour) between a cached fit and
    a plan made from it; the planner's replay runs each kind of work at the speed measured
    here, spread as the timings were (the machine's noise, and how far the model is off for
    some kinds of step more than for others). Medians and a median deviation, so that one
    timing taken while another tenant held the core (a prefill at 2.7x beside images and
    decodes at 1.5x, here) moves neither. ``Speed()`` when the model stored no probes."""
    if timer is None:
        images = probe_images(engine) if "E" in engine.role else []
        timer = EngineTimer(engine, images=images)
        kinds = set(timer.images)
    else:
        kinds = None
    probes = speed_probes(model, kinds)
    if not probes:
        return Speed()
    with probing(engine.device if isinstance(timer, EngineTimer) else None):
        timed = [(probe_kind(probe), timer(probe) / seconds) for _ in range(rounds) for probe, seconds in probes]
    ratios = [r for _, r in timed]
    parts = {kind: statistics.median(r for k, r in timed if k == kind) for kind in dict.fromkeys(k for k, _ in timed)}
    speed = Speed(statistics.median(ratios), log_spread([ratios]), parts)
    logger.info("this machine runs the latency model's probes at %.2fx their fitted time now (%s; log spread %.2f)",
                speed.factor, ", ".join(f"{k} {f:.2f}x" for k, f in parts.items()), speed.spread)
    return speed


# -- speed history ----------------------------------------------------------------------------
# A plan runs for an hour or more, and one speed check sees a few seconds of it (a slow
# minute, another tenant): on the 2-core machine this was built on, the check before a plan
# was further from the speed measured around the live runs that followed than the fitted
# model itself was (bench/replay_settings.py --at profile). So a plan takes the
# median of the recent checks (``SPEED_HISTORY`` of them, none older than
# ``SPEED_HISTORY_SECONDS``), the one just taken and the fit itself as one more at 1.0x: one
# check in a slow minute then moves the plan by half its error at most, and a machine that
# stays slower than its fit outvotes the fit within a few checks.
SPEED_HISTORY = 8
SPEED_HISTORY_SECONDS = 24 * 3600.0


def _fit_id(model: LatencyModel) -> str:
    """The fit a speed was measured against: a refit starts a new history."""
    body = json.dumps(model.to_json()["coefficients"], sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def speed_history_path(model: LatencyModel) -> Path | None:
    """Beside the model's cache file; None for a model not from the cache (no key)."""
    key = model.meta.get("key")
    return cache_path(key).with_suffix(".speeds.jsonl") if isinstance(key, dict) and "model" in key else None


def record_speed(model: LatencyModel, speed: Speed, *, now: float | None = None) -> None:
    """Append ``speed``, a check against ``model``, to its history (one JSON line each)."""
    path = speed_history_path(model)
    if path is None:
        return
    line = json.dumps({"time": time.time() if now is None else now, "fit": _fit_id(model), "factor": speed.factor,
                       "spread": speed.spread, "parts": speed.parts})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # One writer at a time (two profiles, or a profile and a ``--validate``, can share a
        # cache): a trim reads the file and renames a copy over it, and an append between the
        # two would be lost. The lock is a file of its own: the rename replaces the history's inode.
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            lines = path.read_text().splitlines() if path.exists() else []
            if len(lines) >= 4 * SPEED_HISTORY:
                # Keep the file short: rename a trimmed copy into place.
                with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
                    f.write("\n".join(lines[-SPEED_HISTORY:] + [line]) + "\n")
                os.replace(f.name, path)
            else:
                with open(path, "a") as f:
                    f.write(line + "\n")
    except OSError as e:
        logger.warning("could not record the speed check in %s: %s", path, e)


def recent_speeds(model: LatencyModel, *, count: int = SPEED_HISTORY, max_age: float = SPEED_HISTORY_SECONDS,
                  now: float | None = None) -> list[Speed]:
    """The last ``count`` checks against ``model`` no older than ``max_age`` seconds, oldest
    first; lines that do not parse, or were measured against another fit, are skipped."""
    path = speed_history_path(model)
    if path is None or count <= 0:
        return []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    now = time.time() if now is None else now
    fit = _fit_id(model)
    found = []
    for line in lines:
        try:
            entry = json.loads(line)
            if entry["fit"] != fit or not now - max_age <= float(entry["time"]) <= now:
                continue
            speed = Speed(float(entry["factor"]), float(entry["spread"]),
                          {str(k): float(v) for k, v in entry["parts"].items()})
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if math.isfinite(speed.factor) and speed.factor > 0:
            found.append(speed)
    return found[-count:]


def typical_speed(now: Speed, earlier: list[Speed]) -> Speed:
    """The speed to plan with: the median of the ``earlier`` checks, the check ``now`` and the
    fit itself (1.0x), overall and per kind that ``now`` timed; the spread is ``now``'s (how
    steps scatter around the speed, not how the speed moves)."""
    checks = [*earlier, now, Speed(1.0, 0.0, {kind: 1.0 for kind in now.parts})]
    parts = {kind: statistics.median(s.parts[kind] for s in checks if kind in s.parts) for kind in now.parts}
    return Speed(statistics.median(s.factor for s in checks), now.spread, parts)


def speed_sample(now: dict, earlier: dict) -> list[dict]:
    """The checks a plan averages its goodput over (``profile.planning_speeds``), each a
    ``Speed`` by thread count: the earlier checks of every thread count in ``earlier``
    (oldest first, each count's as ``recent_speeds`` gives them), paired newest with newest,
    as many as every count has; the check ``now``; and the fit itself at 1.0x, as in
    ``typical_speed``. A plan runs for an hour in which the machine's speed moves as much as
    it moved between these checks, and near a knee a deployment's goodput moves by several
    times as much: the mean of its goodput at each check is what that hour measures, which
    its goodput at the median speed is not."""
    counts = [len(earlier.get(n, [])) for n in now]
    paired = min(counts) if counts else 0
    checks = [{n: earlier[n][len(earlier[n]) - paired + i] for n in now} for i in range(paired)]
    fit = {n: Speed(1.0, 0.0, {kind: 1.0 for kind in speed.parts}) for n, speed in now.items()}
    return [*checks, dict(now), fit]
