"""Picks the entry instance of a request.

A request with images enters at an instance holding E, a text-only one at an
instance holding P. Among those that are alive, the policy decides:
``round-robin``, ``least-load`` (fewest requests in flight from this daemon,
ties broken round-robin) or ``random``. Plain Python, no device code.
"""

from __future__ import annotations

import itertools
import random
from typing import Protocol, Sequence


class Instance(Protocol):
    instance_id: int
    role: str
    # Takes new work (alive and started).
    accepting: bool

    @property
    def num_inflight(self) -> int: ...


class NoInstanceAvailable(RuntimeError):
    pass


class Router:
    def __init__(self, instances: Sequence[Instance], policy: str = "least-load", seed: int | None = None):
        if policy not in ("round-robin", "least-load", "random"):
            raise ValueError(f"unknown router policy {policy!r}")
        # Held, not copied: an instance restarted or redeployed in place is seen at once.
        self.instances = instances if isinstance(instances, list) else list(instances)
        self.policy = policy
        self._counter = itertools.count()
        self._rng = random.Random(seed)

    def instance(self, instance_id: int):
        """The instance with this id, or None."""
        return next((i for i in self.instances if i.instance_id == instance_id), None)

    def select(self, has_images: bool):
        """The entry instance of a new request."""
        return self.select_stage("E" if has_images else "P")

    def select_stage(self, stage: str, exclude=None):
        """An instance holding ``stage`` (the entry, or the target of a migration), other than
        ``exclude`` when another one holds it."""
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
        return min(rotated, key=lambda i: i.num_inflight)
