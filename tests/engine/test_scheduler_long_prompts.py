"""Prompts one step carries go ahead of long ones, which keep a share of every step; images
that cannot fit beside a step's decodes go past its bound, one step in ``OVERRUN_STEPS``.

A prompt whose whole work, predicted alone, passes the step bound (a long text, a video) is
long; while prompts of both kinds wait, the short ones take the room the decodes left first,
within ``1 - long_prompt_share`` of it, and the long ones the rest. With one kind only, or a
share of 1, steps are built first come first served exactly as before.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from hydrad.engine.latency_model import LatencyModel, StepShape, prefill_pairs
from hydrad.engine.scheduler import OVERRUN_STEPS
from test_scheduler import make_request
from test_scheduler_latency import MODEL, scheduler_with, step


def _with_decodes(share: float, **kwargs):
    """An instance (bound 0.05 s) running four decodes."""
    s = scheduler_with(bound=0.05, long_prompt_share=share, **kwargs)
    decodes = [make_request(f"d{i}", num_prompt=40, max_tokens=400) for i in range(4)]
    for r in decodes:
        s.add(r)
    while not all(r.num_output_tokens for r in decodes):
        step(s)
    return s


def _chunk(out, req) -> int:
    return sum(n for r, n in out.chunks if r is req)


def test_a_prompt_is_long_when_its_work_alone_passes_the_bound():
    s = scheduler_with(bound=0.05, num_image_blocks=64)
    short, long = make_request("s", num_prompt=400), make_request("l", num_prompt=500)
    video = make_request("v", num_prompt=60, images=[(4 * i, 4) for i in range(12)])  # 12 images, 5 ms each
    for r in (short, long, video):
        s.add(r)
    # The same prediction as a step that holds the whole prompt.
    for r in (short, long, video):
        images = [(i.num_patches, i.length, i.attention_span) for i in r.images]
        whole = MODEL.step_seconds(StepShape.of(images=images, prefills=[(0, r.num_tokens)]))
        assert MODEL.prompt_seconds(r.images, r.num_tokens) == pytest.approx(whole)
        assert r.long_prompt == (whole > 0.05)
    assert (short.long_prompt, long.long_prompt, video.long_prompt) == (False, True, True)
    # An instance that only prefills prices no encode: the video's prompt is short there.
    p = scheduler_with(bound=0.05)
    p.set_role("P", p.kv, None)
    other = make_request("v2", num_prompt=60, images=[(4 * i, 4) for i in range(12)])
    p._classify(other)
    assert not other.long_prompt
    # A prompt priced for its log-probabilities counts their cost too: 400 tokens fit alone, not priced.
    priced = scheduler_with(model=dataclasses.replace(MODEL, l_logit=5e-5), bound=0.05)
    plain, scored = make_request("p", num_prompt=400), make_request("q", num_prompt=400, prompt_logprobs=1)
    for r in (plain, scored):
        priced.add(r)
    assert not plain.long_prompt and scored.long_prompt


@pytest.mark.parametrize("share", [0.25, 0.5, 1.0])
def test_a_short_prompt_goes_ahead_of_a_long_one_being_prefilled(share):
    s = _with_decodes(share)
    long = make_request("long", num_prompt=2000, max_tokens=4)
    s.add(long)
    step(s)
    assert long.long_prompt and 0 < long.num_computed_tokens < 2000
    short = make_request("short", num_prompt=40, max_tokens=4)
    s.add(short)
    out, _ = step(s)
    if share < 1.0:
        # The whole short prompt in the next step, beside the long one's chunk.
        assert _chunk(out, short) == 40 and short.num_output_tokens == 1
        assert _chunk(out, long) > 0
    else:
        # First come first served: the long prompt takes the room until it is done (the short
        # one gets what little is left of a step).
        assert _chunk(out, short) < 40
        while not long.num_output_tokens:
            assert not short.num_output_tokens
            step(s)


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5])
def test_a_long_prompt_keeps_its_share_while_short_ones_keep_coming(share):
    """Two 300-token prompts arrive every step, more than a step holds: a long prompt still
    gets at least its share of the room the decodes leave (to one token), and is done in
    about its work over that share; with a share of 0 the short ones take every step."""
    s = _with_decodes(share)
    long = make_request("long", num_prompt=2000, max_tokens=2)
    s.add(long)
    for i in range(40):
        for j in range(2):
            s.add(make_request(f"s{i}.{j}", num_prompt=300, max_tokens=1))
        start = long.num_computed_tokens
        out, _ = step(s)
        if long.num_output_tokens:
            break
        decodes = [r.num_computed_tokens for r, n in out.chunks if n == 1 and r.req_id.startswith("d")]
        floor = MODEL.step_seconds(StepShape.of(decodes=decodes))
        n = _chunk(out, long)
        cost = MODEL.l_prefill * n + MODEL.l_attn * prefill_pairs(start, n) / 1e3
        one_more = MODEL.l_prefill + MODEL.l_attn * (start + n + 1) / 1e3
        assert cost + one_more >= share * (0.05 - floor), (i, n, cost)
        if share == 0.0:
            assert n == 0
    if share == 0.0:
        assert long.num_computed_tokens == 0
    else:
        # The work of its whole prefill over its share of a step's room, and a step of slack.
        work = MODEL.l_prefill * 2000 + MODEL.l_attn * prefill_pairs(0, 2000) / 1e3
        assert long.num_output_tokens == 1 and i <= work / (share * (0.05 - floor)) + 1


def _trace(share: float, prompts: list[tuple[int, int]], images: list[bool]) -> list[tuple]:
    """Every step's chunks and encodes for requests (prompt tokens, max tokens) arriving two a step."""
    s = scheduler_with(bound=0.05, long_prompt_share=share, num_kv_blocks=2000, num_image_blocks=64)
    pending = [make_request(i, num_prompt=n, max_tokens=m, images=[(0, 8, 600)] if img else [])
               for i, ((n, m), img) in enumerate(zip(prompts, images))]
    steps = []
    while pending or s.num_unfinished:
        for _ in range(2):
            if pending:
                s.add(pending.pop(0))
        out, _ = step(s)
        steps.append((tuple((r.req_id, n) for r, n in out.chunks), tuple((r.req_id, i) for r, i in out.encodes)))
    return steps


@pytest.mark.parametrize("kind", ["short", "long"])
def test_prompts_of_one_kind_are_scheduled_first_come_first_served(kind):
    rng = random.Random(7)
    lengths = (20, 300) if kind == "short" else (700, 1500)
    prompts = [(rng.randint(*lengths), rng.randint(1, 30)) for _ in range(24)]
    images = [rng.random() < 0.3 for _ in prompts]
    assert _trace(0.25, prompts, images) == _trace(1.0, prompts, images)


def test_prompts_of_both_kinds_are_not_scheduled_first_come_first_served():
    """The check above can tell: with both kinds, the steps differ."""
    rng = random.Random(7)
    prompts = [(rng.choice((30, 1200)), rng.randint(1, 30)) for _ in range(24)]
    images = [False] * len(prompts)
    assert _trace(0.25, prompts, images) != _trace(1.0, prompts, images)


def test_a_short_prompt_leaves_the_kv_a_long_one_that_came_first_waits_for():
    """A long prompt waiting for KV blocks keeps them: a short one behind it is not admitted
    on blocks the long one needs, or it could wait for as long as short ones keep coming."""
    s = _with_decodes(0.25, num_kv_blocks=520)  # 4 blocks of 4 tokens... per decode, 520 in all
    long = make_request("long", num_prompt=2000, max_tokens=2)  # 500 blocks
    s.add(long)
    step(s)
    assert long.status.value == "waiting" and s.kv.num_free_blocks < 500
    short = make_request("short", num_prompt=40, max_tokens=2)
    s.add(short)
    step(s)
    assert short.status.value == "waiting" and short.num_computed_tokens == 0
    # Room enough for both: the short one is admitted at once.
    s2 = _with_decodes(0.25, num_kv_blocks=600)
    long2, short2 = make_request("long", num_prompt=2000, max_tokens=2), make_request("short", num_prompt=40)
    s2.add(long2)
    s2.add(short2)
    out, _ = step(s2)
    assert _chunk(out, short2) == 40


def test_images_too_long_for_any_step_with_decodes_go_past_the_bound_one_step_in_sixteen():
    """Streams keep coming (a new one each step), so a step always carries decodes, and three
    requests each hold two images that cannot fit beside them: each waits ``OVERRUN_STEPS``
    steps, then a step goes past its bound (up to twice it) to encode what fits that much,
    and the next such step comes no sooner than ``OVERRUN_STEPS`` later (``step`` checks
    both). Without those steps the images would wait for the streams to stop."""
    model = LatencyModel(v_fixed=0.001, v_patch=1e-5, l_fixed=0.002, l_prefill=1e-5, l_decode=5e-4, overlap=1.0)
    s = scheduler_with(model, bound=0.02, num_image_blocks=64, image_block_size=16, num_kv_blocks=8192)
    big = [make_request(f"v{i}", num_prompt=40, images=[(2, 16, 1600), (20, 16, 1600)], max_tokens=2)
           for i in range(3)]
    for r in big:
        s.add(r)
    overruns = []
    for i in range(200):
        s.add(make_request(f"t{i}", num_prompt=8, max_tokens=12))
        out, _ = step(s)
        assert out.num_decodes > 0 or i < 2
        if out.overrun:
            overruns.append(i)
            # Past the bound for the images only: one that alone would pass twice it, or
            # what fits twice it.
            assert all(r in big for r, _ in out.encodes)
        if all(r.num_output_tokens for r in big):
            break
    assert all(r.num_output_tokens for r in big)
    assert len(overruns) >= 3 and all(b - a >= OVERRUN_STEPS for a, b in zip(overruns, overruns[1:]))
    assert s.num_overrun_steps == len(overruns)


def test_images_that_fit_beside_the_decodes_never_go_past_the_bound():
    """Images that wait for room, not for the decodes to end (each fits beside them), take
    their turn within the bound however long the queue."""
    model = LatencyModel(v_fixed=0.001, v_patch=1e-5, l_fixed=0.002, l_prefill=1e-5, l_decode=5e-4, overlap=1.0)
    s = scheduler_with(model, bound=0.02, num_image_blocks=256, image_block_size=16, num_kv_blocks=8192)
    for i in range(60):
        s.add(make_request(f"v{i}", num_prompt=40, images=[(2, 16, 900)], max_tokens=8))
    for _ in range(2000):
        if not s.num_unfinished:
            break
        out, _ = step(s)
        assert not out.overrun
    assert not s.num_unfinished and s.num_overrun_steps == 0


def test_a_step_that_gives_a_short_prompt_its_first_token_keeps_to_the_decodes_bound():
    """A step without decodes may take the idle bound (the TTFT share); one that completes a
    short prompt keeps the long prompts beside it to the decodes' bound, so that the short
    prompt's first token does not wait for them."""
    s = scheduler_with(bound=0.05, idle_bound=0.5)
    long = make_request("long", num_prompt=8000, max_tokens=2)
    s.add(long)
    _, alone = step(s)
    assert alone > 0.4  # the idle bound
    short = make_request("short", num_prompt=40, max_tokens=2)
    s.add(short)
    out, predicted = step(s)
    assert _chunk(out, short) == 40 and _chunk(out, long) > 0 and predicted <= 0.05 * (1 + 1e-9)
    out, predicted = step(s)  # the short one decodes now: the decodes' bound anyway
    assert out.num_decodes == 1 and predicted <= 0.05 * (1 + 1e-9)


# -- steps on the streams' p90 slack (``tbt_slack``) --------------------------------------------

TBT = 0.05 / 0.9  # the SLO's TBT behind a 0.05 s bound (10% headroom)
BOUND = 0.05 * (1 + 1e-9)  # a gap past the bound counts as past the TBT: the p90 gap stays within the bound


@pytest.mark.parametrize("num_gaps", range(1, 64))
def test_gaps_past_p90_is_what_the_bench_allows(num_gaps):
    """With ``gaps_past_p90(n)`` of n gaps past the TBT, the bench's p90 gap is within it;
    with one more, it is not."""
    from hydrad.bench.metrics import percentile
    from hydrad.engine.scheduler import gaps_past_p90

    k = gaps_past_p90(num_gaps)
    assert 0 <= k < num_gaps
    for long in (k, k + 1):
        gaps = [0.01] * (num_gaps - long) + [1.0] * long
        assert (percentile(gaps, 90) <= TBT) == (long == k), (num_gaps, long)


# Steps of 10 ms, and 2 ms a decode: eight streams take half of a 0.05 s bound.
BUSY = LatencyModel(v_fixed=0.001, v_image=0.02, l_fixed=0.01, l_prefill=1e-4, l_attn=2e-5, l_decode=2e-3,
                    l_ctx=5e-5, overlap=1.0)


def _streams_and_a_long_prompt(clock, slack: bool, max_tokens, long_prompt):
    """Streams (``max_tokens`` each) decoding on an instance with a 0.05 s bound (idle bound
    0.5 s) and the ``BUSY`` model, the clock moved by each step's prediction; ``long_prompt``
    (tokens, request) added once the streams have that many tokens. Returns the scheduler,
    every step's output and prediction, and each request's token times."""
    s = scheduler_with(BUSY, bound=0.05, idle_bound=0.5, clock=clock, tbt_slack=slack, num_image_blocks=64)
    streams = [make_request(f"d{i}", num_prompt=40, max_tokens=m) for i, m in enumerate(max_tokens)]
    for r in streams:
        s.add(r)
    times: dict[str, list[float]] = {}
    steps = []
    added = False
    while s.num_unfinished or not added:
        if not added and all(r.num_output_tokens >= long_prompt[0] or r.finish_reason for r in streams):
            s.add(long_prompt[1])
            added = True
        before = {r.req_id: r.num_output_tokens for r in s.requests.values()}
        out, predicted = step(s, clock=clock)
        steps.append((out, predicted))
        for r, _ in out.chunks:
            if r.num_output_tokens > before.get(r.req_id, 0):
                times.setdefault(r.req_id, []).append(clock.now)
    return s, steps, times


def _p90_gap(token_times: list[float]) -> float:
    from hydrad.bench.metrics import percentile

    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    return percentile(gaps, 90) or 0.0


@pytest.mark.parametrize("kind", ["text", "video"])
def test_a_long_prompt_takes_the_streams_slack_and_every_stream_keeps_its_p90(kind):
    """A long prompt (a 3,000-token text; a video of twelve groups, 0.25 s of encode) arrives
    while eight streams decode, each past its tenth gap: steps go past the TBT bound (to the
    idle bound) for it, each stream's p90 gap stays within the bound, and its first token comes
    sooner than when steps keep to the bound (half of each goes to the decodes)."""
    from test_scheduler_latency import Clock

    first_token = {}
    for slack in (True, False):
        clock = Clock()
        if kind == "text":
            long = make_request("long", num_prompt=3000, max_tokens=2)
        else:
            long = make_request("long", num_prompt=60, images=[(4 * i, 4) for i in range(12)], max_tokens=2)
        s, steps, times = _streams_and_a_long_prompt(clock, slack, [40 + 5 * i for i in range(8)], (12, long))
        assert long.long_prompt
        slack_steps = [(out, p) for out, p in steps if out.slack]
        assert bool(slack_steps) == slack and s.num_slack_steps == len(slack_steps)
        for out, predicted in slack_steps:
            assert 0.05 < predicted <= 0.5 * (1 + 1e-9) and out.num_decodes
        for i in range(8):
            assert _p90_gap(times[f"d{i}"]) <= BOUND, (slack, i)
        arrival = times["d0"][11]
        first_token[slack] = times["long"][0] - arrival
    assert first_token[True] < 0.7 * first_token[False], first_token


def test_young_streams_have_no_slack():
    """Streams with fewer than eleven gaps (with ten, one past the TBT would be their p90)
    keep every step to the bound, however long the prompt that waits."""
    from test_scheduler_latency import Clock

    clock = Clock()
    long = make_request("long", num_prompt=3000, max_tokens=2)
    s, steps, times = _streams_and_a_long_prompt(clock, True, [10] * 8, (1, long))
    assert not any(out.slack for out, _ in steps) and s.num_slack_steps == 0
    assert all(p <= 0.05 * (1 + 1e-9) for out, p in steps if out.num_decodes)


def test_streams_that_end_early_keep_their_p90_on_slack():
    """Streams of random lengths (their ends unknown to the scheduler, as with EOS), one new
    every 15 steps, and long prompts: steps take the slack while every stream has some, and
    every stream's p90 gap stays within the TBT however soon it ends."""
    from test_scheduler_latency import Clock

    rng = random.Random(3)
    clock = Clock()
    s = scheduler_with(bound=0.05, idle_bound=0.5, clock=clock, num_kv_blocks=20000)
    times: dict[str, list[float]] = {}
    for i in range(600):
        if i % 15 == 0:
            s.add(make_request(f"s{i}", num_prompt=30, max_tokens=rng.randint(2, 60)))
        if i % 40 == 0:
            s.add(make_request(f"long{i}", num_prompt=3000, max_tokens=2))
        before = {r.req_id: r.num_output_tokens for r in s.requests.values()}
        out, _ = step(s, clock=clock)
        for r, _ in out.chunks:
            if r.num_output_tokens > before.get(r.req_id, 0):
                times.setdefault(r.req_id, []).append(clock.now)
    assert s.num_slack_steps > 0
    for req_id, t in times.items():
        if req_id.startswith("s"):
            assert _p90_gap(t) <= BOUND, req_id


def test_a_slack_step_still_gives_a_short_prompt_its_first_token_within_the_bound():
    """A step that completes a short prompt keeps the long ones beside it to the decodes' bound,
    slack or not."""
    from test_scheduler_latency import Clock

    clock = Clock()
    s = scheduler_with(bound=0.05, idle_bound=0.5, clock=clock)
    streams = [make_request(f"d{i}", num_prompt=40, max_tokens=60) for i in range(4)]
    for r in streams:
        s.add(r)
    while not all(r.num_output_tokens >= 12 for r in streams):
        step(s, clock=clock)
    long = make_request("long", num_prompt=8000, max_tokens=2)
    short = make_request("short", num_prompt=40, max_tokens=2)
    s.add(long)
    s.add(short)
    out, predicted = step(s, clock=clock)
    assert _chunk(out, short) == 40 and _chunk(out, long) > 0
    assert not out.slack and predicted <= 0.05 * (1 + 1e-9)
    # The short one decodes now, a stream without slack: the steps keep to the bound until it
    # ends; the long prompt then takes the others' slack.
    while short.finish_reason is None:
        out, predicted = step(s, clock=clock)
        assert not out.slack and predicted <= 0.05 * (1 + 1e-9)
    out, predicted = step(s, clock=clock)
    assert out.slack and predicted > 0.05
