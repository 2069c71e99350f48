from pathlib import Path

import pytest

from hydrad.config_file import DaemonConfig, RemoteImageConfig, ServerConfig, load_config
from hydrad.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "hydrad.toml"
    path.write_text(text)
    return path


def test_shipped_file_is_valid_and_matches_the_defaults():
    config = load_config(REPO / "etc" / "hydrad.toml")
    # The shipped file documents the defaults, except that it lets devices and deploy follow the machine.
    assert config.server == ServerConfig()
    assert config.engine.parallel.devices == "auto" and config.engine.parallel.deploy == "auto"
    assert config.engine.model == DaemonConfig().engine.model
    assert config.engine.cache == DaemonConfig().engine.cache
    assert config.engine.scheduler == DaemonConfig().engine.scheduler


def test_shipped_file_documents_every_key():
    """Each dataclass field appears in etc/hydrad.toml, set or commented out, in its table."""
    import dataclasses
    import re

    from hydrad.config_file import _SECTIONS

    text = (REPO / "etc" / "hydrad.toml").read_text()
    tables = {"": ""}
    current = ""
    for line in text.splitlines():
        if m := re.fullmatch(r"\[([\w.]+)\]", line.strip()):
            current = m.group(1)
            tables[current] = ""
        tables[current] += line + "\n"
    sections = {**_SECTIONS, "server.remote_images": RemoteImageConfig}
    for name, cls in sections.items():
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.type) or f.name == "remote_images":
                continue
            assert re.search(rf"^#? ?{f.name} = ", tables[name], re.M), f"{name}.{f.name} is not documented"
    assert re.search(r"^seed = ", tables[""], re.M)


def test_file_values_and_flag_overrides(tmp_path):
    path = write(tmp_path, """
seed = 3
[server]
port = 9000
shutdown_timeout = 5
[server.remote_images]
enabled = true
allowed_domains = ["example.com"]
[model]
path = "/models/x"
[parallel]
devices = "cpu:2"
""")
    config = load_config(path, {"server.port": 9100, "parallel.deploy": "2EPD"})
    assert config.engine.seed == 3
    assert config.server.port == 9100
    assert config.server.shutdown_timeout == 5.0
    assert config.server.remote_images == RemoteImageConfig(enabled=True, allowed_domains=["example.com"])
    assert config.engine.model.path == "/models/x"
    assert (config.engine.parallel.devices, config.engine.parallel.deploy) == ("cpu:2", "2EPD")


@pytest.mark.parametrize("text, message", [
    ("[server]\nprot = 1\n", "unknown key server.prot"),
    ("[sever]\n", "unknown section or key 'sever'"),
    ("[server]\nport = \"80\"\n", "server.port must be int"),
    ("[server]\nport = 70000\n", "server.port must be in"),
    ("[server]\nrouter_policy = \"fastest\"\n", "router_policy must be one of"),
    ("[server.remote_images]\nallowed_domains = [1]\n", "allowed_domains must be list"),
    ("[model]\nmax_model_len = 1\n", "max_model_len must be >= 2"),
    ("[server\n", "invalid TOML"),
    # limits that would refuse every request they bound
    ("[server]\nmax_request_pixels = 1000\n", r"max_request_pixels \(1000\) must be at least server.max_image_pixels"),
    ("[server]\nmax_inflight_body_mb = 32\n", r"max_inflight_body_mb \(32\) must be at least server.max_body_mb"),
    ("[server]\nmax_inflight_image_mb = 1000\n", "cannot hold one request of server.max_request_pixels: it needs 1068 MiB"),
    ("[server]\nqueue_timeout = -1\n", "queue_timeout must be >= 0"),
    ("[server]\nresponses_store_mb = -1\n", "responses_store_mb must be >= 0"),
    ("[server]\nfrontend_processes = 0\n", "server.frontend_processes must be >= 1"),
])
def test_errors_name_the_file_and_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_an_error_in_a_value_given_on_the_command_line_says_so(tmp_path):
    path = write(tmp_path, "[server]\nport = 9000\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, {"server.port": 70000})
    assert str(info.value) == "server.port must be in [0, 65535], got 70000 (given on the command line)"
    with pytest.raises(ConfigError, match="given on the command line"):
        load_config(None, {"server.queue_timeout": -1})
    # The file's own error still names the file, beside a valid value given on the command line.
    with pytest.raises(ConfigError, match=f"^{path}: server.port must be in"):
        load_config(write(tmp_path, "[server]\nport = 70000\n"), {"parallel.deploy": "2EPD"})


def test_a_retired_key_is_ignored_with_a_warning(tmp_path, caplog):
    """A file written for an earlier version still loads; the log says what no longer applies."""
    path = write(tmp_path, "[slo]\ntbt = 0.1\ndecode_context_len = 1024\n")
    with caplog.at_level("WARNING", logger="hydrad.config"):
        config = load_config(path)
    assert config.engine.slo.tbt == 0.1
    assert not hasattr(config.engine.slo, "decode_context_len")
    assert any("slo.decode_context_len is ignored" in r.getMessage() for r in caplog.records)
    # Only retired keys pass: a near miss is still an error.
    with pytest.raises(ConfigError, match="unknown key slo.decode_context"):
        load_config(write(tmp_path, "[slo]\ndecode_context = 1024\n"))


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/hydrad.toml")


def test_the_unit_waits_for_the_drain_and_the_workers():
    """systemd must not SIGKILL a daemon still draining: the shipped shutdown_timeout, plus
    about 3 s to end aborted streams and close connections, plus up to 15 s of workers' exit."""
    import re

    unit = (REPO / "systemd" / "hydrad.service").read_text()
    stop_sec = int(re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M).group(1))
    assert stop_sec >= load_config(REPO / "etc" / "hydrad.toml").server.shutdown_timeout + 20


def test_the_unit_keeps_the_trace_and_the_cache_in_the_directories_it_makes_writable():
    """Under ProtectSystem=strict only the unit's own directories are writable: the trace (and
    the plan --deploy auto keeps beside it) and the model cache must live there."""
    import re

    unit = (REPO / "systemd" / "hydrad.service").read_text()
    env = dict(re.findall(r"^Environment=(\w+)=(\S+)$", unit, re.M))
    assert "ProtectSystem=strict" in unit and "ProtectHome=true" in unit
    assert env["HYDRAD_STATE_DIR"] == "/var/lib/" + re.search(r"^StateDirectory=(\S+)$", unit, re.M).group(1)
    assert env["HYDRAD_CACHE_DIR"] == "/var/cache/" + re.search(r"^CacheDirectory=(\S+)$", unit, re.M).group(1)


def test_the_units_watchdog_is_pinged_by_the_main_process_in_time():
    """WatchdogSec makes systemd kill a daemon that stops pinging: the pings come from the
    daemon itself (NotifyAccess=main) every WatchdogSec / 4, which must leave a hanging
    moment of a busy event loop far from the limit."""
    import re

    unit = (REPO / "systemd" / "hydrad.service").read_text()
    watchdog = int(re.search(r"^WatchdogSec=(\d+)$", unit, re.M).group(1))
    assert "Type=notify" in unit and "NotifyAccess=main" in unit and watchdog >= 20
    assert re.search(r"^Restart=on-failure$", unit, re.M)  # a watchdog timeout counts as a failure
