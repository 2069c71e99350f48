"""Session-wide fixtures. Checkpoint fixtures are shared: tests must not modify them."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from factories import LAYOUTS, make_layout, make_tiny, make_tiny_llava, module_state_dict


@pytest.fixture(scope="session", autouse=True)
def hydrad_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private cache dir, so no test reads or fills the user's (the default model lands here),
    and a private state dir, so the daemons of the tests write their request traces there."""
    path = tmp_path_factory.mktemp("hydrad-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYDRAD_CACHE_DIR", str(path))
        mp.setenv("HYDRAD_STATE_DIR", str(tmp_path_factory.mktemp("hydrad-state")))
        yield path


_engines_built = [0]


@pytest.fixture(scope="session", autouse=True)
def count_engines() -> Iterator[None]:
    """Count the engines the tests build in this process (workers of daemons are not counted)."""
    from hydrad.engine.core import EngineCore

    init = EngineCore.__init__

    def counting_init(self, *args, **kwargs):
        _engines_built[0] += 1
        init(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EngineCore, "__init__", counting_init)
        yield


@pytest.fixture(autouse=True)
def collect_engines() -> Iterator[None]:
    """Free what a test's engines held as soon as it ends: an engine's objects refer to each
    other, so only the cycle collector frees them, and its cache pools (hundreds of MB each)
    would otherwise pile up across tests until it happens to run. A full collection costs
    ~0.2 s with torch and transformers loaded, so it runs only after tests that built one."""
    built = _engines_built[0]
    yield
    if _engines_built[0] != built:
        gc.collect()


@pytest.fixture(scope="module", autouse=True)
def collect_module_engines() -> Iterator[None]:
    """The same for engines that module-scoped fixtures held (torn down after the last test)."""
    built = _engines_built[0]
    yield
    if _engines_built[0] != built:
        gc.collect()


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaVA checkpoint (seed 0) as ``hydrad make-model`` writes it."""
    return make_tiny_llava(tmp_path_factory.mktemp("checkpoints") / "llava-tiny")


@pytest.fixture(scope="session")
def tiny_llava_layouts(tmp_path_factory: pytest.TempPathFactory, tiny_llava_dir: Path) -> dict[str, Path]:
    """Layout name -> a complete copy of ``tiny_llava_dir`` with the same weights stored in that layout."""
    state_dict = module_state_dict(tiny_llava_dir)
    root = tmp_path_factory.mktemp("layouts")
    return {
        name: make_layout(tiny_llava_dir, root / name, state_dict, layout, max_shard_size)
        for name, (layout, max_shard_size) in LAYOUTS.items()
    }


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_checkpoint(arch, layout="hf5")``: a tiny checkpoint (seed 0) of ``arch`` with its weights
    named as ``layout`` names them, built once per session."""
    built: dict[tuple[str, str], Path] = {}
    root = tmp_path_factory.mktemp("tiny-checkpoints")

    def get(arch: str, layout: str = "hf5") -> Path:
        if (arch, layout) not in built:
            built[arch, layout] = make_tiny(root / f"{arch}-{layout}", arch, layout=layout)
        return built[arch, layout]

    return get
