"""Picks the entry instance of a request, and the target of a migration.

A request with images enters at an instance holding E, a text-only one at an
instance holding P. Among those that are alive, the policy decides:
``round-robin``, ``least-load`` (fewest requests in flight from this daemon,
ties broken round-robin), ``random``, or ``cache-aware``: the instance most likely
to hold the request's prompt in its prefix cache (``PrefixRoutes``: the one sent the
longest run of the same prompt chunks and images before), unless it has
``BALANCE_SLACK`` more requests in flight than the least loaded (then, and for a
prompt no instance has seen, least-load). Plain Python, no device code.
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from typing import Protocol, Sequence

from hydrad.engine.prefix_cache import SEED, chunk_digest

POLICIES = ("round-robin", "least-load", "random", "cache-aware")
# cache-aware: the instance holding the longest prefix takes the request while it has at most
# this many more requests in flight than the least loaded one, or this share more.
BALANCE_SLACK = 8
BALANCE_RATIO = 1.5
# (group, stage) pairs of completions (``Router.select_stage``) whose instance the router
# remembers; a group's completions are placed one after the other, so a few are enough.
GROUPS = 1024


class Instance(Protocol):
    instance_id: int
    role: str
    # Takes new work (alive and started).
    accepting: bool

    @property
    def num_inflight(self) -> int: ...


class NoInstanceAvailable(RuntimeError):
    pass


class PrefixRoutes:
    """Which instances were sent which prompt prefixes, to send a prompt where its prefix may
    still be cached. Prompts are cut into chunks of ``CHUNK`` tokens, each named by a digest
    chained over the chunks before it and the images among them, as the engine names its KV
    blocks (``prefix_cache.chunk_digest``); the router remembers the instances each digest
    went to, the ``capacity`` most recently sent. An approximation: an instance's cache may
    have let a prefix go since."""

    CHUNK = 32

    def __init__(self, capacity: int = 1 << 16):
        self.capacity = capacity
        self._sent: OrderedDict[bytes, set[int]] = OrderedDict()

    def digests(self, request) -> list[bytes]:
        """Digests of the request's full chunks (up to its first image of unknown content)."""
        tokens, images = request.prompt_token_ids, request.images
        out: list[bytes] = []
        previous = SEED
        for start in range(0, len(tokens) - self.CHUNK + 1, self.CHUNK):
            previous = chunk_digest(previous, tokens[start : start + self.CHUNK], start, images)
            if previous is None:
                break
            out.append(previous)
        return out

    def matches(self, digests: list[bytes], instance_ids) -> dict[int, int]:
        """How many leading chunks each instance was sent."""
        found = dict.fromkeys(instance_ids, 0)
        live = set(found)
        for digest in digests:
            live &= self._sent.get(digest, set())
            if not live:
                break
            for instance_id in live:
                found[instance_id] += 1
        return found

    def sent(self, digests: list[bytes], instance_id: int) -> None:
        sent = self._sent
        for digest in digests:
            owners = sent.get(digest)
            if owners is None:
                sent[digest] = {instance_id}
            else:
                owners.add(instance_id)
                sent.move_to_end(digest)
        while len(sent) > self.capacity:
            sent.popitem(last=False)

    def __len__(self) -> int:
        return len(self._sent)


def entry_stage(has_images: bool) -> str:
    """The stage a new request starts at: E with images, else P."""
    return "E" if has_images else "P"


class Router:
    def __init__(self, instances: Sequence[Instance], policy: str = "least-load", seed: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}")
        # Held, not copied: an instance restarted or redeployed in place is seen at once.
        self.instances = instances if isinstance(instances, list) else list(instances)
        self.policy = policy
        self._counter = itertools.count()
        self._rng = random.Random(seed)
        self.prefixes = PrefixRoutes() if policy == "cache-aware" else None
        # Where each stage of each recent group of completions (``EngineRequest.group``) went,
        # by (group, stage), the ``GROUPS`` most recent: the first was placed by the policy.
        self._groups: OrderedDict[tuple[str, str], int] = OrderedDict()

    def instance(self, instance_id: int):
        """The instance with this id, or None."""
        return next((i for i in self.instances if i.instance_id == instance_id), None)

    def can_take(self, stage: str) -> bool:
        """Whether a live instance takes new work for ``stage``."""
        return any(i.accepting and stage in i.role for i in self.instances)

    def select(self, has_images: bool, request=None):
        """The entry instance of a new request (``request``: its prompt, for ``cache-aware``)."""
        return self.select_stage(entry_stage(has_images), request=request)

    def select_stage(self, stage: str, exclude=None, request=None):
        """An instance holding ``stage`` (the entry, or the target of a migration), other than
        ``exclude`` when another one holds it. ``request`` (anything with ``prompt_token_ids``
        and ``images``): what it will run there, for ``cache-aware``. The completions of one
        prompt (``request.group``) go where the first of them went for that stage, while that
        instance takes work there: it prefills their prompt once."""
        group = getattr(request, "group", None)
        if group is None:
            return self._pick(stage, exclude, request)
        key = (group, stage)
        placed = self._groups.get(key)
        if placed is not None:
            instance = self.instance(placed)
            if instance is not None and instance is not exclude and instance.accepting and stage in instance.role:
                return instance
        instance = self._pick(stage, exclude, request)
        self._groups[key] = instance.instance_id
        if len(self._groups) > GROUPS:
            self._groups.popitem(last=False)
        return instance

    def _pick(self, stage: str, exclude, request):
        """``select_stage`` by the policy alone."""
        candidates = [i for i in self.instances if i.accepting and stage in i.role]
        if exclude is not None and len(candidates) > 1:
            candidates = [i for i in candidates if i is not exclude] or candidates
        if not candidates:
            raise NoInstanceAvailable(f"no live instance can take stage {stage}")
        if self.policy == "random":
            return self._rng.choice(candidates)
        turn = next(self._counter)
        # Rotate first so that equal loads (and round-robin) take turns.
        rotated = candidates[turn % len(candidates) :] + candidates[: turn % len(candidates)]
        if self.policy == "round-robin":
            return rotated[0]
        least = min(rotated, key=lambda i: i.num_inflight)
        if self.prefixes is None or request is None or ("P" not in stage and "E" not in stage):
            return least
        digests = self.prefixes.digests(request)
        if not digests:
            return least
        chosen = least
        if len(candidates) > 1:
            found = self.prefixes.matches(digests, [i.instance_id for i in rotated])
            best = max(rotated, key=lambda i: (found[i.instance_id], -i.num_inflight))
            low = least.num_inflight
            if (found[best.instance_id] > found[least.instance_id]
                    and best.num_inflight <= max(low + BALANCE_SLACK, low * BALANCE_RATIO)):
                chosen = best
        self.prefixes.sent(digests, chosen.instance_id)
        return chosen
