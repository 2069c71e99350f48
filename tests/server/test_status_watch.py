"""``hydractl status --watch`` against a stand-in daemon that answers /admin/status."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time

import pytest
from rich.console import Console

from daemon_process import HYDRACTL, REPO
from factories import http_get_stub
from hydrad.cli.status import watch_status
from hydrad.engine.cores import CpuThreads
from hydrad.errors import HydradError


def captured_status(n: int) -> dict:
    """What /admin/status answered on a 1E+1P+1D daemon, with minute ``n`` of uptime."""
    instance = {"device": "cpu", "num_inflight": 0, "num_running": n, "num_waiting": 0, "kv_usage": 0.1,
                "image_usage": 0.0, "tokens_per_second": 12.5, "pid": 100}
    model = "encode 4.0 ms + 2.0 ms/image; step 1.5 ms + 30 us/prefill token + 250 us/decode + 9.0 us/1k ctx"
    return {
        "model": "tiny-llava", "max_model_len": 512, "uptime_seconds": 60.0 * n,
        "instances": [{**instance, "id": i, "role": role, "state": "ready", "latency_model": model,
                       "latency_bound": 0.1}
                      for i, role in enumerate(("E", "P", "D"))],
        "requests": {"num_inflight": n, "window_seconds": 60.0, "request_rate": 0.5, "ttft_p50": 0.2,
                     "ttft_p90": 0.4, "tbt_p50": 0.02, "tbt_p90": 0.05},
    }


@pytest.fixture
def status_server():
    served = []

    def answer(path: str) -> bytes:
        served.append(path)
        return json.dumps(captured_status(len(served))).encode()

    with http_get_stub(answer) as url:
        yield url, served


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# A shell without job control starts background commands with SIGINT ignored (a CI
# script's `cmd &`); Ctrl-C must stop the watch all the same.
@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_watch_prints_a_snapshot_per_interval_into_a_pipe(status_server, inherited):
    url, served = status_server
    process = subprocess.Popen([sys.executable, *HYDRACTL, "status", "--watch", "--interval", "0.2", "--url", url],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                               env={"PYTHONPATH": str(REPO), "COLUMNS": "120", "PATH": "/usr/bin:/bin"},
                               preexec_fn=ignore_sigint if inherited == "ignored" else None)
    try:
        deadline = time.monotonic() + 60
        while len(served) < 4 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, err
    assert served[0] == "/admin/status" and len(served) >= 4
    # one whole snapshot per refresh (the last answer may have come in as the signal did)
    assert len(served) - 1 <= out.count("hydrad: tiny-llava") <= len(served), out
    for n in (1, 2, 3):
        assert f"up {n}m00s" in out
    assert out.count("steps up to 100.0 ms; encode 4.0 ms") == 3 * out.count("hydrad: tiny-llava")


def scripted_daemon():
    """A status fetch that answers, fails as a restarting daemon does, then answers again, and
    a sleep that interrupts the watch once every answer is out."""
    answers = [captured_status(1), HydradError("cannot reach the daemon at http://x: refused"), captured_status(2)]

    def fetch():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def sleep(_):
        if not answers:
            raise KeyboardInterrupt

    return fetch, sleep


def test_watch_redraws_in_place_on_a_terminal_and_survives_a_restart():
    fetch, sleep = scripted_daemon()

    buf = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        watch_status(fetch, Console(file=buf, force_terminal=True, width=120), 0.1, sleep=sleep)
    out = buf.getvalue()
    assert "up 1m00s" in out and "cannot reach the daemon" in out and "up 2m00s" in out
    assert out.count("\x1b[2K") >= 2  # earlier frames were erased, not scrolled
    assert out.index("up 1m00s") < out.index("cannot reach") < out.index("up 2m00s")


def test_a_worker_that_is_down_shows_no_tokens_per_second():
    """Its last seconds' rate would read as if it were still producing."""
    from types import SimpleNamespace

    from hydrad.cluster.requests import Quarantine

    from hydrad.cli.status import render
    from hydrad.server.admin import status_body

    def client(instance_id, alive):
        return SimpleNamespace(instance_id=instance_id, device="cpu", role="EPD", ready=None, alive=alive,
                               accepting=alive, num_inflight=0, tokens_per_second=lambda: 37.5)

    supervisor = SimpleNamespace(clients=[client(0, False), client(1, True)], crash_loops={}, restarting=set(),
                                 num_restarts={}, specs=[SimpleNamespace(threads=CpuThreads(1))] * 2,
                                 table=SimpleNamespace(num_run_again=0, num_lost=0, kept_image_bytes=0,
                                                       quarantine=Quarantine(60.0)))
    body = status_body(supervisor, [None, None], model="m", max_model_len=64,
                       started=time.monotonic(), num_requests=0, window=captured_status(1)["requests"])
    assert [i["tokens_per_second"] for i in body["instances"]] == [None, 37.5]
    assert [i["state"] for i in body["instances"]] == ["down", "unresponsive"]
    buf = io.StringIO()
    Console(file=buf, width=120).print(render(body))
    rows = [line for line in buf.getvalue().splitlines() if "EPD" in line]
    assert rows[0].rstrip(" │").endswith("-") and rows[1].rstrip(" │").endswith("37.5"), rows
    assert "worker restarts" not in buf.getvalue()  # none yet: no line
    assert "kept responses" not in buf.getvalue()
    buf = io.StringIO()
    Console(file=buf, width=120).print(render({**body, "responses": {"kept": 12, "bytes": 3 << 19,
                                                                     "max_bytes": 64 << 20}}))
    assert "kept responses (/v1/responses): 12, 1.5 of 64 MiB" in buf.getvalue()
    buf = io.StringIO()
    Console(file=buf, width=120).print(render({**body, "responses": {"kept": 12, "bytes": 3 << 19,
                                                                     "max_bytes": 64 << 20, "background_running": 3}}))
    assert "kept responses (/v1/responses): 12, 1.5 of 64 MiB; background running: 3" in buf.getvalue()
    # A daemon that planned once as it started (an outgrown plan), without re-planning.
    decision = {"time": 0.0, "action": "keep", "current": "2EPD", "best": "2EPD", "reason": "80 requests: the best"}
    buf = io.StringIO()
    Console(file=buf, width=120).print(render({**body, "planner": {"auto": False, "decisions": [decision]}}))
    assert "planned at start:" in buf.getvalue() and "re-planning every" not in buf.getvalue()


def test_status_counts_worker_restarts_and_what_became_of_their_requests():
    from types import SimpleNamespace

    from hydrad.cli.status import render
    from hydrad.server.admin import status_body

    client = SimpleNamespace(instance_id=0, device="cpu", role="EPD", ready=None, alive=True, accepting=True,
                             num_inflight=0, tokens_per_second=lambda: 1.0)
    from hydrad.cluster.requests import Quarantine

    table = SimpleNamespace(num_run_again=14, num_lost=1, kept_image_bytes=4096, quarantine=Quarantine(60.0))
    supervisor = SimpleNamespace(clients=[client], crash_loops={}, restarting=set(), num_restarts={0: 2},
                                 specs=[SimpleNamespace(threads=CpuThreads(1))], table=table)

    def shown() -> tuple[dict, str]:
        body = status_body(supervisor, [None], model="m", max_model_len=64, started=time.monotonic(),
                           num_requests=0, window=captured_status(1)["requests"])
        buf = io.StringIO()
        Console(file=buf, width=120).print(render(body))
        return body["failures"], buf.getvalue()

    failures, text = shown()
    assert failures == {"worker_restarts": 2, "requests_run_again": 14, "requests_lost": 1,
                        "rerun_image_bytes": 4096, "quarantined": 0, "requests_refused_quarantined": 0}
    assert "worker restarts: 2 (#0 x2); their requests run again: 14, lost: 1\n" in text
    table.quarantine.add(b"poison")
    table.quarantine.num_refused = 3
    failures, text = shown()
    assert (failures["quarantined"], failures["requests_refused_quarantined"]) == (1, 3)
    assert "lost: 1; quarantined: 1 (refused since: 3)" in text


def test_status_shows_how_each_instance_runs_against_its_model_by_kind():
    from hydrad.cli.status import render

    body = captured_status(1)
    body["instances"][0]["live_speed"] = {"images": 1.31}
    body["instances"][1]["live_speed"] = {"prefills": 1.42, "decodes": 1.18}
    buf = io.StringIO()
    Console(file=buf, width=200).print(render(body))
    out = buf.getvalue()
    assert "#0 E: steps up to 100.0 ms; its steps run images 1.31x their prediction; encode" in out, out
    assert "#1 P: steps up to 100.0 ms; its steps run prefills 1.42x, decodes 1.18x their prediction" in out, out
    assert "#2 D: steps up to 100.0 ms; encode" in out  # nothing measured yet: nothing said


def status_with_threads() -> dict:
    """A 1E+1P+1D CPU daemon's status: E and P borrow D's thread, D no longer answers, P's
    KV cache is full (the longest cells the table has)."""
    body = captured_status(1)
    for i, instance in enumerate(body["instances"]):
        instance.update(threads=1, borrowed_threads=1 if i < 2 else 0)
    body["instances"][2]["state"] = "unresponsive"
    body["instances"][1]["kv_usage"] = 1.0
    return body


def test_the_instances_fit_an_80_column_terminal():
    """Every instance's id, role, state and numbers whole at 80 columns (the instance table once
    cut its ids and roles there); the threads are said with each instance's latency model."""
    from hydrad.cli.status import render

    buf = io.StringIO()
    Console(file=buf, width=80).print(render(status_with_threads()))
    lines = buf.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if "device" in line)
    assert header.split() == ["#", "device", "role", "state", "running", "waiting", "KV", "image", "cached", "tok/s"]
    rows = [line.split() for line in lines[lines.index(header) + 1:][:3]]
    assert rows == [["0", "cpu", "E", "ready", "1", "0", "10.0%", "0.0%", "-", "12.5"],
                    ["1", "cpu", "P", "ready", "1", "0", "100.0%", "0.0%", "-", "12.5"],
                    ["2", "cpu", "D", "unresponsive", "1", "0", "10.0%", "0.0%", "-", "12.5"]], buf.getvalue()
    out = buf.getvalue()
    assert "#0 E on 1+1 threads: steps up to 100.0 ms" in out and "#2 D on 1 thread: steps up to" in out
    # The heading on one line (as the table's title it wrapped at the table's width).
    assert lines[0].startswith("hydrad: ") and lines[0].endswith(")"), lines[0]


def test_status_says_what_each_worker_process_takes():
    """Each worker's share of a core and its resident memory (the shared part where there is one),
    where the daemon read them; an instance whose worker is down says neither."""
    from hydrad.cli.status import render

    body = status_with_threads()
    body["instances"][0].update(cpu_share=0.954, rss_bytes=int(1.25 * (1 << 30)), shared_bytes=1 << 30)
    body["instances"][1].update(cpu_share=None, rss_bytes=512 << 20, shared_bytes=4 << 20)  # a few pages: not said
    body["instances"][2].update(cpu_share=None, rss_bytes=None, shared_bytes=None)
    buf = io.StringIO()
    Console(file=buf, width=200).print(render(body))
    out = buf.getvalue()
    assert "#0 E on 1+1 threads, 95% of a core, 1.25 GiB resident (1.00 shared): steps up to 100.0 ms" in out, out
    assert "#1 P on 1+1 threads, 0.50 GiB resident: steps up to" in out, out
    assert "#2 D on 1 thread: steps up to" in out, out


def run_hydractl(url: str, *args: str, **kw) -> subprocess.CompletedProcess:
    # No COLUMNS: the width a pipe gets from the CLI itself.
    return subprocess.run([sys.executable, *HYDRACTL, "status", "--url", url, *args], capture_output=True,
                          text=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=60,
                          **kw)


def test_status_into_a_pipe_is_not_cut(status_server):
    url, _ = status_server
    result = run_hydractl(url)
    assert result.returncode == 0, result.stderr
    assert "…" not in result.stdout
    # Each latency model on one line, as grep would want it.
    assert ("#1 P: steps up to 100.0 ms; encode 4.0 ms + 2.0 ms/image; step 1.5 ms + 30 us/prefill token + "
            "250 us/decode + 9.0 us/1k ctx") in [line.strip() for line in result.stdout.splitlines()], result.stdout


def test_status_as_json_is_the_daemons_document(status_server):
    url, served = status_server
    result = run_hydractl(url, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == captured_status(1) and len(result.stdout.splitlines()) == 1
    assert served == ["/admin/status"]


def test_watching_json_writes_a_line_per_refresh_and_the_errors_between():
    from hydrad.cli.status import watch_json

    fetch, sleep = scripted_daemon()

    buf = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        watch_json(fetch, buf, 0.1, sleep=sleep)
    first, error, second = (json.loads(line) for line in buf.getvalue().splitlines())
    assert first == captured_status(1) and second == captured_status(2)
    assert error["error"] == "cannot reach the daemon at http://x: refused" and error["time"] > 0
    # Once (no --watch), a daemon that does not answer is the CLI's one-line error, not a JSON line.
    with pytest.raises(HydradError):
        watch_json(lambda: (_ for _ in ()).throw(HydradError("refused")), io.StringIO(), None)


def test_a_reader_that_goes_away_ends_the_watch_quietly(status_server):
    """``hydractl status --json --watch | head -1``: no traceback, no error line."""
    url, served = status_server
    process = subprocess.Popen([sys.executable, *HYDRACTL, "status", "--url", url, "--json", "--watch",
                                "--interval", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                               env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    try:
        assert json.loads(process.stdout.readline())["model"] == "tiny-llava"
        process.stdout.close()
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1 and err == b"", err
    assert len(served) >= 2  # it kept refreshing until a write found the pipe closed


def test_consoles_off_a_terminal_lay_out_whole_lines(monkeypatch):
    """Progress, errors and tables into a pipe, a file or the journal (systemd) are not cut or
    folded at 80 columns; ``COLUMNS`` still sets the width."""
    from hydrad.console import OFF_TERMINAL_WIDTH, make_console

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    for stderr in (False, True):
        out = make_console(stderr=stderr)
        assert not out.is_terminal and out.width == OFF_TERMINAL_WIDTH
    monkeypatch.setenv("COLUMNS", "97")
    assert make_console().width == 97


def test_consoles_off_a_terminal_write_a_line_in_one_write(monkeypatch):
    """Off a terminal the daemon and its workers write into one file: a progress display's
    last line (rich writes its text, flushes, then writes the newline) must reach it in one
    write, or a worker's log line written meanwhile lands on the same line."""
    import time

    from rich.progress import Progress, TextColumn

    from hydrad.console import make_console

    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return super().write(text)

    monkeypatch.setattr(sys, "stderr", Recorder())
    out = make_console(stderr=True)
    with Progress(TextColumn("{task.description}"), console=out) as progress:
        task = progress.add_task("worker 0 cpu EPD: starting")
        time.sleep(0.05)
        progress.update(task, description="worker 0 cpu EPD: ready")
    out.print("error: one line")
    assert writes and all(w.endswith("\n") for w in writes), writes
    assert "".join(writes).splitlines()[-2:] == ["worker 0 cpu EPD: ready", "error: one line"]


def test_status_says_which_model_fills_a_borrower_s_steps_on_borrowed_cores():
    """Its model there where it has one; where a live redeploy left it to the next start (its
    lenders had work), that its own share's model stands in; nothing for one that never borrows."""
    from hydrad.cli.status import render

    body = status_with_threads()
    body["instances"][0]["borrow_latency_model"] = "encode 0.1 ms + 9.0 ms/image"
    body["instances"][1]["borrow_latency_model"] = None
    buf = io.StringIO()
    Console(file=buf, width=300).print(render(body))
    lines = buf.getvalue().splitlines()
    line = {i: next(x for x in lines if x.lstrip().startswith(f"#{i} ")) for i in range(3)}
    assert line[0].endswith("; on borrowed cores: encode 0.1 ms + 9.0 ms/image"), line[0]
    assert line[1].endswith("; on borrowed cores: the same (theirs is measured between steps once its lenders "
                            "are idle)"), line[1]
    assert "borrowed cores" not in line[2]
