"""Fixtures of the CUDA tests (skipped where torch sees no GPU)."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_gpu_for_every_instance(monkeypatch):
    """``plan_instances`` placing every instance of the deploy spec on cuda:0: one GPU runs
    every deployment of roles."""
    import hydrad.cluster.deploy as deploy

    monkeypatch.setattr(deploy, "plan_instances",
                        lambda spec, devices, num_cuda: [(role, "cuda:0") for role in deploy.parse_deploy(spec)])
