"""The pure parts of ``bench/replay_settings.py``: reading a setting, summing up errors. The
replays themselves are the benchmark."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("replay_settings")
    finally:
        sys.path.remove(str(BENCH))


def test_a_corun_setting_reads_per_kind_and_names_a_bad_part(script):
    assert script.parse_kinds("images=0.14, prefills=0.1,decodes=0") == {"images": 0.14, "prefills": 0.1,
                                                                       "decodes": 0.0}
    assert script.parse_kinds("") == {}
    for bad in ("images", "vision=0.1", "images=fast"):
        with pytest.raises(SystemExit, match=repr(bad.strip())):
            script.parse_kinds(bad)


def test_errors_are_summed_up_with_their_sign_and_by_size(script):
    s = script.summarize([0.1, -0.2, 0.3, 0.15])
    assert s["rounds"] == 4
    assert s["mean"] == pytest.approx(0.0875) and s["median"] == pytest.approx(0.125)
    assert s["mean_abs"] == pytest.approx(0.1875)
    assert s["within_15pct"] == 2  # 0.1 and 0.15; -0.2 and 0.3 are out
