"""``bench/step_log.py`` reads the step lines the engine writes at debug level: the line it
parses is the one ``EngineCore`` logs (checked on a real engine's log), and the summary's
kinds, shares and ratios follow from the steps."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(scope="module")
def script(bench_script):
    return bench_script("step_log")


def _line(worker=0, images=0, tokens=16, chunks=16, decodes=16, vision=0.0, pvision=0.0, language=10.0,
          planguage=10.0, cpu=9.0) -> str:
    return (f"2026-11-29 19:28:10,042 DEBUG worker{worker}: step: {images} images, {tokens} tokens in {chunks} "
            f"chunks ({decodes} decodes); vision {vision:.1f} ms (predicted {pvision:.1f}), language "
            f"{language:.1f} ms (predicted {planguage:.1f}); step thread's CPU {cpu:.1f} ms")


def test_kinds_shares_and_ratios(script):
    lines = [
        "2026-11-29 19:28:10,000 INFO worker0: something else",
        _line(decodes=16, tokens=16, language=10.0, planguage=8.0),  # D
        _line(decodes=16, tokens=16, language=10.0, planguage=12.0),  # D
        _line(images=1, decodes=0, tokens=300, chunks=1, vision=20.0, pvision=10.0, language=60.0, planguage=50.0),
        _line(worker=1, decodes=4, tokens=4, language=5.0, planguage=5.0),
    ]
    summary = script.summarize(script.parse(lines, worker=0))
    assert summary["steps"] == 3 and summary["seconds"] == pytest.approx(0.1)
    d, ep = summary["kinds"]["D"], summary["kinds"]["EP"]
    assert (d["steps"], ep["steps"]) == (2, 1)
    assert d["share"] == pytest.approx(0.2) and ep["share"] == pytest.approx(0.8)
    assert d["measured_over_predicted"] == pytest.approx(1.0)
    assert ep["measured_over_predicted"] == pytest.approx(80 / 60)
    assert ep["mean_prompt_tokens"] == 300 and ep["mean_images"] == 1
    assert list(script.summarize(script.parse(lines))["kinds"]) == ["D", "EP"]  # both workers: 3 D steps
    assert script.parse(lines, skip=2, worker=0) == script.parse(lines[3:4], worker=0)
    assert "| EP | 1 | 80.0% | 1.33 |" in script.table(summary)


def test_it_reads_the_line_the_engine_writes(script, tiny_llava_dir, caplog):
    from hydrad import LLM, SamplingParams

    llm = LLM(tiny_llava_dir)
    try:
        with caplog.at_level(logging.DEBUG):
            llm.generate(["one", "two"], SamplingParams(max_tokens=4))
    finally:
        llm.shutdown()
    lines = [f"worker0: {r.getMessage()}" for r in caplog.records if r.getMessage().startswith("step: ")]
    steps = script.parse(lines)
    assert len(steps) == len(lines) >= 4
    kinds = {script.kind(step) for step in steps}
    assert "D" in kinds and any("P" in k for k in kinds)
    assert sum(step["decodes"] for step in steps) == 2 * 3  # every token after the first of each
