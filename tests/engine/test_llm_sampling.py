"""Sampling options through the whole engine, against transformers' ``generate``.

Greedy with ``repetition_penalty`` gives transformers' tokens; the logprobs of greedy
tokens equal transformers' log-softmax; a seeded request gives the same tokens alone
and inside a batch of 64 others with mixed settings; ``n`` gives n completions;
``min_tokens`` and ``logit_bias`` change what is sampled as documented.
"""

from __future__ import annotations

import pytest
import torch

from hydrad import LLM, SamplingParams
from test_llm_correctness import _reference_tokens, _text, conversations, reference  # noqa: F401 (fixtures)

MAX_TOKENS = 16


def _hf_inputs(model_dir, conversation):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    messages = [{"role": m["role"], "content": [_text(m["content"])] if isinstance(m["content"], str) else
                 [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]} for m in conversation]
    images = [p["image"] for m in conversation if not isinstance(m["content"], str)
              for p in m["content"] if p["type"] == "image"]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=text, images=images or None, return_tensors="pt")


@pytest.fixture(scope="module")
def hf_model(tiny_llava_dir):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_llava_dir):
    return LLM(str(tiny_llava_dir), token_budget=64)


def test_greedy_with_repetition_penalty_matches_transformers(llm, tiny_llava_dir, hf_model, conversations):
    for penalty in (1.3, 0.8):
        outs = llm.chat(conversations[:5], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                          repetition_penalty=penalty))
        plain = _reference_tokens(tiny_llava_dir, conversations[:1])[0][:MAX_TOKENS]
        for conv, out in zip(conversations[:5], outs):
            inputs = _hf_inputs(tiny_llava_dir, conv)
            with torch.no_grad():
                ref = hf_model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS,
                                        repetition_penalty=penalty)
            assert out.token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()
        assert outs[0].token_ids != plain  # the penalty changed something: the check is not vacuous


def test_logprobs_of_greedy_tokens_equal_transformers_log_softmax(llm, tiny_llava_dir, hf_model, conversations):
    conv = conversations[0]
    out = llm.chat(conv, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5))[0]
    inputs = _hf_inputs(tiny_llava_dir, conv)
    with torch.no_grad():
        ref = hf_model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS, output_logits=True,
                                return_dict_in_generate=True)
    ref_tokens = ref.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    assert out.token_ids == ref_tokens and len(out.logprobs) == len(ref_tokens)
    for token, lp, step_logits in zip(ref_tokens, out.logprobs, ref.logits):
        expected = torch.log_softmax(step_logits[0].float(), dim=-1)
        assert lp.logprob == pytest.approx(float(expected[token]), abs=1e-4)
        assert lp.rank == 1  # greedy: the most likely token
        top = expected.topk(5)
        assert lp.top_token_ids == top.indices.tolist()
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)


def test_a_seeded_request_is_the_same_alone_and_in_a_batch_of_64(llm, conversations):
    seeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, top_k=40, seed=1234,
                            repetition_penalty=1.1, min_p=0.01)
    alone = llm.chat(conversations[2], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=MAX_TOKENS, temperature=t, top_k=k, top_p=p, seed=s)
              for t, k, p, s in [(0.0, 0, 1.0, None), (1.0, 0, 1.0, None), (0.7, 20, 0.9, None),
                                 (1.3, 0, 0.8, 7)] * 16]
    batch = [conversations[i % len(conversations)] for i in range(64)]
    outs = llm.chat([conversations[2]] + batch, [seeded] + others)
    assert outs[0].token_ids == alone
    assert len({tuple(o.token_ids) for o in outs}) > 8  # the batch really was sampled


def test_n_gives_independent_completions(llm, conversations):
    out = llm.chat(conversations[1], SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=5, ignore_eos=True))[0]
    assert len(out.outputs) == 3 and [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert out.token_ids == out.outputs[0].token_ids
    again = llm.chat(conversations[1], SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=5, ignore_eos=True))[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_min_tokens_holds_back_eos_and_logit_bias_steers(llm, conversations):
    eos = llm.processor.eos_token_ids[0]
    to_eos = {eos: 100.0}  # EOS is the greedy choice at every step
    out = llm.chat(conversations[1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logit_bias=to_eos))[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    out = llm.chat(conversations[1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logit_bias=to_eos,
                                                    min_tokens=3))[0]
    assert len(out.token_ids) == 4 and eos not in out.token_ids[:3] and out.token_ids[3] == eos
    assert out.finish_reason == "stop"
    forced = llm.chat(conversations[1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                       logit_bias={42: 100.0}))[0]
    assert forced.token_ids == [42] * 4
    with pytest.raises(ValueError, match="logit_bias names token"):
        llm.chat(conversations[1], SamplingParams(max_tokens=2, logit_bias={10**7: 1.0}))
