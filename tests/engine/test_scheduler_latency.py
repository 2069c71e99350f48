"""Algorithm 1 made context-aware: steps filled by a synthetic latency model up to the bound.

The scheduler never builds a step predicted over its bound, except one minimal unit of
progress when nothing fits; it fills steps up to the bound (the next unit would not
fit); long decode contexts take more of the bound than short ones; and every earlier
guarantee (integrity after every step, preemption, abort) holds with the model on.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from hydrad.engine.latency_model import LatencyModel, StepShape, prefill_pairs
from hydrad.engine.request import Request, RequestStatus
from hydrad.engine.scheduler import (
    HANDOFF_SHARE, HANDOFF_WINDOW, OVERRUN_FACTOR, OVERRUN_STEPS, Scheduler, gaps_past_p90,
)
from test_scheduler import finish_step, make_request, make_scheduler, schedule_pulling

# Seconds: 2 ms per step, 0.1 ms per prefill token, 0.2 ms per decode, 0.05 ms per 1k KV
# tokens a decode reads, attention 0.02 ms per 1k query-key pairs; 5 ms per image.
MODEL = LatencyModel(v_fixed=0.001, v_image=0.004, v_token=0.0, l_fixed=0.002, l_prefill=1e-4, l_attn=2e-5,
                     l_decode=2e-4, l_ctx=5e-5, overlap=1.0)


def scheduler_with(model=MODEL, bound=0.05, idle_bound=None, **kwargs) -> Scheduler:
    kwargs.setdefault("token_budget", 100_000)
    kwargs.setdefault("image_budget", 100)
    kwargs.setdefault("num_kv_blocks", 4096)
    s = make_scheduler(**kwargs)
    s.set_latency_model(model, bound, idle_bound)
    return s


def is_decode(req, s: Scheduler) -> bool:
    """Scheduled as a decode (a recomputed request's last prompt chunk is a prefill)."""
    return req.req_id in s.decoding


def shape_of(out, s: Scheduler) -> StepShape:
    images = [(req.images[i].num_patches, req.images[i].length, req.images[i].attention_span) for req, i in out.encodes]
    decodes, prefills, priced = [], [], 0
    for req, n in out.chunks:
        if is_decode(req, s):
            decodes.append(req.num_computed_tokens + 1)
        else:
            prefills.append((req.num_computed_tokens, n))
            priced += n if req.prompt_logprobs is not None else 0
    return StepShape.of(images=images, prefills=prefills, decodes=decodes, priced=priced)


def bound_of(out, s: Scheduler) -> float:
    """A step with a decode keeps to the bound, unless it runs on its streams' slack
    (``tbt_slack``); one without may take the idle bound."""
    return s.latency_bound if any(is_decode(r, s) for r, n in out.chunks) and not out.slack else s.idle_bound


def is_minimal(out, s: Scheduler) -> bool:
    """One unit of work: one decode, one image, or one chunk of at most min_chunk tokens."""
    units = len(out.encodes) + len(out.chunks)
    return units == 1 and (not out.chunks or out.chunks[0][1] <= s.min_chunk)


def step(s: Scheduler, token: int = 7, clock=None):
    """One step, checked; ``clock`` (a ``Clock``): moved by the step's prediction before its
    tokens are sampled."""
    out = s.schedule()
    s.check_integrity()
    if out.slack:
        # Past the TBT bound only with every stream in it able to take one more long gap
        # within its p90, as if it ended after this step.
        assert out.num_decodes and all(r.num_long_gaps < gaps_past_p90(r.num_output_tokens)
                                       for r, _ in out.chunks[:out.num_decodes])
    predicted = s.latency_model.step_seconds(shape_of(out, s))
    assert predicted == pytest.approx(s.latency_model.combine(out.predicted_vision, out.predicted_language))
    if out.overrun:
        # Past the bound for images that cannot fit beside the decodes: up to OVERRUN_FACTOR
        # times it (or one such image), once in OVERRUN_STEPS steps.
        assert out.encodes and out.num_decodes
        assert predicted <= OVERRUN_FACTOR * bound_of(out, s) * (1 + 1e-9) or len(out.encodes) == 1, predicted
        assert s._step - getattr(s, "last_overrun_seen", -OVERRUN_STEPS) >= OVERRUN_STEPS
        s.last_overrun_seen = s._step
    else:
        assert predicted <= bound_of(out, s) * (1 + 1e-9) or is_minimal(out, s), (predicted, out.chunks, out.encodes)
    if clock is not None:
        clock.now += predicted
    finish_step(s, out, token)
    s.check_integrity()
    return out, predicted


def test_a_step_that_encodes_fills_the_rest_of_its_bound_with_that_prompt():
    """With ``prefill_after_encode``, decodes running and one image request arriving: the step
    encodes its image and prefills the largest chunk of its prompt that still fits the
    bound. Without it, that step carries the decodes and the image only."""
    fills = {}
    for after in (False, True):
        s = scheduler_with(bound=0.03, num_image_blocks=16, image_block_size=16, prefill_after_encode=after)
        decodes = [make_request(f"d{i}", num_prompt=40, max_tokens=50) for i in range(4)]
        for r in decodes:
            s.add(r)
        while not all(r.num_output_tokens for r in decodes):
            step(s)
        p = make_request("p", num_prompt=400, images=[(2, 16)], max_tokens=2)
        s.add(p)
        out, predicted = step(s)
        assert out.encodes == [(p, 0)]
        fills[after] = sum(n for r, n in out.chunks if r is p)
        if after:
            # The chunk is the largest that fits: one token more would be over the bound.
            more = shape_of_with(out, s, p, fills[after] + 1)
            assert predicted <= 0.03 < MODEL.step_seconds(more)
    assert fills[False] == 0 and fills[True] > 0


def shape_of_with(out, s: Scheduler, req, num_new: int) -> StepShape:
    """The step's shape as run, with ``req``'s chunk (a prefill from token 0 here) ``num_new`` tokens long."""
    images = [(r.images[i].num_patches, r.images[i].length) for r, i in out.encodes]
    decodes = [r.num_computed_tokens for r, n in out.chunks if r is not req]  # already advanced by the step
    return StepShape.of(images=images, prefills=[(0, num_new)], decodes=decodes)


def test_a_long_prompt_is_chunked_to_the_largest_chunk_that_fits():
    s = scheduler_with(bound=0.05)
    r = make_request("r", num_prompt=2000, max_tokens=2)
    s.add(r)
    out, predicted = step(s)
    (req, n), = out.chunks
    # l_fixed + a*n + b*pairs(0, n) <= bound, and n + 1 would not be
    cost = lambda q: MODEL.l_fixed + MODEL.l_prefill * q + MODEL.l_attn * prefill_pairs(0, q) / 1e3  # noqa: E731
    assert cost(n) <= 0.05 < cost(n + 1)
    out, _ = step(s)  # the next chunk reads the first one's KV: attention makes it smaller
    assert 0 < out.chunks[0][1] < n


def test_a_prompt_priced_for_its_log_probabilities_is_cut_to_fit_its_logits_too():
    """A chunk that computes its prompt's log-probabilities (the language model head at every
    position) is cut to the largest that fits with them, beside running decodes; the step as
    the scheduler predicts it counts them."""
    model = dataclasses.replace(MODEL, l_logit=1.5e-4)
    chunks = {}
    for priced in (None, 1):
        s = scheduler_with(model=model, bound=0.05)
        decodes = [make_request(f"d{i}", num_prompt=40, max_tokens=50) for i in range(4)]
        for r in decodes:
            s.add(r)
        while not all(r.num_output_tokens for r in decodes):
            step(s)
        p = make_request("p", num_prompt=2000, max_tokens=2, prompt_logprobs=priced)
        s.add(p)
        out, predicted = step(s)
        (n,) = [n for r, n in out.chunks if r is p]
        chunks[priced] = n
        decode_part = model.l_fixed + sum(model.l_decode + model.l_ctx * r.num_computed_tokens / 1e3
                                          for r, _ in out.chunks if r is not p)  # (advanced by the step)
        per_token = model.l_prefill + (model.l_logit if priced is not None else 0.0)
        cost = lambda q: decode_part + per_token * q + model.l_attn * prefill_pairs(0, q) / 1e3  # noqa: E731
        assert cost(n) == pytest.approx(predicted) and cost(n) <= 0.05 < cost(n + 1)
    assert 0 < chunks[1] < chunks[None]


def test_a_step_without_decodes_takes_the_idle_bound():
    """No stream waits on a step that carries no decode: a lone prompt is prefilled in one
    step up to the idle bound (alpha * TTFT), not cut to the TBT bound."""
    cost = lambda q: MODEL.l_fixed + MODEL.l_prefill * q + MODEL.l_attn * prefill_pairs(0, q) / 1e3  # noqa: E731
    s = scheduler_with(bound=0.01, idle_bound=0.5)
    r = make_request("r", num_prompt=600, max_tokens=3)
    s.add(r)
    out, predicted = step(s)
    assert out.chunks == [(r, 600)] and 0.01 < predicted == pytest.approx(cost(600))
    # Now r decodes: a second prompt shares steps with it and keeps to the TBT bound.
    r2 = make_request("r2", num_prompt=600, max_tokens=3)
    s.add(r2)
    out, predicted = step(s)
    chunk = dict((req.req_id, n) for req, n in out.chunks)
    assert chunk["r"] == 1 and 0 < chunk["r2"] < 600 and predicted <= 0.01 * (1 + 1e-9)
    # The idle bound is never below the bound.
    assert scheduler_with(bound=0.05, idle_bound=0.01).idle_bound == 0.05


def test_decodes_at_long_context_leave_less_room_for_prefill():
    rooms = []
    for context in (16, 3000):
        s = scheduler_with(bound=0.03, kv_block_size=16, num_kv_blocks=8192)
        decodes = [make_request(f"d{i}", num_prompt=context, max_tokens=1000) for i in range(20)]
        for r in decodes:
            s.add(r)
        while not all(r.num_output_tokens for r in decodes):
            step(s)
        s.add(make_request("p", num_prompt=1000, max_tokens=2))
        out, _ = step(s)
        assert [r for r, n in out.chunks if n == 1] == decodes  # every decode, then prefill
        rooms.append(sum(n for r, n in out.chunks if r.req_id == "p"))
    assert rooms[0] > rooms[1] > 0


def test_decodes_beyond_the_bound_wait_and_one_always_runs():
    s = scheduler_with(bound=0.0035)  # l_fixed + 7 decodes at short context
    reqs = [make_request(i, num_prompt=4, max_tokens=30) for i in range(12)]
    for r in reqs:
        s.add(r)
    for _ in range(200):
        if not s.num_unfinished:
            break
        out, predicted = step(s)
        assert out.chunks or out.encodes
    assert not s.num_unfinished
    s2 = scheduler_with(bound=1e-6)  # nothing fits: one minimal unit per step still runs
    r = make_request("x", num_prompt=40, max_tokens=3)
    s2.add(r)
    for _ in range(100):
        if not s2.num_unfinished:
            break
        step(s2)
    assert r.finish_reason == "length"


def test_encodes_fill_the_rest_of_the_step():
    s = scheduler_with(bound=0.02, num_image_blocks=64, image_block_size=16)
    reqs = [make_request(i, num_prompt=30, images=[(2, 16)], max_tokens=2) for i in range(10)]
    for r in reqs:
        s.add(r)
    out, predicted = step(s)
    # 1 ms fixed + 4 ms per image within 20 ms: four images, a fifth would be over
    assert len(out.encodes) == 4
    assert MODEL.vision_seconds(StepShape.of(images=[(0, 16)] * 5)) > 0.02


def test_encode_admission_follows_patches_not_image_count():
    # 1 ms per step, 10 us per patch within 20.5 ms: one image of 1,000 patches per step, or many
    # of 100 patches, though both kinds have 16 tokens.
    model = LatencyModel(v_fixed=0.001, v_patch=1e-5, l_fixed=0.002, l_prefill=1e-4, l_decode=2e-4)
    s = scheduler_with(model, bound=0.0205, num_image_blocks=64, image_block_size=16)
    for i in range(4):
        s.add(make_request(f"large{i}", num_prompt=30, images=[(2, 16, 1000)], max_tokens=2))
    out, _ = step(s)
    assert [r.req_id for r, _ in out.encodes] == ["large0"]
    s = scheduler_with(model, bound=0.0205, num_image_blocks=64, image_block_size=16)
    for i in range(30):
        s.add(make_request(f"small{i}", num_prompt=30, images=[(2, 16, 100)], max_tokens=2))
    out, _ = step(s)
    # 1 ms + n * 1 ms <= 20.5 ms
    assert len(out.encodes) == 19


def test_an_encode_that_attends_within_parts_is_priced_by_them():
    # A video of four groups of frames, 256 patches each, attended group by group (Qwen2-VL):
    # its square term is 4 * 256^2 patches, not 1024^2.
    model = LatencyModel(v_fixed=0.001, v_patch2=1e-5, l_fixed=0.002, l_prefill=1e-4, l_decode=2e-4)
    whole, parts = model.image_seconds(1024, 16), model.image_seconds(1024, 16, span=256)
    assert whole == pytest.approx(1e-5 * 1024 * 1024 / 1e3) and parts == pytest.approx(whole / 4)
    assert StepShape.of(images=[(1024, 16, 256), (100, 4), (50, 4, 0)]).patches_sq == 1024 * 256 + 100**2 + 50**2
    assert model.vision_seconds(StepShape.of(images=[(1024, 16, 256)])) == pytest.approx(0.001 + parts)
    # Within 20.5 ms: one whole image a step (1 + 10.5 ms); the videos group by group (each
    # group an input of its own, 0.66 ms): 29 groups, seven videos and the eighth's first.
    for span, admitted in ((0, [(0, 0)]), (256, [(i, k) for i in range(7) for k in range(4)] + [(7, 0)])):
        s = scheduler_with(model, bound=0.0205, num_image_blocks=64, image_block_size=16)
        for i in range(10):
            s.add(make_request(i, num_prompt=30, images=[(2, 16, 1024, span)], max_tokens=2))
        out, predicted = step(s)
        assert [(int(r.req_id), k) for r, k in out.encodes] == admitted and predicted <= 0.0205


@pytest.mark.parametrize("span", [0, 256])
def test_a_video_is_encoded_group_by_group_beside_running_decodes(span):
    """A video whose encode alone passes the TBT bound, on an instance decoding four streams:
    encoded group by group (span 256: four independent groups of frames), its groups share
    the decodes' steps and its prompt starts while they run; attended whole (span 0) it
    cannot share a step with them within the bound: after ``OVERRUN_STEPS`` steps, one step
    goes past it (up to ``OVERRUN_FACTOR`` times) to encode it, before the decodes finish
    (the streams' p90 slack, which would carry it sooner, off: ``tbt_slack``)."""
    model = LatencyModel(v_fixed=0.001, v_patch=1e-5, l_fixed=0.002, l_prefill=1e-5, l_decode=2e-4, overlap=1.0)
    # Four decodes: 2.8 ms; a group: 1 + 2.56 ms; the whole video 1 + 10.24 ms.
    s = scheduler_with(model, bound=0.01, idle_bound=1.0, num_image_blocks=64, image_block_size=16,
                       tbt_slack=False)
    decodes = [make_request(f"d{i}", num_prompt=8, max_tokens=30) for i in range(4)]
    for r in decodes:
        s.add(r)
    step(s)
    video = make_request("v", num_prompt=40, images=[(2, 16, 1024, span)], max_tokens=2)
    s.add(video)
    assert len(video.images) == (4 if span else 1)
    steps, overruns = 0, 0
    while not video.num_output_tokens:
        out, predicted = step(s)
        steps += 1
        if out.encodes:
            assert out.num_decodes == 4
        overruns += out.overrun
    assert all(r.num_output_tokens < 30 for r in decodes)
    if span:
        assert steps <= 4 and not overruns
    else:
        assert overruns == 1 and OVERRUN_STEPS < steps <= OVERRUN_STEPS + 3


def test_hard_caps_still_bind_under_the_model():
    s = scheduler_with(bound=10.0, token_budget=24, image_budget=1, num_image_blocks=8, image_block_size=16)
    for i in range(4):
        s.add(make_request(i, num_prompt=40, images=[(0, 16)] if i % 2 else [], max_tokens=4))
    for _ in range(60):
        if not s.num_unfinished:
            break
        out, _ = step(s)
        assert out.num_tokens <= 24 and len(out.encodes) <= 1
    assert not s.num_unfinished


@pytest.mark.parametrize("prefill_after_encode", [False, True])
@pytest.mark.parametrize("bound, idle_bound", [(0.004, None), (0.02, None), (0.2, None), (0.004, 0.05)])
def test_randomized_mix_under_the_model_keeps_every_guarantee(bound, idle_bound, prefill_after_encode):
    rng = random.Random(int(bound * 1000))
    clock = Clock()  # steps take their prediction, and one in five a bound more: streams spend their gaps
    s = scheduler_with(model=dataclasses.replace(MODEL, l_logit=5e-5), bound=bound, idle_bound=idle_bound, num_kv_blocks=40, kv_block_size=4, num_image_blocks=6, image_block_size=8,
                       token_budget=10_000, image_budget=10, prefill_after_encode=prefill_after_encode, clock=clock)
    s.set_calibration(1.0, 1.3)
    reqs = []
    for i in range(40):
        images = [(1, 8)] if rng.random() < 0.4 else []
        reqs.append(make_request(i, num_prompt=rng.randint(12, 60), images=images, max_tokens=rng.randint(1, 16),
                                 prompt_logprobs=1 if i % 4 == 3 else None))
    pending, aborted = list(reqs), set()
    for _ in range(20_000):
        if pending and rng.random() < 0.3:
            s.add(pending.pop(0))
        if s.num_unfinished and rng.random() < 0.03:
            victim = rng.choice(list(s.requests.values()))
            s.abort(victim.req_id)
            aborted.add(victim.req_id)
            s.check_integrity()
        if not pending and not s.num_unfinished:
            break
        step(s, clock=clock)
        clock.now += bound if rng.random() < 0.2 else 0.0
    assert not s.num_unfinished and s.kv.num_used_blocks == 0 and s.images.num_used_blocks == 0
    assert s.num_preemptions > 0 or bound < 0.01
    assert s.num_guarded_steps > 0 and not s._spent
    for r in reqs:
        assert r.status is RequestStatus.FINISHED
        if r.req_id not in aborted:
            assert r.num_output_tokens == r.sampling_params.max_tokens


def test_without_a_model_only_the_caps_bind():
    s = make_scheduler(token_budget=16)
    s.add(make_request("a", num_prompt=100, max_tokens=2))
    out = s.schedule()
    assert out.chunks[0][1] == 16 and out.predicted_language == 0.0


class Clock:
    """The scheduler's seconds, moved by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _decoding_with_a_long_prompt_waiting(clock: Clock | None = None, bound: float = 0.1):
    """Four streams decoding (their last tokens sampled at the clock's time) and a long prompt
    waiting to prefill, on a scheduler filled to ``bound``."""
    s = scheduler_with(bound=bound, idle_bound=0.5, kv_block_size=16, clock=clock)
    decodes = [make_request(f"d{i}", num_prompt=16, max_tokens=1000) for i in range(4)]
    for r in decodes:
        s.add(r)
    while not all(r.num_output_tokens for r in decodes):
        step(s)
    s.add(make_request("p", num_prompt=4000, max_tokens=2))
    return s, decodes


def _predicted(s: Scheduler, out) -> float:
    return s.latency_model.combine(out.predicted_vision, out.predicted_language)


def _full_to(s: Scheduler, out, bound: float) -> bool:
    """The step is predicted within ``bound`` and the next token would not have fitted."""
    return bound - 0.0002 < _predicted(s, out) <= bound * (1 + 1e-9)


def _handoff_room(s: Scheduler, out, bound: float) -> float:
    """``bound`` while decodes are handed over from another instance: less the step's
    decodes and one more (``Scheduler._bound_for_handoffs``), down to half of it."""
    decodes = [r.num_computed_tokens + 1 for r, n in out.chunks if is_decode(r, s)]
    first = s.latency_model.step_seconds(StepShape.of(decodes=decodes + [1000]))
    return max(bound - first, HANDOFF_SHARE * bound)


def test_a_calibrated_step_with_decodes_fills_to_the_bound_over_the_factor():
    """Steps with decodes that run 1.5x their prediction are filled to bound / 1.5; a step
    without decodes keeps its idle bound."""
    rooms = {}
    for factor in (1.0, 1.5):
        s, _ = _decoding_with_a_long_prompt_waiting(bound=0.03)
        s.set_calibration(factor)
        out = s.schedule()
        assert out.num_decodes == 4
        assert _full_to(s, out, 0.03 / factor)
        rooms[factor] = sum(n for r, n in out.chunks if r.req_id == "p")
    assert rooms[1.0] > rooms[1.5] > 0
    alone = scheduler_with(bound=0.03, idle_bound=0.5)
    alone.set_calibration(2.0)
    alone.add(make_request("q", num_prompt=4000, max_tokens=2))
    out = alone.schedule()
    assert out.num_decodes == 0 and out.predicted_language > 0.25  # the idle bound, not the bound / 2
    with pytest.raises(ValueError, match="> 0"):
        alone.set_calibration(0.0)


def test_the_calibration_is_the_recent_steps_quantile_within_its_limits():
    from hydrad.engine.latency_model import Calibration

    c = Calibration(window=20, every=10, quantile=0.9, low=0.8, high=2.0)
    changed = [c.add(0.010, 0.010 * (1.0 + 0.02 * i)) for i in range(10)]  # ratios 1.00 .. 1.18
    assert changed == [False] * 9 + [True] and c.factor == pytest.approx(1.18)
    assert not c.add(0.001, 1.0)  # too short to count
    for _ in range(10):
        c.add(0.010, 0.030)  # the machine got 3x slower: capped
    assert c.factor == 2.0
    for _ in range(20):
        c.add(0.010, 0.005)  # and then 2x faster than the model: floored
    assert c.factor == 0.8
    with pytest.raises(ValueError):
        Calibration(window=4, every=8)


def test_a_step_predicts_its_prefill_terms_apart_from_its_decodes():
    """``predicted_prefill`` is the prefill chunks' share of ``predicted_language``: the
    language step's fixed cost and the decodes are not in it."""
    s = scheduler_with(bound=0.05, kv_block_size=16)
    decode = make_request("d", num_prompt=16, max_tokens=100)
    s.add(decode)
    step(s)
    out = s.schedule()
    assert out.predicted_prefill == 0.0 and out.predicted_language > 0  # decodes only
    s.update_after_language(out, [7])
    s.add(make_request("p", num_prompt=200, max_tokens=2))
    out = s.schedule()
    ((_, one), (req, n)) = out.chunks
    assert req.req_id == "p" and n > 0
    expected = MODEL.l_prefill * n + MODEL.l_attn * prefill_pairs(req.num_computed_tokens, n) / 1e3
    assert out.predicted_prefill == pytest.approx(expected)
    decode_part = MODEL.l_fixed + MODEL.l_decode + MODEL.l_ctx * (decode.num_computed_tokens + 1) / 1e3
    assert out.predicted_language == pytest.approx(expected + decode_part)


def test_the_live_speed_is_each_kinds_median_over_steps_of_that_kind():
    from hydrad.engine.latency_model import LiveSpeed

    speed = LiveSpeed(window=16, min_steps=4, dominant=0.75)
    for ratio in (1.2, 1.4, 1.3, 9.0):  # one step slowed by something else: the median holds
        speed.add(0.010, 0.0, 0.0, 0.010, 0.010 * ratio)  # images only
    for ratio in (1.5, 1.6, 1.7):
        speed.add(0.0, 0.018, 0.020, 0.020, 0.020 * ratio)  # prefill terms 90% of the step
    speed.add(0.0, 0.0, 0.005, 0.005, 0.006)  # decodes only
    speed.add(0.005, 0.004, 0.006, 0.011, 0.050)  # mixed: counts for no kind
    speed.add(0.0, 0.0, 0.001, 0.001, 0.010)  # under min_seconds: the timer's noise
    assert speed.counts() == {"images": 4, "prefills": 3, "decodes": 1}
    assert speed.parts() == {"images": pytest.approx(1.35)}  # only kinds with min_steps
    speed.add(0.0, 0.016, 0.020, 0.020, 0.020 * 1.6)  # 80% prefill: still a prefill step
    assert speed.parts()["prefills"] == pytest.approx(1.6)
    # The spread: of the log ratios about each kind's median (median absolute deviation).
    import math
    import statistics

    from hydrad.engine.latency_model import NORMAL_MEDIAN_ABS

    logs = {"images": [math.log(r) for r in (1.2, 1.4, 1.3, 9.0)],
            "prefills": [math.log(r) for r in (1.5, 1.6, 1.7, 1.6)]}
    deviations = [abs(x - statistics.median(v)) for v in logs.values() for x in v]
    assert speed.spread() == pytest.approx(statistics.median(deviations) / NORMAL_MEDIAN_ABS)
    assert LiveSpeed().spread() == 0.0 and LiveSpeed().parts() == {}
    with pytest.raises(ValueError):
        LiveSpeed(window=2, min_steps=4)


def _kv_offer(req_id: str, output_token_ids: list[int], last_token_time: float | None = None):
    """A KV hand-over of a 64-token prompt from instance 1, with the tokens sampled there."""
    from hydrad.engine.migration import MigrationOffer
    from hydrad.sampling_params import SamplingParams

    return MigrationOffer(
        req_id=req_id, source=1, kind="kv", block_ids=[0, 1, 2, 3], prompt_token_ids=list(range(5, 69)),
        output_token_ids=output_token_ids, num_computed_tokens=64 if output_token_ids else 48,
        sampling_params=SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True), images=[],
        eos_token_ids=(2,), generator_state=None,
        timeline={"arrival": 0.0, "encode_exec": 0.0, "prefill_exec": 0.0, "decode_exec": 0.0},
        last_token_time=last_token_time)


def _pull_in(s: Scheduler, clock: Clock, req_id: str, age: float) -> Request:
    """A stream migrating in whose previous token was sampled ``age`` seconds ago at its
    source, pulled in during one step of ``s`` (its clock does not move)."""
    s.add(Request.from_offer(_kv_offer(req_id, [7], clock.now - age)))
    out = s.schedule()
    (pull,) = out.pulls
    s.update_after_language(out, [7 for r, n in out.chunks if r.num_computed_tokens + n == r.num_tokens])
    s.finish_pull(pull.req)
    return pull.req


@pytest.mark.parametrize("factor", [1.0, 1.5])
def test_a_step_ends_before_its_most_pressed_streams_next_token_is_due(factor):
    """Each stream's next token is due one bound after its previous one. Streams that were in
    the step before leave the step its whole bound (the headroom covers the time between
    steps); a stream whose previous token came 60 ms ago leaves it what it has left (in
    predicted seconds, over the calibration factor)."""
    clock = Clock()
    s, decodes = _decoding_with_a_long_prompt_waiting(clock)
    s.set_calibration(factor)
    clock.now += 0.005  # 5 ms since every stream's last token
    out = s.schedule()
    assert out.num_decodes == 4
    assert _full_to(s, out, 0.1 / factor)  # the whole bound
    s.update_after_language(out, [7 for r, n in out.chunks if r.num_computed_tokens + n == r.num_tokens])
    _pull_in(s, clock, "m", age=0.06)
    out = s.schedule()
    assert out.num_decodes == 5 and any(r.req_id == "p" for r, n in out.chunks)
    left = (0.1 - 0.06) / factor
    assert _full_to(s, out, left)
    s.update_after_language(out, [7 for r, n in out.chunks if r.num_computed_tokens + n == r.num_tokens])
    out = s.schedule()  # it was in the step before, as all the others
    # The whole bound, less room for the next stream handed over.
    assert _full_to(s, out, _handoff_room(s, out, 0.1 / factor))


def test_a_stream_whose_gap_is_lost_anyway_does_not_shrink_the_step():
    """When even the decodes alone cannot reach a stream before its deadline, the step is
    filled to the others' deadlines, as if that stream had none."""
    clock = Clock()
    s, _ = _decoding_with_a_long_prompt_waiting(clock)
    _pull_in(s, clock, "late", age=0.0995)  # 0.5 ms left: less than the decodes take
    out = s.schedule()
    assert out.num_decodes == 5
    assert _full_to(s, out, _handoff_room(s, out, 0.1))
    s.update_after_language(out, [7 for r, n in out.chunks if r.num_computed_tokens + n == r.num_tokens])
    _pull_in(s, clock, "late2", age=0.0995)
    _pull_in(s, clock, "pressed", age=0.03)
    out = s.schedule()
    assert out.num_decodes == 7
    assert _full_to(s, out, 0.07)


def test_a_migrated_streams_next_token_is_due_a_bound_after_the_one_sampled_at_its_source():
    """A prefill instance samples the first token and hands the KV over; the decode
    instance's step that carries the first decode ends a bound after that first token,
    however long the hand-over and the wait for the step took."""
    from hydrad.engine.migration import offer_for

    clock = Clock()
    source = scheduler_with(bound=0.5, kv_block_size=16, clock=clock)
    source.set_role("P", source.kv, source.images)
    r = make_request("m", num_prompt=64, max_tokens=8)
    source.add(r)
    while not source.new_offers:
        step(source)
    clock.now += 0.01
    ((req, kind),) = source.new_offers
    req.num_long_gaps = 1  # and its gaps past the TBT so far (``tbt_slack``)
    offer = offer_for(req, kind, 0)
    assert kind == "kv" and offer.last_token_time == pytest.approx(clock.now - 0.01)
    target, _ = _decoding_with_a_long_prompt_waiting(clock)
    assert Request.from_offer(offer).num_long_gaps == 1
    target.add(Request.from_offer(offer))
    out = target.schedule()
    (pull,) = out.pulls
    target.update_after_language(out, [7 for r, n in out.chunks if r.num_computed_tokens + n == r.num_tokens])
    target.finish_pull(pull.req)
    clock.now += 0.035  # the copy, and the step under way when it arrived
    out = target.schedule()
    assert out.num_decodes == 5 and any(r.req_id == "m" for r, n in out.chunks[:5])
    left = 0.1 - 0.045
    assert _full_to(target, out, left)


def test_while_decodes_are_handed_over_every_step_leaves_room_for_the_next_one():
    """A stream handed over after its first token waits for the step under way here, then
    for its own first step: while hand-overs arrive, a step without decodes stays under the
    TBT bound (not the idle bound) less that first step, and a step with decodes under the
    bound less its decodes and one more; never under half the bound. Ten seconds after the
    last hand-over, steps take their whole bounds again."""
    clock = Clock()
    s = scheduler_with(bound=0.1, idle_bound=0.5, kv_block_size=16, clock=clock)
    s.add(make_request("a", num_prompt=4000, max_tokens=2))
    out = s.schedule()
    assert _full_to(s, out, 0.5)  # no decodes, no hand-over: the idle bound
    s.update_after_language(out, [])
    _pull_in(s, clock, "m", age=0.0)  # a hand-over, pulled in while "a" finishes its prefill
    s.add(make_request("b", num_prompt=4000, max_tokens=2))
    out = s.schedule()
    assert out.num_decodes == 2 and any(r.req_id == "b" for r, n in out.chunks)  # "a" and "m" decode
    room = _handoff_room(s, out, 0.1)
    assert 0.09 < room < 0.1 and _full_to(s, out, room)
    s.update_after_language(out, [7 for r, n in out.chunks if r.num_computed_tokens + n == r.num_tokens])
    # Decodes that take most of the bound (2 ms each here): half of it is kept for prompts.
    many = scheduler_with(model=dataclasses.replace(MODEL, l_decode=0.002), bound=0.026, idle_bound=0.5,
                          kv_block_size=16, clock=clock)
    for i in range(4):
        many.add(make_request(f"d{i}", num_prompt=16, max_tokens=1000))
    while len(many.decoding) < 4:
        step(many)
    _pull_in(many, clock, "m", age=0.0)
    many.add(make_request("p", num_prompt=4000, max_tokens=2))
    out = many.schedule()
    assert out.num_decodes == 5 and any(r.req_id == "p" for r, n in out.chunks)
    assert _handoff_room(many, out, 0.026) == HANDOFF_SHARE * 0.026 and _full_to(many, out, 0.013)
    many.update_after_language(out, [7 for r, n in out.chunks if r.num_computed_tokens + n == r.num_tokens])
    # Ten seconds after the last hand-over, a step takes its whole bound again.
    clock.now += HANDOFF_WINDOW
    out = s.schedule()
    assert out.num_decodes >= 1 and any(r.req_id == "b" for r, n in out.chunks)
    assert _full_to(s, out, 0.1)


def test_a_prompt_handed_over_is_no_decode_hand_over():
    """Only a stream that has sampled a token elsewhere waits on a step here: an image or
    prompt handed over (E to P) leaves steps their bounds."""
    clock = Clock()
    s = scheduler_with(bound=0.1, idle_bound=0.5, kv_block_size=16, clock=clock)
    s.add(Request.from_offer(_kv_offer("x", [])))  # its prefill continues here
    s.add(make_request("a", num_prompt=4000, max_tokens=2))
    out = s.schedule()
    assert out.num_decodes == 0 and _full_to(s, out, 0.5)


def test_a_stage_handed_over_advances_every_step_though_decodes_fill_the_bound():
    """An EPD instance hands E and P over (a redeploy to ``1EP+1D`` keeping D), holding a
    prompt half prefilled and a request with one of its two images encoded, while the
    instance taking P over sends it decodes that fill every step to the bound (a closed
    loop at saturation: each that ends is followed by another). Once, these never got a
    step and the redeploy waited on them for five minutes; now, starved for ``STARVED_STEPS``
    steps, the oldest takes a unit (a ``min_chunk``, an image) every step past the bound, and
    the hand-over completes."""
    from test_scheduler import handed_decode

    model = dataclasses.replace(MODEL, l_decode=5e-3)  # ten decodes fill the 50 ms bound
    s = scheduler_with(model, bound=0.05, image_budget=1, num_kv_blocks=256, kv_block_size=16)
    prompt = make_request("p", num_prompt=1200, max_tokens=4)  # 0.12 s to prefill: chunked
    pictured = make_request("q", num_prompt=60, images=[(2, 16), (30, 16)], max_tokens=4)
    s.add(pictured)
    s.add(prompt)
    for _ in range(3):
        finish_step(s, schedule_pulling(s))
        if 0 < prompt.num_computed_tokens and pictured.num_encoded_images == 1:
            break
    assert 0 < prompt.num_computed_tokens < 1200 and pictured.num_encoded_images == 1
    s.retire("EP")
    names = (f"d{i}" for i in range(10_000))
    for _ in range(12):
        s.add(handed_decode(next(names), max_tokens=30))
    for step in range(200):
        out = schedule_pulling(s)
        forced = [r for r, n in out.chunks if r is prompt] + [r for r, _ in out.encodes]
        if not forced:  # only the stage being handed over may take a step past its bound
            assert model.step_seconds(shape_of(out, s)) <= s.latency_bound + 1e-9
        result = finish_step(s, out)
        for req_id in list(s.offered):  # the instances that take E and P over pull what is offered
            s.release(req_id)
        for req in result.finished:
            s.add(handed_decode(next(names), max_tokens=30))
        if s.drained(keep_kv=True, keep_images=False):
            break
    assert s.drained(keep_kv=True, keep_images=False), (
        f"still held after {step + 1} steps: {prompt.num_computed_tokens} of 1200 prompt tokens, "
        f"{pictured.num_encoded_images} of 2 images")
    assert prompt.output_token_ids and "p" in s.decoding  # D stays here: it decodes on


def test_prompts_advance_while_decodes_handed_over_fill_every_step():
    """An instance that prefills and also decodes for another instance (``1EP+1EPD``), whose
    decodes fill every step (to the bound less the room it keeps for the next handed-over
    decode's first step) while each that ends is followed by another: its own prompts once
    waited for as long as that lasted. After ``STARVED_STEPS`` steps without a step for
    them, each step advances the oldest by one unit (a ``min_chunk``, an image) past that
    bound if need be; a step over its bound carries that one unit beside the decodes."""
    from hydrad.engine.scheduler import STARVED_STEPS
    from test_scheduler import handed_decode

    model = dataclasses.replace(MODEL, l_decode=5e-3)  # ten decodes fill the 50 ms bound
    s = scheduler_with(model, bound=0.05, image_budget=2, num_kv_blocks=512, kv_block_size=16)
    names = (f"d{i}" for i in range(10_000))
    for _ in range(12):
        s.add(handed_decode(next(names), max_tokens=30))
    for _ in range(3):  # the decodes are pulled and running
        finish_step(s, schedule_pulling(s))
    prompt = make_request("p", num_prompt=200, max_tokens=4)
    pictured = make_request("q", num_prompt=60, images=[(2, 16), (30, 16)], max_tokens=4)
    s.add(prompt)
    s.add(pictured)
    for step in range(400):
        out = schedule_pulling(s)
        units = len(out.encodes) + len(out.chunks) - out.num_decodes
        if model.step_seconds(shape_of(out, s)) > s.latency_bound + 1e-9:
            assert units == 1 and all(n <= s.min_chunk for r, n in out.chunks[out.num_decodes:]), out.chunks
        result = finish_step(s, out)
        for req in result.finished:
            if req not in (prompt, pictured):
                s.add(handed_decode(next(names), max_tokens=30))
        if prompt.output_token_ids and pictured.output_token_ids:
            break
    assert prompt.output_token_ids and pictured.output_token_ids, (
        f"after {step + 1} steps: {prompt.num_computed_tokens} of 200 prompt tokens, "
        f"{pictured.num_encoded_images} of 2 images, {pictured.num_computed_tokens} of 60 tokens")
    # 13 chunks of 200 tokens, two images, 4 chunks of 60: a unit a step once starved.
    assert step < STARVED_STEPS + 13 + 2 + 4 + 5
