"""Greedy tokens of ``LLM.chat`` equal transformers' ``generate``, conversation by conversation.

The reference runs each conversation alone (batched HF generation pads, which can
change greedy results); hydrad runs them all in one batch, flattened, over the
paged caches, with chunked prefill, odd block sizes and preemption.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from hydrad import LLM, SamplingParams

MAX_TOKENS = 24


def _photo(name: str) -> Image.Image:
    from skimage import data

    return Image.fromarray(getattr(data, name)()).convert("RGB")


def _noise(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _img(image):
    return {"type": "image", "image": image}


def _text(text):
    return {"type": "text", "text": text}


@pytest.fixture(scope="module")
def conversations():
    astronaut, coffee, rocket, chelsea = (_photo(n) for n in ("astronaut", "coffee", "rocket", "chelsea"))
    return [
        [{"role": "user", "content": [_img(astronaut), _text("What is in this image?")]}],
        [{"role": "user", "content": "Tell me a story about a brave little robot who learns to paint."}],
        [{"role": "user", "content": [_img(coffee), _text("Describe the drink.")]}],
        [{"role": "user", "content": [_text("Compare these two pictures:"), _img(rocket), _img(chelsea)]}],
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": [_img(chelsea), _text("What animal is this?")]},
            {"role": "assistant", "content": "A cat."},
            {"role": "user", "content": "What colour is its fur, and where is it sitting?"},
        ],
        [{"role": "user", "content": "Hi"}],
        [{"role": "user", "content": [_img(_noise(20, 30, 1)), _text("A tiny image. " * 12)]}],
        [{"role": "user", "content": [_img(_noise(300, 120, 2)), _text("What do you see?")]}],
        [{"role": "user", "content": [_text("Caption:"), _img(astronaut)]}],
    ]


def _reference_tokens(model_dir, conversations) -> list[list[int]]:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    for conv in conversations:
        images, messages = [], []
        for m in conv:
            content = m["content"]
            if isinstance(content, str):
                content = [_text(content)]
            parts = []
            for p in content:
                if p["type"] == "image":
                    images.append(p["image"])
                    parts.append({"type": "image"})
                else:
                    parts.append(p)
            messages.append({"role": m["role"], "content": parts})
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=text, images=images or None, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
        results.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    return results


@pytest.fixture(scope="module")
def reference(tiny_llava_dir, conversations):
    return _reference_tokens(tiny_llava_dir, conversations)


def _check(llm: LLM, conversations, reference):
    outs = llm.chat(conversations, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out.token_ids == ref, f"conversation {i}: {out.token_ids} != {ref}"
        assert out.finish_reason == ("stop" if len(ref) < MAX_TOKENS else "length")
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_manager.num_used_blocks == 0
    assert llm.engine.image_manager.num_used_blocks == 0
    return outs


def test_reference_is_not_degenerate(reference):
    # A check on the check: the random tiny model must produce varied tokens, or equality is cheap.
    assert sum(len(set(r)) for r in reference) > 3 * len(reference)
    assert len({tuple(r) for r in reference}) == len(reference)


@pytest.mark.parametrize("layout", ["hub", "hf5", "module", "hub-sharded"])
def test_greedy_matches_transformers_in_every_weight_layout(tiny_llava_layouts, layout, conversations, reference):
    _check(LLM(str(tiny_llava_layouts[layout])), conversations, reference)


@pytest.mark.parametrize("kv_block_size", [1, 16, 32])
def test_greedy_matches_with_chunked_prefill_and_block_sizes(tiny_llava_dir, kv_block_size, conversations, reference):
    # A 10-token budget cuts every prompt, and every image's 16 tokens, into chunks.
    llm = LLM(str(tiny_llava_dir), kv_block_size=kv_block_size, token_budget=10, image_budget=1)
    _check(llm, conversations, reference)


def test_greedy_matches_under_preemption(tiny_llava_dir, conversations, reference):
    llm = LLM(str(tiny_llava_dir), kv_block_size=4, num_kv_blocks=40, num_image_blocks=3, token_budget=64)
    _check(llm, conversations, reference)
    assert llm.engine.scheduler.num_preemptions > 0


def test_greedy_matches_from_cached_prefixes(tiny_llava_dir, conversations, reference):
    """Prefix caching: asked again, every conversation starts its prefill from its cached KV and
    encodes none of its images; the next turn of a conversation finds the turns before it."""
    llm = LLM(str(tiny_llava_dir), kv_block_size=4, token_budget=64)
    first = _check(llm, conversations, reference)
    s = llm.engine.scheduler
    hits, images = s.prefix_hits, s.images_cached
    again = _check(llm, conversations, reference)
    prompts = [len(out.prompt_token_ids) for out in first]
    assert s.prefix_hits - hits == sum((n - 1) // 4 * 4 for n in prompts)
    assert [out.num_cached_tokens for out in again] == [(n - 1) // 4 * 4 for n in prompts]
    assert s.images_cached - images == sum(out.num_images for out in first)
    # The next turn: the conversation so far, the answer as the model gave it, a new question.
    turns = [conv + [{"role": "assistant", "content": out.text}, {"role": "user", "content": "And then?"}]
             for conv, out in zip(conversations[:2], first[:2])]
    hits = s.prefix_hits
    _check(llm, turns, _reference_tokens(tiny_llava_dir, turns))
    assert s.prefix_hits - hits >= sum(prompts[:2]) - 2 * 4 - 8


def test_greedy_n_completions_prefill_their_prompt_once_and_match(tiny_llava_dir, conversations, reference):
    """Four greedy completions of each conversation, all sent at once: the first of each
    prefills the prompt (and encodes its images), the other three wait and find it cached;
    every completion is transformers' answer."""
    llm = LLM(str(tiny_llava_dir), kv_block_size=4, token_budget=512)
    outs = llm.chat(conversations, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, n=4))
    s = llm.engine.scheduler
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert [c.token_ids for c in out.outputs] == [ref] * 4, f"conversation {i}"
        found = (len(out.prompt_token_ids) - 1) // 4 * 4
        # The first computed its prompt (after a beginning other conversations share, if cached).
        first, *others = [c.num_cached_tokens for c in out.outputs]
        assert first < found and others == [found] * 3, f"conversation {i}"
    assert s.images_cached >= 3 * sum(out.num_images for out in outs) > 0
    assert not s._computing and llm.engine.kv_manager.num_used_blocks == 0


def test_dual_streams_forced_on_gives_the_same_tokens(tiny_llava_dir, conversations, reference):
    # Off by default on CPU; the two-executor path must stay exact where it is used.
    llm = LLM(str(tiny_llava_dir), dual_streams=True, token_budget=32)
    assert llm.engine.streams.enabled
    _check(llm, conversations, reference)


def test_prefills_started_in_the_step_that_encodes_their_images_give_the_same_tokens(
        tiny_llava_dir, conversations, reference):
    # Off, the default on CPU: vision then language on one thread, and a step's prefill reads
    # the features its own vision work just wrote.
    llm = LLM(str(tiny_llava_dir))
    s = llm.engine.scheduler
    assert s.prefill_after_encode and not llm.engine.streams.enabled
    started = []
    schedule = s.schedule

    def watched():
        out = schedule()
        started.extend(r.req_id for r, _ in out.chunks if any(q is r for q, _ in out.encodes))
        return out

    s.schedule = watched
    _check(llm, conversations, reference)
    assert len(set(started)) >= 3  # requests with images whose prefill began beside their encode


def test_bfloat16_on_a_cpu_agrees_with_float32(tiny_llava_dir, conversations):
    """bfloat16 on a CPU, every linear layer packed for oneDNN in bfloat16, against float32
    (which equals transformers, above): the same tokens with near log-probabilities until a
    near-tie, if any (tests/agreement.py), through chunked prefill over cached context and
    decodes."""
    from agreement import PARAMS, check_answers

    from hydrad.models.linear import PackedLinear, packing_supported

    want = LLM(str(tiny_llava_dir), dtype="float32", token_budget=24).chat(conversations, PARAMS)
    half = LLM(str(tiny_llava_dir), dtype="bfloat16", token_budget=24)
    model = half.engine.runner.model
    assert next(model.parameters()).dtype == torch.bfloat16
    if packing_supported("cpu", torch.bfloat16):  # tests/models/test_linear.py: where that holds
        packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
        assert packed and all(m.packed_weight.dtype == torch.bfloat16 for m in packed)
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
    check_answers(half.chat(conversations, PARAMS), want, "bfloat16")
    assert half.engine.runner.kv_cache.dtype == torch.bfloat16


def test_auto_runs_a_half_precision_checkpoint_in_bfloat16_where_the_cpu_has_it(tmp_path, tiny_llava_dir,
                                                                                monkeypatch, conversations):
    """``dtype = "auto"`` on a CPU: a checkpoint stored in bfloat16 runs in bfloat16 where the
    CPU has native bfloat16 (hydrad.dtypes), in float32 elsewhere; a float32 one in float32."""
    import json

    from factories import make_layout, module_state_dict

    from hydrad import dtypes

    state_dict = {name: t.to(torch.bfloat16) for name, t in module_state_dict(tiny_llava_dir).items()}
    path = make_layout(tiny_llava_dir, tmp_path / "half", state_dict, "hf5")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    params = SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0)
    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(dtypes, "native_bfloat16", lambda native=native: native)
        llm = LLM(str(path), num_kv_blocks=64, num_image_blocks=8)
        assert llm.engine.dtype == want and llm.engine.runner.kv_cache.dtype == want
        assert [len(o.token_ids) for o in llm.chat(conversations[:2], params)] == [4, 4]
        llm.shutdown()
    assert LLM(str(tiny_llava_dir), num_kv_blocks=64, num_image_blocks=8).engine.dtype == torch.float32


def test_same_seed_same_samples(tiny_llava_dir, conversations):
    llm = LLM(str(tiny_llava_dir))
    params = [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=s) for s in (1, 2)]
    first = llm.chat(conversations[:2] * 2, params * 2)
    again = llm.chat(conversations[:2][::-1], params[::-1])  # different batch, different order
    assert first[0].token_ids == first[2].token_ids == again[1].token_ids
    assert first[1].token_ids == first[3].token_ids == again[0].token_ids
    other = llm.chat(conversations[:1], SamplingParams(max_tokens=16, temperature=1.0, seed=99))
    assert other[0].token_ids != first[0].token_ids


def test_stop_strings_and_max_tokens(tiny_llava_dir, conversations, reference):
    llm = LLM(str(tiny_llava_dir))
    full = llm.chat(conversations[1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    assert len(full.text) > 4
    stop = full.text[2:4]
    out = llm.chat(conversations[1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    short = llm.chat(conversations[1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert short.token_ids == reference[1][:3] and short.finish_reason == "length"
    assert llm.engine.kv_manager.num_used_blocks == 0


def test_generate_takes_texts_and_token_ids_as_vllm_does(tiny_llava_dir):
    """``LLM.generate``'s prompts: a text, ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``
    (taken as they are, no tokenizer): greedy tokens equal transformers' for each."""
    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(tiny_llava_dir)
    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir, dtype=torch.float32).eval()
    text = "A story about a brave little robot"
    # Not what the tokenizer gives for any text: no BOS, and the ids of the text's two halves.
    ids = tokenizer("about a brave", add_special_tokens=False)["input_ids"] + tokenizer(" robot")["input_ids"]
    with torch.no_grad():
        want = [model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS)[0, len(prompt):]
                .tolist() for prompt in (tokenizer(text)["input_ids"], ids)]
    llm = LLM(str(tiny_llava_dir))
    outs = llm.generate([text, {"prompt": text}, {"prompt_token_ids": ids}],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    assert [out.token_ids for out in outs] == [want[0], want[0], want[1]]
    assert outs[2].prompt_token_ids == ids
    for bad in ({"prompt_token_ids": ["a"]}, {"prompt": text, "prompt_token_ids": ids}, {"text": text}):
        with pytest.raises(ValueError, match="a prompt must be"):
            llm.generate(bad, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        llm.generate({"prompt_token_ids": [10**6]}, use_tqdm=False)


def test_chat_continues_a_final_message_as_vllm_does(tiny_llava_dir):
    """``LLM.chat``'s template options (vLLM's): the model continues an answer begun for it
    (greedy tokens as transformers' over the prompt the HF processor renders so); both options
    at once are refused."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_llava_dir)
    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir, dtype=torch.float32).eval()
    begun = [{"role": "user", "content": [_text("Tell me a story.")]},
             {"role": "assistant", "content": [_text("Once upon a time")]}]
    ids = processor(text=processor.apply_chat_template(begun, continue_final_message=True, tokenize=False),
                    return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = model.generate(input_ids=ids, do_sample=False, max_new_tokens=MAX_TOKENS)[0, ids.shape[1]:].tolist()
    llm = LLM(str(tiny_llava_dir))
    (out,) = llm.chat(begun, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False,
                      add_generation_prompt=False, continue_final_message=True)
    assert out.prompt_token_ids == ids[0].tolist() and out.token_ids == want
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(begun, continue_final_message=True, use_tqdm=False)
