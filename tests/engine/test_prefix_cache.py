"""Prefix caching: the pool's registered blocks, block digests, and the scheduler taking
cached prefixes (checked against a fake KV pool that records what each slot was computed
from, so a block handed to the wrong request cannot go unnoticed)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from hydrad.config import SchedulerConfig
from hydrad.engine.block_manager import BlockManager
from hydrad.engine.inputs import EngineRequest, ImageInput
from hydrad.engine.prefix_cache import block_digests
from hydrad.engine.request import Request, RequestStatus
from hydrad.engine.scheduler import Scheduler
from hydrad.sampling_params import SamplingParams


# -- the pool ------------------------------------------------------------------------------------
def test_registered_blocks_are_found_shared_and_kept_after_release():
    pool = BlockManager(4, 2, "kv")
    a = pool.allocate(2)
    assert pool.register(a[0], b"x") and pool.register(a[1], b"y")
    assert not pool.register(a[0], b"z"), "a block is registered once"
    assert pool.lookup([b"x", b"y", b"w"]) == a
    assert pool.lookup([b"y"]) == [a[1]] and pool.lookup([b"w", b"x"]) == []
    pool.acquire(a)  # a second holder
    pool.check_integrity([a, list(a)])
    with pytest.raises(AssertionError, match="miscounted"):
        pool.check_integrity([a])
    pool.free(a)
    assert pool.num_used_blocks == 2 and pool.num_free_blocks == 2
    pool.free(a)
    # Released, still registered, and free to allocate.
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    assert pool.num_unheld(a) == 2
    pool.acquire(pool.lookup([b"x"]))
    assert pool.num_free_blocks == 3 and pool.num_unheld(a) == 1
    pool.check_integrity([[a[0]]])


def test_allocate_takes_unregistered_blocks_first_then_the_end_of_prefixes():
    pool = BlockManager(5, 1, "kv")
    a = pool.allocate(3)
    for block_id, digest in zip(a, (b"p0", b"p1", b"p2")):
        pool.register(block_id, digest)
    pool.free(a)
    first = pool.allocate(2)  # the two never-registered blocks
    assert set(first).isdisjoint(a) and pool.num_cached_blocks == 3
    assert pool.allocate(1) == [a[2]], "the end of a prefix goes first"
    assert pool.lookup([b"p0", b"p1", b"p2"]) == a[:2] and pool.num_cached_blocks == 2
    pool.check_integrity([first, [a[2]]])
    # An unregistered block cannot be shared.
    with pytest.raises(AssertionError, match="two owners"):
        pool.check_integrity([first, [first[0]], [a[2]]])
    with pytest.raises(RuntimeError, match="not registered"):
        pool.acquire([first[0]])


# -- digests -------------------------------------------------------------------------------------
def _request(req_id, tokens, images=(), max_tokens=4) -> Request:
    return Request(EngineRequest(str(req_id), list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                          ignore_eos=True), images=list(images)))


def _image(offset, length, seed) -> ImageInput:
    return ImageInput(torch.full((3, 4, 4), float(seed)), offset, length)


def test_block_digests_follow_tokens_and_image_content():
    base = list(range(100, 140))
    a = _request("a", base, [_image(10, 12, seed=1)])
    same = _request("same", base, [_image(10, 12, seed=1)])
    other_image = _request("other", base, [_image(10, 12, seed=2)])
    other_token = _request("tok", base[:25] + [7] + base[26:], [_image(10, 12, seed=1)])
    da = block_digests(a, 4, 9)
    assert len(da) == 9 and block_digests(same, 4, 9) == da
    # The image covers tokens 10..21: blocks 2..5 see it, and every block after depends on it.
    do = block_digests(other_image, 4, 9)
    assert do[:2] == da[:2] and all(x != y for x, y in zip(do[2:], da[2:]))
    dt = block_digests(other_token, 4, 9)  # token 25 is in block 6
    assert dt[:6] == da[:6] and all(x != y for x, y in zip(dt[6:], da[6:]))
    # Where the image's content is unknown, no block from its first placeholder on has a digest.
    unknown = _request("u", base, [ImageInput(None, 10, 12)])
    assert len(block_digests(unknown, 4, 9)) == 2
    # A migrated image keeps its digest without its pixels.
    moved = dataclasses.replace(a.images[0], pixel_values=None)
    assert block_digests(_request("m", base, [moved]), 4, 9) == da


# -- the scheduler ---------------------------------------------------------------------------------
def make_scheduler(num_kv_blocks=64, kv_block_size=4, num_image_blocks=8, image_block_size=16, token_budget=32,
                   max_num_seqs=64, prefix_caching=True) -> Scheduler:
    return Scheduler(SchedulerConfig(token_budget=token_budget, image_budget=2, max_num_seqs=max_num_seqs),
                     BlockManager(num_kv_blocks, kv_block_size, "kv"),
                     BlockManager(num_image_blocks, image_block_size, "image"),
                     4096, clock=lambda: 0.0, prefix_caching=prefix_caching)


class FakePool:
    """What each KV slot and image slot was computed from, written as a step would write it:
    a KV slot holds the request's tokens up to its position and the images among them, an
    image slot its image. Every step checks that each chunk's earlier positions hold its own."""

    def __init__(self, s: Scheduler):
        self.s = s
        self.kv: dict[tuple[int, int], tuple] = {}
        self.image: dict[int, bytes] = {}

    @staticmethod
    def key(req: Request, pos: int) -> tuple:
        images = tuple(image.digest() for image in req.images if image.offset <= pos)
        return tuple(req.token_ids(0, pos + 1)), images

    def check_and_write(self, out) -> None:
        bs, ibs = self.s.kv.block_size, self.s.images.block_size
        for req, index in out.encodes:
            for block_id in req.image_block_ids[index]:
                self.image[block_id] = req.images[index].digest()
        for req, n in out.chunks:
            start = req.num_computed_tokens
            for pos in range(start):
                slot = (req.kv_block_ids[pos // bs], pos % bs)
                assert self.kv.get(slot) == self.key(req, pos), f"{req} reads KV it did not compute at {pos}"
            for i, image in enumerate(req.images):
                if start < image.offset + image.length and image.offset < start + n:
                    blocks = req.image_block_ids[i]
                    assert blocks and all(self.image.get(b) == image.digest() for b in blocks[: -(-image.length // ibs)])
            for pos in range(start, start + n):
                self.kv[req.kv_block_ids[pos // bs], pos % bs] = self.key(req, pos)


def step(s: Scheduler, pool: FakePool, token=7):
    out = s.schedule()
    s.check_integrity()
    for req, n in out.chunks:
        assert req.images_done
    pool.check_and_write(out)
    s.update_after_encode(out)
    sampled = [token for r, n in out.chunks if r.num_computed_tokens + n == r.num_tokens]
    result = s.update_after_language(out, sampled)
    s.check_integrity()
    return out, result


def run_until_done(s, pool, reqs, max_steps=5000) -> list:
    outs = []
    for _ in range(max_steps):
        if not s.num_unfinished:
            break
        outs.append(step(s, pool)[0])
    assert all(r.status is RequestStatus.FINISHED for r in reqs)
    assert s.kv.num_used_blocks == 0 and s.images.num_used_blocks == 0
    return outs


def test_a_repeated_prompt_prefills_only_what_was_not_cached():
    s = make_scheduler()
    pool = FakePool(s)
    a = _request("a", range(100, 130))
    s.add(a)
    run_until_done(s, pool, [a])
    assert s.prefix_hits == 0 and s.prefix_queries == 30
    b = _request("b", range(100, 130))
    s.add(b)
    out, _ = step(s, pool)
    # 30 tokens: blocks 0..6 (28 tokens) found; the last two computed, the last one samples.
    assert out.chunks == [(b, 2)] and s.prefix_hits == 28
    run_until_done(s, pool, [b])
    # A longer prompt that begins the same (the next turn of a chat) finds a's prompt and output.
    c = _request("c", list(range(100, 130)) + a.output_token_ids[:3] + [1, 2, 3, 4, 5])
    s.add(c)
    out, _ = step(s, pool)
    assert out.chunks == [(c, 38 - 32)] and s.prefix_hits == 28 + 32
    run_until_done(s, pool, [c])


def test_without_prefix_caching_nothing_is_found():
    s = make_scheduler(prefix_caching=False)
    pool = FakePool(s)
    for name in "ab":
        r = _request(name, range(100, 130))
        s.add(r)
        out, _ = step(s, pool)
        assert out.chunks == [(r, 30)]
        run_until_done(s, pool, [r])
    assert s.kv.num_cached_blocks == 0 and s.prefix_hits == 0


def test_images_inside_a_cached_prefix_are_not_encoded():
    s = make_scheduler()
    pool = FakePool(s)
    prompt = list(range(100, 140))
    a = _request("a", prompt, [_image(4, 16, 1), _image(24, 8, 2)])
    s.add(a)
    run_until_done(s, pool, [a])
    # The same images and text: nothing to encode, 36 tokens found.
    b = _request("b", prompt, [_image(4, 16, 1), _image(24, 8, 2)])
    s.add(b)
    out, _ = step(s, pool)
    assert not out.encodes and out.chunks == [(b, 4)] and s.images_cached == 2
    run_until_done(s, pool, [b])
    # Another second image: the first is found, the second is encoded (the prefix stops before it).
    c = _request("c", prompt, [_image(4, 16, 1), _image(24, 8, 3)])
    s.add(c)
    out, _ = step(s, pool)
    assert out.encodes == [(c, 1)] and c.num_computed_tokens == 24 and s.images_cached == 3
    assert c.image_block_ids[0] == [] and c.image_block_ids[1]
    outs = run_until_done(s, pool, [c])
    assert outs[0].chunks[0] == (c, 16)


def test_a_prefix_that_ends_inside_an_image_reads_it_from_the_image_cache_or_encodes_it():
    s = make_scheduler(num_image_blocks=1)
    pool = FakePool(s)
    a = _request("a", range(100, 160), [_image(30, 12, 1)])
    s.add(a)
    run_until_done(s, pool, [a])
    # b ends two tokens after the image: its last full block before its last token ends at 40,
    # inside the image (30..41); prefill reads the image's last two features, found in the image
    # cache (a encoded it): nothing is encoded.
    b = _request("b", range(100, 143), [_image(30, 12, 1)])
    s.add(b)
    out, _ = step(s, pool)
    assert not out.encodes and out.chunks == [(b, 3)] and s.images_cached == 1
    assert b.found_images == [True]
    run_until_done(s, pool, [b])
    # Another image takes the pool's one block: a third such request encodes the image again.
    s.add(other := _request("other", range(300, 330), [_image(4, 12, 2)]))
    run_until_done(s, pool, [other])
    c = _request("c", range(100, 143), [_image(30, 12, 1)])
    s.add(c)
    out, _ = step(s, pool)
    assert out.encodes == [(c, 0)] and c.num_computed_tokens == 40 and s.images_cached == 1
    outs = run_until_done(s, pool, [c])
    assert outs[0].chunks == [(c, 3)]


def test_a_preempted_request_finds_its_own_blocks_again():
    s = make_scheduler(num_kv_blocks=12, token_budget=64)
    pool = FakePool(s)
    reqs = [_request(i, [200 + i] + list(range(1, 16)), max_tokens=20) for i in range(3)]
    for r in reqs:
        s.add(r)
    outs = run_until_done(s, pool, reqs)
    assert s.num_preemptions > 0
    assert s.prefix_hits > 0, "a preempted request recomputed what it had registered"
    assert sum(len(o.preempted) for o in outs) == s.num_preemptions


def test_equal_prompts_sent_at_once_prefill_once():
    """The n completions of a prompt (or equal prompts sent together): the first prefills it
    and encodes its image, the others wait for that and compute only its last partial block."""
    s = make_scheduler()
    pool = FakePool(s)
    reqs = [_request(name, range(100, 130), [_image(4, 16, 1)]) for name in "abcd"]
    for r in reqs:
        s.add(r)
    out, _ = step(s, pool)
    # a's image alone (the step takes two images: b's would have gone beside it), then its
    # prefill alone (30 of the step's 32 tokens: b would have taken the last two).
    assert out.encodes == [(reqs[0], 0)] and not out.chunks
    out, _ = step(s, pool)
    assert not out.encodes and out.chunks == [(reqs[0], 30)]
    assert all(r.status is RequestStatus.WAITING for r in reqs[1:])
    out, _ = step(s, pool)
    # 28 tokens (7 blocks) found, the image inside them: two tokens each, nothing encoded.
    assert not out.encodes and [(r, n) for r, n in out.chunks[out.num_decodes:]] == [(r, 2) for r in reqs[1:]]
    assert s.prefix_hits == 3 * 28 and s.images_cached == 3 and all(r.num_cached_tokens == 28 for r in reqs[1:])
    run_until_done(s, pool, reqs)
    assert not s._computing


def test_a_prompt_prefilled_in_chunks_is_waited_for_to_its_end():
    s = make_scheduler(token_budget=16)
    pool = FakePool(s)
    a, b = _request("a", range(100, 160)), _request("b", range(100, 160))
    s.add(a)
    s.add(b)
    for expected in (16, 16, 16, 12):
        out, _ = step(s, pool)
        assert out.chunks[-1] == (a, expected) and b.status is RequestStatus.WAITING
    out, _ = step(s, pool)
    assert out.chunks == [(a, 1), (b, 4)] and b.num_cached_tokens == 56
    # A different prompt behind b was not held up: it went in beside a's chunks.
    c = _request("c", range(300, 310))
    d = _request("d", range(300, 310))
    e = _request("e", range(500, 505))
    for r in (c, d, e):
        s.add(r)
    out, _ = step(s, pool)
    assert (c, 10) in out.chunks and e in [r for r, _ in out.chunks] and d.status is RequestStatus.WAITING
    run_until_done(s, pool, [a, b, c, d, e])


def test_a_prompt_whose_first_leaves_is_computed_by_the_next():
    """The first of two equal prompts is aborted (or preempted) during its prefill: the other
    stops waiting and computes it; nothing is left waiting for a request that is gone."""
    s = make_scheduler(token_budget=16)
    pool = FakePool(s)
    a, b = _request("a", range(100, 160)), _request("b", range(100, 160))
    s.add(a)
    s.add(b)
    step(s, pool)
    assert b.status is RequestStatus.WAITING and s._computing
    s.abort("a")
    s.check_integrity()
    assert not s._computing
    out, _ = step(s, pool)
    # b finds a's first 16 tokens (registered before the abort) and goes on from there.
    assert out.chunks == [(b, 16)] and b.num_cached_tokens == 16
    run_until_done(s, pool, [b])


def test_a_prompt_that_shares_only_a_short_beginning_does_not_wait():
    """One block (a system prompt) in common with a prompt being computed: not worth a step's
    wait; half of what it would compute is."""
    s = make_scheduler(token_budget=64)
    pool = FakePool(s)
    a = _request("a", range(100, 130))
    b = _request("b", list(range(100, 104)) + list(range(300, 326)))  # a's first block, then its own
    c = _request("c", list(range(100, 116)) + list(range(400, 416)))  # a's first four blocks of 32 tokens
    for r in (a, b, c):
        s.add(r)
    out, _ = step(s, pool)
    assert [r for r, _ in out.chunks] == [a, b] and c.status is RequestStatus.WAITING
    out, _ = step(s, pool)
    assert out.chunks[-1] == (c, 16) and c.num_cached_tokens == 16
    run_until_done(s, pool, [a, b, c])


def _image_offer(req_id: str, tokens, image) -> Request:
    """A request whose image an E instance encoded, offered here for its prefill."""
    from hydrad.engine.migration import MigrationOffer

    offer = MigrationOffer(
        req_id=req_id, source=9, kind="image", block_ids=[[100 + i for i in range(image.length // 16 + 1)]],
        prompt_token_ids=list(tokens), output_token_ids=[], num_computed_tokens=0,
        sampling_params=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        images=[dataclasses.replace(image, pixel_values=None)], eos_token_ids=(), generator_state=None,
        timeline=dict(_request("x", [1]).timeline), group="g")
    return Request.from_offer(offer)


@pytest.mark.parametrize("abort_first", [False, True])
def test_completions_pulled_in_wait_for_the_first_ones_prefill(abort_first):
    """On an instance that prefills what an E instance encoded, the first of a prompt's
    completions pulled in is noted from its pull on: the others stay offered (their images
    not pulled) until its prefill is registered, then take it cached. Aborted while its pull
    runs, the first frees them."""
    s = make_scheduler()
    s.set_role("PD", s.kv, s.images)
    pool = FakePool(s)
    image = _image(4, 16, 1)
    image.digest()  # as the offer carries it
    reqs = [_image_offer(name, range(100, 130), image) for name in "abc"]
    for r in reqs:
        s.add(r)
    out = s.schedule()
    assert [p.req for p in out.pulls] == reqs[:1] and [r.req_id for r in s.incoming] == ["b", "c"]
    s.check_integrity()
    if abort_first:
        s.abort("a")
        s.finish_pull(reqs[0])  # the copy thread ends; the aborted request gives its blocks back
        s.check_integrity()
        assert not s._computing
        out = s.schedule()
        assert [p.req for p in out.pulls] == reqs[1:2]
        return
    s.finish_pull(reqs[0])
    for block_id in reqs[0].image_block_ids[0]:  # what the copy wrote
        pool.image[block_id] = image.digest()
    s.update_after_encode(out)
    s.update_after_language(out, [])
    out, _ = step(s, pool)
    assert out.chunks == [(reqs[0], 30)] and [r.req_id for r in s.incoming] == ["b", "c"]
    out = s.schedule()  # both pulled now, their images to be read after the cached prefix
    assert [p.req for p in out.pulls] == reqs[1:]
    for pull in out.pulls:
        s.finish_pull(pull.req)
    assert [r.num_cached_tokens for r in reqs[1:]] == [28, 28] and not s._computing
    s.check_integrity()


def test_a_request_that_prices_its_prompt_does_not_wait():
    s = make_scheduler(token_budget=64)
    pool = FakePool(s)
    a = _request("a", range(100, 130))
    b = Request(EngineRequest("b", list(range(100, 130)), SamplingParams(max_tokens=2, temperature=0.0,
                                                                         prompt_logprobs=1)))
    s.add(a)
    s.add(b)
    out, _ = step(s, pool)
    assert out.chunks == [(a, 30), (b, 30)]
    run_until_done(s, pool, [a, b])


# -- the image cache ---------------------------------------------------------------------------------
def _encoder(**kwargs) -> Scheduler:
    """An instance that only encodes (its requests' prefill is another instance's)."""
    s = make_scheduler(**kwargs)
    s.set_role("E", None, s.images)
    return s


def _encode_step(s: Scheduler):
    out = s.schedule()
    s.check_integrity()
    s.update_after_encode(out)
    s.update_after_language(out, [])
    s.check_integrity()
    return out


def _offered(s: Scheduler) -> list[str]:
    offers, s.new_offers = s.new_offers, []
    assert all(kind == "image" for _, kind in offers)
    return [r.req_id for r, _ in offers]


def test_an_image_encoded_for_another_instance_is_found_by_the_next_request_with_it():
    s = _encoder()
    a = _request("a", range(100, 130), [_image(4, 16, 1)])
    s.add(a)
    assert _encode_step(s).encodes == [(a, 0)] and _offered(s) == ["a"]
    # Another question about the same image: offered at once, on a's blocks, nothing encoded.
    b = _request("b", range(200, 240), [_image(4, 16, 1)])
    s.add(b)
    out = _encode_step(s)
    assert not out.encodes and _offered(s) == ["b"] and s.images_cached == 1
    assert b.image_block_ids == a.image_block_ids and b.found_images == [True] and b.images_done
    assert "encode_done" in b.timeline and b.timeline["encode_exec"] == 0
    s.release("a")  # a's target copied its image
    s.check_integrity()
    assert s.images.num_used_blocks == 1, "b still holds the block"
    s.release("b")
    assert s.images.num_used_blocks == 0 and s.images.num_cached_blocks == 1
    # After both are gone it is still found; another image is encoded.
    c, d = _request("c", range(300, 330), [_image(4, 16, 1)]), _request("d", range(300, 330), [_image(4, 16, 2)])
    s.add(c)
    s.add(d)
    assert _encode_step(s).encodes == [(d, 0)] and _offered(s) == ["c", "d"]


def test_completions_sent_at_once_to_an_encoder_encode_their_image_once():
    """The step takes two images: without waiting, b's would be encoded beside a's."""
    s = _encoder()
    reqs = [_request(name, range(100, 130), [_image(4, 16, 1)]) for name in "abcd"]
    for r in reqs:
        s.add(r)
    out = _encode_step(s)
    assert out.encodes == [(reqs[0], 0)] and _offered(s) == ["a"]
    assert all(r.status is RequestStatus.WAITING for r in reqs[1:])
    out = _encode_step(s)
    assert not out.encodes and _offered(s) == ["b", "c", "d"] and s.images_cached == 3
    assert all(r.image_block_ids == reqs[0].image_block_ids for r in reqs[1:]) and not s._encoding_images


def test_a_request_waiting_for_an_image_encodes_it_when_the_first_is_aborted():
    s = _encoder()
    a, b = (_request(name, range(100, 130), [_image(4, 16, 1)]) for name in "ab")
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert out.encodes == [(a, 0)]
    s.abort("a")  # while its encode runs: its blocks are back, nobody waits for it
    s.update_after_encode(out)
    s.update_after_language(out, [])
    s.check_integrity()
    assert not s._encoding_images and s.images.num_cached_blocks == 0
    assert _encode_step(s).encodes == [(b, 0)] and _offered(s) == ["b"]


@pytest.mark.parametrize("case", ["unknown content", "prefix caching off"])
def test_images_are_not_cached_without_their_content_or_prefix_caching(case):
    if case == "unknown content":
        s = _encoder()
        images = [ImageInput(None, 4, 16), ImageInput(None, 4, 16)]
    else:
        s = _encoder(prefix_caching=False)
        images = [_image(4, 16, 1), _image(4, 16, 1)]
    a, b = _request("a", range(100, 130), images[:1]), _request("b", range(100, 130), images[1:])
    s.add(a)
    s.add(b)
    assert _encode_step(s).encodes == [(a, 0), (b, 0)]
    s.add(c := _request("c", range(100, 130), images[1:]))
    assert _encode_step(s).encodes == [(c, 0)] and s.images_cached == 0


def test_an_image_pulled_in_by_an_instance_that_encodes_is_not_waited_for():
    """An EPD instance that prefills what an E instance encoded: the image it pulls in is not
    one it encodes, and nobody waits for it as if it were."""
    s = make_scheduler()
    assert s.role == "EPD"
    image = _image(4, 16, 1)
    image.digest()  # as the offer carries it
    a = _image_offer("a", range(100, 130), image)
    s.add(a)
    out = s.schedule()
    assert [p.req for p in out.pulls] == [a] and not s._encoding_images
    s.check_integrity()


def test_found_images_are_skipped_in_a_requests_encodes_and_read_by_its_prefill():
    """One instance that encodes and prefills: images found anywhere in a prompt are not
    encoded; its prefill reads them from the blocks found (``FakePool`` checks each)."""
    s = make_scheduler()
    pool = FakePool(s)
    x = lambda offset: _image(offset, 16, 1)  # noqa: E731
    a = _request("a", range(100, 130), [x(4)])
    s.add(a)
    run_until_done(s, pool, [a])
    # b's first 24 tokens are a's (x inside them: found in the KV cache); y is new; x again.
    b = _request("b", range(100, 160), [x(4), _image(24, 16, 2), x(44)])
    s.add(b)
    out, _ = step(s, pool)
    assert out.encodes == [(b, 1)] and b.found_images[1:] == [False, True] and b.num_computed_tokens == 24
    assert s.images_cached == 2  # x inside the prefix, x found
    run_until_done(s, pool, [b])
    # x found first, z encoded after it (no prefix: another first token).
    c = _request("c", [999] + list(range(101, 160)), [x(4), _image(24, 16, 3)])
    s.add(c)
    out, _ = step(s, pool)
    assert out.encodes == [(c, 1)] and c.found_images == [True, False] and c.images_done
    run_until_done(s, pool, [c])
    assert s.images_cached == 3 and not s._encoding_images


@pytest.mark.parametrize("seed", range(6))
def test_an_encoder_under_pressure_hands_on_every_image_from_blocks_that_hold_it(seed):
    """An instance that only encodes, a small image pool, requests of one to three images
    drawn from a few pictures, their targets copying them some steps later, aborts: after
    every step the pool and the queues agree, and every request offered holds, for each of
    its images, blocks that were written with that image (encoded here for it or for another
    request before)."""
    rng = random.Random(seed)
    s = _encoder(num_image_blocks=rng.choice([3, 4, 6]), max_num_seqs=rng.choice([2, 8]))
    written: dict[int, bytes] = {}  # image block -> the image an encode wrote into it
    offered: list[Request] = []
    live: list[Request] = []
    encodes = 0

    def encode_step() -> None:
        """One step, its encodes written; each request it offers holds its images."""
        nonlocal encodes
        out = s.schedule()
        s.check_integrity()
        for req, index in out.encodes:
            assert not req.found_images[index]
            for block_id in req.image_block_ids[index]:
                written[block_id] = req.images[index].digest()
        encodes += len(out.encodes)
        s.update_after_encode(out)
        s.update_after_language(out, [])
        s.check_integrity()
        for req, kind in s.new_offers:
            assert kind == "image" and req.images_done
            for image, blocks in zip(req.images, req.image_block_ids):
                assert blocks and all(written.get(b) == image.digest() for b in blocks), f"{req}"
            offered.append(req)
        s.new_offers = []

    for i in range(80):
        n = rng.randrange(1, 4)
        images = [_image(4 + 20 * k, 16, rng.randrange(4)) for k in range(n)]
        r = _request(i, range(100, 100 + 20 * n + 8), images)
        s.add(r)
        live.append(r)
        for _ in range(rng.randrange(0, 3)):
            encode_step()
        while offered and rng.random() < 0.6:  # a target copied one: its blocks go
            s.release(offered.pop(rng.randrange(len(offered))).req_id)
            s.check_integrity()
        if rng.random() < 0.1 and live:
            victim = rng.choice(live)
            if victim.status is not RequestStatus.FINISHED:
                s.abort(victim.req_id)
                offered = [r for r in offered if r is not victim]
                s.check_integrity()
        live = [r for r in live if r.status is not RequestStatus.FINISHED]
    for _ in range(500):  # the rest: encoded and copied
        if not s.num_unfinished:
            break
        encode_step()
        for req in offered:
            s.release(req.req_id)
        offered = []
    assert not s.num_unfinished and s.images.num_used_blocks == 0 and not s._encoding_images
    assert s.images_cached > 0 and encodes > 0


@pytest.mark.parametrize("seed", range(6))
def test_shared_prefixes_under_pressure_keep_every_request_on_its_own_kv(seed):
    """Prompts from a few templates and images, a pool that evicts and preempts, aborts:
    every step reads only KV computed from the reader's own tokens and images."""
    rng = random.Random(seed)
    s = make_scheduler(num_kv_blocks=rng.choice([40, 60, 120]), num_image_blocks=6, token_budget=rng.choice([16, 48]),
                       max_num_seqs=rng.choice([4, 16]))
    pool = FakePool(s)
    templates = [[rng.randrange(10, 60) for _ in range(rng.randrange(4, 30))] for _ in range(3)]
    questions = [[rng.randrange(10, 60) for _ in range(8)] for _ in range(2)]
    live = []
    for i in range(60):
        tokens = list(rng.choice(templates))
        images = []
        if rng.random() < 0.5:
            images.append(_image(len(tokens), 8, rng.randrange(3)))
            tokens += [3] * 8
        if rng.random() < 0.5:  # the same question again
            tokens += questions[rng.randrange(len(questions))]
        tokens += [rng.randrange(10, 60) for _ in range(rng.randrange(1, 12))]
        r = _request(i, tokens, images, max_tokens=rng.randrange(1, 12))
        s.add(r)
        live.append(r)
        for _ in range(rng.randrange(0, 4)):
            if s.num_unfinished:
                step(s, pool)
        if rng.random() < 0.1:
            victim = rng.choice(live)
            if victim.status is not RequestStatus.FINISHED:
                s.abort(victim.req_id)
        live = [r for r in live if r.status is not RequestStatus.FINISHED]
    run_until_done(s, pool, live)
    assert s.prefix_hits > 0 and s.images_cached > 0
