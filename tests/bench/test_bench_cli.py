import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from hydrad.cli.hydractl_main import cli

SLO_FLAGS = ["--slo-ttft", "0.2", "--slo-tbt", "0.05"]


def hydractl(*args: str) -> subprocess.CompletedProcess:
    code = "from hydrad.cli.hydractl_main import main; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)


def test_bench_writes_json_and_plot(server_url, write_jsonl, tmp_path):
    workload = write_jsonl([{"prompt": "ttft=0.01 tbt=0.01", "output_tokens": 3}])
    out, plot = tmp_path / "results.json", tmp_path / "attainment.png"
    result = CliRunner().invoke(cli, [
        "bench", "--url", server_url, "--workload", str(workload), "--sweep", "20:40:20", "--num-requests", "3",
        *SLO_FLAGS, "--out", str(out), "--plot", str(plot),
    ])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert [e["rate"] for e in doc["sweep"]] == [20.0, 40.0] and doc["summary"]["goodput_rps"] == 40.0
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert "goodput" in result.output and "TTFT" in result.output


def test_closed_loop_from_the_command_line(server_url, write_jsonl, tmp_path):
    workload = write_jsonl([{"prompt": "ttft=0.01 tbt=0.01", "output_tokens": 3}])
    out = tmp_path / "results.json"
    result = CliRunner().invoke(cli, [
        "bench", "--url", server_url, "--workload", str(workload), "--concurrency", "4", "--num-requests", "8",
        "--warmup", "2", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "20", *SLO_FLAGS, "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["summary"]["concurrency"] == 4 and doc["summary"]["num_requests"] == 8
    assert doc["config"]["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 20}
    assert "4 in flight" in result.output


def test_a_response_format_from_the_command_line(server_url, write_jsonl, tmp_path):
    workload = write_jsonl([{"prompt": "ttft=0.01 tbt=0.01", "output_tokens": 3}])
    out = tmp_path / "results.json"
    result = CliRunner().invoke(cli, ["bench", "--url", server_url, "--workload", str(workload), "--concurrency", "2",
                                      "--num-requests", "4", "--response-format", "json_object", *SLO_FLAGS,
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["config"]["sampling"]["response_format"] == {"type": "json_object"}
    proc = hydractl("bench", "--url", server_url, *SLO_FLAGS, "--workload", "text", "--concurrency", "2",
                    "--response-format", "yaml")
    assert proc.returncode != 0 and "json_object or json_schema:FILE" in proc.stderr and "Traceback" not in proc.stderr


def test_the_responses_api_from_the_command_line(server_url, write_jsonl, fake_requests, tmp_path):
    workload = write_jsonl([{"prompt": "ttft=0.01 tbt=0.01", "output_tokens": 3}])
    out = tmp_path / "results.json"
    result = CliRunner().invoke(cli, ["bench", "--url", server_url, "--workload", str(workload), "--concurrency", "2",
                                      "--num-requests", "4", "--api", "responses", *SLO_FLAGS, "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["config"]["api"] == "responses" and doc["summary"]["errors"] == 0
    assert {r["max_output_tokens"] for r in fake_requests()} == {3}  # all went to /v1/responses
    proc = hydractl("bench", "--url", server_url, *SLO_FLAGS, "--workload", "text", "--concurrency", "2",
                    "--api", "completions")
    assert proc.returncode != 0 and "'completions' is not one of 'chat', 'responses'" in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [(["--workload", "text", "--concurrency", "2", "--top-p", "0"], "Invalid value for '--top-p'")],
)
def test_bad_sampling_flags(server_url, args, message):
    proc = hydractl("bench", "--url", server_url, *SLO_FLAGS, *args)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workload", "text", "--rate", "1", "--sweep", "1:2:1"],
         "exactly one of --rate, --sweep, --goodput and --concurrency"),
        (["--workload", "text", "--rate", "1", "--concurrency", "4"],
         "exactly one of --rate, --sweep, --goodput and --concurrency"),
        (["--workload", "text", "--sweep", "5:1:1"], "a sweep needs 0 < R1 <= R2"),
        (["--workload", "text", "--sweep", "1-5"], "expected R1:R2:STEP"),
        (["--workload", "nosuch", "--rate", "1"], "unknown workload 'nosuch'"),
        (["--workload", "text", "--rate", "1", "--trace", "/nonexistent/trace.jsonl"], "cannot read trace file"),
        (["--workload", "text", "--rate", "-2"], "request rates must be > 0"),
    ],
)
def test_user_errors_are_one_line(server_url, args, message):
    proc = hydractl("bench", "--url", server_url, *SLO_FLAGS, *args)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_unreachable_server_is_one_line():
    proc = hydractl("bench", "--url", "http://127.0.0.1:9", "--workload", "text", "--rate", "1", *SLO_FLAGS)
    assert proc.returncode == 1
    # Rich wraps long lines at the terminal width; the message itself is a single line.
    assert " ".join(proc.stderr.split()).startswith("error: cannot reach http://127.0.0.1:9")
    assert "Traceback" not in proc.stderr
