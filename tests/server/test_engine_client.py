"""Request and choice streams: tokens fed by the request table become one output per
token, with the text they decode to, for each of ``n`` completions; the handler takes
everything a step produced in one batch."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from hydrad.engine.inputs import EngineRequest
from hydrad.sampling_params import SamplingParams
from hydrad.server.engine_client import ChoiceStream, RequestStream
from hydrad.server.metrics import Metrics


@pytest.fixture(scope="module")
def tokenizer(tiny_llava_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llava_dir)


def make_stream(tokenizer, n=1, params: SamplingParams | None = None):
    aborted = []
    metrics = Metrics("m")
    client = SimpleNamespace(metrics=metrics, trace=None, processor=SimpleNamespace(tokenizer=tokenizer),
                             table=SimpleNamespace(abort=aborted.append, routes={}), flushed=[])
    client.flush_later = client.flushed.append  # the step's flush is run by the test
    instance = SimpleNamespace(instance_id=0, abort=aborted.append)
    stream = RequestStream(client, num_prompt_tokens=3, arrival=0.0, user=None)
    for i in range(n):
        request = EngineRequest(f"r-{i}", [1, 2, 3], params or SamplingParams(max_tokens=100))
        stream.choices.append(ChoiceStream(stream, i, request, instance))
    return stream, aborted, metrics


def collect(stream: RequestStream) -> list[list]:
    async def run():
        return [batch async for batch in stream]

    return asyncio.run(run())


def test_each_token_gives_one_output_and_the_finish_rides_on_the_last(tokenizer):
    ids = tokenizer.encode("fox jumps over", add_special_tokens=False)
    stream, aborted, metrics = make_stream(tokenizer)
    choice = stream.choices[0]
    for t in ids:
        choice.on_token(t, None)
    choice.on_finish("length", {"decode_exec": 1.0})
    (batch,) = collect(stream)  # everything queued before the handler woke: one batch
    assert [o.token_ids for o in batch] == [[t] for t in ids]
    assert [o.finish_reason for o in batch] == [None] * (len(ids) - 1) + ["length"]
    assert [o.num_output_tokens for o in batch] == list(range(1, len(ids) + 1))
    assert "".join(o.text for o in batch) == "fox jumps over" and not aborted
    generated = metrics.registry.get_sample_value("hydrad_generation_tokens_total", {"model_name": "m"})
    assert generated == len(ids) and stream.num_output_tokens == len(ids)


def test_a_stop_string_ends_the_outputs_there_and_aborts(tokenizer):
    ids = tokenizer.encode("fox jumps over the dog", add_special_tokens=False)
    stream, aborted, _ = make_stream(tokenizer, params=SamplingParams(max_tokens=100, stop=["over"]))
    for t in ids:
        stream.choices[0].on_token(t, None)
    outs = [o for batch in collect(stream) for o in batch]
    assert "".join(o.text for o in outs) == "fox jumps "
    assert outs[-1].finish_reason == "stop" and len(outs) < len(ids) and aborted == ["r-0"]


def test_an_unfinished_last_character_ends_the_text_as_the_decode_does(tokenizer):
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)
    ids = next(ids[:n] for n in range(len(ids), 0, -1) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    stream, _, _ = make_stream(tokenizer)
    for t in ids:
        stream.choices[0].on_token(t, None)
    stream.choices[0].on_finish("length", None)
    outs = [o for batch in collect(stream) for o in batch]
    assert len([o for o in outs if o.token_ids]) == len(ids)
    assert "".join(o.text for o in outs) == tokenizer.decode(ids, skip_special_tokens=True)


def test_n_completions_interleave_and_end_independently(tokenizer):
    stream, aborted, _ = make_stream(tokenizer, n=2)
    a, b = stream.choices
    a.on_token(10, None)
    b.on_token(11, None)
    b.on_finish("stop", None)
    a.on_token(12, None)

    async def run():
        first = await stream.__anext__()
        a.on_finish("length", None)
        rest = [batch async for batch in stream]
        return first, rest

    first, rest = asyncio.run(run())
    assert [(o.index, o.token_ids, o.finish_reason) for o in first] == [(0, [10], None), (1, [11], "stop"),
                                                                       (0, [12], None)]
    assert [(o.index, o.finish_reason) for batch in rest for o in batch] == [(0, "length")]
    assert stream.num_output_tokens == 3 and stream.finished and not aborted


def test_an_error_surfaces_once_and_closing_aborts_what_is_left(tokenizer):
    stream, aborted, _ = make_stream(tokenizer, n=2)
    stream.choices[0].on_error(RuntimeError("worker 0 (cpu, EPD) exited"))

    async def run():
        with pytest.raises(RuntimeError, match="exited"):
            await stream.__anext__()

    asyncio.run(run())
    stream.close()
    assert aborted == ["r-1"]  # the failed one is gone already; the other is aborted


def test_with_direct_writes_a_step_is_written_after_its_delivery_and_the_handler_wakes_only_to_end(tokenizer):
    ids = tokenizer.encode("fox jumps over", add_special_tokens=False)
    stream, _, _ = make_stream(tokenizer)
    choice = stream.choices[0]
    written: list[list] = []
    full = [False]  # the connection's buffer is full: the handler writes and waits

    def direct(outputs):
        if full[0]:
            return False
        written.append([(o.token_ids, o.finish_reason) for o in outputs])
        return True

    async def run():
        handler_batches = []

        async def handler():
            async for batch in stream:
                handler_batches.append([(o.token_ids, o.finish_reason) for o in batch])

        task = asyncio.ensure_future(handler())
        await asyncio.sleep(0)
        stream.direct = direct
        choice.on_token(ids[0], None)  # a step's token: queued until the step's flush
        assert stream.client.flushed == [stream] and not written
        stream.client.flushed.pop().flush()
        assert written == [[([ids[0]], None)]]
        await asyncio.sleep(0)
        assert not handler_batches and not task.done()  # the handler slept through it
        full[0] = True
        choice.on_token(ids[1], None)
        stream.client.flushed.pop().flush()
        await asyncio.sleep(0)
        assert handler_batches == [[([ids[1]], None)]]  # written by the handler instead
        full[0] = False
        for t in ids[2:]:
            choice.on_token(t, None)
        choice.on_finish("length", None)  # in the same step: one flush, the finish on the last token
        assert stream.client.flushed == [stream]
        stream.client.flushed.pop().flush()
        await asyncio.wait_for(task, 1)  # woken to end the stream
        return handler_batches

    handler_batches = asyncio.run(run())
    assert written[1] == [([t], None) for t in ids[2:-1]] + [([ids[-1]], "length")]
    assert len(handler_batches) == 1


def test_a_video_takes_its_groups_blocks_in_the_image_cache():
    """A video is held in the image cache group by group (``ImageInput.groups``), each group
    in blocks of its own: four groups of 99 tokens take 8 blocks of 64, not 7."""
    from hydrad.engine.inputs import ImageInput
    from hydrad.errors import RequestError
    from hydrad.server.engine_client import check_image_caches

    video = ImageInput(None, 5, 396, grid_thw=(4, 18, 22), num_patches=1584, attention_span=396, frames=8)
    check_image_caches([video], ((8, 64),), "messages")
    with pytest.raises(RequestError, match="the request's 1 images take 396 image tokens, 8 blocks of 64"):
        check_image_caches([video], ((7, 64),), "messages")
    whole = ImageInput(None, 5, 396, num_patches=1584)
    check_image_caches([whole], ((7, 64),), "messages")
