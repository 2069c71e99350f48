"""A worker process: one engine instance on one device, driven over a pipe.

The loop: take every pending message (blocking only while the engine is idle),
run one engine step, send that step's deltas in one ``StepOutput``. The worker
exits on ``Shutdown`` or when the daemon's end of the pipe closes, so a crashed
daemon never leaves workers behind. A worker that fails sends ``WorkerFailed``
and exits with status 1.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Protocol

from hydrad.config import EngineConfig
from hydrad.engine.inputs import EngineOutput, EngineRequest, EngineStats, FinishedRequest
from hydrad.engine.migration import MigrationOffer, Pulled, export_pools, import_pools
from hydrad.transport.messages import (
    Abort,
    AddRequest,
    AttachPeers,
    DetachPeer,
    ExportPools,
    GetStats,
    Migrate,
    PoolsExported,
    Reconfigure,
    Reconfigured,
    Release,
    Retire,
    Retired,
    RequestRejected,
    Shutdown,
    StatsReply,
    StepOutput,
    WorkerFailed,
    WorkerReady,
)

logger = logging.getLogger("hydrad.worker")


class Engine(Protocol):
    max_model_len: int
    instance_id: int

    def add_request(self, req: EngineRequest) -> None: ...
    def abort_requests(self, req_ids) -> None: ...
    def step(self) -> EngineOutput: ...
    def has_work(self) -> bool: ...
    def has_unfinished_requests(self) -> bool: ...
    def get_stats(self) -> EngineStats: ...
    def shutdown(self) -> None: ...
    # migration between instances
    def attach_peer(self, instance_id: int, pools: dict) -> None: ...
    def detach_peer(self, instance_id: int) -> None: ...
    def pools(self) -> dict: ...
    def add_migration(self, offer: MigrationOffer) -> None: ...
    def release(self, req_ids) -> None: ...
    def take_offers(self) -> list[MigrationOffer]: ...
    def take_pulled(self) -> list[Pulled]: ...


def worker_main(
    instance_id: int,
    role: str,
    device: str,
    config: EngineConfig,
    conn: Connection,
    num_threads: int,
    peer_ids: tuple[int, ...] = (),
) -> None:
    """Process entry point (spawned by the daemon's supervisor)."""
    # Ctrl-C reaches the whole process group; the daemon decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=os.environ.get("HYDRAD_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s worker{instance_id}: %(message)s",
    )
    start = time.monotonic()
    try:
        import torch

        torch.set_num_threads(num_threads)
        from hydrad.engine.core import EngineCore

        engine = EngineCore(config, role=role, device=device, instance_id=instance_id, shared_pools=bool(peer_ids))
        model = bound = None
        if config.scheduler.derive_budgets:
            from hydrad.engine.latency_model import latency_bound
            from hydrad.engine.profiler import fit_latency_model

            model, bound = fit_latency_model(engine), latency_bound(config.slo, engine.role)
            engine.set_latency_model(model, bound)
        pools = export_pools(engine.pools(), peer_ids) if peer_ids else {}
        from hydrad.engine.profiler import measure_bandwidth

        # Measured (or read from its cache) before any request holds a block of the pool.
        bandwidth = measure_bandwidth(engine) if engine.kv_manager is not None else None
        engine.copy_bandwidth = bandwidth
    except Exception as e:  # reported to the daemon, which prints it as one line
        conn.send(WorkerFailed(instance_id, f"{type(e).__name__}: {e}", traceback.format_exc()))
        conn.close()
        sys.exit(1)
    conn.send(WorkerReady(instance_id, os.getpid(), engine.max_model_len, time.monotonic() - start, model, bound,
                          engine.geometry(), bandwidth, pools))
    try:
        run_worker(engine, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.info("daemon went away; exiting")
    except Exception as e:
        logger.exception("engine step failed")
        try:
            conn.send(WorkerFailed(instance_id, f"{type(e).__name__}: {e}", traceback.format_exc()))
        except OSError:
            pass
        sys.exit(1)
    finally:
        engine.shutdown()
        conn.close()


def _reconfigure(engine, role: str, num_threads: int | None = None) -> Reconfigured:
    """Expand the instance to ``role`` (on ``num_threads`` torch threads from now on, when
    given) and give it the latency model and bound of its new role."""
    import torch

    start = time.monotonic()
    threads_before = torch.get_num_threads()
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        new_role = engine.expand(role)
        model, bound = _latency(engine, new_role)
    except Exception as e:  # the daemon reports it and keeps the deployment as it was
        torch.set_num_threads(threads_before)
        logger.exception("taking on role %s failed", role)
        return Reconfigured(engine.instance_id, engine.role, time.monotonic() - start, error=f"{type(e).__name__}: {e}")
    return Reconfigured(engine.instance_id, new_role, time.monotonic() - start, model, bound,
                        geometry=engine.geometry())


def _latency(engine, role: str):
    """The latency model (cached, or measured between steps) and bound for ``role``."""
    config = engine.config
    if not config.scheduler.derive_budgets:
        return None, None
    from hydrad.engine.latency_model import latency_bound
    from hydrad.engine.profiler import fit_latency_model

    model, bound = fit_latency_model(engine, allow_busy=True), latency_bound(config.slo, role)
    engine.set_latency_model(model, bound)
    return model, bound


def run_worker(engine: Engine, conn: Connection) -> None:
    """Serve messages and step the engine until ``Shutdown`` has been honoured."""
    live: set[str] = set()  # admitted and not finished: what a Shutdown may have to abort
    draining = False
    retiring_since: float | None = None  # a Retire is under way
    while True:
        if retiring_since is not None and engine.drained():
            role = engine.shrink()
            bound = None
            if engine.scheduler.latency_model is not None:
                from hydrad.engine.latency_model import latency_bound

                bound = latency_bound(engine.config.slo, role)
                engine.set_latency_model(engine.scheduler.latency_model, bound)
            conn.send(Retired(engine.instance_id, role, time.monotonic() - retiring_since, bound))
            retiring_since = None
        if draining and not engine.has_unfinished_requests():
            return
        busy = engine.has_work()
        # Block for messages only when there is nothing to step.
        timeout = 0 if busy else None
        while conn.poll(timeout):
            msg = conn.recv()
            timeout = 0
            if isinstance(msg, (AddRequest, Migrate)):
                # A new request, or one migrating in: either may not fit this instance.
                req_id, admit, payload = (
                    (msg.request.req_id, engine.add_request, msg.request)
                    if isinstance(msg, AddRequest)
                    else (msg.offer.req_id, engine.add_migration, msg.offer)
                )
                try:
                    admit(payload)
                except ValueError as e:
                    conn.send(RequestRejected(req_id, str(e), getattr(e, "param", None)))
                else:
                    live.add(req_id)
            elif isinstance(msg, Abort):
                engine.abort_requests(msg.req_ids)
                live.difference_update(msg.req_ids)
            elif isinstance(msg, Release):
                engine.release(msg.req_ids)
                live.difference_update(msg.req_ids)
            elif isinstance(msg, AttachPeers):
                for peer_id, blob in msg.pools.items():
                    engine.attach_peer(peer_id, import_pools(blob))
            elif isinstance(msg, ExportPools):
                engine.share_pools()
                blob = export_pools(engine.pools(), (msg.peer_id,))[msg.peer_id]
                conn.send(PoolsExported(engine.instance_id, msg.peer_id, blob))
            elif isinstance(msg, DetachPeer):
                engine.detach_peer(msg.peer_id)
            elif isinstance(msg, Reconfigure):
                conn.send(_reconfigure(engine, msg.role, msg.num_threads))
            elif isinstance(msg, Retire):
                engine.retire(msg.stages)
                retiring_since = time.monotonic()
            elif isinstance(msg, GetStats):
                conn.send(StatsReply(msg.seq, engine.get_stats()))
            elif isinstance(msg, Shutdown):
                if not msg.finish_running and live:
                    engine.abort_requests(list(live))
                    conn.send(StepOutput(EngineOutput(finished=[FinishedRequest(r, "abort") for r in sorted(live)])))
                    live.clear()
                draining = True
            else:
                raise TypeError(f"unexpected message {type(msg).__name__}")
        output = engine.step() if busy else EngineOutput()
        offers, pulled = engine.take_offers(), engine.take_pulled()
        if output or output.timing is not None or offers or pulled:
            live.difference_update(f.req_id for f in output.finished)
            live.difference_update(o.req_id for o in offers if o.kind == "prompt")  # moved whole
            conn.send(StepOutput(output, offers, pulled, time.monotonic()))
