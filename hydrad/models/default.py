"""The built-in default model: LLaVA ``small`` (seed 0), built into the user cache on first use."""

from __future__ import annotations

from pathlib import Path

from hydrad.errors import CheckpointError
from hydrad.paths import cache_dir

DEFAULT_ARCH = "llava"
DEFAULT_SIZE = "small"
DEFAULT_SEED = 0


def default_model_path() -> Path:
    """The folder of the built-in default model, built (with a progress display) if missing."""
    path = cache_dir() / "models" / f"{DEFAULT_ARCH}-{DEFAULT_SIZE}-seed{DEFAULT_SEED}"
    # The builder renames a finished folder into place, so config.json present means complete.
    if (path / "config.json").is_file():
        return path
    from hydrad.models.builder import build_model

    try:
        build_model(path, DEFAULT_ARCH, DEFAULT_SIZE, DEFAULT_SEED, progress=True)
    except CheckpointError:
        # Another process may have finished the same build first; its result is identical.
        if not (path / "config.json").is_file():
            raise
    return path


def resolve_model_path(path: str | None) -> Path:
    """The model folder to serve: ``path`` if given (it must be a folder), else the default model."""
    if path is None:
        return default_model_path()
    resolved = Path(path).expanduser()
    if not resolved.is_dir():
        what = "is not a folder" if resolved.exists() else "does not exist"
        raise CheckpointError(f"model folder {resolved} {what}")
    return resolved
