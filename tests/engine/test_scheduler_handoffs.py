"""First tokens handed over (``EP+D``): a decode instance takes a stream after its first token
only where its next step can carry the stream's decode, and the instance that sampled the
first token admits no new prompt while one it handed over has waited past the TBT to be
taken. A saturated decode instance then makes new prompts wait before their first token, not
between their first and second."""

from __future__ import annotations

import dataclasses

import pytest

from hydrad.engine.migration import offer_for
from hydrad.engine.request import Request
from hydrad.engine.scheduler import Scheduler
from test_scheduler import finish_step, make_request
from test_scheduler_latency import MODEL, Clock, scheduler_with, step

# 2 ms a decode: a 50 ms bound carries about twenty of them.
DECODES = dataclasses.replace(MODEL, l_decode=2e-3)
TBT = 0.05


def prefill_instance(bound: float = 1.0, handoff_wait: float | None = None, clock=None,
                     num_kv_blocks: int = 4096) -> Scheduler:
    """A P instance (its decodes handed over), holding new prompts while a first token it
    handed over waits ``handoff_wait`` seconds to be taken (None: never)."""
    s = scheduler_with(DECODES, bound=bound, kv_block_size=16, num_kv_blocks=num_kv_blocks,
                       **({"clock": clock} if clock else {}))
    s.set_role("P", s.kv, s.images)
    s.set_latency_model(DECODES, bound, handoff_wait=handoff_wait)
    return s


def decode_instance(clock=None, num_kv_blocks: int = 4096) -> Scheduler:
    """A D instance whose steps within the TBT carry about twenty decodes."""
    s = scheduler_with(DECODES, bound=TBT, kv_block_size=16, num_kv_blocks=num_kv_blocks,
                       **({"clock": clock} if clock else {}))
    s.set_role("D", s.kv, None)
    return s


def decode_step_seconds(s: Scheduler, contexts: list[int]) -> float:
    m = s.latency_model
    return m.l_fixed + sum(m.l_decode + m.l_ctx * c / 1e3 for c in contexts)


def first_token_offer(source: Scheduler, req_id: str, num_prompt: int = 64, max_tokens: int = 40) -> Request:
    """A request prefilled on ``source`` (a P instance) to its first token; returns the copy a
    decode instance gets from its offer."""
    source.add(make_request(req_id, num_prompt=num_prompt, max_tokens=max_tokens))
    while not any(r.req_id == req_id for r, _ in source.new_offers):
        step(source)
    offers = [r for r, kind in source.new_offers if r.req_id == req_id]
    source.new_offers = [(r, k) for r, k in source.new_offers if r.req_id != req_id]
    return Request.from_offer(offer_for(offers[0], "kv", 0))


def test_a_decode_instance_takes_first_tokens_only_where_its_next_step_carries_their_decodes():
    source, target = prefill_instance(), decode_instance()
    for i in range(40):
        target.add(first_token_offer(source, f"r{i}"))
    pulled_at: dict[str, int] = {}
    for n in range(200):
        out = target.schedule()
        target.check_integrity()
        # Every stream pulled runs in every step from the next one on: none is pulled to wait.
        decodes = [r for r, _ in out.chunks[:out.num_decodes]]
        assert len(decodes) == len(target.decoding)
        for pull in out.pulls:
            pulled_at[pull.req.req_id] = n
            target.finish_pull(pull.req)
        assert decode_step_seconds(target, [r.num_computed_tokens + 1 for r in decodes]) <= TBT * (1 + 1e-9)
        finish_step(target, out)
        if not target.requests:
            break
    assert len(pulled_at) == 40 and not target.requests
    # Only what one step can carry was taken at first; the rest as streams ended.
    assert sum(at == 0 for at in pulled_at.values()) < 25 and max(pulled_at.values()) > 30


def test_streams_handed_over_mid_answer_are_taken_whatever_the_room():
    """A redeploy that takes D from an instance hands over streams already decoding: the
    instance taking D over pulls them at once (the redeploy waits on it), past its step's
    room and past the first tokens waiting for room ahead of them; their decodes then share
    the steps as before."""
    from test_scheduler_latency import _kv_offer

    source, target = prefill_instance(), decode_instance()
    for i in range(30):
        target.add(first_token_offer(source, f"r{i}"))
    for i in range(40):
        target.add(Request.from_offer(_kv_offer(f"m{i}", [7, 7, 7])))
    target.add(first_token_offer(source, "late"))
    out = target.schedule()
    pulled = [p.req.req_id for p in out.pulls]
    assert sum(r.startswith("m") for r in pulled) == 40 and "late" not in pulled
    first = [r for r in pulled if r.startswith("r")]
    assert 0 < len(first) < 30 and first == [f"r{i}" for i in range(len(first))]  # in their order
    assert [r.req_id for r in target.incoming] == [f"r{i}" for i in range(len(first), 30)] + ["late"]


def test_the_instance_that_sampled_first_tokens_holds_new_prompts_while_one_waits_past_the_tbt():
    clock = Clock()
    source = prefill_instance(handoff_wait=TBT, clock=clock)
    source.add(make_request("a", num_prompt=64, max_tokens=8))
    out = source.schedule()
    finish_step(source, out)
    assert [(r.req_id, kind) for r, kind in source.new_offers] == [("a", "kv")]
    source.new_offers.clear()
    # Taken within the TBT: the next prompt is admitted as usual.
    clock.now += 0.8 * TBT
    source.add(make_request("b", num_prompt=64, max_tokens=8))
    out = source.schedule()
    assert [r.req_id for r, _ in out.chunks] == ["b"] and source.num_held_steps == 0
    finish_step(source, out)
    source.new_offers.clear()
    # "a" not taken yet, a TBT after its offer: the prompts that arrive wait here.
    clock.now += 0.3 * TBT
    source.add(make_request("c", num_prompt=64, max_tokens=8))
    out = source.schedule()
    assert not out.chunks and source.num_held_steps == 1 and "c" not in source.running
    # Taken: admitted again, in order. A long prompt admitted beside it goes on while what
    # it handed over waits: prompts already admitted are not held.
    source.release("a")
    source.release("b")
    source.set_latency_model(DECODES, 0.05, handoff_wait=TBT)  # a few hundred prefill tokens a step
    source.add(long := make_request("long", num_prompt=2000, max_tokens=8))
    out = source.schedule()
    assert [r.req_id for r, _ in out.chunks] == ["c", "long"]
    finish_step(source, out)
    assert 0 < long.num_computed_tokens < 2000 and "c" in source.offered
    clock.now += 2 * TBT  # "c" waits past the TBT
    source.add(make_request("d", num_prompt=64, max_tokens=8))
    out = source.schedule()
    assert [r.req_id for r, _ in out.chunks] == ["long"] and "d" not in source.running
    assert source.num_held_steps == 2
    finish_step(source, out)
    # An offer that ends otherwise (aborted) holds nothing any more.
    source.abort("c")
    out = source.schedule()
    assert "d" in {r.req_id for r, _ in out.chunks} and source.num_held_steps == 2


def test_while_first_tokens_wait_the_steps_keep_to_the_handoff_wait():
    """Once a first token has waited past the TBT to be taken, the steps of the instance that
    handed it over keep to the TBT for ``BEHIND_WINDOW`` seconds (its prompts' first tokens
    then come a few at a time, as the decode instance takes them); then the whole bound again."""
    from hydrad.engine.scheduler import BEHIND_WINDOW

    clock = Clock()
    source = prefill_instance(handoff_wait=TBT, clock=clock)
    source.add(make_request("a", num_prompt=64, max_tokens=8))
    finish_step(source, source.schedule())
    source.add(long := make_request("long", num_prompt=20_000, max_tokens=8))
    out = source.schedule()  # "a" just offered: the whole bound
    assert out.predicted_language > 0.5
    finish_step(source, out)
    clock.now += 2 * TBT
    source.add(make_request("w", num_prompt=64, max_tokens=8))
    out = source.schedule()  # "a" waits past the TBT: "w" held, and a step of the TBT
    assert [r.req_id for r, _ in out.chunks] == ["long"] and out.predicted_language <= TBT * (1 + 1e-9)
    assert source.num_held_steps == 1
    finish_step(source, out)
    source.release("a")
    clock.now += BEHIND_WINDOW / 2
    out = source.schedule()  # taken, within the window: "w" admitted, still short steps
    assert "w" in {r.req_id for r, _ in out.chunks} and out.predicted_language <= TBT * (1 + 1e-9)
    assert source.num_held_steps == 1
    finish_step(source, out)
    source.release("w")  # its first token taken at once
    clock.now += BEHIND_WINDOW
    out = source.schedule()  # past it: the whole bound again
    assert out.predicted_language > 0.5 and long.num_computed_tokens < 20_000


def test_without_a_handoff_wait_new_prompts_are_admitted_whatever_waits():
    clock = Clock()
    source = prefill_instance(clock=clock)
    source.add(make_request("a", num_prompt=64, max_tokens=8))
    finish_step(source, source.schedule())
    clock.now += 100.0
    source.add(make_request("b", num_prompt=64, max_tokens=8))
    out = source.schedule()
    assert [r.req_id for r, _ in out.chunks] == ["b"] and source.num_held_steps == 0


def _ep_d(backpressure: bool, num_streams: int, seconds: float, seed: int = 0):
    """A P instance and a D instance, each stepping on its own core (a step lasts what the
    model predicts; an idle instance looks again at the other's next event), in a closed loop
    of ``num_streams`` streams for ``seconds``; a first token offered goes to D at once, and
    D's pulls copy at once. Returns each finished stream's (TTFT, gap between its first and
    second token), and the P instance's held steps."""
    import heapq
    import random

    rng = random.Random(seed)
    clock = Clock()
    p = prefill_instance(0.2, TBT if backpressure else None, clock, num_kv_blocks=8192)
    d = decode_instance(clock, num_kv_blocks=8192)
    arrival, first, second, done = {}, {}, {}, []
    names = iter(range(10**6))

    def new_stream():
        req = make_request(f"s{next(names)}", num_prompt=rng.randrange(32, 400), max_tokens=rng.randrange(8, 40))
        arrival[req.req_id] = clock.now
        p.add(req)

    for _ in range(num_streams):
        new_stream()
    # Each instance steps on its own core: a step starts when its last one ended.
    events = [(0.0, 0, "start", p), (0.0, 1, "start", d)]
    outs, seq = {}, 2
    while clock.now < seconds:
        t, _, what, s = heapq.heappop(events)
        clock.now = t
        if what == "start":
            out = s.schedule()
            for pull in out.pulls:  # copied at once
                s.finish_pull(pull.req)
                p.release(pull.req.req_id)
            if not (out.chunks or out.encodes):
                heapq.heappush(events, (max(events[0][0], t + 1e-4), seq, "start", s))
            else:
                outs[id(s)] = out
                step_seconds = s.latency_model.combine(out.predicted_vision, out.predicted_language)
                heapq.heappush(events, (t + step_seconds, seq, "finish", s))
        else:
            result = finish_step(s, outs.pop(id(s)))
            for req, kind in s.new_offers:
                first[req.req_id] = clock.now
                d.add(Request.from_offer(offer_for(req, kind, 0)))
            s.new_offers.clear()
            if s is d:
                for req in d.decoding.values():
                    if req.num_output_tokens == 2 and req.req_id not in second:
                        second[req.req_id] = clock.now
                for req in result.finished:
                    second.setdefault(req.req_id, clock.now)
                    done.append((first[req.req_id] - arrival[req.req_id], second[req.req_id] - first[req.req_id]))
                    new_stream()
            heapq.heappush(events, (t, seq, "start", s))
        seq += 1
    return done, p.num_held_steps


def test_a_saturated_decode_instance_moves_the_wait_before_the_first_token():
    """96 streams against a decode instance whose steps carry about twenty, for 30 s: without
    the hold, first tokens keep coming and each waits at the decode instance for a stream to
    end (seconds between the first and second token); with it, the gap after the first token
    is a fraction of that and the wait comes before the first token, for as many answers."""
    held, num_held = _ep_d(True, 96, 30.0)
    free, _ = _ep_d(False, 96, 30.0)
    assert num_held > 0 and len(free) > 300

    def pct(values, q):
        values = sorted(values)
        return values[int(q * (len(values) - 1))]

    free_gaps, held_gaps = [g for _, g in free], [g for _, g in held]
    assert pct(free_gaps, 0.5) > 20 * TBT
    assert pct(held_gaps, 0.5) < 0.2 * pct(free_gaps, 0.5) and pct(held_gaps, 0.9) < 0.3 * pct(free_gaps, 0.9)
    # The wait moved before the first token; the answers came as fast.
    assert pct([t for t, _ in held], 0.5) > 10 * pct([t for t, _ in free], 0.5)
    assert len(held) >= 0.95 * len(free)
