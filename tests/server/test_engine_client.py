"""``OutputStream``: engine deltas become one output per token, with the text the tokens decode to."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from hydrad.engine.inputs import EngineRequest, RequestDelta
from hydrad.sampling_params import SamplingParams
from hydrad.server.engine_client import OutputStream
from hydrad.server.metrics import Metrics


@pytest.fixture(scope="module")
def tokenizer(tiny_llava_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llava_dir)


def outputs_of(tokenizer, deltas: list[RequestDelta], params: SamplingParams | None = None):
    """Run ``deltas`` through an OutputStream; return its outputs and what it aborted."""
    aborted = []
    metrics = Metrics("m")
    client = SimpleNamespace(metrics=metrics, processor=SimpleNamespace(tokenizer=tokenizer))
    instance = SimpleNamespace(instance_id=0, abort=aborted.append)
    request = EngineRequest("r", [1, 2, 3], params or SamplingParams(max_tokens=100))

    async def run():
        queue = asyncio.Queue()
        for delta in deltas:
            queue.put_nowait(delta)
        return [out async for out in OutputStream(client, request, instance, queue, arrival=0.0)]

    return asyncio.run(run()), aborted, metrics


def test_a_delta_with_several_tokens_gives_one_output_per_token(tokenizer):
    ids = tokenizer.encode("fox jumps over", add_special_tokens=False)
    assert len(ids) >= 3
    deltas = [RequestDelta("r", ids[:1]), RequestDelta("r", ids[1:], "length", stage_times={"decode_exec": 1.0})]
    outs, aborted, metrics = outputs_of(tokenizer, deltas)
    assert [o.token_ids for o in outs] == [[t] for t in ids]
    assert [o.finish_reason for o in outs] == [None] * (len(ids) - 1) + ["length"]
    assert [o.num_output_tokens for o in outs] == list(range(1, len(ids) + 1))
    assert "".join(o.text for o in outs) == "fox jumps over" and not aborted
    generated = metrics.registry.get_sample_value("hydrad_generation_tokens_total", {"model_name": "m"})
    assert generated == len(ids)


def test_a_stop_string_inside_a_delta_ends_the_outputs_there(tokenizer):
    ids = tokenizer.encode("fox jumps over the dog", add_special_tokens=False)
    outs, aborted, _ = outputs_of(tokenizer, [RequestDelta("r", ids)],
                                  SamplingParams(max_tokens=100, stop=["over"]))
    assert "".join(o.text for o in outs) == "fox jumps "
    assert outs[-1].finish_reason == "stop" and len(outs) < len(ids) and aborted == ["r"]


def test_an_unfinished_last_character_ends_the_text_as_the_decode_does(tokenizer):
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)
    ids = next(ids[:n] for n in range(len(ids), 0, -1) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    deltas = [RequestDelta("r", [t]) for t in ids[:-1]] + [RequestDelta("r", ids[-1:], "length")]
    outs, _, _ = outputs_of(tokenizer, deltas)
    assert len(outs) == len(ids)
    assert "".join(o.text for o in outs) == tokenizer.decode(ids, skip_special_tokens=True)
