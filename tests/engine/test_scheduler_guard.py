"""Guarded steps: a stream with no gap past the bound left to spend within its p90 gets steps
filled by the calibration's higher quantile (``[scheduler] tbt_guard``).

A stream's allowance is counted over its expected length: the gaps it has had, or a typical
finished request's if more, at most its ``max_tokens``'. Synthetic latency models; the clock
moves only where a test moves it, so gaps are long only where a test makes them so.
"""

from __future__ import annotations

import pytest

from hydrad.engine.latency_model import Calibration, StepShape
from test_scheduler import finish_step, make_request
from test_scheduler_latency import Clock, _full_to, scheduler_with

BOUND = 0.03


def _streams(clock: Clock, max_tokens: int = 1000, guard: bool = True, before: int = 0):
    """Four streams decoding on an instance with a ``BOUND`` step bound, after ``before``
    requests of 32 tokens finished there (their gaps all short); a long prompt waits."""
    s = scheduler_with(bound=BOUND, idle_bound=0.5, kv_block_size=16, clock=clock, tbt_guard=guard)
    s.set_calibration(1.0, 1.5)
    for i in range(before):
        s.add(make_request(f"done{i}", num_prompt=16, max_tokens=32))
    while s.num_unfinished:
        finish_step(s, s.schedule())
    streams = [make_request(f"d{i}", num_prompt=16, max_tokens=max_tokens) for i in range(4)]
    for r in streams:
        s.add(r)
    while not all(r.num_output_tokens for r in streams):
        finish_step(s, s.schedule())
    s.add(make_request("p", num_prompt=4000, max_tokens=2))
    return s, streams


def _long_gap(s, clock: Clock):
    """One step whose tokens come a second after the streams' last: a gap past the bound each."""
    out = s.schedule()
    clock.now += 1.0
    finish_step(s, out)


def test_a_stream_with_no_long_gap_left_to_spend_gets_steps_filled_by_the_higher_quantile():
    """A young stream (its allowance counted over the gaps it has had: none within 10) that
    had a gap past the bound makes each step it is in fill to bound / guard factor; the
    steps before it did filled to bound / factor; the count of guarded steps says so."""
    clock = Clock()
    s, streams = _streams(clock)
    out = s.schedule()
    assert out.num_decodes == 4 and _full_to(s, out, BOUND) and s.num_guarded_steps == 0
    finish_step(s, out)
    clock.now += 1.0
    finish_step(s, s.schedule())  # a gap past the bound for each stream
    assert all(r.num_long_gaps == 1 for r in streams)
    out = s.schedule()
    assert out.num_decodes == 4 and _full_to(s, out, BOUND / 1.5) and s.num_guarded_steps == 1
    finish_step(s, out)
    for r in streams:
        s.abort(r.req_id)
    out = s.schedule()  # the spent streams left: the prompt alone, to its idle bound
    assert out.num_decodes == 0 and s.num_guarded_steps == 1


def test_a_guarded_step_keeps_every_decode_and_guards_only_its_prompt_work():
    """With 100 streams the decodes alone take more than the guarded bound (bound / 1.5) and
    less than the bound: a guarded step still carries every one of them, and no prompt
    work; the step before, unguarded, carries a prompt chunk up to the bound."""
    clock = Clock()
    s = scheduler_with(bound=BOUND, idle_bound=0.5, kv_block_size=16, clock=clock, max_num_seqs=256)
    s.set_calibration(1.0, 1.5)
    streams = [make_request(f"d{i}", num_prompt=16, max_tokens=1000) for i in range(100)]
    for r in streams:
        s.add(r)
    while not all(r.num_output_tokens for r in streams):
        finish_step(s, s.schedule())
    s.add(make_request("p", num_prompt=4000, max_tokens=2))
    out = s.schedule()
    decodes_alone = s.latency_model.step_seconds(StepShape.of(decodes=[r.num_computed_tokens + 1 for r in streams]))
    assert BOUND / 1.5 < decodes_alone < BOUND
    assert out.num_decodes == 100 and len(out.chunks) == 101 and _full_to(s, out, BOUND)
    clock.now += 1.0
    finish_step(s, out)  # a gap past the bound for every stream: all spent
    out = s.schedule()
    assert out.num_decodes == 100 and len(out.chunks) == 100 and s.num_guarded_steps == 1


def test_a_streams_allowance_is_counted_over_a_typical_finished_requests_length():
    """After requests of 32 tokens (31 gaps) finished here, a young stream may have three
    gaps past the bound (``gaps_past_p90(31)``): its steps are guarded once it has had them
    all; one whose ``max_tokens`` is 5 may have none."""
    clock = Clock()
    s, streams = _streams(clock, before=16)
    for gaps in range(1, 4):
        _long_gap(s, clock)
        assert all(r.num_long_gaps == gaps for r in streams)
        out = s.schedule()
        assert out.num_decodes == 4 and s.num_guarded_steps == (gaps == 3), gaps
        assert _full_to(s, out, BOUND / 1.5 if gaps == 3 else BOUND)
        finish_step(s, out)

    clock = Clock()
    short, streams = _streams(clock, max_tokens=5, before=16)
    _long_gap(short, clock)
    out = short.schedule()
    assert out.num_decodes == 4 and _full_to(short, out, BOUND / 1.5) and short.num_guarded_steps == 1


def test_a_stream_whose_length_grows_past_the_typical_one_gets_its_allowance_back():
    """A stream that has spent its allowance and decodes on past the typical length gains
    one more allowed gap every ten: from its 41st gap on, its steps are no longer guarded."""
    clock = Clock()
    s, streams = _streams(clock, before=16)
    for _ in range(3):
        _long_gap(s, clock)
    guarded = s.num_guarded_steps
    while streams[0].num_output_tokens < 42:  # 41 gaps allow four past the bound
        finish_step(s, s.schedule())
        guarded += 1
        assert s.num_guarded_steps == guarded
    finish_step(s, s.schedule())
    assert s.num_guarded_steps == guarded


def test_without_the_guard_every_step_is_filled_by_the_p90():
    clock = Clock()
    s, streams = _streams(clock, guard=False)
    _long_gap(s, clock)
    out = s.schedule()
    assert out.num_decodes == 4 and _full_to(s, out, BOUND) and s.num_guarded_steps == 0


def test_the_guard_factor_is_the_higher_quantile_of_the_same_steps():
    c = Calibration(window=50, every=50, quantile=0.9, guard_quantile=0.98)
    for i in range(50):
        c.add(0.010, 0.010 * (1.0 + 0.01 * i))  # ratios 1.00 .. 1.49
    assert c.factor == pytest.approx(1.45) and c.guard_factor == pytest.approx(1.49)
    with pytest.raises(ValueError, match="guard_quantile"):
        Calibration(quantile=0.9, guard_quantile=0.8)
