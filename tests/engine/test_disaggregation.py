"""Every deployment of roles gives transformers' greedy tokens; migration leaks nothing.

These run the instances in one process (``worker_processes=False``: ``LocalCluster``), with
the same engines, router and pull-based migration protocol that run across worker processes
in the daemon and in ``LLM`` by default, so every intermediate state can be stepped to and
inspected.
"""

from __future__ import annotations

import threading

import pytest
from factories import DEPLOYMENTS

from hydrad import LLM, SamplingParams
from hydrad.engine.migration import Pulled
from hydrad.engine.request import RequestStatus

MAX_TOKENS = 24



def _assert_nothing_held(llm: LLM) -> None:
    for engine in llm.engine.engines:
        engine.scheduler.check_integrity()
        assert not engine.has_unfinished_requests(), engine.scheduler.requests
        if engine.kv_manager:
            assert engine.kv_manager.num_used_blocks == 0
        if engine.image_manager:
            assert engine.image_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def reference(tiny_llava_dir, conversations):
    from test_llm_correctness import _reference_tokens

    return _reference_tokens(tiny_llava_dir, conversations)


@pytest.fixture(scope="module")
def conversations():
    from test_llm_correctness import conversations as make

    return make.__wrapped__()


@pytest.mark.parametrize("deploy, devices", DEPLOYMENTS)
def test_every_deployment_matches_transformers(tiny_llava_dir, deploy, devices, conversations, reference):
    llm = LLM(str(tiny_llava_dir), worker_processes=False, deploy=deploy, devices=devices, token_budget=24)
    outs = llm.chat(conversations, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out.token_ids == ref, f"{deploy}: conversation {i}"
    _assert_nothing_held(llm)
    roles = [e.role for e in llm.engine.engines]
    if "E" in roles:  # an encode-only instance must have handed its images on
        assert any("encode_to_prefill_migration" in (o.stage_times or {}) for o in outs)
    if "D" in roles:
        assert any("prefill_to_decode_migration" in (o.stage_times or {}) for o in outs)


@pytest.mark.parametrize("deploy, devices", [("1E+1P+1D", "cpu:3"), ("1EP+1D", "cpu:2")])
def test_prefill_instances_start_from_cached_prefixes(tiny_llava_dir, deploy, devices, conversations, reference):
    """The instance that prefills finds what it prefilled before, whether it encoded the images
    itself (EP: not again) or pulled them from an E instance (its prefix taken on arrival)."""
    llm = LLM(str(tiny_llava_dir), worker_processes=False, deploy=deploy, devices=devices, token_budget=24,
              kv_block_size=4)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    llm.chat(conversations, params)
    prefill = next(e for e in llm.engine.engines if "P" in e.role)
    hits = prefill.scheduler.prefix_hits
    outs = llm.chat(conversations, params)
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out.token_ids == ref, f"{deploy}: conversation {i}"
    assert prefill.scheduler.prefix_hits - hits == sum((len(o.prompt_token_ids) - 1) // 4 * 4 for o in outs)
    # The count reaches the output from the decode instance: it crossed the migration.
    assert [o.num_cached_tokens for o in outs] == [(len(o.prompt_token_ids) - 1) // 4 * 4 for o in outs]
    decode = next(e for e in llm.engine.engines if e.role == "D")
    assert decode.scheduler.prefix_hits == 0 and decode.kv_manager.num_cached_blocks == 0
    if deploy == "1EP+1D":
        assert prefill.scheduler.images_cached >= sum(o.num_images for o in outs)
    _assert_nothing_held(llm)


@pytest.mark.parametrize("deploy, devices", [("1E+1P+1D", "cpu:3"), ("1E+2PD", "cpu:3"), ("2EPD", "cpu:2")])
def test_the_completions_of_one_prompt_prefill_it_once_in_every_deployment(tiny_llava_dir, deploy, devices,
                                                                          conversations, reference):
    """Four greedy completions of each conversation: they are placed together (on E, then on
    P: round-robin would spread them), the first prefills the prompt and the others wait for
    it, pulled in or not, and find it cached; each is transformers' answer."""
    llm = LLM(str(tiny_llava_dir), worker_processes=False, deploy=deploy, devices=devices, token_budget=512,
              kv_block_size=4, router_policy="round-robin")
    outs = llm.chat(conversations, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, n=4))
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert [c.token_ids for c in out.outputs] == [ref] * 4, f"{deploy}: conversation {i}"
        found = (len(out.prompt_token_ids) - 1) // 4 * 4
        first, *others = [c.num_cached_tokens for c in out.outputs]
        assert first < found and others == [found] * 3, f"{deploy}: conversation {i}"
    for engine in llm.engine.engines:
        assert not engine.scheduler._computing and not engine.scheduler._encoding_images
    if deploy.startswith("1E+"):
        # The E instance encoded each image once (the astronaut and the cat are in two
        # conversations each): every other completion and conversation found it.
        images = [image.digest() for conv in conversations for image in llm.processor.process_chat(conv).images]
        (encoder,) = [e for e in llm.engine.engines if e.role == "E"]
        assert encoder.scheduler.images_cached == 4 * len(images) - len(set(images)) > 0
    _assert_nothing_held(llm)


@pytest.mark.parametrize("policy", ["cache-aware", "round-robin"])
def test_the_cache_aware_router_sends_a_prompt_where_it_is_cached(tiny_llava_dir, conversations, reference, policy):
    llm = LLM(str(tiny_llava_dir), worker_processes=False, deploy="2EPD", devices="cpu:2", token_budget=24,
              kv_block_size=4, router_policy=policy)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    llm.chat(conversations, params)
    hits = sum(e.scheduler.prefix_hits for e in llm.engine.engines)
    outs = llm.chat(conversations, params)
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out.token_ids == ref, f"conversation {i}"
    hits = sum(e.scheduler.prefix_hits for e in llm.engine.engines) - hits
    cached = sum((len(o.prompt_token_ids) - 1) // 4 * 4 for o in outs)
    if policy == "cache-aware":
        assert hits == cached
    else:  # a reference for the check: taking turns sends some prompts where they are not cached
        assert hits < cached
    _assert_nothing_held(llm)


def test_stress_small_caches_everywhere(tiny_llava_dir, conversations, reference):
    """64 requests through E+P+D with caches far smaller than the load: all finish, right."""
    llm = LLM(
        str(tiny_llava_dir), worker_processes=False, deploy="1E+1P+1D", devices="cpu:3",
        kv_block_size=4, num_kv_blocks=48, num_image_blocks=3, token_budget=32, image_budget=2,
    )
    convs = (conversations * 8)[:64]
    outs = llm.chat(convs, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for i, out in enumerate(outs):
        assert out.token_ids == reference[i % len(conversations)], f"request {i}"
    _assert_nothing_held(llm)


@pytest.mark.parametrize("deploy, devices", [("1E+1EP+1D", "cpu:3"), ("1E+1EPD", "cpu:2")])
def test_requests_pulled_into_an_instance_that_encodes_run_under_kv_pressure(tiny_llava_dir, deploy, devices,
                                                                             conversations, reference):
    """An instance that encodes and prefills takes image requests pulled from E, whose pixels
    stayed behind: under KV pressure it must never preempt one of them (recomputing it would
    encode its images again, without pixels: the step failed and the worker with it). They
    hold their whole KV instead, as on an instance that cannot encode."""
    llm = LLM(str(tiny_llava_dir), worker_processes=False, deploy=deploy, devices=devices,
              kv_block_size=4, num_kv_blocks=40, num_image_blocks=3, token_budget=64)
    convs = (conversations * 2)[:18]
    outs = llm.chat(convs, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for i, out in enumerate(outs):
        assert out.token_ids == reference[i % len(conversations)], f"{deploy}: request {i}"
    _assert_nothing_held(llm)
    assert any("encode_to_prefill_migration" in (o.stage_times or {}) for o in outs)


def test_seeded_sampling_survives_migration(tiny_llava_dir, conversations):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=7)
    single = LLM(str(tiny_llava_dir)).chat(conversations[:3], params)
    # across worker processes: the generator's state travels with the request
    with LLM(str(tiny_llava_dir), deploy="1E+1P+1D", devices="cpu:3") as llm:
        split = llm.chat(conversations[:3], params)
    assert [o.token_ids for o in single] == [o.token_ids for o in split]


def _step_until(llm: LLM, engine, predicate, max_steps=500):
    for _ in range(max_steps):
        if predicate():
            return
        llm.engine.step_instance(engine)
    raise AssertionError("condition never reached")


@pytest.mark.parametrize(
    "when", ["before-encode", "offered-by-E", "pulling-into-P", "mid-prefill", "offered-by-P", "mid-decode"]
)
def test_abort_at_every_stage_frees_every_instance(tiny_llava_dir, conversations, when):
    llm = LLM(str(tiny_llava_dir), worker_processes=False, deploy="1E+1P+1D", devices="cpu:3", token_budget=8)
    e, p, d = llm.engine.engines
    prompt = llm.processor.process_chat(conversations[0])
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm.engine.add_request(llm.processor.make_engine_request("r", prompt, params))

    def status(engine):
        r = engine.scheduler.requests.get("r")
        return r.status if r else None

    # Drive instance by instance so that every intermediate state can be caught.
    plan = {
        "before-encode": [],
        "offered-by-E": [(e, lambda: status(e) is RequestStatus.OFFERED)],
        "pulling-into-P": [(e, lambda: status(e) is RequestStatus.OFFERED), (p, lambda: status(p) is RequestStatus.PULLING)],
        "mid-prefill": [(e, lambda: status(e) is RequestStatus.OFFERED),
                        (p, lambda: status(p) is RequestStatus.RUNNING and p.scheduler.requests["r"].num_computed_tokens > 0)],
        "offered-by-P": [(e, lambda: status(e) is RequestStatus.OFFERED), (p, lambda: status(p) is RequestStatus.OFFERED)],
        "mid-decode": [(e, lambda: status(e) is RequestStatus.OFFERED), (p, lambda: status(p) is RequestStatus.OFFERED),
                       (d, lambda: status(d) is RequestStatus.RUNNING and d.scheduler.requests["r"].num_output_tokens > 3)],
    }[when]
    copy_gate = threading.Event()
    if when == "pulling-into-P":
        # Hold the copy in flight so the abort lands while P's blocks are being written.
        copy = p.copier._copy
        p.copier._copy = lambda pull: (copy_gate.wait(10), copy(pull))
    else:
        copy_gate.set()
    for engine, predicate in plan:
        _step_until(llm, engine, predicate)
    if when == "before-encode":
        assert status(e) is RequestStatus.WAITING
    held = sum(
        (x.kv_manager.num_used_blocks if x.kv_manager else 0) + (x.image_manager.num_used_blocks if x.image_manager else 0)
        for x in (e, p, d)
    )
    assert held > 0 or when == "before-encode"
    llm.engine.abort_requests(["r"])
    if when == "pulling-into-P":
        assert p.kv_manager.num_used_blocks == 0 and p.image_manager.num_used_blocks > 0  # freed after the copy
        copy_gate.set()
    for _ in range(5):  # let in-flight copies land
        llm.engine.step()
    _assert_nothing_held(llm)


def test_an_instance_waiting_for_a_release_does_not_spin(tiny_llava_dir, conversations):
    """E's only image block is held by an offered request: E has nothing to run (its worker
    sleeps on its pipe) until P pulls the blocks and E is told to release them."""
    llm = LLM(str(tiny_llava_dir), worker_processes=False, deploy="1E+1P+1D", devices="cpu:3", num_image_blocks=1)
    e, p, _ = llm.engine.engines
    params = SamplingParams(max_tokens=4, temperature=0.0)
    for req_id, conversation in (("a", conversations[0]), ("b", conversations[2])):  # two images
        prompt = llm.processor.process_chat(conversation)
        llm.engine.add_request(llm.processor.make_engine_request(req_id, prompt, params))
    e.step()  # encodes "a" and offers it; "b" waits for the image block
    offers = e.take_offers()
    assert [o.req_id for o in offers] == ["a"] and e.has_work()
    assert not e.step() and not e.has_work()  # stalled: nothing changes until a release
    p.add_migration(offers[0])
    for _ in range(100):
        p.step()
        if (pulled := p.take_pulled()):
            break
    assert pulled == [Pulled("a", e.instance_id)]
    e.release(["a"])
    assert e.has_work()
    e.step()
    assert [o.req_id for o in e.take_offers()] == ["b"]


@pytest.mark.parametrize("bandwidth, runs_at_once", [(1e12, True), (None, False), (1.0, False)])
def test_a_quick_pull_runs_in_the_step_that_waited_for_it(tiny_llava_dir, conversations, bandwidth, runs_at_once):
    """P waits for a pull predicted to take a small share of its step bound, so the pulled
    request prefills in that same step; with no measured bandwidth, or a copy predicted to be
    slow, the step does not wait and the request runs in a later one."""
    from hydrad.engine.latency_model import LatencyModel

    llm = LLM(str(tiny_llava_dir), worker_processes=False, deploy="1E+1P+1D", devices="cpu:3")
    e, p, _ = llm.engine.engines
    p.set_latency_model(LatencyModel(l_fixed=1e-3, l_prefill=1e-6, l_decode=1e-6), 1.0)
    p.copy_bandwidth = bandwidth
    prompt = llm.processor.process_chat(conversations[0])
    llm.engine.add_request(llm.processor.make_engine_request("a", prompt, SamplingParams(max_tokens=4,
                                                                                         temperature=0.0)))
    e.step()
    (offer,) = e.take_offers()
    p.add_migration(offer)
    p.step()
    offers = p.take_offers()
    if runs_at_once:
        assert p.take_pulled() == [Pulled("a", e.instance_id)]
        assert [(o.req_id, o.kind) for o in offers] == [("a", "kv")]  # prefilled in that step
    else:
        assert offers == []
        for _ in range(100):
            p.step()
            if (offers := p.take_offers()):
                break
        assert [(o.req_id, o.kind) for o in offers] == [("a", "kv")]
    p.scheduler.check_integrity()
