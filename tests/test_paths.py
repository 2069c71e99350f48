"""hydrad's own directories (``hydrad.paths``): the explicit variable, else the XDG one, else
the home default; a ``~`` in a variable is expanded."""

from __future__ import annotations

from pathlib import Path

import pytest

from hydrad.paths import cache_dir, state_dir


@pytest.mark.parametrize("find, explicit, xdg, home_default", [
    (cache_dir, "HYDRAD_CACHE_DIR", "XDG_CACHE_HOME", ".cache/hydrad"),
    (state_dir, "HYDRAD_STATE_DIR", "XDG_STATE_HOME", ".local/state/hydrad"),
])
def test_explicit_then_xdg_then_home(monkeypatch, tmp_path, find, explicit, xdg, home_default):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(explicit, raising=False)
    monkeypatch.delenv(xdg, raising=False)
    assert find() == tmp_path / "home" / home_default
    monkeypatch.setenv(xdg, "")  # empty counts as unset
    assert find() == tmp_path / "home" / home_default
    monkeypatch.setenv(xdg, str(tmp_path / "xdg"))
    assert find() == tmp_path / "xdg" / "hydrad"
    monkeypatch.setenv(explicit, "~/mine")
    assert find() == Path(tmp_path / "home" / "mine")
