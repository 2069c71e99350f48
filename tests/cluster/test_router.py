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


# -- cache-aware -----------------------------------------------------------------------------------
@dataclass
class Prompt:
    prompt_token_ids: list
    images: list


@dataclass
class Image:
    offset: int
    length: int
    content_hash: bytes | None

    def digest(self) -> bytes | None:
        return self.content_hash


def _prompt(head: int, n: int = 100, images=()) -> Prompt:
    return Prompt([head] + list(range(1, n)), list(images))


def _cache_aware(*loads, roles=None):
    instances = [FakeInstance(role, load, instance_id=i) for i, (role, load) in
                 enumerate(zip(roles or ["EPD"] * len(loads), loads))]
    return Router(instances, "cache-aware"), instances


def test_cache_aware_sends_a_prompt_back_where_it_went():
    router, instances = _cache_aware(0, 0, 0)
    first = [router.select(False, _prompt(h)) for h in (1, 2, 3)]
    assert len({i.instance_id for i in first}) == 3  # new prompts: least-load, taking turns
    for inst in instances:
        inst.num_inflight = 2
    for h, inst in zip((1, 2, 3), first):
        assert router.select(False, _prompt(h, 140)) is inst  # the same start, a longer prompt
    # Without a prompt, or with one shorter than a chunk, it is least-load.
    instances[0].num_inflight = 0
    assert router.select(False) is instances[0]
    assert router.select(False, _prompt(2, 20)) is instances[0]


def test_cache_aware_leaves_a_busy_holder_and_matches_the_longest_run():
    router, instances = _cache_aware(0, 0)
    a = router.select(False, _prompt(1))
    other = instances[1 - instances.index(a)]
    a.num_inflight = 8  # within the slack of the idle one
    assert router.select(False, _prompt(1)) is a
    a.num_inflight = 9
    assert router.select(False, _prompt(1)) is other  # and now both were sent it
    a.num_inflight, other.num_inflight = 2, 3
    assert router.select(False, _prompt(1)) is a, "a tie on the run: the less loaded of the two"
    a.num_inflight = 4
    assert router.select(False, _prompt(1)) is other
    # Both were sent the first chunk; only one the rest: that one.
    router, instances = _cache_aware(0, 0)
    head = router.select(False, Prompt(list(range(40)), []))
    head.num_inflight = 20
    tail = router.select(False, Prompt(list(range(40)) + [7] * 60, []))
    assert tail is not head
    head.num_inflight = 0
    tail.num_inflight = 2
    assert router.select(False, Prompt(list(range(40)) + [7] * 80, [])) is tail
    assert router.select(False, Prompt(list(range(40)) + [8] * 80, [])) is head  # a tie on one chunk


def test_cache_aware_tells_images_apart_by_content():
    router, instances = _cache_aware(0, 0, roles=["EPD", "EPD"])
    tokens = list(range(10)) + [5] * 64 + list(range(30))
    cat = router.select(True, Prompt(tokens, [Image(10, 64, b"cat")]))
    dog = router.select(True, Prompt(tokens, [Image(10, 64, b"dog")]))
    assert cat is not dog
    for inst in instances:
        inst.num_inflight = 1
    assert router.select(True, Prompt(tokens, [Image(10, 64, b"dog")])) is dog
    assert router.select(True, Prompt(tokens, [Image(10, 64, b"cat")])) is cat
    # An image of unknown content ends the digests at its first chunk.
    assert len(router.prefixes.digests(Prompt(tokens, [Image(40, 20, None)]))) == 1


def test_cache_aware_forgets_the_oldest_prefixes():
    router, instances = _cache_aware(0, 0)
    router.prefixes.capacity = 6
    for h in range(10):
        router.select(False, _prompt(h))  # three chunks each
    assert len(router.prefixes) == 6
    assert router.prefixes.matches(router.prefixes.digests(_prompt(0)), [0, 1]) == {0: 0, 1: 0}
    assert max(router.prefixes.matches(router.prefixes.digests(_prompt(9)), [0, 1]).values()) == 3


@dataclass
class Completion:
    """One of a prompt's ``n`` completions, as the router sees it."""

    group: str | None
    prompt_token_ids: tuple = ()
    images: tuple = ()


@pytest.mark.parametrize("policy", ["round-robin", "least-load", "random", "cache-aware"])
def test_the_completions_of_one_prompt_go_where_the_first_went(policy):
    """The n completions of a prompt share its prefill only on one instance: every policy
    places the first of them, the rest follow it while it takes work."""
    instances = [FakeInstance("EPD", instance_id=i) for i in range(3)]
    router = Router(instances, policy, seed=3)
    for group in ("a", "b", "c", "d"):
        chosen = [router.select(False, Completion(group)) for _ in range(4)]
        assert len(set(map(id, chosen))) == 1, chosen
        chosen[0].num_inflight += 4
    # Groups are placed by the policy: round-robin and least-load spread four of them.
    if policy in ("round-robin", "least-load"):
        assert sorted(i.num_inflight for i in instances) == [4, 4, 8]
    # The instance of a group stops taking work: the rest of the group goes elsewhere, together.
    first = router.select(False, Completion("e"))
    first.accepting = False
    rest = {id(router.select(False, Completion("e"))) for _ in range(3)}
    assert len(rest) == 1 and id(first) not in rest
    # Requests outside a group are placed one by one.
    first.accepting = True
    if policy == "round-robin":
        assert len({id(router.select(False, Completion(None))) for _ in range(3)}) == 3


def test_the_router_remembers_a_bounded_number_of_groups():
    from hydrad.cluster.router import GROUPS

    router = Router([FakeInstance("EPD", instance_id=i) for i in range(2)], "round-robin")
    for g in range(GROUPS + 10):
        router.select(False, Completion(str(g)))
    assert len(router._groups) == GROUPS
    assert ("0", "P") not in router._groups and (str(GROUPS + 9), "P") in router._groups


def test_the_completions_of_one_prompt_are_handed_on_to_one_instance():
    """Encoded on one E instance, a prompt's completions are offered to a P instance each:
    all go to the one the first went to (which prefills their prompt once), while it takes
    work; requests of no group are spread as the policy says."""
    e = FakeInstance("E", instance_id=0)
    pds = [FakeInstance("PD", instance_id=i) for i in (1, 2, 3)]
    router = Router([e, *pds], "round-robin")
    entry = {id(router.select(True, Completion("g"))) for _ in range(4)}
    assert entry == {id(e)}
    targets = {id(router.select_stage("P", exclude=e, request=Completion("g"))) for _ in range(4)}
    assert len(targets) == 1
    assert len({id(router.select_stage("P", exclude=e, request=Completion(None))) for _ in range(3)}) == 3
