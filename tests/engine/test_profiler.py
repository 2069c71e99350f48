"""SLO-derived budgets: the binary search, the probe batches per role, the disk cache,
and one real measurement on the tiny checkpoint."""

from __future__ import annotations

import dataclasses
import json
import random
from contextlib import contextmanager

import pytest

from hydrad.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SLOConfig
from hydrad.engine.profiler import MIN_TOKEN_BUDGET, Probe, derive_budgets, search_budget
from hydrad.errors import ConfigError

ROLES = ("E", "P", "D", "EP", "ED", "PD", "EPD")
MAX_MODEL_LEN = 512
CONTEXT_LEN = MAX_MODEL_LEN // 4
MAX_NUM_SEQS = 32
NUM_KV_BLOCKS = 512
NUM_IMAGE_BLOCKS = 40  # the tiny model's image fills one 16-slot block: 40 images fit


def make_engine(model_dir, role="EPD"):
    from hydrad.engine.core import EngineCore

    config = EngineConfig(
        model=ModelConfig(path=str(model_dir), max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(kv_block_size=16, num_kv_blocks=NUM_KV_BLOCKS, num_image_blocks=NUM_IMAGE_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS),
    )
    return EngineCore(config, role=role)


@pytest.fixture(scope="module")
def engine(tiny_llava_dir):
    core = make_engine(tiny_llava_dir)
    yield core
    core.shutdown()


@pytest.fixture(autouse=True)
def budgets_dir(tmp_path, monkeypatch):
    """A fresh cache per test, so no test sees another's budgets."""
    monkeypatch.setenv("HYDRAD_CACHE_DIR", str(tmp_path))
    return tmp_path / "budgets"


class FakeLatency:
    """Linear in batch size, decodes paying per context token; records every probe."""

    def __init__(self, per_image=0.01, per_token=1e-4, per_context_token=0.0):
        self.per_image, self.per_token, self.per_context_token = per_image, per_token, per_context_token
        self.probes: list[Probe] = []

    def __call__(self, probe: Probe) -> float:
        self.probes.append(probe)
        if probe.kind == "encode":
            return self.per_image * probe.num_images
        return self.per_token * probe.num_tokens + self.per_context_token * probe.num_decodes * probe.context_len


def _assert_all_free(engine):
    for pool in (engine.kv_manager, engine.image_manager):
        if pool is not None:
            assert pool.num_used_blocks == 0
            pool.check_integrity([])


# -- the search ---------------------------------------------------------------------------------
@pytest.mark.parametrize("lo,hi", [(1, 1), (1, 2), (16, 512), (1, 64), (16, 16384), (7, 1000)])
def test_search_finds_the_exact_knee_with_few_probes(lo, hi):
    rng = random.Random(hi)
    knees = {lo, hi, lo + 1, hi - 1, (lo + hi) // 2} | {rng.randint(lo, hi) for _ in range(20)}
    for knee in sorted(k for k in knees if lo <= k <= hi):
        calls = []

        def latency_of(n):
            calls.append(n)
            return 1.0 + (n > knee) + n * 1e-6  # a step at the knee on a slow ramp

        assert search_budget(latency_of, 1.5, lo, hi) == knee
        assert len(calls) == len(set(calls)) <= 2 + (hi - lo).bit_length()
        assert all(lo <= n <= hi for n in calls)


def test_search_returns_lo_when_even_lo_is_over():
    assert search_budget(lambda n: 2.0, 1.0, 16, 512) == 16
    with pytest.raises(ValueError):
        search_budget(lambda n: 0.0, 1.0, 5, 4)


# -- roles, bounds and probe batches -----------------------------------------------------------
@pytest.mark.parametrize("role", ROLES)
def test_each_role_gets_its_budgets_and_bound(engine, role):
    slo = SLOConfig(ttft=1.0, tbt=0.1, alpha=0.5)
    fake = FakeLatency()
    budgets = derive_budgets(engine, slo, role=role, latency_fn=fake)
    assert budgets.measured and budgets.role == role and budgets.within_bound
    assert budgets.latency_bound == (0.1 if "D" in role else 0.5)
    assert (budgets.image_budget is None) == ("E" not in role)
    assert (budgets.token_budget is None) == (role == "E")
    language = [p for p in fake.probes if p.kind == "language"]
    if "D" in role:
        assert all(p.num_decodes > 0 and p.context_len == CONTEXT_LEN for p in language)
        assert budgets.context_len == CONTEXT_LEN
    else:
        assert all(p.num_decodes == 0 for p in language)
    if role in ("D", "ED"):
        # Nothing prefills here: the batch is all decodes, so max_num_seqs bounds it (3.2 ms < 0.1 s).
        assert all(p.num_prefill_tokens == 0 for p in language)
        assert budgets.token_budget == MAX_NUM_SEQS
    _assert_all_free(engine)


def test_prefill_budgets_are_exact_knees(engine):
    fake = FakeLatency(per_image=0.03, per_token=0.0021)
    budgets = derive_budgets(engine, SLOConfig(ttft=1.0, alpha=0.5), role="EP", latency_fn=fake)
    # 0.5 s / 0.03 s per image = 16.7; 0.5 s / 2.1 ms per token = 238.1
    assert (budgets.image_budget, budgets.token_budget) == (16, 238)
    assert budgets.image_latency == pytest.approx(16 * 0.03)
    assert budgets.token_latency == pytest.approx(238 * 0.0021)
    assert len(fake.probes) <= 2 * (2 + 9)


def test_decode_context_shrinks_the_token_budget(engine):
    slo = SLOConfig(tbt=0.0505)
    with_context = derive_budgets(engine, slo, role="PD", latency_fn=FakeLatency(per_context_token=1e-6))
    empty = derive_budgets(engine, slo, role="PD", latency_fn=FakeLatency(per_context_token=1e-6), context_len=0)
    assert empty.context_len == 0 and with_context.context_len == CONTEXT_LEN
    # Without context every token costs 0.1 ms: 505 tokens fit in 50.5 ms.
    assert empty.token_budget == 505
    # At context 128 each of the 31 decodes (one sequence left to prefill) costs 0.128 ms more:
    # (50.5 - 31 * 0.128) / 0.1 = 465.3.
    assert with_context.token_budget == 465
    assert with_context.token_latency <= slo.tbt
    # The [slo] section sets the same context for every instance.
    from_config = derive_budgets(engine, SLOConfig(tbt=0.0505, decode_context_len=0), role="PD",
                                 latency_fn=FakeLatency(per_context_token=1e-6))
    assert from_config.context_len == 0 and from_config.token_budget == 505


def test_budget_floor_is_reported_when_the_slo_cannot_be_met(engine):
    budgets = derive_budgets(engine, SLOConfig(tbt=1e-3), role="EPD", latency_fn=FakeLatency(per_image=1.0))
    assert (budgets.image_budget, budgets.token_budget) == (1, MIN_TOKEN_BUDGET)
    assert not budgets.within_bound
    assert "OVER" in budgets.summary()


@contextmanager
def _free_blocks(engine, num_kv: int, num_image: int):
    """Shrink the engine's pools to ``num_kv`` / ``num_image`` free blocks for the duration."""
    kv, images = engine.kv_manager, engine.image_manager
    held_kv, held_images = kv.allocate(kv.num_free_blocks - num_kv), images.allocate(images.num_free_blocks - num_image)
    try:
        yield
    finally:
        kv.free(held_kv)
        images.free(held_images)
    _assert_all_free(engine)


def test_search_is_capped_by_what_the_pools_hold(engine):
    with _free_blocks(engine, num_kv=10, num_image=3):
        prefill = derive_budgets(engine, SLOConfig(), role="EP", latency_fn=FakeLatency(0.0, 0.0))
        assert (prefill.image_budget, prefill.token_budget) == (3, 10 * 16)
        # One decode at context 128 takes 9 of the 10 free blocks.
        assert derive_budgets(engine, SLOConfig(), role="D", latency_fn=FakeLatency(0.0, 0.0)).token_budget == 1
        with pytest.raises(ConfigError, match="not one decode"):
            derive_budgets(engine, SLOConfig(), role="D", latency_fn=FakeLatency(), context_len=MAX_MODEL_LEN - 1)
    with _free_blocks(engine, num_kv=50, num_image=3):
        # A 512-token prefill chunk takes 32 blocks; the other 18 hold two decodes beside it.
        fake = FakeLatency(0.0, 0.0)
        assert derive_budgets(engine, SLOConfig(), role="PD", latency_fn=fake).token_budget == MAX_MODEL_LEN
        assert max(p.num_decodes for p in fake.probes) == 2


def test_invalid_arguments_are_refused(engine):
    for role in ("", "X", "EPX"):
        with pytest.raises(ConfigError):
            derive_budgets(engine, SLOConfig(), role=role, latency_fn=FakeLatency())
    with pytest.raises(ConfigError):
        derive_budgets(engine, SLOConfig(), role="D", latency_fn=FakeLatency(), context_len=MAX_MODEL_LEN)


# -- the disk cache -----------------------------------------------------------------------------
def test_cache_is_written_reused_keyed_and_forced(engine, budgets_dir):
    slo = SLOConfig(ttft=1.0, tbt=0.1)
    fake = FakeLatency()
    first = derive_budgets(engine, slo, role="EPD", latency_fn=fake)
    (path,) = budgets_dir.glob("*.json")
    assert json.loads(path.read_text())["key"]["role"] == "EPD"
    num_probes = len(fake.probes)
    assert num_probes > 0

    again = derive_budgets(engine, slo, role="EPD", latency_fn=fake)
    assert len(fake.probes) == num_probes
    assert not again.measured
    assert again == dataclasses.replace(first, measured=False)

    derive_budgets(engine, SLOConfig(ttft=1.0, tbt=0.2), role="EPD", latency_fn=fake)
    assert len(fake.probes) > num_probes
    num_probes = len(fake.probes)
    derive_budgets(engine, slo, role="EP", latency_fn=fake)
    assert len(fake.probes) > num_probes
    num_probes = len(fake.probes)
    # EP probes no decodes, so their context is not part of its key.
    assert not derive_budgets(engine, slo, role="EP", latency_fn=fake, context_len=7).measured
    assert len(fake.probes) == num_probes
    assert len(list(budgets_dir.glob("*.json"))) == 3

    forced = derive_budgets(engine, slo, role="EPD", latency_fn=fake, force=True)
    assert len(fake.probes) > num_probes and forced.measured


def test_unreadable_cache_file_is_measured_again(engine, budgets_dir):
    fake = FakeLatency()
    derive_budgets(engine, SLOConfig(), role="P", latency_fn=fake)
    (path,) = budgets_dir.glob("*.json")
    path.write_text("{not json")
    num_probes = len(fake.probes)
    assert derive_budgets(engine, SLOConfig(), role="P", latency_fn=fake).measured
    assert len(fake.probes) > num_probes
    json.loads(path.read_text())


def test_a_result_over_the_bound_is_not_cached(engine, budgets_dir):
    slow = lambda probe: 10.0  # noqa: E731  (every batch misses the SLO, e.g. a busy machine)
    budgets = derive_budgets(engine, SLOConfig(ttft=1.0, tbt=0.1), role="EPD", latency_fn=slow)
    assert not budgets.within_bound and budgets.token_budget == 16 and budgets.image_budget == 1
    assert not list(budgets_dir.glob("*.json"))
    assert derive_budgets(engine, SLOConfig(ttft=1.0, tbt=0.1), role="EPD", latency_fn=FakeLatency()).measured


# -- measuring on the device --------------------------------------------------------------------
def test_real_measurement_on_the_tiny_checkpoint(engine):
    generous = SLOConfig(ttft=60.0, tbt=30.0)
    budgets = derive_budgets(engine, generous, role="EPD", repeats=1)
    assert budgets.measured and budgets.within_bound
    # Every probe is far under 30 s, so each search ends at the top of its range.
    assert budgets.image_budget == NUM_IMAGE_BLOCKS
    assert budgets.token_budget == MAX_MODEL_LEN
    assert 0 < budgets.token_latency <= generous.tbt and 0 < budgets.image_latency <= generous.tbt
    _assert_all_free(engine)
    assert derive_budgets(engine, generous, role="EPD").measured is False

    impossible = derive_budgets(engine, SLOConfig(tbt=1e-9), role="EPD", repeats=1)
    assert (impossible.image_budget, impossible.token_budget) == (1, MIN_TOKEN_BUDGET)
    assert not impossible.within_bound
    _assert_all_free(engine)


@pytest.mark.parametrize("role", ["E", "D"])
def test_real_measurement_on_single_stage_instances(tiny_llava_dir, role):
    engine = make_engine(tiny_llava_dir, role)
    try:
        budgets = derive_budgets(engine, SLOConfig(ttft=60.0, tbt=30.0), role=role, repeats=1)
        if role == "E":
            assert (budgets.image_budget, budgets.token_budget) == (NUM_IMAGE_BLOCKS, None)
        else:
            assert (budgets.image_budget, budgets.token_budget) == (None, MAX_NUM_SEQS)
        _assert_all_free(engine)
        with pytest.raises(ConfigError, match="cannot run"):
            derive_budgets(engine, SLOConfig(), role="EPD", latency_fn=FakeLatency())
    finally:
        engine.shutdown()
