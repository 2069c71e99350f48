"""``LLM`` with several instances runs one worker process per device, as the daemon does."""

from __future__ import annotations

import multiprocessing

import pytest

from test_disaggregation import conversations, reference  # noqa: F401  (fixtures)

from hydrad import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_worker_processes_match_transformers(tiny_llava_dir, conversations, reference):
    with LLM(str(tiny_llava_dir), deploy="1E+1P+1D", devices="cpu:3", token_budget=24) as llm:
        workers = multiprocessing.active_children()
        assert len([w for w in workers if w.name.startswith("hydrad-worker")]) == 3
        outs = llm.chat(conversations, SamplingParams(max_tokens=24, temperature=0.0))
        for i, (out, ref) in enumerate(zip(outs, reference)):
            assert out.token_ids == ref, f"conversation {i}"
        assert any("encode_to_prefill_migration" in (o.stage_times or {}) for o in outs)
        assert any("prefill_to_decode_migration" in (o.stage_times or {}) for o in outs)
        # a request that can never fit is refused with a clear error, and the LLM stays usable
        with pytest.raises(ValueError, match="context length"):
            llm.chat(conversations[1], SamplingParams(max_tokens=100_000))
        assert llm.chat(conversations[5], SamplingParams(max_tokens=3, temperature=0.0))[0].token_ids == reference[5][:3]
    assert not [w for w in multiprocessing.active_children() if w.name.startswith("hydrad-worker")]
