"""Cache pools sized from a GPU's memory (``hydrad.engine.memory``), on a GPU: the readings
the CPU tests replace (tests/engine/test_memory.py), the largest step measured for real, and
transformers' greedy tokens on the pools that come out. Skipped where torch sees no GPU."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from hydrad import LLM, SamplingParams

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "engine")]

from test_disaggregation import conversations, reference  # noqa: E402, F401  (fixtures)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MB = 1 << 20


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def test_one_instance_takes_its_share_and_keeps_transformers_tokens(tiny_llava_dir, conversations, reference):
    _release()
    total = torch.cuda.mem_get_info(0)[1]
    before = torch.cuda.memory_reserved(0)  # what tests before this one in the process still hold
    with LLM(str(tiny_llava_dir), devices="cuda:0", dtype="float32", gpu_memory_utilization=0.3) as llm:
        engine = llm.engine
        assert engine.pool_bytes is not None and engine.pool_bytes > 512 * MB
        geometry = engine.geometry()
        pools = engine.kv_manager.num_blocks * geometry.kv_block_bytes + \
            engine.image_manager.num_blocks * geometry.image_block_bytes
        assert 0.9 * engine.pool_bytes <= pools <= engine.pool_bytes
        assert torch.cuda.memory_reserved(0) - before <= 0.3 * total
        assert engine._step_peak > 0
        outs = llm.chat(conversations, SamplingParams(max_tokens=24, temperature=0.0))
        for i, (out, ref) in enumerate(zip(outs, reference)):
            assert out.token_ids == ref, f"conversation {i}: {out.token_ids} != {ref}"
    _release()


def test_two_instances_on_one_gpu_each_take_their_share(tiny_llava_dir, conversations, reference,
                                                         one_gpu_for_every_instance):
    _release()
    total = torch.cuda.mem_get_info(0)[1]
    before = torch.cuda.memory_reserved(0)  # what tests before this one in the process still hold
    with LLM(str(tiny_llava_dir), deploy="1EP+1D", devices="cuda:0", dtype="float32", worker_processes=False,
             gpu_memory_utilization=0.3) as llm:
        first, second = llm.engine.engines
        assert first.pool_bytes and second.pool_bytes
        assert abs(first.pool_bytes - second.pool_bytes) < 0.05 * first.pool_bytes
        assert torch.cuda.memory_reserved(0) - before <= 0.6 * total
        outs = llm.chat(conversations, SamplingParams(max_tokens=24, temperature=0.0))
        assert [o.token_ids for o in outs] == reference
    _release()
