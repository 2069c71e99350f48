"""Deployment specs (``4EPD``, ``1E+1P+2D``, ``2EP+2D``, ``auto``) and device lists.

A spec is ``+``-separated terms ``<count><role>``; a role is a non-empty set of the
stages E (encode), P (prefill), D (decode), written in that order. Together the
instances must hold every stage. ``auto`` here means one EPD instance per device; ``hydrad
start`` first asks the planner for a better one when it has a trace (``hydrad.cli.start``).
"""

from __future__ import annotations

import re

from hydrad.errors import ConfigError

STAGES = "EPD"
_TERM = re.compile(r"(\d+)([A-Za-z]+)")
def parse_deploy(spec: str, num_devices: int | None = None) -> list[str]:
    """The role of each instance, in order. ``auto`` needs ``num_devices``."""
    spec = spec.strip()
    if spec.lower() == "auto":
        if num_devices is None:
            raise ConfigError("deploy 'auto' needs the number of devices")
        return ["EPD"] * num_devices
    if not spec:
        raise ConfigError("deploy spec is empty (example: 2EPD or 1E+1P+2D)")
    roles: list[str] = []
    for term in spec.split("+"):
        m = _TERM.fullmatch(term.strip())
        if m is None:
            raise ConfigError(f"deploy {spec!r}: bad term {term!r} (expected <count><role>, e.g. 2EPD)")
        count, role = int(m.group(1)), _normalize_role(m.group(2).upper(), spec)
        if count < 1:
            raise ConfigError(f"deploy {spec!r}: instance count must be >= 1 in {term!r}")
        roles += [role] * count
    missing = [s for s in STAGES if not any(s in r for r in roles)]
    if missing:
        raise ConfigError(f"deploy {spec!r}: no instance holds stage {', '.join(missing)}")
    return roles


def format_deploy(roles: list[str]) -> str:
    """The spec of a list of roles, counted in the order they first appear: ``["EP", "D",
    "D"]`` -> ``1EP+2D``."""
    counts: dict[str, int] = {}
    for role in roles:
        counts[role] = counts.get(role, 0) + 1
    return "+".join(f"{n}{role}" for role, n in counts.items())


def _normalize_role(role: str, spec: str) -> str:
    bad = set(role) - set(STAGES)
    if bad:
        raise ConfigError(f"deploy {spec!r}: unknown stage {sorted(bad)[0]!r} (stages are E, P, D)")
    if len(set(role)) != len(role):
        raise ConfigError(f"deploy {spec!r}: repeated stage in role {role!r}")
    return "".join(s for s in STAGES if s in role)


def parse_devices(spec: str, num_cuda: int) -> list[str]:
    """``cpu``, ``cpu:N`` (N CPU workers), ``cuda``, ``cuda:0,1``, or ``auto``
    (every visible GPU, else one CPU worker; ``hydrad start --deploy auto`` may plan more,
    ``planner.auto``) -> one device string per worker."""
    spec = spec.strip().lower()
    if spec == "auto":
        return [f"cuda:{i}" for i in range(num_cuda)] or ["cpu"]
    kind, _, rest = spec.partition(":")
    if kind == "cpu":
        if not rest:
            return ["cpu"]
        if not rest.isdigit() or int(rest) < 1:
            raise ConfigError(f"devices {spec!r}: expected cpu:N with N >= 1")
        return ["cpu"] * int(rest)
    if kind == "cuda":
        if num_cuda == 0:
            raise ConfigError(f"devices {spec!r}: no CUDA device is visible")
        if not rest:
            return [f"cuda:{i}" for i in range(num_cuda)]
        ids = [s.strip() for s in rest.split(",")]
        if not all(s.isdigit() for s in ids) or len(set(ids)) != len(ids):
            raise ConfigError(f"devices {spec!r}: expected distinct GPU indices, e.g. cuda:0,1")
        for s in ids:
            if int(s) >= num_cuda:
                raise ConfigError(f"devices {spec!r}: cuda:{s} does not exist ({num_cuda} visible)")
        return [f"cuda:{s}" for s in ids]
    raise ConfigError(f"devices {spec!r}: expected cpu:N, cuda:0,1 or auto")


def plan_instances(deploy: str, devices: str, num_cuda: int) -> list[tuple[str, str]]:
    """(role, device) per instance; the deploy spec must use every listed device once.
    ``auto`` devices without a GPU: a CPU worker for each instance of the spec."""
    device_list = parse_devices(devices, num_cuda)
    roles = parse_deploy(deploy, len(device_list))
    if devices.strip().lower() == "auto" and not num_cuda:
        device_list = ["cpu"] * len(roles)
    if len(roles) != len(device_list):
        raise ConfigError(
            f"deploy {deploy!r} has {len(roles)} instance(s) but devices {devices!r} gives "
            f"{len(device_list)}; use e.g. --deploy {len(device_list)}EPD"
        )
    return list(zip(roles, device_list))
