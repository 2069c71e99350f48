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


def test_a_worker_killed_mid_generation_changes_no_token(tiny_llava_dir, conversations, reference):
    """The decode worker is killed (SIGKILL) while it decodes: it is restarted, the requests it
    held run again from the tokens they had, and every answer still equals transformers'."""
    import asyncio
    import os
    import signal
    import threading
    import time

    with LLM(str(tiny_llava_dir), deploy="1E+1P+1D", devices="cpu:3", token_budget=24) as llm:
        cluster = llm.engine
        supervisor = cluster.supervisor
        decode = supervisor.clients[2]
        killed: list[int] = []

        async def decoding() -> bool:  # asked on the cluster's own loop: D decodes two or more
            return (await decode.get_stats()).num_running >= 2

        def kill_once_decoding() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if asyncio.run_coroutine_threadsafe(decoding(), cluster._loop).result():
                    killed.append(decode.ready.pid)
                    os.kill(decode.ready.pid, signal.SIGKILL)
                    return
                time.sleep(0.002)

        killer = threading.Thread(target=kill_once_decoding, daemon=True)
        killer.start()
        outs = llm.chat(conversations, SamplingParams(max_tokens=24, temperature=0.0))
        killer.join(5)
        assert killed, "the decode instance never decoded two requests at once"
        for i, (out, ref) in enumerate(zip(outs, reference)):
            assert out.token_ids == ref, f"conversation {i}"
        assert supervisor.num_restarts[2] == 1 and supervisor.table.num_run_again >= 1
        assert supervisor.table.num_lost == 0
