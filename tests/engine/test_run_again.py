"""A request that runs again with the tokens it had (its instance died: ``EngineRequest.
output_token_ids``) goes on with the tokens it would have had without the interruption:
greedy, seeded sampling (its generator goes on after the draws of those tokens), with
penalties and ``min_tokens`` counting them, on one instance and split over three, and for
every family (M-RoPE positions after the prompt, images of varying size)."""

from __future__ import annotations

import dataclasses

import pytest

from hydrad import LLM, SamplingParams
from hydrad.engine.inputs import EngineRequest
from test_llm_correctness import _reference_tokens, _text, conversations, reference  # noqa: F401 (fixtures)

SETTINGS = [
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=0.9, top_p=0.95, top_k=40, seed=1234, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=1.0, seed=7, repetition_penalty=1.3, frequency_penalty=0.5,
                   presence_penalty=0.4, min_tokens=12),
]


def _run(llm: LLM, request: EngineRequest) -> tuple[list[int], str]:
    """The tokens and finish reason of ``request`` alone through ``llm``'s engine."""
    llm.engine.add_request(request)
    tokens: list[int] = []
    for _ in range(1000):
        step = llm.engine.step()
        tokens += [t for r, t in zip(step.req_ids, step.token_ids) if r == request.req_id]
        for end in step.finished:
            if end.req_id == request.req_id:
                return tokens, end.finish_reason
    raise AssertionError(f"{request.req_id} did not finish")


def _check_runs_again(llm: LLM, conversations) -> None:
    prompts = [llm.processor.process_chat(conversations[i]) for i in (0, 1, 3)]
    for p, prompt in enumerate(prompts):
        for s, params in enumerate(SETTINGS):
            whole, reason = _run(llm, llm.processor.make_engine_request(f"whole-{p}-{s}", prompt, params))
            assert len(whole) == params.max_tokens and reason == "length"
            for k in (1, 6, params.max_tokens - 1):
                request = llm.processor.make_engine_request(f"again-{p}-{s}-{k}", prompt, params)
                again, reason = _run(llm, dataclasses.replace(request, output_token_ids=whole[:k]))
                assert again == whole[k:], (p, s, k)
                assert reason == "length"
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("deploy, devices", [("1EPD", "cpu:1"), ("1E+1P+1D", "cpu:3")])
def test_a_request_run_again_with_its_tokens_goes_on_as_if_uninterrupted(tiny_llava_dir, conversations, deploy,
                                                                         devices):
    _check_runs_again(LLM(str(tiny_llava_dir), worker_processes=False, deploy=deploy, devices=devices,
                          token_budget=64), conversations)


@pytest.mark.parametrize("arch", ["llava-next", "qwen2-vl"])
def test_every_family_runs_again_as_if_uninterrupted(tiny_checkpoint, conversations, arch):
    _check_runs_again(LLM(str(tiny_checkpoint(arch)), worker_processes=False, deploy="1E+1PD", devices="cpu:2",
                          token_budget=64), conversations)
