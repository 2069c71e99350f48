"""Every message type survives the pipe; pixel tensors travel as shared memory."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from hydrad.engine.inputs import (
    EngineOutput,
    EngineRequest,
    EngineStats,
    FinishedRequest,
    ImageInput,
    StepTiming,
    TokenLogprobs,
)
from hydrad.engine.latency_model import FitError, LatencyModel
from hydrad.engine.migration import MigrationOffer, Pulled
from hydrad.sampling_params import SamplingParams
from hydrad.transport.messages import (
    Abort,
    AddRequest,
    AttachPeers,
    GetStats,
    Migrate,
    Release,
    RequestRejected,
    Shutdown,
    StatsReply,
    StepOutput,
    WorkerFailed,
    WorkerReady,
)


@pytest.fixture(scope="module")
def pipe():
    a, b = mp.get_context("spawn").Pipe()
    yield a, b
    a.close()
    b.close()


def round_trip(pipe, msg):
    a, b = pipe
    a.send(msg)
    return b.recv()


def make_stats() -> EngineStats:
    return EngineStats(num_running=3, num_waiting=1, kv_usage=0.25, image_usage=0.5, num_kv_blocks_used=7,
                       num_image_blocks_used=2, num_preemptions=1)


MESSAGES = [
    Abort(("a", "b")),
    GetStats(7),
    Shutdown(),
    Shutdown(finish_running=True),
    WorkerReady(instance_id=1, pid=1234, max_model_len=2048, load_seconds=1.5),
    StepOutput(EngineOutput(["a", "b"], [5, 6], [None, TokenLogprobs(6, -0.5, 2, [7], [-0.1])],
                            [FinishedRequest("b", "length", {"decode_exec": 0.1}), FinishedRequest("c", "abort")],
                            StepTiming(0.01, 0.012, 0.02, 0.019))),
    WorkerReady(instance_id=1, pid=1234, max_model_len=2048, load_seconds=1.5,
                latency_model=LatencyModel(l_fixed=0.001, l_decode=1e-4, meta={"key": {"a": 1}},
                                           error=FitError(0.05, 0.1, 6)), latency_bound=0.1),
    StatsReply(7, make_stats()),
    RequestRejected("a", "too long"),
    WorkerFailed(0, "RuntimeError: boom", "Traceback ..."),
    AttachPeers({1: b"pickled pools"}),
    Migrate(MigrationOffer("a", 0, "kv", [3, 4], [1, 2, 3], [9], 3, SamplingParams(max_tokens=4), [], (2,), None,
                           {"arrival": 1.0})),
    Release(("a",)),
    StepOutput(EngineOutput(["a"], [5]), offers=[MigrationOffer("b", 1, "image", [[0, 1]], [1], [], 0,
                                                                SamplingParams(), [ImageInput(None, 0, 1)], (2,),
                                                                None, {})], pulled=[Pulled("c", 0)]),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(pipe, msg):
    assert round_trip(pipe, msg) == msg


def test_add_request_round_trip_shares_pixels(pipe):
    pixels = torch.rand(3, 8, 8).share_memory_()
    request = EngineRequest("r1", [1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0.0, stop=["x"]),
                            [ImageInput(pixels, offset=1, length=2)], eos_token_ids=(2,), arrival_time=3.0)
    got = round_trip(pipe, AddRequest(request)).request
    assert (got.req_id, got.prompt_token_ids, got.eos_token_ids, got.arrival_time) == ("r1", [1, 2, 3, 4], (2,), 3.0)
    assert got.sampling_params == request.sampling_params
    image = got.images[0]
    assert (image.offset, image.length) == (1, 2)
    assert image.pixel_values.is_shared()
    assert torch.equal(image.pixel_values, pixels)
    pixels[0, 0, 0] = 42.0  # the same memory, not a copy
    assert image.pixel_values[0, 0, 0].item() == 42.0


def test_add_request_round_trip_carries_variable_resolution_fields(pipe):
    # A Qwen2-VL request: the image's patch grid and the prompt's M-RoPE positions cross with it.
    pixels = torch.rand(16, 1176).share_memory_()
    positions = torch.arange(30).expand(3, -1).clone()
    positions[1:, 10:14] = torch.tensor([[10, 10, 11, 11], [10, 11, 10, 11]])
    request = EngineRequest("q1", list(range(30)), SamplingParams(max_tokens=4),
                            [ImageInput(pixels, offset=10, length=4, grid_thw=(1, 4, 4))],
                            mrope_positions=positions, mrope_delta=-2)
    got = round_trip(pipe, AddRequest(request)).request
    assert got.images[0].grid_thw == (1, 4, 4) and got.images[0].image_size is None
    assert torch.equal(got.mrope_positions, positions) and got.mrope_delta == -2
    next_image = round_trip(pipe, AddRequest(EngineRequest(
        "n1", [1, 2, 3], SamplingParams(), [ImageInput(pixels, 0, 2, image_size=(480, 640))]))).request.images[0]
    assert next_image.image_size == (480, 640)
