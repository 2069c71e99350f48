from dataclasses import dataclass

import pytest

from hydrad.cluster.router import NoInstanceAvailable, Router


@dataclass(eq=False)
class FakeInstance:
    role: str
    num_inflight: int = 0
    accepting: bool = True
    instance_id: int = 0


def picks(router, n, has_images=False):
    return [router.instances.index(router.select(has_images)) for _ in range(n)]


def test_round_robin_skips_dead_instances():
    instances = [FakeInstance("EPD"), FakeInstance("EPD", accepting=False), FakeInstance("EPD")]
    assert picks(Router(instances, "round-robin"), 4) == [0, 2, 0, 2]


def test_least_load_prefers_idle_and_alternates_on_ties():
    instances = [FakeInstance("EPD", 3), FakeInstance("EPD", 1), FakeInstance("EPD", 1)]
    router = Router(instances, "least-load")
    assert set(picks(router, 4)) == {1, 2}
    instances[2].num_inflight = 5
    assert picks(router, 3) == [1, 1, 1]


def test_random_is_seeded_and_covers_all():
    instances = [FakeInstance("EPD") for _ in range(3)]
    a, b = picks(Router(instances, "random", seed=1), 30), picks(Router(instances, "random", seed=1), 30)
    assert a == b and set(a) == {0, 1, 2}


def test_entry_stage_depends_on_images():
    instances = [FakeInstance("E"), FakeInstance("PD")]
    router = Router(instances, "round-robin")
    assert picks(router, 2, has_images=True) == [0, 0]
    assert picks(router, 2, has_images=False) == [1, 1]


def test_no_live_instance():
    with pytest.raises(NoInstanceAvailable):
        Router([FakeInstance("EPD", accepting=False)]).select(False)


@pytest.mark.parametrize("policy", ["round-robin", "least-load", "random"])
def test_a_migration_target_is_never_its_source_when_another_holds_the_stage(policy):
    """After a redeploy gives a request's source the next stage, its offer still goes to another
    instance: a request is never pulled from an instance's own pool."""
    instances = [FakeInstance("EPD", instance_id=0), FakeInstance("EPD", instance_id=1)]
    router = Router(instances, policy, seed=0)
    assert {router.select_stage("D", exclude=instances[1]).instance_id for _ in range(10)} == {0}
    # The source alone holds it: the source.
    lone = Router([FakeInstance("EPD"), FakeInstance("E")], policy, seed=0)
    assert lone.select_stage("D", exclude=lone.instances[0]) is lone.instances[0]
