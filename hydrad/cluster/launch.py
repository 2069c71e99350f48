"""Launching worker processes: the instance specs and the start of one worker.

Nothing here imports torch, so ``hydrad start`` launches its workers before the daemon
imports its own stack (torch, transformers, aiohttp): a worker's start-up, which is
its weights and caches, then runs beside the daemon's instead of after it. The
supervisor adopts the launched workers (``Supervisor(launched=...)``) and launches
every later one (restarts, redeploys) itself, the same way.

Where the platform has one, workers are forked from a fork server that imported
``hydrad.engine.preload`` once (torch, the engine, the model families, transformers'
configuration classes): a new worker skips seconds of imports, which on a few cores
is most of a worker's start-up. The server starts with the first worker of this
process and lives as long as it; workers see the environment it started with.
Elsewhere workers are spawned, each importing what it needs itself. Until the
server's imports are done, the first start waits for them, so starts run on a
background thread: ``Launched.started`` is set once the process exists.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from hydrad.config import EngineConfig
from hydrad.engine.cores import CoreBoard, CpuThreads, cpu_threads, usable_cpus

logger = logging.getLogger("hydrad.supervisor")


@dataclass(frozen=True)
class InstanceSpec:
    instance_id: int
    role: str
    device: str
    threads: CpuThreads = CpuThreads(1)  # torch threads on a CPU (``engine.cores``)


@dataclass(frozen=True)
class Launched:
    """A worker process being started and the daemon's end of its pipe (not ready yet)."""

    process: BaseProcess
    conn: Connection
    # Set once ``process.start()`` returned (or failed: the pipe then reads EOF at once).
    started: threading.Event = field(default_factory=threading.Event)
    # Where the deployment's CPU workers say whether they have work (``engine.cores``).
    board: CoreBoard | None = None


def plan_specs(instances: list[tuple[str, str]]) -> list[InstanceSpec]:
    """Number the (role, device) pairs and split the CPU cores among CPU workers
    (``engine.cores.cpu_threads``)."""
    return [InstanceSpec(i, role, device, threads)
            for i, ((role, device), threads) in enumerate(zip(instances, plan_threads(instances)))]


def plan_threads(instances: list[tuple[str, str]]) -> list[CpuThreads]:
    """Each instance's threads (``CpuThreads(1)`` off a CPU), lenders named by instance id."""
    cpu = [i for i, (_, device) in enumerate(instances) if device == "cpu"]
    threads = {i: dataclasses.replace(t, lenders=tuple(cpu[j] for j in t.lenders))
               for i, t in zip(cpu, cpu_threads([instances[i][0] for i in cpu], usable_cpus()))}
    return [threads.get(i, CpuThreads(1)) for i in range(len(instances))]


def share_cpu_cores(specs: list[InstanceSpec]) -> None:
    """Before the first worker starts: when several CPU workers share the cores, an idle
    OpenMP thread spins for a short while only (``GOMP_SPINCOUNT``, ``KMP_BLOCKTIME``) and
    then sleeps, so it does not hold a core that another worker (or the borrower of a lent
    core, ``engine.cores``) needs. Not passive waiting: waking sleeping threads at every
    parallel region makes a decode step 1.5-2x as slow. Workers fork from a server that
    reads the environment once; an operator's own setting stays."""
    if sum(1 for spec in specs if spec.device == "cpu") > 1:
        os.environ.setdefault("GOMP_SPINCOUNT", "30000")
        os.environ.setdefault("KMP_BLOCKTIME", "1")


def new_board(specs: list[InstanceSpec]) -> CoreBoard | None:
    """The board through which the CPU workers of ``specs`` lend cores (``engine.cores``), when
    several share them (a redeploy may make one a lender later)."""
    return CoreBoard.new() if sum(1 for spec in specs if spec.device == "cpu") > 1 else None


def migrates(specs: list[InstanceSpec]) -> bool:
    """Whether requests move between the instances (so they share cache pools)."""
    return any(spec.role != "EPD" for spec in specs)


PRELOAD = "hydrad.engine.preload"


def _context():
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])  # read when the server starts, the first time only
    return ctx


def launch_worker(config: EngineConfig, spec: InstanceSpec, peer_ids: tuple[int, ...],
                  board: CoreBoard | None = None, shared: bool = False) -> Launched:
    """Start the worker of ``spec`` on a background thread (``Launched.started``);
    ``peer_ids`` are the instances it exports its pools to; ``board``: the deployment's
    (``engine.cores``), when its CPU workers share the cores; ``shared``: its pools are made
    in shared memory even without peers (``pools_in_shared_memory``)."""
    return _launch([(config, spec, peer_ids, shared or bool(peer_ids))], board)[0]


def launch_all(config: EngineConfig, specs: list[InstanceSpec]) -> dict[int, Launched]:
    """Start every instance's worker, by instance id."""
    share_cpu_cores(specs)
    moves = migrates(specs)
    shared = pools_in_shared_memory(config, specs)
    if shared and not moves:
        logger.info("cache pools made in shared memory: a redeploy that moves requests between the instances "
                    "shares them as they are")
    board = new_board(specs)
    launched = _launch([(config, spec, peer_ids(spec, specs) if moves else (), shared) for spec in specs], board)
    return {spec.instance_id: item for spec, item in zip(specs, launched)}


def pools_in_shared_memory(config: EngineConfig, specs: list[InstanceSpec]) -> bool:
    """Whether the CPU workers make their cache pools in shared memory: where requests move
    between them (they copy from each other's pools), and where they do not but /dev/shm
    has room for the pools (``preflight.room_for_shared_pools``), so that a live redeploy to
    a deployment that moves requests need not move them there: moving two 512 MiB pools
    stopped both workers' steps for 1.8 s on a 2-core CPU."""
    if migrates(specs):
        return True
    from hydrad.cluster.preflight import room_for_shared_pools

    return room_for_shared_pools(config.cache, [spec.device for spec in specs])


def _launch(workers: list[tuple[EngineConfig, InstanceSpec, tuple[int, ...], bool]],
            board: CoreBoard | None) -> list[Launched]:
    ctx = _context()
    items, children = [], []
    for config, spec, peers, shared in workers:
        if board is not None and spec.device == "cpu" and spec.instance_id < CoreBoard.SIZE:
            # Starting (a restart too): it lends its cores once its loop runs, not while it
            # loads and measures (a borrower's probes beside a lender's start slowed it).
            board.flags[spec.instance_id] = 1
        parent, child = ctx.Pipe()
        process = ctx.Process(
            target=_worker_entry,
            args=(spec.instance_id, spec.role, spec.device, config, child, spec.threads, peers,
                  board.flags if board is not None else None, shared),
            name=f"hydrad-worker-{spec.instance_id}",
        )
        items.append(Launched(process, parent, board=board))
        children.append(child)

    def start() -> None:
        for item, child in zip(items, children):
            try:
                item.process.start()
            except Exception as e:  # the worker then reads as exited: its pipe is at EOF
                logger.error("cannot start %s: %s", item.process.name, e)
            finally:
                child.close()  # so the daemon sees EOF when the worker exits
                item.started.set()

    threading.Thread(target=start, name="hydrad-launch", daemon=True).start()
    return items


def peer_ids(spec: InstanceSpec, specs: list[InstanceSpec]) -> tuple[int, ...]:
    return tuple(s.instance_id for s in specs if s.instance_id != spec.instance_id)


def stop_unadopted(launched: dict[int, Launched], timeout: float = 5.0) -> None:
    """Stop the launched workers no supervisor took (the daemon failed before it started)."""
    for item in launched.values():
        item.started.wait()
        item.conn.close()
        if item.process.is_alive():
            item.process.terminate()
    for item in launched.values():
        if item.process.pid is None:  # never started
            continue
        item.process.join(timeout)
        if item.process.is_alive():
            item.process.kill()
            item.process.join()
    launched.clear()


def cuda_device_count(devices: str) -> int:
    """How many CUDA devices torch sees, asked only when ``devices`` may name one and the
    host has a GPU driver: for ``cpu:N``, and on a host without one, torch is not imported."""
    if devices.strip().lower().startswith("cpu"):
        return 0
    if os.name == "posix" and not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia",
                                                                    "/dev/kfd")):
        return 0
    import torch

    return torch.cuda.device_count()


def _worker_entry(*args) -> None:
    """The process's target: the worker module (and torch) are imported in the child only."""
    from hydrad.engine.worker import worker_main

    worker_main(*args)
