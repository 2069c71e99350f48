"""LLaVA-NeXT, Qwen2-VL and Qwen2.5-VL through ``LLM.chat`` give transformers' greedy tokens.

Nine conversations per family (images of many sizes and aspect ratios, so their token counts
differ; two images in one turn; text only; multi-turn with images in two turns) run in one
batch and are compared, conversation by conversation, with transformers' ``generate`` on each
alone: in every weight layout, with prefill chunked through image tokens and KV preemption, in
every deployment with migration at every boundary, and across worker processes.

The log-probability of every generated token is compared too: the tiny random models' greedy
tokens barely depend on positions, but their log-probabilities do, so M-RoPE positions that
were lost or recomputed from a flat arange anywhere (a chunk, a recompute, a migration) fail
here even when the tokens happen to agree.
"""

from __future__ import annotations

import pytest
from factories import DEPLOYMENTS, hf_references, mixed_conversations
from test_disaggregation import _assert_nothing_held

from hydrad import LLM, SamplingParams

ARCHS = ("llava-next", "qwen2-vl", "qwen2.5-vl")
# The Qwen hub checkpoints and transformers 5 name the weights alike, so "hf5" stands for both.
LAYOUTS = {"llava-next": ("hub", "hf5", "module"), "qwen2-vl": ("hf5", "module"), "qwen2.5-vl": ("hf5", "module")}
MAX_TOKENS = 12
# The preemption test's answers: long enough that the decodes outgrow a pool their prompts fit.
LONG_TOKENS = 40
# Smaller than most images' token runs: prefill chunks end inside images.
TOKEN_BUDGET = 10
# Image-cache blocks of 8 slots: most images take several. Pools of a few MB: the tiny models
# need no more, and allocating (and, across processes, sharing) the default ones takes seconds.
CACHE = dict(image_block_size=8, kv_cache_memory_mb=16, image_cache_memory_mb=8)
# Greedy runs agree to float rounding (observed < 1e-6); wrong positions move them by ~1e-3.
LOGPROB_TOL = 5e-5
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)


@pytest.fixture(scope="module")
def conversations():
    return mixed_conversations()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, conversations):
    """``reference(arch, num_tokens=MAX_TOKENS)``: per conversation, transformers' first
    ``num_tokens`` tokens (at most ``LONG_TOKENS``) and their log-probabilities."""
    cache = {}

    def get(arch: str, num_tokens: int = MAX_TOKENS):
        if arch not in cache:
            cache[arch] = hf_references(tiny_checkpoint(arch), conversations, LONG_TOKENS)
        return [(tokens[:num_tokens], logprobs[:num_tokens]) for tokens, logprobs in cache[arch]]

    return get


def _check(llm: LLM, conversations, reference, what: str, tol: float = LOGPROB_TOL, params=PARAMS):
    outs = llm.chat(conversations, params, use_tqdm=False)
    for i, (out, (tokens, logprobs)) in enumerate(zip(outs, reference)):
        assert out.token_ids == tokens, f"{what}: conversation {i}"
        got = [entry.logprob for entry in out.logprobs]
        assert got == pytest.approx(logprobs, abs=tol), f"{what}: conversation {i}"
    return outs


@pytest.mark.parametrize("arch", ARCHS)
def test_conversations_cover_every_case(tiny_checkpoint, conversations, reference, arch):
    """A check on the check: image token counts differ, the cases are there, chunks are smaller
    than images, and the references are not degenerate."""
    from hydrad.processor import InputProcessor

    processor = InputProcessor(tiny_checkpoint(arch))
    prompts = [processor.process_chat(conv) for conv in conversations]
    lengths = [image.length for prompt in prompts for image in prompt.images]
    assert len(set(lengths)) >= 5 and max(lengths) > 2 * TOKEN_BUDGET, lengths
    assert len({image.num_patches for prompt in prompts for image in prompt.images}) >= 3
    assert any(len(p.images) == 2 for p in prompts) and any(not p.images for p in prompts)
    assert sum(len(conv) > 1 for conv in conversations) >= 2
    # The tiny random models continue some prompts alike; their log-probabilities still differ.
    refs = reference(arch)
    tokens = [tuple(t) for t, _ in refs]
    assert len(set(tokens)) > len(tokens) // 2 and sum(len(set(t)) for t in tokens) > 4 * len(tokens)
    assert len({(tuple(t), tuple(round(x, 3) for x in lp)) for t, lp in refs}) == len(refs)


@pytest.mark.parametrize("arch, layout", [(arch, layout) for arch in ARCHS for layout in LAYOUTS[arch]])
def test_every_layout_with_chunks_through_images_and_preemption(tiny_checkpoint, conversations, reference, arch,
                                                                 layout):
    path = tiny_checkpoint(arch, layout)
    refs = reference(arch, LONG_TOKENS)
    # KV room for the longest request alone: a prompt is admitted only while the free KV covers it,
    # and the decodes of the requests admitted together outgrow the pool, so requests are
    # preempted and recomputed (their images encoded again) while others run.
    kv_block_size = 4
    longest = max(len(ids) for ids in _prompt_ids(path, conversations)) + LONG_TOKENS
    llm = LLM(str(path), token_budget=TOKEN_BUDGET, kv_block_size=kv_block_size,
              num_kv_blocks=-(-longest // kv_block_size), **CACHE)
    runner = llm.engine.runner
    chunks = []
    execute = runner.execute

    def recording(step_chunks, num_decodes=0):
        chunks.extend((req, req.num_computed_tokens, n) for req, n in step_chunks)
        return execute(step_chunks, num_decodes)

    runner.execute = recording
    params = SamplingParams(max_tokens=LONG_TOKENS, min_tokens=LONG_TOKENS, temperature=0.0, logprobs=0)
    _check(llm, conversations, refs, f"{arch} {layout}", params=params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(image.offset < start + n < image.offset + image.length
               for req, start, n in chunks for image in req.images), "no prefill chunk ended inside an image"
    assert llm.engine.kv_manager.num_used_blocks == 0 and llm.engine.image_manager.num_used_blocks == 0
    llm.shutdown()


def _prompt_ids(path, conversations) -> list[list[int]]:
    from hydrad.processor import InputProcessor

    processor = InputProcessor(path)
    return [processor.process_chat(conv).prompt_token_ids for conv in conversations]


@pytest.mark.parametrize("deploy, devices", DEPLOYMENTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_deployment_migrates_positions_and_layouts(tiny_checkpoint, conversations, reference, arch, deploy,
                                                          devices):
    llm = LLM(str(tiny_checkpoint(arch)), worker_processes=False, deploy=deploy, devices=devices,
              token_budget=TOKEN_BUDGET, **CACHE)
    outs = _check(llm, conversations, reference(arch), f"{arch} {deploy}")
    _assert_nothing_held(llm)
    roles = [e.role for e in llm.engine.engines]
    if "E" in roles:  # an encode-only instance must have handed its images on
        assert any("encode_to_prefill_migration" in (o.stage_times or {}) for o in outs)
    if "D" in roles:
        assert any("prefill_to_decode_migration" in (o.stage_times or {}) for o in outs)
    llm.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_prefixes_keep_positions_and_layouts(tiny_checkpoint, conversations, reference, arch):
    """Asked again, every conversation prefills from its cached KV (M-RoPE positions and image
    layouts past a cached prefix stay exact) and encodes none of its images."""
    llm = LLM(str(tiny_checkpoint(arch)), kv_block_size=4, token_budget=TOKEN_BUDGET, **CACHE)
    first = _check(llm, conversations, reference(arch), f"{arch} first")
    s = llm.engine.scheduler
    hits, images = s.prefix_hits, s.images_cached
    _check(llm, conversations, reference(arch), f"{arch} cached")
    assert s.prefix_hits - hits == sum((len(out.prompt_token_ids) - 1) // 4 * 4 for out in first)
    assert s.images_cached - images == sum(out.num_images for out in first)
    llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_worker_processes(tiny_checkpoint, conversations, reference, arch):
    """Positions, layouts and pixels cross process pipes (shared memory) at every boundary."""
    with LLM(str(tiny_checkpoint(arch)), deploy="1E+1P+1D", devices="cpu:3", token_budget=TOKEN_BUDGET,
             **CACHE) as llm:
        outs = _check(llm, conversations, reference(arch), f"{arch} in worker processes")
    assert any("encode_to_prefill_migration" in (o.stage_times or {}) for o in outs)
    assert any("prefill_to_decode_migration" in (o.stage_times or {}) for o in outs)


def test_a_request_without_its_positions_is_refused(tiny_checkpoint, conversations):
    llm = LLM(str(tiny_checkpoint("qwen2-vl")), **CACHE)
    prompt = llm.processor.process_chat(conversations[0])
    request = llm.processor.make_engine_request("r", prompt, PARAMS)
    positions = request.mrope_positions
    request.mrope_positions = positions[:, :-1]
    with pytest.raises(ValueError, match="mrope_positions has shape"):
        llm.engine.add_request(request)
    request.mrope_positions = None
    with pytest.raises(ValueError, match="needs its mrope_positions"):
        llm.engine.add_request(request)
    request.mrope_positions = positions
    llm.engine.add_request(request)
    llm.shutdown()
