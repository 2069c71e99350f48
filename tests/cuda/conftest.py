"""Fixtures of the CUDA tests (skipped where torch sees no GPU)."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_gpu_for_every_instance(monkeypatch):
    """Every instance on cuda:0 (``factories.place_every_instance_on_gpu0``)."""
    from factories import place_every_instance_on_gpu0

    place_every_instance_on_gpu0(monkeypatch)
