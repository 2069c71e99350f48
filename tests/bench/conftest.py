from __future__ import annotations

import importlib
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from hydrad.bench import SLO, BenchConfig

FAKE_SERVER = Path(__file__).with_name("fake_server.py")
BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench_script():
    """Imports a script of ``bench/`` by module name (``bench/`` is on ``sys.path`` while the
    test module runs, as it is for the script itself)."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="session")
def server_url():
    proc = subprocess.Popen([sys.executable, str(FAKE_SERVER)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), f"fake server did not start: {line!r}"
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def fake_requests(server_url):
    """Returns what the server received since the previous call (drained before the test)."""

    def fetch() -> list[dict]:
        with urllib.request.urlopen(f"{server_url}/fake/requests") as resp:
            return json.load(resp)

    fetch()
    return fetch


@pytest.fixture
def write_jsonl(tmp_path):
    def write(rows: list[dict], name: str = "workload.jsonl") -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return path

    return write


@pytest.fixture
def make_config(server_url, write_jsonl):
    """BenchConfig factory against the fake server: a few short text requests at a high rate."""
    quick = write_jsonl([{"prompt": "ttft=0.01 tbt=0.01", "output_tokens": 3}], "quick.jsonl")

    def make(**overrides) -> BenchConfig:
        fields = {"url": server_url, "slo": SLO(ttft=0.2, tbt=0.05), "workload": str(quick),
                  "rates": (50.0,), "num_requests": 4}
        return BenchConfig(**{**fields, **overrides})

    return make
