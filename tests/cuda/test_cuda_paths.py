"""The CUDA paths, against transformers' greedy tokens on CPU: one instance on a GPU, the
dual CUDA streams, migration's copy stream, cache pools shared between worker processes
through CUDA IPC handles (workers forked from the fork server), and the daemon on a GPU.

These run only where torch sees a GPU (CI has none: they are skipped there). Several
instances share GPU 0 here, so one GPU runs every deployment of roles.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from hydrad import LLM, SamplingParams

# The conversations and references of the CPU correctness tests; the daemon launcher.
TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "engine"), str(TESTS / "server")]

# transformers on CPU in float32: the external reference for every test here.
from test_disaggregation import conversations, reference  # noqa: E402, F401  (fixtures)
from factories import FIXED_POOLS, place_every_instance_on_gpu0  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_TOKENS = 24

def _check(llm: LLM, conversations, reference) -> list:
    outs = llm.chat(conversations, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out.token_ids == ref, f"conversation {i}: {out.token_ids} != {ref}"
    return outs


@pytest.mark.parametrize("dual_streams", [False, True])
def test_one_instance_on_cuda_matches_transformers(tiny_llava_dir, conversations, reference, dual_streams):
    llm = LLM(str(tiny_llava_dir), devices="cuda:0", **FIXED_POOLS,
              dtype="float32", dual_streams=dual_streams, token_budget=24)
    assert llm.engine.device.type == "cuda"
    streams = llm.engine.streams
    assert streams.enabled == dual_streams and (streams._vision_stream is not None) == dual_streams
    both, run = [], streams.run

    def counting_run(vision, language):
        both.append(vision is not None and language is not None)
        return run(vision, language)

    streams.run = counting_run
    _check(llm, conversations, reference)
    assert llm.engine.kv_manager.num_used_blocks == 0
    assert any(both)  # some step had vision and language work (on the two streams when dual)


@pytest.mark.parametrize("dtype, backend", [("bfloat16", "auto"), ("bfloat16", "sdpa"), ("float16", "sdpa")])
def test_half_precision_agrees_with_float32(tiny_llava_dir, conversations, dtype, backend):
    """bfloat16 (the default on CUDA) and float16 against float32 on the same GPU (which equals
    transformers, above), token by token with log-probabilities (tests/agreement.py), with
    prefill chunks after cached context and decodes: the attention calls that take a mask."""
    from agreement import PARAMS, check_answers

    full = LLM(str(tiny_llava_dir), devices="cuda:0", **FIXED_POOLS, dtype="float32", token_budget=24)
    want = full.chat(conversations, PARAMS, use_tqdm=False)
    full.shutdown()
    half = LLM(str(tiny_llava_dir), devices="cuda:0", **FIXED_POOLS,
               dtype=dtype, attention_backend=backend, token_budget=24)
    check_answers(half.chat(conversations, PARAMS, use_tqdm=False), want, dtype)


def test_migration_copy_stream_on_cuda(tiny_llava_dir, conversations, reference, one_gpu_for_every_instance):
    llm = LLM(str(tiny_llava_dir), deploy="1E+1P+1D", devices="cuda:0", **FIXED_POOLS, dtype="float32",
              worker_processes=False, token_budget=24)
    assert all(e.device.type == "cuda" for e in llm.engine.engines)
    outs = _check(llm, conversations, reference)
    assert any("encode_to_prefill_migration" in (o.stage_times or {}) for o in outs)
    assert any("prefill_to_decode_migration" in (o.stage_times or {}) for o in outs)
    for engine in llm.engine.engines:
        if engine.kv_manager:
            assert engine.kv_manager.num_used_blocks == 0


def test_worker_processes_share_pools_through_cuda_ipc(tiny_llava_dir, conversations, reference,
                                                      one_gpu_for_every_instance):
    with LLM(str(tiny_llava_dir), deploy="1E+1P+1D", devices="cuda:0", **FIXED_POOLS,
             dtype="float32", token_budget=24) as llm:
        workers = [w for w in multiprocessing.active_children() if w.name.startswith("hydrad-worker")]
        assert len(workers) == 3
        outs = _check(llm, conversations, reference)
        assert any("encode_to_prefill_migration" in (o.stage_times or {}) for o in outs)
        assert any("prefill_to_decode_migration" in (o.stage_times or {}) for o in outs)
        # A seeded request's generator moves with it between the workers: alone, it draws what
        # it draws on one instance on the same GPU.
        seeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=1)
        moved = [llm.chat(conversation, seeded)[0].token_ids for conversation in conversations[:3]]
    single = LLM(str(tiny_llava_dir), devices="cuda:0", **FIXED_POOLS, dtype="float32", token_budget=24)
    assert moved == [single.chat(conversation, seeded)[0].token_ids for conversation in conversations[:3]]


def test_daemon_on_cuda(tiny_llava_dir, tmp_path):
    from daemon_process import Daemon

    daemon = Daemon(["--model", str(tiny_llava_dir), "--devices", "cuda"], tmp_path / "hydrad.log")
    try:
        with urllib.request.urlopen(daemon.url + "/v1/models", timeout=30) as response:
            model = json.load(response)["data"][0]["id"]
        body = json.dumps({"model": model, "max_tokens": 8, "temperature": 0,
                           "messages": [{"role": "user", "content": "Say something."}]}).encode()
        request = urllib.request.Request(daemon.url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.load(response)
        assert answer["usage"]["completion_tokens"] > 0, answer
        with urllib.request.urlopen(daemon.url + "/admin/status", timeout=30) as response:
            status = json.load(response)
        assert "cuda" in json.dumps(status), status
    finally:
        assert daemon.stop() == 0, daemon.log()


# -- the families with variable image tokens and M-RoPE ------------------------------------------
# float32 on the GPU agrees with the CPU reference to ~1e-5 in log-probability; lost or
# recomputed positions move it by ~1e-3.
FAMILY_LOGPROB_TOL = 3e-4


@pytest.fixture(scope="module")
def family_conversations():
    from factories import mixed_conversations

    return mixed_conversations()


@pytest.mark.parametrize("arch", ["llava-next", "qwen2-vl", "qwen2.5-vl"])
def test_families_on_cuda_with_chunks_preemption_and_ipc(tiny_checkpoint, family_conversations, arch,
                                                        one_gpu_for_every_instance):
    from factories import hf_references
    from test_llm_families import CACHE, LONG_TOKENS, TOKEN_BUDGET, _check, _prompt_ids

    path = tiny_checkpoint(arch)
    refs = hf_references(path, family_conversations, LONG_TOKENS)
    params = SamplingParams(max_tokens=LONG_TOKENS, min_tokens=LONG_TOKENS, temperature=0.0, logprobs=0)

    def check(llm: LLM, what: str) -> list:
        return _check(llm, family_conversations, refs, what, tol=FAMILY_LOGPROB_TOL, params=params)

    # KV room for the longest request alone (as on the CPU, tests/engine/test_llm_families.py):
    # the decodes of the requests admitted together outgrow it, and requests are preempted.
    longest = max(len(ids) for ids in _prompt_ids(path, family_conversations)) + LONG_TOKENS
    llm = LLM(str(path), devices="cuda:0", dtype="float32", token_budget=TOKEN_BUDGET, kv_block_size=4,
              num_kv_blocks=-(-longest // 4), **CACHE)
    check(llm, f"{arch} one instance")
    assert llm.engine.scheduler.num_preemptions > 0
    llm.shutdown()
    with LLM(str(path), deploy="1E+1P+1D", devices="cuda:0", dtype="float32", token_budget=TOKEN_BUDGET,
             **CACHE) as llm:
        outs = check(llm, f"{arch} in worker processes")
    assert any("prefill_to_decode_migration" in (o.stage_times or {}) for o in outs)


# -- videos (Qwen2-VL, Qwen2.5-VL) -------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen2-vl", "qwen2.5-vl"])
def test_videos_on_cuda_in_worker_processes(tiny_checkpoint, arch, monkeypatch):
    """A conversation with an image and a video (frames given as arrays: no PyAV needed) on the
    GPU, on one instance and across worker processes (the video's embeddings through CUDA IPC),
    against the same request on the CPU in float32, token by token with log-probabilities (on the
    CPU its greedy tokens are transformers', tests/models/test_qwen2_vl_videos.py)."""
    from factories import image, photo_frames, text
    from test_llm_families import CACHE

    conversation = [
        {"role": "user", "content": [image(80, 64, 3), text("and then")]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": [{"type": "video", "video": photo_frames(6, 90, 120, 1), "fps": 3.0},
                                     text("What happens in the video?")]},
    ]
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, logprobs=0)
    path = str(tiny_checkpoint(arch))
    with LLM(path, devices="cpu:1", worker_processes=False, **CACHE) as cpu:
        want = cpu.chat([conversation], params, use_tqdm=False)[0]
    place_every_instance_on_gpu0(monkeypatch)  # after the reference: it would take that to the GPU too

    def check(llm: LLM, what: str):
        got = llm.chat([conversation], params, use_tqdm=False)[0]
        assert got.token_ids == want.token_ids, what
        assert [e.logprob for e in got.logprobs] == pytest.approx([e.logprob for e in want.logprobs],
                                                                   abs=FAMILY_LOGPROB_TOL), what
        return got

    with LLM(path, devices="cuda:0", dtype="float32", token_budget=16, **CACHE) as llm:
        assert llm.engine.device.type == "cuda"
        check(llm, f"{arch} one instance")
    with LLM(path, deploy="1E+1P+1D", devices="cuda:0", dtype="float32", token_budget=16, **CACHE) as llm:
        got = check(llm, f"{arch} in worker processes")
    assert "encode_to_prefill_migration" in (got.stage_times or {})
