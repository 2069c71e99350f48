"""A worker process: one engine instance on one device, driven over a pipe.

The loop: take every pending message (blocking only while the engine is idle),
run one engine step, send that step's deltas in one ``StepOutput``. The worker
exits on ``Shutdown`` or when the daemon's end of the pipe closes, so a crashed
daemon never leaves workers behind. A worker that fails sends ``WorkerFailed``
and exits with status 1.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Protocol

from hydrad.config import EngineConfig
from hydrad.engine.allocator import HeapTrimmer
from hydrad.engine.cores import CoreBoard, CoreLending, CpuThreads, LendersBusy
from hydrad.engine.inputs import EngineOutput, EngineRequest, EngineStats, FinishedRequest
from hydrad.engine.migration import MigrationOffer, Pulled, export_pools, import_pools
from hydrad.errors import HydradError
from hydrad.heap import freeze_startup_heap
from hydrad.transport.messages import (
    Abort,
    AddRequest,
    AttachPeers,
    DetachPeer,
    ExportPools,
    GetStats,
    Migrate,
    ModelMeasured,
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
from hydrad.transport.sharing import HandleLedger

logger = logging.getLogger("hydrad.worker")


class Engine(Protocol):
    max_model_len: int
    instance_id: int

    def add_request(self, req: EngineRequest) -> None: ...
    def grammar_pending(self, req: EngineRequest | MigrationOffer) -> Future | None: ...
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
    threads: CpuThreads,
    peer_ids: tuple[int, ...] = (),
    board_flags=None,
    shared_pools: bool = False,
) -> None:
    """Process entry point (started by the daemon's supervisor). ``threads``: its torch
    threads on a CPU; ``board_flags``: the memory of the deployment's ``CoreBoard``, when
    its CPU workers share the cores; ``shared_pools``: its pools are made in shared memory
    (with ``peer_ids``, always)."""
    # Ctrl-C reaches the whole process group; the daemon decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=os.environ.get("HYDRAD_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s worker{instance_id}: %(message)s",
    )
    start = time.monotonic()
    try:
        import torch

        torch.set_num_threads(threads.own)
        from hydrad.engine.core import EngineCore

        engine = EngineCore(config, role=role, device=device, instance_id=instance_id,
                            shared_pools=shared_pools or bool(peer_ids))
        board = CoreBoard(board_flags) if board_flags is not None and engine.device.type == "cpu" else None
        # It lends its cores once its loop runs (``publish``), not while it starts.
        step_threads = StepThreads(engine, CoreLending(board, instance_id, threads, busy=True))
        # What its start leaves out is measured once it serves, between its steps
        # (``_MeasuredLater``): the model at the count it borrows up to, unless the cache has
        # it (a first start's probes on every core waited for the other workers' probes and
        # came after them), and its own, where the machine's speed moved while it ran.
        model, bound, borrow_model = step_threads.fit(engine.role, allow_busy=False, start=True)
        exported: dict[int, HandleLedger] = {}  # by peer: the pools' descriptors handed to it
        pools = export_pools(engine.pools(), peer_ids, exported) if peer_ids else {}
        from hydrad.engine.profiler import measure_bandwidth

        # Measured (or read from its cache) before any request holds a block of the pool.
        bandwidth = measure_bandwidth(engine) if engine.kv_manager is not None else None
        engine.copy_bandwidth = bandwidth
    except Exception as e:  # reported to the daemon, which prints it as one line
        conn.send(WorkerFailed(instance_id, f"{type(e).__name__}: {e}", traceback.format_exc()))
        conn.close()
        sys.exit(1)
    conn.send(WorkerReady(instance_id, os.getpid(), engine.max_model_len, time.monotonic() - start, model, bound,
                          engine.geometry(), bandwidth, pools, borrow_model, engine.image_cache(),
                          str(engine.dtype).removeprefix("torch.")))
    freeze_startup_heap(logger)
    try:
        run_worker(engine, conn, step_threads, exported)
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
        step_threads.lending.publish(False)
        engine.shutdown()
        conn.close()


class StepThreads:
    """The torch threads each step of a worker runs on, and the latency model measured at
    that count. On a CPU: its own share of the cores, or more while the instances it
    borrows from are idle (``engine.cores``); it publishes whether it has work itself, for
    the instances that borrow from it (``run_worker``).

    A borrower fills each step by the model at the count its lenders allow as the step
    starts, and follows them within the step: a forward pre-hook on every layer (each entry
    of the model's ``nn.ModuleList``s) and on every module without children in it reads the
    board again and changes torch's thread count when a lender has started or stopped having
    work, so a long prefill borrows the core a decode instance frees halfway through it, and
    hands it back within one operation when that instance gets work."""

    def __init__(self, engine, lending: CoreLending):
        self.engine = engine
        self.lending = lending
        self.models: dict = {}  # threads -> LatencyModel
        self.bound: float | None = None
        self.current = lending.threads.own  # the count the step started on: its model's
        self._torch_threads: int | None = None  # what torch runs on now
        self._hooks: list = []
        self._probing = False  # latency-model probes run: the hooks leave the count alone
        # Borrowed counts whose lenders had work past ``LENDERS_PATIENCE`` the last time a
        # model was measured at them: the next measurement does not wait for them again.
        self._lenders_stayed_busy: set[int] = set()
        # The counts whose models the last fit left to later, in order (``measuring_later``).
        self.later: list[int] = []

    def fit(self, role: str, threads: CpuThreads | None = None, *, allow_busy: bool = True, block: bool = True,
            start: bool = False):
        """Measure (or load) the latency models of ``role`` at every count it steps on (from
        now on on ``threads``, when given), and fill steps by them. Returns the model at its
        own share, the bound, and the model while borrowing (None: it never borrows, or it is
        left to ``later``). On an error nothing changed. ``block``: wait for another worker's
        probes on these cores to end (else ``profiler.ProbingElsewhere``). ``start``: a
        starting worker's fit, which leaves to ``later`` the model at the borrowed count
        where the cache lacks it, and measures its own share's once (where the machine's
        speed moved meanwhile, it serves on that model and measures it again later)."""
        from hydrad.engine.profiler import drain

        return drain(self._fitting(role, threads, sliced=False, allow_busy=allow_busy, block=block,
                                   borrowed=not start, once=start))

    def fitting(self, role: str, threads: CpuThreads | None = None, hurry: Callable[[], bool] = lambda: False,
                borrowed: bool = True):
        """``fit`` a probe run at a time, for a busy worker that serves steps between them
        (``profiler.measuring_latency_model``): a generator that yields what the next run
        waits for (None after a run), with torch on the threads the worker serves on, and
        returns what ``fit`` returns. Closed before its end, nothing changed.

        On borrowed cores a probe beside a lender's step times both: a count that borrows is
        measured in runs while its lenders are idle (``LendersBusy`` while they are not), and
        cached only where they were idle before every run; where they have had work for
        ``LENDERS_PATIENCE`` seconds on end, or ``hurry()`` says there is no time to wait, it
        is left to ``later`` (its steps on the borrowed cores are filled by the
        model at its own share meanwhile). Once its lenders have stayed busy that long, the
        next measurement at that count waits for them no more (under load, each redeploy
        waited the whole patience, every time), until one finds them idle and is measured.
        Without ``borrowed`` it is only taken from the cache (its threads change right
        after)."""
        return self._fitting(role, threads, sliced=True, hurry=hurry, borrowed=borrowed)

    def _fitting(self, role: str, threads: CpuThreads | None, *, sliced: bool, allow_busy: bool = True,
                 block: bool = True, hurry: Callable[[], bool] = lambda: False, borrowed: bool = True,
                 once: bool = False):
        threads = self.lending.usable(threads or self.lending.threads)
        own, most = threads.own, threads.most
        models, bound = {}, None
        self._probing = True  # the probes run at the count they are measured at: no hook moves it
        try:
            if self.engine.config.scheduler.derive_budgets:
                from hydrad.engine.latency_model import latency_bound
                from hydrad.engine.profiler import fit_latency_model

                # Its share first: an instance that lends may derive its model from this one,
                # and the daemon's own start (imports, the processor) is over before the probes
                # that take every core.
                for n in sorted({own, most}):
                    self._set_torch_threads(n)
                    if n != own and not borrowed:
                        from hydrad.engine.profiler import known_latency_model

                        if (model := known_latency_model(self.engine)) is not None:
                            models[n] = model
                    elif not sliced:
                        models[n] = fit_latency_model(self.engine, allow_busy=allow_busy, block=block, once=once)
                    elif (model := (yield from self._between_steps(n, threads, hurry))) is not None:
                        models[n] = model
                bound = latency_bound(self.engine.config.slo, role)
        finally:
            self._probing = False
            self._set_torch_threads(self.current)
        self.lending.set(threads)
        self.models, self.bound = models, bound
        from hydrad.engine.profiler import unsteady

        self.later = sorted(n for n in {own, most} if models and (n not in models or once and unsteady(models[n])))
        self._use(own, force=True)
        self._hook_layers()  # its parts may have changed with its role: placed anew
        return models.get(own), bound, models.get(most) if most != own else None

    def measuring_later(self):
        """The model at the first count ``later`` holds, measured a run at a time between
        steps (``fitting``): at a borrowed count whenever its lenders are idle, for as long as
        that takes. Once measured the steps on that count are filled by it. Returns the count
        and the model (None where nothing is left to measure)."""
        if not self.later:
            return None
        n = self.later[0]
        self._probing = True
        try:
            self._set_torch_threads(n)
            model = yield from self._between_steps(n, self.lending.threads, lambda: False, patient=True)
        finally:
            self._probing = False
            self._set_torch_threads(self.current)
        self.models[n] = model
        self.later.remove(n)
        if self.current == n:
            self.engine.set_latency_model(model, self.bound)
        return n, model

    def _between_steps(self, n: int, threads: CpuThreads, hurry: Callable[[], bool], patient: bool = False):
        """The model at ``n`` threads, measured a run at a time (``fitting``); None where a
        borrowed count is left to later. ``patient``: its lenders are waited for as long as
        they have work."""
        from hydrad.engine.profiler import measuring_latency_model

        own = threads.own
        lenders_were_idle = True  # before every run so far
        steps = measuring_latency_model(self.engine, cache=True if n == own else lambda: lenders_were_idle)
        busy_since = None  # since when its lenders have had work
        patience = math.inf if patient else 0.0 if n in self._lenders_stayed_busy else LENDERS_PATIENCE
        while True:
            waits = None
            if n != own and not self.lending.lenders_idle(threads):
                lenders_were_idle = False
                busy_since = busy_since or time.monotonic()
                if hurry() or time.monotonic() - busy_since >= patience:
                    steps.close()
                    self._lenders_stayed_busy.add(n)
                    logger.info("the latency model at %d threads is left to later: its lenders have work (a "
                                "probe on their cores would time their steps too)%s; its steps there are filled "
                                "by the model at %d meanwhile", n, "" if patience else ", as the last time", own)
                    return None
                waits = LendersBusy(f"the lenders of the cores its model at {n} threads is measured on have work")
            else:
                busy_since = None
            try:
                waits = waits or next(steps)
            except StopIteration as stop:
                self._lenders_stayed_busy.discard(n)
                return stop.value
            # The worker serves a step between two runs: on its own threads, its hooks on.
            self._probing = False
            self._set_torch_threads(self.current)
            try:
                yield waits
            except GeneratorExit:
                steps.close()
                raise
            self._probing = True
            self._set_torch_threads(n)

    def set_bound(self, bound: float | None) -> None:
        self.bound = bound
        self.engine.set_latency_model(self.models.get(self.current, self.engine.scheduler.latency_model), bound)

    def before_step(self) -> None:
        """A borrower takes the threads it may use now, and the model at that count."""
        if self.lending.threads.borrow:
            n = self.lending.threads_now()
            if n != self._torch_threads:
                logger.debug("steps on %d threads (was %s)", n, self._torch_threads)
            self._use(n)
            self._set_torch_threads(n)

    def follow_lenders(self) -> None:
        """Within a step, before each layer and operation: take or hand back the lent
        threads as the lenders' work says (the model the step was filled by stays)."""
        if self._probing:
            return
        n = self.lending.threads_now()
        if n != self._torch_threads:
            logger.debug("threads %s -> %d within the step", self._torch_threads, n)
            self._set_torch_threads(n)

    def _hook_layers(self) -> None:
        """Re-pick the thread count before every layer of a CPU borrower's model and every
        operation in it (its parts may have changed with its role: the hooks are placed anew)."""
        self._unhook()
        model = getattr(self.engine, "model", None)
        if not self.lending.threads.borrow or model is None or self.engine.device.type != "cpu":
            return
        from torch import nn

        hook = lambda _module, _args: self.follow_lenders()  # noqa: E731
        # Each layer and each module without children in it (its linear layers, norms,
        # attention): a lender's step that starts meanwhile shares the cores with the
        # borrowed threads for one operation at most.
        layers = {id(layer): layer for module in model.modules() if isinstance(module, nn.ModuleList)
                  for layer in module}
        leaves = {id(m): m for layer in layers.values() for m in layer.modules() if next(m.children(), None) is None}
        self._hooks = [m.register_forward_pre_hook(hook) for m in {**layers, **leaves}.values()]

    def _unhook(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _use(self, n: int, force: bool = False) -> None:
        if n == self.current and not force:
            return
        self._set_torch_threads(n)
        self.current = n
        if n in self.models:
            self.engine.set_latency_model(self.models[n], self.bound)

    def _set_torch_threads(self, n: int) -> None:
        if self.engine.device.type == "cpu" and n != self._torch_threads:
            import torch

            torch.set_num_threads(n)
            self._torch_threads = n


class _PendingReconfigure:
    """A ``Reconfigure`` under way. The instance takes on the new stages at once; the latency
    models of its new role (or threads) are measured between its steps, a step's length of
    probes at a time (``StepThreads.fitting``), so that it keeps serving and its streams wait
    for a few probes at a time, not for all. A probe runs once the pools hold room for it (a
    busy instance's requests may hold every block it needs: an EP instance's image cache
    full of images waiting to be prefilled) and no other worker probes on the same cores
    (``profiler.probing``); waiting for either, it tries again every
    ``RECONFIGURE_RETRY_SECONDS`` (for room, once the pools have more free blocks than at the
    last try). Once ``msg.wait`` has passed it answers with what it still waits for, and times
    the probes left at once; an idle instance that lacks room answers at once (its requests
    cannot free any)."""

    def __init__(self, msg: Reconfigure, start: float):
        self.msg, self.start = msg, start
        self.next_try = start
        self.waits_for: str | None = None  # what the next probe waits for: "room", "probes"
        self.room = (0, 0)
        self.steps = None  # the measurement, once the stages are taken on
        self.said: set[str] = set()  # what it has logged it waits for (once each)
        self.pools: _PoolsAhead | None = None  # the new stages' pools, made beside the steps

    def due(self, engine, now: float) -> bool:
        if now < self.next_try:
            return False
        if now - self.start >= self.msg.wait or self.waits_for != "room":
            return True  # a probe to run, the other worker's probes may be over, or the answer
        return any(free > before for free, before in zip(_room(engine), self.room))

    def close(self) -> None:
        """Stop measuring: the models measured so far are dropped, the threads stay."""
        if self.steps is not None:
            self.steps.close()

    def answer(self, engine, step_threads: StepThreads, now: float) -> Reconfigured | None:
        """Run the next probes (or all that are left, past the wait); the answer, or None
        while the models are still being measured."""
        from hydrad.engine.profiler import NoProbeRoom

        role = self.msg.role
        if self.steps is None:
            if self.pools is None:
                self.pools = _PoolsAhead(engine, role)
            if not self.pools.ready():
                self.next_try = now + POOLS_POLL_SECONDS
                return None
            try:
                role = engine.expand(role, self.pools.take())
            except HydradError as e:
                return _not_reconfigured(engine, self.msg.role, self.start, e)
            except Exception as e:  # the daemon reports it and keeps the deployment as it was
                logger.exception("taking on role %s failed", role)
                return Reconfigured(engine.instance_id, engine.role, now - self.start,
                                    error=f"{type(e).__name__}: {e}")
            self.steps = step_threads.fitting(role, self.msg.threads,
                                              hurry=lambda: time.monotonic() - self.start >= self.msg.wait,
                                              borrowed=self.msg.borrowed)
        late = now - self.start >= self.msg.wait
        # Probes until they have taken a step's length (its bound: the TBT for an instance
        # that decodes, longer for one that only encodes and prefills): the streams wait
        # about a step more, and an instance of long steps does not take a step per probe.
        budget = step_threads.bound if step_threads.bound is not None else RECONFIGURE_RETRY_SECONDS
        # Probing is work: an instance that borrows these cores hands them back meanwhile (the
        # loop publishes what the engine has again before it blocks).
        step_threads.lending.publish(True)
        try:
            while True:
                waits = next(self.steps)
                if isinstance(waits, NoProbeRoom) and not engine.has_unfinished_requests():
                    raise waits  # nothing in flight gives room back
                if waits is not None and late:
                    raise waits
                if waits is not None or (not late and time.monotonic() - now >= budget):
                    break
        except StopIteration as stop:
            model, bound, borrow_model = stop.value
            return Reconfigured(engine.instance_id, engine.role, time.monotonic() - self.start, model, bound,
                                geometry=engine.geometry(), borrow_model=borrow_model)
        except HydradError as e:
            self.steps.close()
            return _not_reconfigured(engine, self.msg.role, self.start, e)
        except Exception as e:
            self.steps.close()
            logger.exception("measuring the latency models of role %s failed", self.msg.role)
            return Reconfigured(engine.instance_id, engine.role, time.monotonic() - self.start,
                                error=f"{type(e).__name__}: {e}")
        waits_for = None if waits is None else ("room" if isinstance(waits, NoProbeRoom) else
                                                "lenders" if isinstance(waits, LendersBusy) else "probes")
        if waits_for is not None and waits_for not in self.said:
            self.said.add(waits_for)
            logger.info("taking on role %s: the latency models wait for %s", self.msg.role, {
                "room": "room in the pools", "probes": "another worker's probes to end",
                "lenders": "the lenders of its borrowed cores to be idle"}[waits_for])
        self.waits_for, self.room = waits_for, _room(engine)
        self.next_try = now if waits is None else now + RECONFIGURE_RETRY_SECONDS
        return None


class _MeasuredLater:
    """A latency model left out of the worker's start (or of a redeploy:
    ``StepThreads.later``), measured between its steps a probe run at a time
    (``StepThreads.measuring_later``), once no other worker probes on its cores and, for a
    count that borrows cores, while their lenders are idle. At a first start of ``1EP+1D``
    on two cores the EP instance serves on its own core's model from when that one is
    measured, beside the D instance's probes, instead of waiting for them to end to probe on
    both cores (42-50 s to healthy, against 21-28 s here); its steps on the borrowed
    cores are filled by the model at its own share until then. A start whose probes saw the
    machine's speed move serves on that model and measures it again here, instead of
    running every probe again before it is ready."""

    def __init__(self, step_threads: StepThreads, now: float):
        self.threads = step_threads.later[0]
        self.steps = step_threads.measuring_later()
        self.next_try = now

    def due(self, now: float) -> bool:
        return now >= self.next_try

    def close(self) -> None:
        self.steps.close()

    def advance(self, engine, step_threads: StepThreads, now: float) -> tuple[bool, object | None]:
        """The next probe run, or a look whether one may run: (done, the model). Done
        without a model where it cannot be measured (it keeps the model it has)."""
        from hydrad.engine.profiler import NoProbeRoom

        # Probing is work: lenders are told so, as during a redeploy's probes.
        step_threads.lending.publish(True)
        try:
            waits = next(self.steps)
        except StopIteration as stop:
            return True, stop.value[1]
        except Exception as e:  # noqa: BLE001 (it serves on, by the model it has)
            return self._give_up(step_threads, f"{type(e).__name__}: {e}")
        if isinstance(waits, NoProbeRoom) and not engine.has_unfinished_requests():
            self.steps.close()  # nothing in flight gives room back
            return self._give_up(step_threads, str(waits))
        # One run at a time: the messages that came meanwhile are taken before the next.
        self.next_try = now if waits is None else now + RECONFIGURE_RETRY_SECONDS
        return False, None

    def _give_up(self, step_threads: StepThreads, why: str) -> tuple[bool, None]:
        logger.warning("the latency model at %s threads cannot be measured (it keeps the model it has): %s",
                       self.threads, why)
        step_threads.later.remove(self.threads)
        return True, None


class _PoolsAhead:
    """The pools a ``Reconfigure``'s new stages need (``EngineCore.pools_to_add``), made on a
    thread while the instance goes on stepping; ``expand`` then takes them as they are. Made
    in its ``expand``, between two steps, the image pool of a D instance taking on E and P
    (256 MiB in shared memory, every page touched) held all its streams for a second under
    load. Where making them fails, ``expand`` makes them itself (and says why it cannot)."""

    def __init__(self, engine, role: str):
        try:
            self.shapes = engine.pools_to_add(role)
        except Exception:  # noqa: BLE001 (expand meets the same error, and reports it)
            self.shapes = {}
        self.pools: dict = {}
        self.failed = False
        self._thread = None
        if self.shapes:
            self._thread = threading.Thread(target=self._make, args=(engine.runner,), name="hydrad-pools",
                                            daemon=True)
            self._thread.start()

    def _make(self, runner) -> None:
        import torch

        torch.set_num_threads(1)  # this thread's own: the instance's threads step beside it
        try:
            for kind, shape in self.shapes.items():
                self.pools[kind] = runner.new_pool(shape)
        except Exception:  # noqa: BLE001 (expand allocates them again, and reports the error)
            self.failed = True

    def ready(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def take(self) -> dict:
        pools = {} if self.failed else self.pools
        self.pools = {}
        return pools


# How often a worker looks whether the pools of a ``Reconfigure`` are made (between steps).
POOLS_POLL_SECONDS = 0.01


def _room(engine) -> tuple[int, int]:
    """Free blocks in the KV and image pools (0 where there is none)."""
    return tuple(pool.num_free_blocks if pool is not None else 0 for pool in (engine.kv_manager, engine.image_manager))


RECONFIGURE_RETRY_SECONDS = 0.2
# How often an idle worker looks whether a grammar it builds for a waiting request is done.
GRAMMAR_POLL_SECONDS = 0.002
# How long a borrower's model at its borrowed count waits, on end, for its lenders to be idle
# before it is left to later (``_MeasuredLater``).
LENDERS_PATIENCE = 2.0


def _later(step_threads: StepThreads) -> _MeasuredLater | None:
    """The next model a start or a redeploy left to later (or that a redeploy broke off,
    where it failed: nothing of the worker's threads and models changed then)."""
    if not step_threads.later:
        return None
    return _MeasuredLater(step_threads, time.monotonic())


def _not_reconfigured(engine, role: str, start: float, error: HydradError) -> Reconfigured:
    """The answer to a ``Reconfigure`` that failed for a reason the message says whole."""
    logger.warning("taking on role %s failed: %s", role, error)
    return Reconfigured(engine.instance_id, engine.role, time.monotonic() - start, error=str(error))


def run_worker(engine: Engine, conn: Connection, step_threads: StepThreads | None = None,
               exported: dict[int, HandleLedger] | None = None) -> None:
    """Serve messages and step the engine until ``Shutdown`` has been honoured. ``exported``:
    the pools' descriptors handed to each peer (``export_pools``), closed when it is detached."""
    exported = {} if exported is None else exported
    if step_threads is None:
        step_threads = StepThreads(engine, CoreLending(None, 0, CpuThreads(1)))
    live: set[str] = set()  # admitted and not finished: what a Shutdown may have to abort
    draining = False
    retiring_since: float | None = None  # a Retire is under way
    received = 0  # messages taken from the daemon (stamped on what is sent about requests)
    reconfiguring: _PendingReconfigure | None = None
    later = _later(step_threads)  # what its start left to later
    # New requests whose grammar (structured outputs) is being built off the step thread:
    # req_id -> (request, the message count when it came, the build); admitted when it is done.
    awaiting_grammar: dict[str, tuple[EngineRequest, int, Future]] = {}
    heap = HeapTrimmer()  # free memory of the C heap handed back between steps (engine.allocator)

    def admit(req_id: str, add, payload, stamp: int) -> None:
        try:
            add(payload)
        except ValueError as e:
            live.discard(req_id)
            conn.send(RequestRejected(req_id, str(e), getattr(e, "param", None), stamp))
        else:
            live.add(req_id)

    while True:
        for req_id in [r for r, (_, _, build) in awaiting_grammar.items() if build.done()]:
            request, stamp, _ = awaiting_grammar.pop(req_id)
            admit(req_id, engine.add_request, request, stamp)
        if retiring_since is not None and engine.drained():
            role = engine.shrink()
            bound = None
            if engine.scheduler.latency_model is not None:
                from hydrad.engine.latency_model import latency_bound

                bound = latency_bound(engine.config.slo, role)
                step_threads.set_bound(bound)
            conn.send(Retired(engine.instance_id, role, time.monotonic() - retiring_since, bound))
            retiring_since = None
        if draining and not engine.has_unfinished_requests() and not awaiting_grammar:
            return
        busy = engine.has_work()
        step_threads.lending.publish(busy)  # before blocking: an idle worker lends its cores
        # Block for messages only when there is nothing to step (and no probe to run or try
        # again, no grammar being built).
        timeout = 0 if busy else min((max(0.0, pending.next_try - time.monotonic())
                                      for pending in (reconfiguring, later) if pending is not None), default=None)
        if awaiting_grammar and not busy:
            timeout = GRAMMAR_POLL_SECONDS if timeout is None else min(timeout, GRAMMAR_POLL_SECONDS)
        if not busy and (trim_in := heap.due_in(time.monotonic())) is not None:  # wake to trim the heap
            timeout = trim_in if timeout is None else min(timeout, trim_in)
        while conn.poll(timeout):
            msg = conn.recv()
            received += 1
            timeout = 0
            if isinstance(msg, AddRequest):
                # A new request: it may not fit this instance, or wait for its grammar.
                req_id = msg.request.req_id
                build = engine.grammar_pending(msg.request)
                if build is None:
                    admit(req_id, engine.add_request, msg.request, received)
                else:
                    awaiting_grammar[req_id] = (msg.request, received, build)
                    live.add(req_id)
            elif isinstance(msg, Migrate):
                # Its grammar, where it has one, is started off this thread: its first step here
                # waits only for what is left of that build.
                engine.grammar_pending(msg.offer)
                admit(msg.offer.req_id, engine.add_migration, msg.offer, received)
            elif isinstance(msg, Abort):
                engine.abort_requests(msg.req_ids)
                live.difference_update(msg.req_ids)
                for req_id in msg.req_ids:
                    awaiting_grammar.pop(req_id, None)
            elif isinstance(msg, Release):
                engine.release(msg.req_ids)
                live.difference_update(msg.req_ids)
            elif isinstance(msg, AttachPeers):
                for peer_id, blob in msg.pools.items():
                    engine.attach_peer(peer_id, import_pools(blob))
            elif isinstance(msg, ExportPools):
                began = time.monotonic()
                moved = engine.share_pools()
                if moved:
                    logger.info("moved the cache pools (%d MiB) to shared memory in %.1f s, no step meanwhile",
                                moved >> 20, time.monotonic() - began)
                blob = export_pools(engine.pools(), (msg.peer_id,), exported)[msg.peer_id]
                conn.send(PoolsExported(engine.instance_id, msg.peer_id, blob))
            elif isinstance(msg, DetachPeer):
                engine.detach_peer(msg.peer_id)
                # The peer is gone: what it never fetched of the pools stays open otherwise.
                ledger = exported.pop(msg.peer_id, None)
                if ledger is not None:
                    ledger.release()
            elif isinstance(msg, Reconfigure):
                if reconfiguring is not None:  # superseded (the daemon stopped waiting for it)
                    reconfiguring.close()
                if later is not None:  # measured anew for the new role and threads
                    later.close()
                    later = None
                reconfiguring = _PendingReconfigure(msg, time.monotonic())
                answer = reconfiguring.answer(engine, step_threads, reconfiguring.start)
                if answer is not None:
                    conn.send(answer)
                    reconfiguring = None
                    later = _later(step_threads)
            elif isinstance(msg, Retire):
                engine.retire(msg.stages)
                retiring_since = time.monotonic()
            elif isinstance(msg, GetStats):
                conn.send(StatsReply(msg.seq, engine.get_stats()))
            elif isinstance(msg, Shutdown):
                if not msg.finish_running and live:
                    awaiting_grammar.clear()
                    engine.abort_requests(list(live))
                    conn.send(StepOutput(EngineOutput(finished=[FinishedRequest(r, "abort") for r in sorted(live)]),
                                         received=received))
                    live.clear()
                draining = True
            else:
                raise TypeError(f"unexpected message {type(msg).__name__}")
        if busy:
            step_threads.before_step()
        output = engine.step() if busy else EngineOutput()
        offers, pulled = engine.take_offers(), engine.take_pulled()
        if output or output.timing is not None or offers or pulled:
            live.difference_update(f.req_id for f in output.finished)
            # Moved whole, or passed on without being pulled here: nothing of them is held here.
            live.difference_update(o.req_id for o in offers if o.kind == "prompt" or o.source != engine.instance_id)
            conn.send(StepOutput(output, offers, pulled, time.monotonic(), received))
        if busy:
            heap.stepped()
        now = time.monotonic()
        heap.maybe(now)
        if reconfiguring is not None and reconfiguring.due(engine, now):
            answer = reconfiguring.answer(engine, step_threads, now)
            if answer is not None:
                conn.send(answer)
                reconfiguring = None
                later = _later(step_threads)
        elif later is not None and reconfiguring is None and later.due(now):
            done, model = later.advance(engine, step_threads, now)
            if done:
                if model is not None:
                    conn.send(ModelMeasured(engine.instance_id, later.threads, model,
                                            borrowed=later.threads != step_threads.lending.threads.own))
                later = _later(step_threads)
