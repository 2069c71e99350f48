"""Per-stage throughput from the latency models: HydraInfer's Algorithm 2, and capacity bounds.

**Stage costs.** Under load an instance fills each step up to its role's bound (TBT on
roles that decode, alpha * TTFT otherwise). At that fill, the instance-seconds one
request costs in each stage are, from the latency model:

* encode: ``LatencyModel.image_seconds(patches, tokens, span)`` per image (per group of
  a video's frames, as the engine encodes them: ``ImageInput.groups``), plus ``v_fixed``
  shared by the images of a full step;
* prefill: ``l_prefill * n + l_attn * pairs(0, n) / 1e3`` for a prompt of ``n`` tokens,
  plus ``l_fixed`` shared by the tokens of the largest chunk that fits the bound;
* decode: ``l_decode + l_ctx * context / 1e3`` per generated token after the first, at
  its own context, plus ``l_fixed`` shared by the decodes of a full step.

**Algorithm 2** (HydraInfer §4.1, hybrid EPD disaggregation): the workload's totals per
stage divided by one instance's throughput for that stage give the time each stage
needs, ``t_E, t_P, t_D``; ``N`` instances are split in proportion (``n_s = N * t_s /
(t_E + t_P + t_D)``, largest remainders, at least one each), and the three methods
are the candidates: E+P+D ``(n_E, n_P, n_D)``, EP+D ``(round(N * (t_E + t_P) / T), rest)``,
ED+P ``(round(N * (t_E + t_D) / T), rest)``. The simulator then ranks them.

**Capacity bound of a deployment.** The router sends each stage round-robin over the
live instances holding it, and a stage the current instance holds runs in place; that
fixes the share of every stage each instance gets. Instance ``i`` is then busy
``lambda * sum_s share_s(i) * cost_s(role_i)`` of the time (its vision and language
parts overlapping as its model's ``overlap`` says), and ``lambda`` cannot exceed the
rate that makes the busiest instance busy all the time. That bound prunes the full
search and brackets each goodput bisection; it is not a result: rankings come from the
simulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hydrad.config import SchedulerConfig, SLOConfig
from hydrad.engine.latency_model import LatencyModel, latency_bound, prefill_pairs
from hydrad.models.inputs import encode_groups
from hydrad.planner.simulator import role_model
from hydrad.planner.workload import Workload

STAGES = ("E", "P", "D")


@dataclass(frozen=True)
class StageCosts:
    """Mean instance-seconds per request of each stage on an instance of one role; the
    vision part (encode) and language part (prefill, decode) separately."""

    encode: float
    prefill: float
    decode: float
    overlap: float

    def busy(self, e: float, p: float, d: float) -> float:
        """Seconds busy for shares ``e, p, d`` of a request's encode, prefill and decode."""
        vision, language = e * self.encode, p * self.prefill + d * self.decode
        if self.overlap >= 1.0:
            return vision + language
        return max(vision, language) + self.overlap * min(vision, language)


def _full_batch(budget: float, fixed: float, per_unit: float, cap: int) -> int:
    """Units of ``per_unit`` seconds in a step of ``fixed`` + units within ``budget``."""
    if per_unit <= 0:
        return max(1, cap)
    return max(1, min(cap, int((budget - fixed) / per_unit)))


def _groups(patches: int, tokens: int, span: int) -> list[tuple[int, int, int]]:
    """(patches, tokens, span) of each part an image encodes as (``encode_groups``)."""
    n = encode_groups(patches, span, tokens)
    return [(patches // n, tokens // n, span)] * n


def stage_costs(model: LatencyModel, role: str, workload: Workload, slo: SLOConfig,
                scheduler: SchedulerConfig) -> StageCosts:
    m = role_model(model, role)
    bound = latency_bound(slo, role)
    shapes = workload.shapes
    n = len(shapes)
    images = [part for s in shapes for _, tokens, patches, *span in s.images
              for part in _groups(patches, tokens, span[0] if span else 0)]
    encode = prefill = decode = 0.0
    if "E" in role and images:
        per_image = [m.image_seconds(*image) for image in images]
        mean = sum(per_image) / len(per_image)
        batch = _full_batch(bound, m.v_fixed, mean, scheduler.image_budget)
        encode = (sum(per_image) + len(images) * m.v_fixed / batch) / n
    if "P" in role:
        total_tokens = sum(s.num_prompt_tokens for s in shapes)
        chunk = _full_batch(bound, m.l_fixed, m.l_prefill, scheduler.token_budget)
        attention = sum(m.l_attn * prefill_pairs(0, s.num_prompt_tokens) / 1e3 for s in shapes)
        prefill = (m.l_prefill * total_tokens + attention + m.l_fixed * total_tokens / chunk) / n
    if "D" in role:
        tokens = sum(s.num_output_tokens - 1 for s in shapes)
        if tokens:
            # Context read by the decodes: the prompt plus the tokens generated before each.
            context = sum((s.num_output_tokens - 1) * (s.num_prompt_tokens + s.num_output_tokens / 2 + 1)
                          for s in shapes)
            per_decode = m.l_decode + m.l_ctx * context / tokens / 1e3
            batch = _full_batch(bound, m.l_fixed, per_decode, min(scheduler.max_num_seqs, scheduler.token_budget))
            decode = tokens * (per_decode + m.l_fixed / batch) / n
    return StageCosts(encode, prefill, decode, m.overlap)


def stage_shares(roles: list[str], has_images: float) -> list[tuple[float, float, float]]:
    """Per instance, the share of all requests' encode, prefill and decode it runs, under
    round-robin routing; ``has_images`` is the fraction of requests with images."""
    holders = {s: [i for i, r in enumerate(roles) if s in r] for s in STAGES}
    if not all(holders.values()):
        raise ValueError(f"deployment {roles} does not hold every stage")
    n = len(roles)
    enc, pre, dec = [0.0] * n, [0.0] * n, [0.0] * n
    for i in holders["E"]:
        enc[i] = has_images / len(holders["E"])
    # Prefill in place on an entry that holds P; else round-robin over the P holders.
    moved = sum(enc[i] for i in holders["E"] if "P" not in roles[i]) + (1.0 - has_images)
    for i in holders["P"]:
        pre[i] = (enc[i] if "E" in roles[i] else 0.0) + moved / len(holders["P"])
    moved = sum(pre[i] for i in holders["P"] if "D" not in roles[i])
    for i in holders["D"]:
        dec[i] = (pre[i] if "P" in roles[i] else 0.0) + moved / len(holders["D"])
    return list(zip(enc, pre, dec))


@dataclass(frozen=True)
class Capacity:
    rate: float  # the highest sustainable request rate (req/s), an upper bound
    bottleneck: int  # the busiest instance
    stage: str  # the stage that takes most of its time


def capacity(roles: list[str], costs: dict[str, StageCosts], has_images: float) -> Capacity:
    """The request rate at which the busiest instance of ``roles`` is busy all the time."""
    worst, worst_i = 0.0, 0
    for i, (e, p, d) in enumerate(stage_shares(roles, has_images)):
        busy = costs[roles[i]].busy(e, p, d)
        if busy > worst:
            worst, worst_i = busy, i
    c = costs[roles[worst_i]]
    e, p, d = stage_shares(roles, has_images)[worst_i]
    parts = {"encode": e * c.encode, "prefill": p * c.prefill, "decode": d * c.decode}
    return Capacity(1.0 / worst if worst > 0 else math.inf, worst_i, max(parts, key=parts.get))


# -- Algorithm 2 ----------------------------------------------------------------------------------
def stage_times(costs: dict[str, StageCosts], has_images: float) -> tuple[float, float, float]:
    """Instance-seconds per request of each stage on a single-stage instance (E, P, D):
    the workload's total of the stage over one instance's throughput for it."""
    return has_images * costs["E"].encode, costs["P"].prefill, costs["D"].decode


def apportion(total: int, weights: list[float], minimum: int = 1) -> list[int]:
    """``total`` split in proportion to ``weights``: at least ``minimum`` each, then the
    rest by largest remainders (ties to the earlier)."""
    if total < minimum * len(weights):
        raise ValueError(f"{total} instances cannot give {len(weights)} stages {minimum} each")
    whole = sum(weights)
    quotas = [total * w / whole if whole > 0 else total / len(weights) for w in weights]
    counts = [max(minimum, math.floor(q)) for q in quotas]
    while sum(counts) > total:  # the minimums pushed it over: take from the most over its quota
        j = max((k for k in range(len(counts)) if counts[k] > minimum), key=lambda k: counts[k] - quotas[k])
        counts[j] -= 1
    order = sorted(range(len(weights)), key=lambda k: (-(quotas[k] - counts[k]), k))
    for k in order[: total - sum(counts)]:
        counts[k] += 1
    return counts


def algorithm2(n: int, times: tuple[float, float, float]) -> dict[str, list[str]]:
    """HydraInfer's Algorithm 2: the candidate deployment of each method for ``n`` instances
    and stage times ``(t_E, t_P, t_D)``. Methods that need more instances than ``n`` are left out."""
    t_e, t_p, t_d = times
    out: dict[str, list[str]] = {}
    if n >= 3:
        n_e, n_p, n_d = apportion(n, [t_e, t_p, t_d])
        out["E+P+D"] = ["E"] * n_e + ["P"] * n_p + ["D"] * n_d
    if n >= 2:
        n_ep, n_d = apportion(n, [t_e + t_p, t_d])
        out["EP+D"] = ["EP"] * n_ep + ["D"] * n_d
        n_ed, n_p = apportion(n, [t_e + t_d, t_p])
        out["ED+P"] = ["ED"] * n_ed + ["P"] * n_p
    return out
