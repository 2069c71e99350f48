import pytest

from hydrad.errors import ConfigError
from hydrad.cluster.deploy import parse_deploy, parse_devices, plan_instances


@pytest.mark.parametrize("spec, roles", [
    ("2EPD", ["EPD", "EPD"]),
    ("1E+1P+2D", ["E", "P", "D", "D"]),
    ("2EP+2D", ["EP", "EP", "D", "D"]),
    ("1E+1EP+2D", ["E", "EP", "D", "D"]),
    ("3ED+1P", ["ED", "ED", "ED", "P"]),
    (" 1pe + 1d ", ["EP", "D"]),
])
def test_parse_deploy(spec, roles):
    assert parse_deploy(spec) == roles


@pytest.mark.parametrize("spec, message", [
    ("", "empty"),
    ("EPD", "bad term"),
    ("0EPD", "count must be >= 1"),
    ("1X", "unknown stage 'X'"),
    ("1EE+1PD", "repeated stage"),
    ("1E+1P", "no instance holds stage D"),
    ("2EPD+", "bad term"),
])
def test_parse_deploy_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_deploy(spec)


def test_auto_deploy_is_one_epd_per_device():
    assert parse_deploy("auto", 3) == ["EPD"] * 3


@pytest.mark.parametrize("spec, num_cuda, devices", [
    ("cpu", 0, ["cpu"]),
    ("cpu:3", 0, ["cpu"] * 3),
    ("auto", 0, ["cpu"]),
    ("auto", 2, ["cuda:0", "cuda:1"]),
    ("cuda:1,0", 2, ["cuda:1", "cuda:0"]),
    ("cuda", 2, ["cuda:0", "cuda:1"]),
])
def test_parse_devices(spec, num_cuda, devices):
    assert parse_devices(spec, num_cuda) == devices


@pytest.mark.parametrize("spec, num_cuda, message", [
    ("cpu:0", 0, "N >= 1"),
    ("cuda:0", 0, "no CUDA device"),
    ("cuda:2", 2, "cuda:2 does not exist"),
    ("cuda:0,0", 1, "distinct"),
    ("tpu:1", 0, "expected cpu:N"),
])
def test_parse_devices_errors(spec, num_cuda, message):
    with pytest.raises(ConfigError, match=message):
        parse_devices(spec, num_cuda)


def test_plan_instances_pairs_roles_and_devices():
    assert plan_instances("2EPD", "cpu:2", 0) == [("EPD", "cpu"), ("EPD", "cpu")]
    assert plan_instances("auto", "cuda:0,1", 2) == [("EPD", "cuda:0"), ("EPD", "cuda:1")]
    with pytest.raises(ConfigError, match="has 1 instance.*gives 2.*--deploy 2EPD"):
        plan_instances("1EPD", "cpu:2", 0)
    # auto devices on a machine without GPUs: as many CPU workers as the spec has instances.
    assert plan_instances("1EP+1D", "auto", 0) == [("EP", "cpu"), ("D", "cpu")]
    assert plan_instances("auto", "auto", 0) == [("EPD", "cpu")]
    with pytest.raises(ConfigError, match="has 2 instance.*gives 1"):
        plan_instances("1EP+1D", "auto", 1)
