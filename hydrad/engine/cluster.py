"""Several instances in one process, with migration relayed between them.

This is the in-process counterpart of the daemon: the same engines, the same
router, the same pull-based migration protocol (offer → the router picks a target →
the target pulls when it schedules the request → the source releases), with the
pools passed by reference instead of through shared memory. ``hydrad.LLM`` uses it
for deployments of several instances; the instances take turns in one process.
"""

from __future__ import annotations

from typing import Iterable

from hydrad.config import EngineConfig
from hydrad.engine.core import EngineCore
from hydrad.engine.inputs import EngineOutput, EngineRequest
from hydrad.server.router import Router


def merge_outputs(into: EngineOutput, output: EngineOutput) -> None:
    """Append ``output``'s columns to ``into`` (logprobs kept aligned with the tokens)."""
    if output.logprobs is not None and into.logprobs is None:
        into.logprobs = [None] * len(into.req_ids)
    into.req_ids += output.req_ids
    into.token_ids += output.token_ids
    if into.logprobs is not None:
        into.logprobs += output.logprobs if output.logprobs is not None else [None] * len(output.req_ids)
    into.finished += output.finished


class _Handle:
    """What the router sees of an in-process instance."""

    def __init__(self, engine: EngineCore):
        self.engine = engine
        self.role = engine.role
        self.alive = True
        self.index = engine.instance_id

    @property
    def num_inflight(self) -> int:
        return self.engine.scheduler.num_unfinished


class LocalCluster:
    def __init__(self, config: EngineConfig, roles: list[str], *, device: str = "cpu", policy: str = "round-robin"):
        self.engines = [EngineCore(config, role=role, device=device, instance_id=i) for i, role in enumerate(roles)]
        for engine in self.engines:
            for peer in self.engines:
                if peer is not engine:
                    engine.attach_peer(peer.instance_id, peer.pools())
        self.router = Router([_Handle(e) for e in self.engines], policy=policy, seed=config.seed)
        self.max_model_len = min(e.max_model_len for e in self.engines)
        # req_id -> instances that may hold a part of it (for aborts)
        self._holders: dict[str, set[int]] = {}

    def add_request(self, req: EngineRequest) -> None:
        entry = self.router.select(has_images=bool(req.images)).engine
        entry.add_request(req)
        self._holders[req.req_id] = {entry.instance_id}

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            for i in self._holders.pop(req_id, ()):
                self.engines[i].abort_requests([req_id])

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines)

    def step(self) -> EngineOutput:
        merged = EngineOutput()
        for engine in self.engines:
            merge_outputs(merged, self.step_instance(engine))
        return merged

    def step_instance(self, engine: EngineCore) -> EngineOutput:
        """One step of one instance, then relay its offers and finished pulls."""
        output = engine.step() if engine.has_work() else EngineOutput()
        # Releases first: the source may be the target of this step's offers (ED+P).
        for req_id, source in engine.take_pulled():
            self.engines[source].release([req_id])
        for offer in engine.take_offers():
            target = self.router.select_stage(offer.next_stage).engine
            target.add_migration(offer)
            self._holders.setdefault(offer.req_id, set()).add(target.instance_id)
        for finished in output.finished:
            self._holders.pop(finished.req_id, None)
        return output

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown()
