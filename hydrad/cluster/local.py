"""Several instances in one process, with migration relayed between them.

This is the in-process counterpart of the daemon: the same engines, the same router,
the same migration relay (offer → the router picks a target → the target pulls when
it schedules the request → the source releases), with the pools passed by reference
instead of through shared memory. ``hydrad.LLM`` uses it for deployments of several
instances when ``worker_processes=False``; the instances take turns in one process.
"""

from __future__ import annotations

from typing import Iterable

from hydrad.cluster.redeploy import RoleChange, plan_redeploy
from hydrad.cluster.relay import MigrationRelay
from hydrad.cluster.router import Router
from hydrad.config import EngineConfig
from hydrad.engine.core import EngineCore
from hydrad.engine.inputs import EngineOutput, EngineRequest
from hydrad.engine.migration import MigrationOffer


def merge_outputs(into: EngineOutput, output: EngineOutput) -> None:
    """Append ``output``'s columns to ``into`` (logprobs kept aligned with the tokens)."""
    if output.logprobs is not None and into.logprobs is None:
        into.logprobs = [None] * len(into.req_ids)
    into.req_ids += output.req_ids
    into.token_ids += output.token_ids
    if into.logprobs is not None:
        into.logprobs += output.logprobs if output.logprobs is not None else [None] * len(output.req_ids)
    into.finished += output.finished


class LocalInstance:
    """An in-process engine as the router and the relay see it."""

    def __init__(self, engine: EngineCore, relay_of):
        self.engine = engine
        self.instance_id = engine.instance_id
        self.alive = True
        # What the router sees: the engine's role, except during a redeploy.
        self.role = engine.role
        self._relay_of = relay_of

    @property
    def accepting(self) -> bool:
        return self.alive

    @property
    def num_inflight(self) -> int:
        return self._relay_of().held_by(self)

    def migrate(self, offer: MigrationOffer) -> None:
        self.engine.add_migration(offer)

    def release(self, req_ids: tuple[str, ...]) -> None:
        self.engine.release(req_ids)

    def abort(self, req_ids: tuple[str, ...]) -> None:
        self.engine.abort_requests(req_ids)


class LocalCluster:
    def __init__(self, config: EngineConfig, roles: list[str], *, device: str = "cpu", policy: str = "round-robin"):
        self.engines = [EngineCore(config, role=role, device=device, instance_id=i) for i, role in enumerate(roles)]
        self._attach_all()
        self._shrinking: dict[int, RoleChange] = {}
        self.instances = [LocalInstance(e, lambda: self.relay) for e in self.engines]
        self.router = Router(self.instances, policy=policy, seed=config.seed)
        self.relay = MigrationRelay(self.router)
        self.max_model_len = min(e.max_model_len for e in self.engines)

    def _attach_all(self) -> None:
        for engine in self.engines:
            for peer in self.engines:
                if peer is not engine:
                    engine.attach_peer(peer.instance_id, peer.pools())

    # -- live redeploy ---------------------------------------------------------------------------
    def redeploy(self, roles: list[str]) -> list[RoleChange]:
        """Start changing the instances' roles (``hydrad.cluster.redeploy``): expand at once,
        then each instance sheds its lost stages as the following steps drain them
        (``redeploying`` is True until then)."""
        if self._shrinking:
            raise RuntimeError("a redeploy is already under way")
        changes = plan_redeploy([e.role for e in self.engines], roles)
        for change in changes:
            self.engines[change.instance_id].expand(change.union)
            self.instances[change.instance_id].role = change.union
        self._attach_all()
        for change in changes:
            self.instances[change.instance_id].role = change.new
            if change.loses:
                self.engines[change.instance_id].retire(change.loses)
                self._shrinking[change.instance_id] = change
        self._finish_shrinks()
        return changes

    @property
    def redeploying(self) -> bool:
        return bool(self._shrinking)

    def _finish_shrinks(self) -> None:
        for instance_id in [i for i in self._shrinking if self.engines[i].drained()]:
            self.engines[instance_id].shrink()
            del self._shrinking[instance_id]

    def add_request(self, req: EngineRequest) -> None:
        entry = self.router.select(has_images=bool(req.images), request=req)
        entry.engine.add_request(req)
        self.relay.open(req.req_id, entry)

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        self.relay.abort(list(req_ids))

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines)

    def step(self) -> EngineOutput:
        merged = EngineOutput()
        for instance in self.instances:
            merge_outputs(merged, self.step_instance(instance.engine))
        if self._shrinking:
            self._finish_shrinks()
        return merged

    def step_instance(self, engine: EngineCore) -> EngineOutput:
        """One step of one instance, then relay its offers and finished pulls."""
        instance = self.instances[engine.instance_id]
        output = engine.step() if engine.has_work() else EngineOutput()
        # Releases first: the source may be the target of this step's offers (ED+P).
        for pulled in engine.take_pulled():
            self.relay.on_pulled(instance, pulled)
        for offer in engine.take_offers():
            self.relay.on_offer(instance, offer)
        for finished in output.finished:
            self.relay.close(finished.req_id)
        return output

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown()
