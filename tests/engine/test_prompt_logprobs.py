"""A prompt's log-probabilities (``SamplingParams.prompt_logprobs``) against transformers'
forward over the same prompt: every prompt token's log-probability given the ones before it,
its rank and the most likely tokens there, through chunked prefill, preemption, the prefix
cache and a hand-over between instances."""

from __future__ import annotations

import pytest
import torch

from hydrad import LLM, SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog and runs far away into the forest",
           "Once upon a time", "Hi"]
TOP = 3


@pytest.fixture(scope="module")
def reference(tiny_llava_dir):
    """Per prompt: its token ids and transformers' log-softmax at every position."""
    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(tiny_llava_dir)
    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        out.append((ids, torch.log_softmax(logits, dim=-1)))
    return out


def check(outputs, reference):
    for out, (ids, raw) in zip(outputs, reference):
        assert out.prompt_token_ids == ids
        entries = out.prompt_logprobs
        assert len(entries) == len(ids) and entries[0] is None
        for position, entry in enumerate(entries[1:]):
            row = raw[position]  # what position predicts: token position + 1
            token = ids[position + 1]
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry.rank == int((row > row[token]).sum()) + 1
            top = row.topk(TOP)
            assert entry.top_token_ids == top.indices.tolist()
            assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)


PARAMS = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=TOP)


def test_prompt_logprobs_match_transformers(tiny_llava_dir, reference, monkeypatch):
    llm = LLM(str(tiny_llava_dir))
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    check(outs, reference)
    assert all(out.logprobs is None for out in outs)  # not asked: none for the generated tokens
    # Asked again, the prompts are in the prefix cache: a request that prices its prompt
    # computes it all the same, and one that does not still finds it.
    check(llm.generate(PROMPTS, PARAMS, use_tqdm=False), reference)
    plain = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0
    # With the generated tokens' own logprobs, and n completions: each carries the prompt's,
    # which one of them computed.
    priced, price = set(), llm.engine.runner._price_prompt

    def spy(hidden, req, *rest):
        priced.add(req.req_id)
        return price(hidden, req, *rest)

    monkeypatch.setattr(llm.engine.runner, "_price_prompt", spy)
    both = llm.generate(PROMPTS[1:2], SamplingParams(max_tokens=3, temperature=0.0, logprobs=1, n=2,
                                                     prompt_logprobs=0), use_tqdm=False)[0]
    assert len(both.logprobs) == 3 and len(priced) == 1
    for completion in both.outputs:
        assert [e.top_token_ids for e in completion.prompt_logprobs[1:]] == [[]] * (len(both.prompt_token_ids) - 1)
        assert [e.logprob for e in completion.prompt_logprobs[1:]] == [e.logprob for e in outs[1].prompt_logprobs[1:]]


def test_prompt_logprobs_through_chunks_and_preemption(tiny_llava_dir, reference):
    # A 5-token budget cuts every prompt into chunks; 64 tokens of KV for the three (up to
    # 57 + 24 + 22 tokens) preempt.
    llm = LLM(str(tiny_llava_dir), token_budget=5, kv_block_size=4, num_kv_blocks=16)
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    check(llm.generate(PROMPTS, long, use_tqdm=False), reference)
    assert llm.engine.scheduler.num_preemptions > 0


def test_prompt_logprobs_across_a_hand_over(tiny_llava_dir, reference):
    """Prefill on one instance, decode on another: the first token, sampled where the prompt
    was computed, brings the prompt's log-probabilities."""
    llm = LLM(str(tiny_llava_dir), deploy="1EP+1D", devices="cpu:2", worker_processes=False)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    check(outs, reference)
    assert all("prefill_to_decode_migration" in out.stage_times for out in outs)
