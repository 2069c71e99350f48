"""The migration relay: which instances hold each request, and the hand-offs between them.

The engine side of pull-based migration is ``hydrad.engine.migration``. Here: when an
instance offers a request whose next stage it does not hold, the router picks a live
target holding that stage and the target is handed the offer (it pulls when it
schedules the request); when a target reports a finished pull, the source is told to
release its blocks. An abort reaches every instance that may hold a part of the
request. The same relay serves the in-process cluster (instances are engines) and the
daemon (instances are worker pipes): it only calls ``Instance`` methods.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Protocol

from hydrad.cluster.router import NoInstanceAvailable, Router
from hydrad.engine.migration import MigrationOffer, Pulled


class Instance(Protocol):
    """What the router and the relay see of an instance."""

    instance_id: int
    role: str
    alive: bool  # its link is up (it may still be starting)
    accepting: bool  # it takes new work

    def migrate(self, offer: MigrationOffer) -> None: ...
    def release(self, req_ids: tuple[str, ...]) -> None: ...
    def abort(self, req_ids: tuple[str, ...]) -> None: ...


class MigrationRelay:
    def __init__(self, router: Router):
        self.router = router
        self.holders: dict[str, set[Instance]] = {}
        self._num_held: dict[int, int] = defaultdict(int)  # instance id -> requests it holds a part of
        # Offers handed to a target that has not pulled yet: req_id -> (source, target, offer).
        # The source still holds the blocks, so if the target dies the offer can go elsewhere.
        self.in_flight: dict[str, tuple[Instance, Instance, MigrationOffer]] = {}

    def __len__(self) -> int:
        return len(self.holders)

    def is_open(self, req_id: str) -> bool:
        return req_id in self.holders

    def held_by(self, instance: Instance) -> int:
        """Requests in flight that ``instance`` holds a part of (O(1), for least-load routing)."""
        return self._num_held[instance.instance_id]

    def requests_held_by(self, instance: Instance) -> list[str]:
        return [req_id for req_id, holders in self.holders.items() if instance in holders]

    # -- a request's life --------------------------------------------------------------------
    def open(self, req_id: str, entry: Instance) -> None:
        self.holders[req_id] = {entry}
        self._num_held[entry.instance_id] += 1

    def close(self, req_id: str) -> set[Instance]:
        """The request ended: forget it; returns the instances that held a part of it."""
        self.in_flight.pop(req_id, None)
        holders = self.holders.pop(req_id, set())
        for instance in holders:
            self._num_held[instance.instance_id] -= 1
        return holders

    def abort(self, req_ids: Iterable[str]) -> None:
        """End requests everywhere: every instance holding a part drops it and frees its blocks."""
        for req_id in req_ids:
            for instance in self.close(req_id):
                if instance.alive:
                    instance.abort((req_id,))

    # -- migration ---------------------------------------------------------------------------
    def on_offer(self, source: Instance, offer: MigrationOffer) -> Instance | None:
        """Hand ``offer`` to a target and return it (None when the request is gone); raises
        ``NoInstanceAvailable`` when no live instance holds the next stage (the caller fails
        the request)."""
        holders = self.holders.get(offer.req_id)
        if holders is None:  # gone meanwhile (aborted): the source must not keep it
            source.release((offer.req_id,))
            return None
        # An offer made before a redeploy gave its source the next stage goes elsewhere: a
        # request is never pulled from an instance's own pool.
        # An offer to prefill carries the prompt: the cache-aware router sends it where it may be cached.
        target = self.router.select_stage(offer.next_stage, exclude=source if offer.kind != "prompt" else None,
                                          request=offer if offer.next_stage in ("E", "P") else None)
        if target not in holders:
            holders.add(target)
            self._num_held[target.instance_id] += 1
        # Passed on by an instance that was offered it and no longer runs its stage (a
        # redeploy): it holds nothing; the blocks are still at the offer's source, which may
        # be the target now (it takes the request back).
        forwarded = offer.kind != "prompt" and offer.source != source.instance_id
        if offer.kind == "prompt" or forwarded:  # the source let the request go already
            if source in holders and source is not target:
                holders.discard(source)
                self._num_held[source.instance_id] -= 1
        if offer.kind != "prompt":
            holder = self.router.instance(offer.source) if forwarded else source
            self.in_flight[offer.req_id] = (holder or source, target, offer)
        target.migrate(offer)
        return target

    def take_back(self, req_id: str, target: Instance) -> tuple[Instance, MigrationOffer] | None:
        """``target`` died before pulling ``req_id``: forget it as a holder and return the
        (source, offer) to hand on again, if the source still holds the blocks."""
        entry = self.in_flight.get(req_id)
        if entry is None or entry[1] is not target or not entry[0].alive:
            return None
        del self.in_flight[req_id]
        holders = self.holders.get(req_id)
        if holders is not None and target in holders:
            holders.discard(target)
            self._num_held[target.instance_id] -= 1
        return entry[0], entry[2]

    def on_pulled(self, target: Instance, pulled: Pulled) -> None:
        """The target has the blocks: the source lets them go."""
        self.in_flight.pop(pulled.req_id, None)
        source = self.router.instance(pulled.source)
        if source is None:
            return
        holders = self.holders.get(pulled.req_id)
        if holders is not None and source in holders and source is not target:
            holders.discard(source)
            self._num_held[source.instance_id] -= 1
        if source.alive:
            source.release((pulled.req_id,))


__all__ = ["Instance", "MigrationRelay", "NoInstanceAvailable"]
