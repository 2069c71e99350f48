"""A daemon on the tiny model, one per test module, for the clients to drive."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The daemon launcher lives with the server tests; this suite starts the same daemon.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from daemon_process import Daemon, http  # noqa: E402
from interop_support import counters  # noqa: E402


@pytest.fixture(scope="module")
def daemon(tiny_llava_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("interop")
    d = Daemon(["--model", str(tiny_llava_dir), "--devices", "cpu:1"], tmp / "hydrad.log")
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def model_name(daemon) -> str:
    return http("GET", daemon.url + "/v1/models").json()["data"][0]["id"]


@pytest.fixture
def hydrad_counts(daemon):
    """Call it after a tool has run: hydrad's counters for what happened since the test began."""
    before = counters(daemon)
    return lambda: counters(daemon) - before
