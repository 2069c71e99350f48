"""Algorithm 1 on synthetic requests: budgets, ordering, preemption, aborts, integrity."""

from __future__ import annotations

import random

import pytest
import torch

from hydrad.config import SchedulerConfig
from hydrad.engine.block_manager import BlockManager
from hydrad.engine.inputs import EngineRequest, ImageInput
from hydrad.engine.request import Request, RequestStatus
from hydrad.engine.scheduler import Scheduler
from hydrad.sampling_params import SamplingParams

EOS = 0


def make_request(req_id, num_prompt=20, images=(), max_tokens=8, ignore_eos=True, prompt_logprobs=None) -> Request:
    """images: (offset, length) pairs inside the prompt, or (offset, length, num_patches[,
    attention_span]); ``prompt_logprobs``: its prompt priced (``SamplingParams``')."""
    return Request(
        EngineRequest(
            req_id=str(req_id),
            prompt_token_ids=[5 + i % 50 for i in range(num_prompt)],
            sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos,
                                           prompt_logprobs=prompt_logprobs),
            images=[ImageInput(torch.zeros(1), *image[:2], num_patches=sum(image[2:3]), attention_span=sum(image[3:]))
                    for image in images],
            eos_token_ids=(EOS,),
        )
    )


def make_scheduler(num_kv_blocks=64, kv_block_size=4, num_image_blocks=8, image_block_size=16,
                   token_budget=32, image_budget=2, max_num_seqs=64, max_model_len=4096, clock=None,
                   prefill_after_encode=False, long_prompt_share=0.25, tbt_slack=True, tbt_guard=True) -> Scheduler:
    """``clock``: the scheduler's seconds; by default time stands still (steps take none), so
    no stream's token is ever late unless a test moves the clock."""
    return Scheduler(
        SchedulerConfig(token_budget=token_budget, image_budget=image_budget, max_num_seqs=max_num_seqs,
                        long_prompt_share=long_prompt_share, tbt_slack=tbt_slack, tbt_guard=tbt_guard),
        BlockManager(num_kv_blocks, kv_block_size, "kv"),
        BlockManager(num_image_blocks, image_block_size, "image"),
        max_model_len,
        clock=clock or (lambda: 0.0),
        prefill_after_encode=prefill_after_encode,
    )


def schedule_pulling(s: Scheduler):
    """The next step of an instance that takes migrating requests, each copy done at once
    (those admitted ahead of the step, ``admit_pulls``, and those in it)."""
    for pull in s.admit_pulls():
        s.finish_pull(pull.req)
    out = s.schedule()
    s.check_integrity()
    for pull in out.pulls:
        s.finish_pull(pull.req)
    return out


def finish_step(s: Scheduler, out, token=7):
    """The step's results: its encodes done, and ``token`` sampled for each chunk that
    completes its request's tokens, in chunk order (as the runner samples)."""
    s.update_after_encode(out)
    return s.update_after_language(out, [token for r, n in out.chunks if r.num_computed_tokens + n == r.num_tokens])


def run_step(s: Scheduler, token=7, pulling: bool = False):
    """One step with synthetic model outputs; checks the invariants the engine relies on.
    ``pulling``: migrating requests' copies are done at once (``schedule_pulling``)."""
    out = schedule_pulling(s) if pulling else s.schedule()
    s.check_integrity()
    # A request preempted while this step was built may run again in it: the runner must
    # drop its old batch row before the step, so it is among this step's dropped.
    assert all(any(d is r for d in out.dropped) for r in out.preempted)
    assert sum(n for _, n in out.chunks) <= s.config.token_budget
    assert len(out.encodes) <= s.config.image_budget
    for req, n in out.chunks:
        # With prefill_after_encode, a prefill may start in the step that encodes its last images.
        in_step = sum(1 for r, _ in out.encodes if r is req) if s.prefill_after_encode else 0
        assert req.num_encoded_images + in_step == req.num_images, "prefill scheduled before its images are encoded"
        assert len(req.kv_block_ids) * s.kv.block_size >= req.num_computed_tokens + n
        for i, image in enumerate(req.images):
            touches = req.num_computed_tokens < image.offset + image.length and image.offset < req.num_computed_tokens + n
            if touches:
                assert req.image_block_ids[i], "prefill reads an image whose blocks were freed"
    for req, index in out.encodes:
        assert req.image_block_ids[index]
    result = finish_step(s, out, token)
    s.check_integrity()
    return out, result


def run_to_completion(s: Scheduler, reqs, max_steps=10_000):
    for _ in range(max_steps):
        if not s.num_unfinished:
            break
        run_step(s)
    assert s.num_unfinished == 0
    assert s.kv.num_used_blocks == 0 and s.images.num_used_blocks == 0
    for r in reqs:
        assert r.status is RequestStatus.FINISHED


def test_decodes_come_first_then_prefill_chunks():
    s = make_scheduler(token_budget=16)
    a = make_request("a", num_prompt=10)
    s.add(a)
    run_step(s)  # a prefilled fully, first token sampled
    b = make_request("b", num_prompt=40)
    s.add(b)
    out, _ = run_step(s)
    assert out.chunks[0] == (a, 1)
    assert out.chunks[1][0] is b and out.chunks[1][1] == 15  # the rest of the budget


def test_prefill_is_chunked_through_image_tokens_and_waits_for_encode():
    s = make_scheduler(token_budget=7, image_block_size=16)
    r = make_request("r", num_prompt=30, images=[(3, 16)], max_tokens=2)
    s.add(r)
    out, _ = run_step(s)
    assert out.encodes == [(r, 0)] and not out.chunks  # encode first, prefill next step
    seen = []
    while r.status is not RequestStatus.FINISHED:
        out, _ = run_step(s)
        seen += [n for q, n in out.chunks if q is r]
    assert seen[:5] == [7, 7, 7, 7, 2]  # 30 prompt tokens in chunks of the budget
    assert s.images.num_used_blocks == 0


def test_with_prefill_after_encode_a_prefill_starts_in_the_step_that_encodes_its_last_image():
    """Vision and language of a step run one after the other: the step that encodes a
    request's last image also takes its first chunk (the features are written before the
    prefill reads them); a request with an image left to encode waits."""
    now = [0.0]
    s = make_scheduler(token_budget=7, image_block_size=16, image_budget=1, prefill_after_encode=True,
                       clock=lambda: now[0])
    r = make_request("r", num_prompt=30, images=[(3, 16)], max_tokens=2)
    two = make_request("two", num_prompt=40, images=[(1, 8), (20, 8)], max_tokens=2)
    s.add(r)
    s.add(two)
    out = s.schedule()
    assert out.encodes == [(r, 0)] and out.chunks == [(r, 7)]
    assert r.status is RequestStatus.RUNNING and r.num_held_images == 1 and "two" in s.requests
    now[0] = 1.0
    s.update_after_encode(out, exec_time=0.25, language_time=0.5)
    s.update_after_language(out, [])
    s.check_integrity()
    # Its encoding ended before the step's language work.
    assert r.timeline["encode_done"] == 0.5 and r.timeline["encode_exec"] == 0.25
    assert r.num_computed_tokens == 7 and r.num_encoded_images == 1
    out, _ = run_step(s)  # r's next chunk fills the budget; two's first image alone (one a step)
    assert out.encodes == [(two, 0)] and out.chunks == [(r, 7)]
    out, _ = run_step(s)
    assert out.encodes == [(two, 1)] and [q for q, _ in out.chunks] == [r]  # no room left for two
    while r.status is not RequestStatus.FINISHED:
        run_step(s)
    run_to_completion(s, [r, two])


def test_image_blocks_freed_once_prefill_read_past_them():
    s = make_scheduler(token_budget=10, image_block_size=8)
    r = make_request("r", num_prompt=40, images=[(2, 8), (20, 8)])
    s.add(r)
    run_step(s)
    assert s.images.num_used_blocks == 2
    run_step(s)  # tokens 0..9: first image read
    assert r.image_block_ids[0] == [] and r.image_block_ids[1]
    run_step(s)
    run_step(s)  # tokens up to 29: second image read
    assert s.images.num_used_blocks == 0


def test_image_budget_limits_encodes_per_step():
    s = make_scheduler(image_budget=2, num_image_blocks=16, image_block_size=4)
    reqs = [make_request(i, num_prompt=30, images=[(1, 4), (10, 4), (20, 4)]) for i in range(3)]
    for r in reqs:
        s.add(r)
    counts = []
    for _ in range(6):
        out, _ = run_step(s)
        counts.append(len(out.encodes))
    assert max(counts) == 2 and sum(counts) == 9


def test_preemption_under_kv_pressure_and_everything_finishes():
    s = make_scheduler(num_kv_blocks=12, kv_block_size=4, token_budget=64)
    reqs = [make_request(i, num_prompt=12, max_tokens=20) for i in range(4)]
    for r in reqs:
        s.add(r)
    run_to_completion(s, reqs)
    assert s.num_preemptions > 0
    for r in reqs:
        assert r.num_output_tokens == 20 and r.finish_reason == "length"


@pytest.mark.parametrize("prefill_after_encode", [False, True])
def test_randomized_mix_keeps_integrity(prefill_after_encode):
    rng = random.Random(0)
    s = make_scheduler(num_kv_blocks=24, kv_block_size=4, num_image_blocks=6, image_block_size=8,
                       token_budget=24, image_budget=2, prefill_after_encode=prefill_after_encode)
    reqs = []
    for i in range(30):
        n = rng.randint(12, 40)
        images = [(1, 8)] if rng.random() < 0.5 else []
        if images and rng.random() < 0.3:
            images.append((10, 8))
        reqs.append(make_request(i, num_prompt=n, images=images, max_tokens=rng.randint(1, 12)))
    pending = list(reqs)
    aborted = set()
    for step in range(5000):
        if pending and rng.random() < 0.5:
            s.add(pending.pop(0))
        if s.num_unfinished and rng.random() < 0.05:
            victim = rng.choice(list(s.requests.values()))
            s.abort(victim.req_id)
            aborted.add(victim.req_id)
            s.check_integrity()
        if not pending and not s.num_unfinished:
            break
        run_step(s)
    assert not s.num_unfinished
    assert s.kv.num_used_blocks == 0 and s.images.num_used_blocks == 0
    for r in reqs:
        if r.req_id not in aborted:
            assert r.finish_reason == "length" and r.num_output_tokens == r.sampling_params.max_tokens


@pytest.mark.parametrize("when", ["waiting", "encoding", "mid-prefill", "mid-decode"])
def test_abort_frees_everything(when):
    s = make_scheduler(token_budget=8)
    r = make_request("r", num_prompt=30, images=[(2, 16)], max_tokens=50)
    other = make_request("o", num_prompt=10, max_tokens=50)
    s.add(other)
    s.add(r)
    steps = {"waiting": 0, "encoding": 1, "mid-prefill": 3, "mid-decode": 8}[when]
    for _ in range(steps):
        run_step(s)
    expected = {"waiting": RequestStatus.WAITING, "encoding": RequestStatus.RUNNING,
                "mid-prefill": RequestStatus.RUNNING, "mid-decode": RequestStatus.RUNNING}[when]
    assert r.status is expected
    if when == "mid-prefill":
        assert 0 < r.num_computed_tokens < r.num_prompt_tokens
    if when == "mid-decode":
        assert r.num_output_tokens > 0
    held_before = s.kv.num_used_blocks
    s.abort("r")
    s.check_integrity()
    assert r.status is RequestStatus.FINISHED and r.finish_reason == "abort"
    assert r.kv_block_ids == [] and all(not b for b in r.image_block_ids)
    assert s.kv.num_used_blocks == len(other.kv_block_ids) <= held_before
    s.abort("o")
    assert s.kv.num_used_blocks == 0 and s.images.num_used_blocks == 0


@pytest.mark.parametrize("max_tokens, max_model_len, eos_at", [
    (1, 4096, None), (4, 4096, None), (8, 4096, 0), (8, 4096, 3), (4, 4096, 3), (50, 24, None), (50, 24, 3),
])
def test_first_tokens_and_decodes_end_by_one_rule(max_tokens, max_model_len, eos_at):
    """The stop test runs in two places, ``_stop_reason`` for a prompt's first token and
    written out in the decode loop (its hot path): both end a request at its EOS ("stop",
    before any length limit it reaches with the same token), at ``max_tokens`` or at
    ``max_model_len`` ("length"), and not a token earlier or later."""
    prompt = 20
    s = make_scheduler(max_model_len=max_model_len)
    r = make_request("r", num_prompt=prompt, max_tokens=max_tokens, ignore_eos=False)
    s.add(r)
    while r.finish_reason is None:
        run_step(s, token=EOS if r.num_output_tokens == eos_at else 7)
    limit = min(max_tokens, max_model_len - prompt)
    stops = eos_at is not None and eos_at < limit
    assert r.finish_reason == ("stop" if stops else "length")
    assert r.num_output_tokens == (eos_at + 1 if stops else limit)


def test_stop_on_eos_unless_ignored():
    s = make_scheduler()
    a = make_request("a", max_tokens=5, ignore_eos=False)
    b = make_request("b", max_tokens=5, ignore_eos=True)
    s.add(a)
    s.add(b)
    _, steps = run_step(s, token=EOS)
    assert a.finish_reason == "stop" and a.output_token_ids == [EOS]
    assert b.finish_reason is None
    run_to_completion(s, [a, b])
    assert b.finish_reason == "length" and b.num_output_tokens == 5


def test_refuses_what_can_never_fit():
    s = make_scheduler(num_kv_blocks=4, kv_block_size=4, num_image_blocks=1, image_block_size=8)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add(make_request("big", num_prompt=10, max_tokens=10))
    with pytest.raises(ValueError, match="image-cache blocks"):
        s.add(make_request("img", num_prompt=10, images=[(0, 9)], max_tokens=2))
    s.check_integrity()


def test_block_manager_detects_double_free_and_leaks():
    m = BlockManager(4, 2)
    ids = m.allocate(2)
    m.check_integrity([ids])
    with pytest.raises(AssertionError, match="leaked"):
        m.check_integrity([])
    m.free(ids)
    with pytest.raises(RuntimeError, match="not allocated"):
        m.free(ids[:1])
    assert m.can_allocate(4) and not m.can_allocate(5)


def test_token_ids_span_prompt_and_output():
    r = make_request("t", num_prompt=4)
    r.set_output([90, 91, 92])
    everything = r.prompt_token_ids + r.output_token_ids
    for start in range(len(everything)):
        for end in range(start, len(everything) + 1):
            assert r.token_ids(start, end) == everything[start:end]


def test_a_kv_pull_copies_only_the_blocks_of_computed_tokens():
    """A source that cannot recompute reserves blocks for a request's whole length; a target
    that can reserves for the tokens so far plus one. The pull copies the blocks holding the
    computed tokens into as many blocks here, never more source blocks than target blocks."""
    from hydrad.engine.migration import MigrationOffer

    s = make_scheduler(kv_block_size=4)  # EPD: can recompute, reserves num_computed + 1 slots
    prompt = list(range(5, 15))
    offer = MigrationOffer(
        req_id="r", source=1, kind="kv", block_ids=[10, 11, 12, 13, 14, 15], prompt_token_ids=prompt,
        output_token_ids=[7], num_computed_tokens=10,
        sampling_params=SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True), images=[],
        eos_token_ids=(EOS,), generator_state=None, timeline={})
    s.add(Request.from_offer(offer))
    out = s.schedule()
    (pull,) = out.pulls
    assert pull.src_block_ids == [10, 11, 12]  # 10 computed tokens in blocks of 4
    assert len(pull.dst_block_ids) == 3 and len(pull.req.kv_block_ids) == 3
    s.check_integrity()


@pytest.mark.parametrize("takes_last_block", [False, True])
def test_pulls_admitted_ahead_of_a_step_leave_a_block_per_running_decode(takes_last_block):
    """``admit_pulls`` (before the step is built) keeps one free KV block per running decode,
    which the step may need to grow it; ``schedule`` then admits what is left as before."""
    from hydrad.engine.migration import MigrationOffer

    s = make_scheduler(num_kv_blocks=16, kv_block_size=4)
    s.add(make_request("d", num_prompt=6, max_tokens=20))
    while "d" not in s.decoding:
        run_step(s)
    free = s.kv.num_free_blocks
    # Blocks for its computed tokens plus the next one: every free block, or all but one.
    num_computed = 4 * (free if takes_last_block else free - 1) - 1
    offer = MigrationOffer(
        req_id="r", source=1, kind="kv", block_ids=list(range(100, 100 + free)),
        prompt_token_ids=list(range(5, 5 + num_computed)), output_token_ids=[7], num_computed_tokens=num_computed,
        sampling_params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), images=[],
        eos_token_ids=(EOS,), generator_state=None, timeline={})
    s.add(Request.from_offer(offer))
    pulls = s.admit_pulls()
    if takes_last_block:  # the decode may need that block: left for schedule()
        assert pulls == [] and [r.req_id for r in s.incoming] == ["r"]
    else:
        assert [p.req.req_id for p in pulls] == ["r"] and s.kv.num_free_blocks == 1
    s.check_integrity()


def handed_decode(req_id: str, num_computed: int = 5, max_tokens: int = 3) -> Request:
    """A decode handed over from another instance (its first token sampled there), arriving now."""
    from hydrad.engine.migration import MigrationOffer

    return Request.from_offer(MigrationOffer(
        req_id=req_id, source=1, kind="kv", block_ids=list(range(100, 100 + (num_computed + 3) // 4)),
        prompt_token_ids=list(range(5, 5 + num_computed)), output_token_ids=[7], num_computed_tokens=num_computed,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), images=[],
        eos_token_ids=(EOS,), generator_state=None, timeline=make_request("t").timeline))


@pytest.mark.parametrize("case", ["prefilling", "retiring P", "waiting"])
def test_decodes_handed_over_without_end_leave_an_older_prompt_its_room(case):
    """An instance that prefills and takes decodes from others (a mixed deployment, or one
    handing its P over in a redeploy), its pool full, while each decode that ends is followed
    by another (a closed loop at saturation). The blocks the ending decodes free used to be
    pulled at once by the next ones: a prompt mid-prefill got none (with P handed over it
    then held the hand-over for as long as the load lasted) and a waiting one was never
    admitted. Now a KV pull leaves the admitted prompts' room, and a prompt that arrived
    before the first migrating request is admitted ahead of it."""
    # Each decode holds 2 blocks of 4 for all its 3 tokens: 12 fill the pool.
    s = make_scheduler(num_kv_blocks=24, kv_block_size=4, token_budget=8)
    names = (f"d{i}" for i in range(10_000))
    p = make_request("p", num_prompt=40, max_tokens=4)  # 10 blocks
    if case == "waiting":
        for _ in range(12):  # these came first: they are pulled first
            s.add(handed_decode(next(names)))
        s.add(p)
    else:
        s.add(p)
        run_step(s)  # its first chunk: 8 of its 40 tokens
        assert "p" in s.prefilling
        if case == "retiring P":
            s.retire("P")
        for _ in range(12):
            s.add(handed_decode(next(names)))
    for _ in range(100):
        out, result = run_step(s, pulling=True)
        for req in result.finished:
            if req is not p:
                s.add(handed_decode(next(names)))
        if p.output_token_ids:
            break
    assert p.output_token_ids, f"{p.req_id} never got its first token: {p.num_computed_tokens} of 40 computed"
    assert p.num_preemptions == 0
    if case == "retiring P":  # its prefill done, it decodes here: the hand-over is complete
        assert s.drained(keep_kv=True, keep_images=False)


@pytest.mark.parametrize("images", [True, False])
def test_admission_leaves_kv_for_the_prompts_already_admitted(images):
    """A request is admitted (to encoding or to its first chunk) only while the free KV covers
    its prompt and what the requests admitted before it still need for theirs: at hundreds of
    streams, admitting on image-cache room alone over-commits the pool, and the prefills then
    preempt each other (an image request preempted is encoded again)."""
    s = make_scheduler(num_kv_blocks=40, kv_block_size=4, num_image_blocks=64, image_block_size=16,
                       token_budget=64, image_budget=2)
    # 38 prompt tokens and 2 generated: 10 blocks each, taken whole by the prefill (no decode grows).
    reqs = [make_request(i, num_prompt=38, images=[(2, 16)] if images else (), max_tokens=2) for i in range(12)]
    for r in reqs:
        s.add(r)
    encodes = 0
    for _ in range(10_000):
        if not s.num_unfinished:
            break
        out, _ = run_step(s)
        encodes += len(out.encodes)
        admitted = [*s.encoding.values(), *s.running.values()]
        # Each admitted prompt (10 blocks) will be held whole at once: never more than the pool.
        assert sum(s.kv.num_blocks_for(r.num_prompt_tokens) for r in admitted) <= s.kv.num_blocks
    assert s.num_unfinished == 0
    assert s.num_preemptions == 0
    assert encodes == (len(reqs) if images else 0)
