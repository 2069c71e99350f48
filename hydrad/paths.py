"""Where hydrad keeps files of its own: the XDG base directories, each overridable."""

from __future__ import annotations

import os
from pathlib import Path


def _base(explicit: str, xdg: str, fallback: str) -> Path:
    if value := os.environ.get(explicit):
        return Path(value).expanduser()
    return Path(os.environ.get(xdg) or fallback).expanduser() / "hydrad"


def cache_dir() -> Path:
    """``$HYDRAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/hydrad``, else ``~/.cache/hydrad``: the
    default model, latency models, measured budgets."""
    return _base("HYDRAD_CACHE_DIR", "XDG_CACHE_HOME", "~/.cache")


def state_dir() -> Path:
    """``$HYDRAD_STATE_DIR``, else ``$XDG_STATE_HOME/hydrad``, else ``~/.local/state/hydrad``:
    the request trace and the plan ``--deploy auto`` keeps."""
    return _base("HYDRAD_STATE_DIR", "XDG_STATE_HOME", "~/.local/state")
