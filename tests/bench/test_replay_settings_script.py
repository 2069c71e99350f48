"""The pure parts of ``bench/replay_settings.py``: reading a setting, summing up errors. The
replays themselves are the benchmark."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def script(bench_script):
    return bench_script("replay_settings")


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


def test_a_setting_takes_its_defaults_and_rejects_bad_values_in_one_line(script):
    defaults = {"corun_slowdown": {"images": 0.14}}
    assert script.make_setting(None, "no", 32, 0.0, defaults) == {
        "corun_slowdown": {"images": 0.14}, "client_cpu": False, "warm_requests": 32, "noise_correlation": 0.0}
    assert script.make_setting("decodes=0.1", "yes", 0, 0.6, defaults)["corun_slowdown"] == {"decodes": 0.1}
    with pytest.raises(SystemExit, match="warm-up requests must be >= 0, got -1"):
        script.make_setting(None, "no", -1, 0.0, defaults)
    with pytest.raises(SystemExit, match=r"noise correlation must be in \[0, 1\), got 1.0"):
        script.make_setting(None, "no", 0, 1.0, defaults)
