"""Imports run downward only: server -> planner -> cluster -> engine -> models, and the
planner -> the bench client, which imports none of the others.

Read from the source (every import statement, at module level or inside a function),
so an upward import fails this test before it can run anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hydrad"

# package -> the hydrad packages it must never import
FORBIDDEN = {
    "engine": ("hydrad.server", "hydrad.cli", "hydrad.cluster", "hydrad.planner"),
    "cluster": ("hydrad.server", "hydrad.cli"),
    "planner": ("hydrad.server", "hydrad.cli"),
    "models": ("hydrad.server", "hydrad.cli", "hydrad.cluster", "hydrad.engine", "hydrad.planner"),
    "transport": ("hydrad.server", "hydrad.cli", "hydrad.cluster", "hydrad.planner"),
    # The bench client drives a daemon over HTTP: the planner's --validate and the
    # replay's workloads use it, so it imports none of the packages above it.
    "bench": ("hydrad.server", "hydrad.cli", "hydrad.cluster", "hydrad.planner", "hydrad.engine",
              "hydrad.models", "hydrad.transport"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def violations(package: str) -> list[str]:
    bad = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for line, module in imported_modules(path):
            if any(module == f or module.startswith(f + ".") for f in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("package", sorted(p for p in FORBIDDEN if (PACKAGE / p).is_dir()))
def test_no_upward_imports(package):
    assert violations(package) == []


def test_the_check_sees_function_level_imports(tmp_path, monkeypatch):
    """A check on the check: an import inside a function is found."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "bad.py").write_text("def f():\n    from hydrad.server.app import make_app\n")
    monkeypatch.setattr("test_layering.PACKAGE", tmp_path)
    assert violations("engine") == [f"{tmp_path.name}/engine/bad.py:2 imports hydrad.server.app"]


def test_the_scheduling_and_planning_code_loads_without_torch():
    """The scheduler, block managers, latency model, router, relay and the planner's simulator
    and search are plain Python: they load (in a fresh interpreter) without torch."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import hydrad.engine.scheduler, hydrad.engine.block_manager, hydrad.engine.latency_model\n"
            "import hydrad.cluster.router, hydrad.cluster.relay, hydrad.engine.migration\n"
            "import hydrad.planner.simulator, hydrad.planner.search, hydrad.planner.capacity\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
