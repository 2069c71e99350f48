"""Structured outputs through the whole engine.

Greedy: the tokens equal transformers' ``generate`` with a logits processor that masks by a
matcher of the same grammar, built here from llguidance and the checkpoint's tokenizer (the
engine's batching, masking and matcher bookkeeping against a one-request loop). Sampled:
every output stays in its language. Handed over between instances, preempted and recomputed:
the same tokens as one instance.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from hydrad import LLM, SamplingParams
from hydrad.sampling_params import StructuredOutputsParams
from test_llm_correctness import conversations  # noqa: F401 (fixture)
from test_llm_sampling import _hf_inputs, hf_model  # noqa: F401 (fixture)

MAX_TOKENS = 24
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "count": {"type": "integer"}},
          "required": ["answer", "count"], "additionalProperties": False,
          # No whitespace between tokens: a random model left free to emit it may never stop.
          "x-guidance": {"whitespace_flexible": False}}
LANGUAGES = {
    "json": {"json": SCHEMA},
    "choice": {"choice": ["red", "green", "blue"]},
    "regex": {"regex": "[0-9]{3}-[a-z]{2}"},
    "json_object": {"json_object": True},
}


@pytest.fixture(scope="module")
def llm(tiny_llava_dir):
    return LLM(str(tiny_llava_dir), token_budget=64)


@pytest.fixture(scope="module")
def llg_tokenizer(tiny_llava_dir):
    import llguidance.hf
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    vocab = AutoConfig.from_pretrained(tiny_llava_dir).text_config.vocab_size
    eos = GenerationConfig.from_pretrained(tiny_llava_dir).eos_token_id
    return llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(tiny_llava_dir), n_vocab=vocab,
                                        eos_token=eos), vocab, eos


def _allowed(matcher, vocab: int) -> torch.Tensor:
    import llguidance.torch

    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
    return torch.from_numpy(bits.astype(bool))


def _reference(hf_model, tiny_llava_dir, llg_tokenizer, conversation, language) -> list[int]:  # noqa: F811
    """transformers' greedy ``generate``, each step masked by a matcher of the language."""
    from llguidance import LLMatcher
    from transformers import LogitsProcessor, LogitsProcessorList

    tokenizer, vocab, eos = llg_tokenizer
    matcher = LLMatcher(tokenizer, StructuredOutputsParams(**language).compiled)
    inputs = _hf_inputs(tiny_llava_dir, conversation)
    prompt_len = inputs["input_ids"].shape[1]

    class Mask(LogitsProcessor):
        seen = 0

        def __call__(self, input_ids, scores):
            new = input_ids[0, prompt_len + self.seen:].tolist()
            assert matcher.consume_tokens(new)
            self.seen += len(new)
            return scores.masked_fill(~_allowed(matcher, vocab), float("-inf"))

    with torch.no_grad():
        out = hf_model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS,
                                logits_processor=LogitsProcessorList([Mask()]), eos_token_id=eos)
    tokens = out[0, prompt_len:].tolist()
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def _in_language(text: str, language: dict) -> bool:
    if "json" in language:
        value = json.loads(text)
        return set(value) == {"answer", "count"} and value["answer"] in ("yes", "no") and isinstance(value["count"], int)
    if "json_object" in language:
        return isinstance(json.loads(text), dict)
    if "choice" in language:
        return text in language["choice"]
    return re.fullmatch(language["regex"], text) is not None


def _accepted(llg_tokenizer, language, token_ids) -> bool:
    """Every token is one a fresh matcher of the language takes, in order."""
    from llguidance import LLMatcher

    matcher = LLMatcher(llg_tokenizer[0], StructuredOutputsParams(**language).compiled)
    return matcher.consume_tokens(token_ids) and not matcher.is_error()


@pytest.mark.parametrize("kind", sorted(LANGUAGES))
def test_greedy_structured_outputs_match_transformers_masked_by_the_same_grammar(
        llm, tiny_llava_dir, hf_model, llg_tokenizer, conversations, kind):  # noqa: F811
    language = LANGUAGES[kind]
    convs = conversations[:4]
    # Constrained and unconstrained requests in one batch: the masks go to their own rows.
    outs = llm.chat(convs + convs[:2], [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                       structured_outputs=language)] * len(convs)
                    + [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)] * 2)
    for conv, out in zip(convs, outs):
        assert out.token_ids == _reference(hf_model, tiny_llava_dir, llg_tokenizer, conv, language)
        if out.finish_reason == "stop":
            assert _in_language(out.text, language), out.text
    assert any(o.finish_reason == "stop" for o in outs[:4]) or kind == "json_object"
    # The unconstrained rows of the batch are as without any constraint: the mask was per row,
    # and it changed the constrained ones (the check is not vacuous).
    plain = llm.chat(convs[:2], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [o.token_ids for o in outs[4:]] == [o.token_ids for o in plain]
    assert [o.token_ids for o in outs[:2]] != [o.token_ids for o in plain]


def test_sampled_structured_outputs_stay_in_their_language(llm, llg_tokenizer, conversations):
    languages = [LANGUAGES[kind] for kind in sorted(LANGUAGES)] * 4
    requests = [conversations[i % len(conversations)] for i in range(len(languages))]
    params = [SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95 if i % 2 else 1.0,
                             top_k=20 if i % 3 == 0 else 0, seed=i, structured_outputs=language)
              for i, language in enumerate(languages)]
    outs = llm.chat(requests, params)
    stopped = 0
    for out, language in zip(outs, languages):
        assert _accepted(llg_tokenizer, language, out.token_ids), (language, out.text)
        if out.finish_reason == "stop":
            stopped += 1
            assert _in_language(out.text, language), (language, out.text)
    assert stopped >= 8
    # Seeded: the same tokens alone as in the batch.
    alone = llm.chat(requests[5], params[5])[0]
    assert alone.token_ids == outs[5].token_ids


def test_a_finished_language_ends_the_output_before_min_tokens(llm, conversations):
    """min_tokens masks EOS; once the language allows nothing but EOS, the language wins."""
    out = llm.chat(conversations[1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, min_tokens=10,
                                                    structured_outputs={"choice": ["yes"]}))[0]
    assert out.text == "yes" and out.finish_reason == "stop"


@pytest.mark.parametrize("deploy, devices, cache", [
    ("1EP+1D", "cpu:2", {}),  # the first token sampled on EP, the rest on D: D's matcher replays it
    ("1E+1P+1D", "cpu:3", {}),
    ("1EPD", "cpu:1", {"kv_block_size": 4, "num_kv_blocks": 36, "num_image_blocks": 3}),  # preempted, recomputed
])
def test_structured_outputs_survive_migration_and_preemption(llm, tiny_llava_dir, conversations, deploy, devices,
                                                           cache):
    convs = (conversations * 2)[:18]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if i % 2 else 1.0, seed=i,
                             structured_outputs=LANGUAGES[sorted(LANGUAGES)[i % 4]]) for i in range(len(convs))]
    single = llm.chat(convs, params)
    other = LLM(str(tiny_llava_dir), worker_processes=False, deploy=deploy, devices=devices, token_budget=64,
                **cache)
    outs = other.chat(convs, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in single]
    if "D" in deploy.split("+")[-1] and "+" in deploy:
        assert all("prefill_to_decode_migration" in (o.stage_times or {}) for o in outs)
    else:
        assert other.engine.scheduler.num_preemptions > 0


def test_a_grammar_the_models_tokenizer_refuses_is_the_requests_error_alone(llm, conversations):
    """A special token the checkpoint's tokenizer lacks compiles without a tokenizer (where the
    request came in) and is refused by the instance, with the model's tokenizer, before the
    request is queued; the engine serves on."""
    from hydrad.errors import RequestError

    params = SamplingParams(max_tokens=4, structured_outputs={"grammar": 'start: <|no_such_token|> "a"'})
    with pytest.raises(RequestError, match=re.escape('unknown special token: "<|no_such_token|>"')):
        llm.chat(conversations[1], params)
    assert llm.chat(conversations[1], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids


def test_an_instance_builds_each_grammar_once_and_each_request_gets_a_fresh_copy(llm, conversations):
    """The second request of a grammar takes a copy of the instance's matcher of it, not the
    first request's state: the same prompt gives the same tokens, alone and batched, and the
    grammar was built once. A refused grammar is refused again without another build."""
    from hydrad.errors import RequestError

    grammars = llm.engine.runner.grammars
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs={"regex": "[a-f]{2}-[0-9]{5}"})
    built = grammars.num_built
    first = llm.chat(conversations[1], params)[0].token_ids
    assert grammars.num_built == built + 1
    again = llm.chat([conversations[1]] * 3, params)
    assert [o.token_ids for o in again] == [first] * 3 and grammars.num_built == built + 1
    refused = SamplingParams(max_tokens=4, structured_outputs={"grammar": 'start: <|not_a_token|> "b"'})
    for _ in range(2):
        with pytest.raises(RequestError, match="not_a_token"):
            llm.chat(conversations[1], refused)
    assert grammars.num_built == built + 2


def test_a_grammar_is_built_on_a_thread_of_its_own_then_kept(tiny_llava_dir):
    import threading

    from hydrad.engine.grammar_mask import MAX_TEMPLATES, GrammarMasks
    from hydrad.engine.request import Request
    from hydrad.engine.inputs import EngineRequest

    grammars = GrammarMasks(str(tiny_llava_dir), 4096)
    threads = []
    build = grammars._build
    grammars._build = lambda *args: threads.append(threading.current_thread()) or build(*args)
    params = StructuredOutputsParams(regex="x[0-9]+")
    future = grammars.prepare(params, (2,))
    assert future is not None and grammars.prepare(params, (2,)) in (future, None)
    future.result(timeout=30)
    assert grammars.prepare(params, (2,)) is None and threads[0] is not threading.current_thread()
    req = Request(EngineRequest("r", [1, 2], SamplingParams(structured_outputs=params), eos_token_ids=(2,)))
    matcher = grammars.matcher(req)
    assert not matcher.is_error() and not matcher.is_accepting()  # fresh: "x" not taken yet
    assert len(threads) == 1  # the matcher is a copy of the one built
    for i in range(MAX_TEMPLATES):  # the least recently used grammars go first
        grammars.matcher(Request(EngineRequest(f"r{i}", [1], SamplingParams(
            structured_outputs=StructuredOutputsParams(regex=f"y{i}")), eos_token_ids=(2,))))
    assert grammars.prepare(params, (2,)) is not None
    grammars.close()


@pytest.mark.parametrize("language, message", [
    ({"json": {"type": "objekt"}}, "the json is not valid: Invalid type: objekt"),
    ({"json": "{not json"}, "the json is not valid"),
    ({"regex": "a(b"}, "unclosed group"),
    ({"grammar": "start: undefined_rule"}, 'unknown name: "undefined_rule"'),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({"choice": []}, "choice must be 1 to 1024 non-empty strings"),
    ({"choice": ["", "x"]}, "non-empty strings"),
    ({"jsn": {}}, "unknown field 'jsn'"),
])
def test_a_language_that_does_not_compile_is_refused_at_once(language, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(structured_outputs=language)
