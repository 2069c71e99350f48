"""Every message that crosses the daemon <-> worker pipes (and the daemon <-> front-end
process pipes, at the end), grouped by direction.

Messages are small records of ids and diffs. A request travels to a worker once,
in ``AddRequest`` (its pixel tensors in shared memory, so only handles are
pickled); afterwards only ids (``Abort``, ``Release``), per-step token diffs
(``StepOutput``) and migration offers (``Migrate``: block ids, not blocks)
cross. Messages are pickled by torch's multiprocessing pickler, which carries
``share_memory_()`` tensors as shared-memory handles.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydrad.engine.cores import CpuThreads
from hydrad.engine.inputs import EngineOutput, EngineRequest, EngineStats
from hydrad.engine.migration import MigrationOffer, Pulled

# -- daemon -> worker ----------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    """Schedule a new request; its pixel tensors must already be in shared memory."""

    request: EngineRequest


@dataclass(frozen=True)
class Abort:
    """Drop these requests at once and free their blocks; no further deltas follow."""

    req_ids: tuple[str, ...]


@dataclass(frozen=True)
class GetStats:
    """Ask for an ``EngineStats`` snapshot; the reply carries the same ``seq``."""

    seq: int


@dataclass(frozen=True)
class Shutdown:
    """Exit. With ``finish_running`` the worker first runs its requests to the end;
    without, it aborts them (reporting each with finish_reason ``"abort"``)."""

    finish_running: bool = False


@dataclass(frozen=True)
class AttachPeers:
    """Other instances' cache pools, exported once at start, for pull-based migration.

    ``pools[instance_id]`` is that instance's ``{"kv": tensor, "image": tensor}``
    pickled by torch's multiprocessing pickler for this receiver alone (shared
    memory on CPU, CUDA IPC on GPU); the daemon forwards the bytes unopened.
    """

    pools: dict[int, bytes]


@dataclass(frozen=True)
class ExportPools:
    """Pickle this instance's cache pools for instance ``peer_id`` (a peer that was
    restarted or changed its pools) and send them back in ``PoolsExported``."""

    peer_id: int


@dataclass(frozen=True)
class DetachPeer:
    """Instance ``peer_id`` is gone: drop its pools (nothing is pulled from it any more)."""

    peer_id: int


@dataclass(frozen=True)
class Reconfigure:
    """Take on the stages of ``role`` too (live redeploy, phase 1): build the model parts and
    pools they need while serving the current stages; answered by ``Reconfigured``.
    ``threads``: a CPU instance's torch threads from now on (``engine.cores.CpuThreads``:
    its share of the cores and what it borrows change with the deployment). ``wait``: seconds
    within which the instance measures the latency models of the new role or threads between
    its steps, serving meanwhile, and waits while its pools have no room for a probe or
    another worker is measuring on the same cores; past it, the probes left run at once and
    what it still waits for is the answer (0: all at once, at the message). ``borrowed``:
    measure its model on the cores it borrows too (False: only take it from the cache, where
    its threads change right after, as a redeploy's next step gives them)."""

    role: str
    threads: CpuThreads | None = None
    wait: float = 0.0
    borrowed: bool = True


@dataclass(frozen=True)
class Retire:
    """Hand ``stages`` over to other instances (live redeploy, phase 2); once nothing here
    needs them, drop them and answer ``Retired``."""

    stages: str


@dataclass(frozen=True)
class Migrate:
    """Target side: queue this request at the head; pull its blocks when it is scheduled."""

    offer: MigrationOffer


@dataclass(frozen=True)
class Release:
    """Source side: these requests' blocks were copied by their target (or are no longer
    wanted): free them."""

    req_ids: tuple[str, ...]


# -- worker -> daemon ----------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerReady:
    """Weights loaded and caches allocated: the worker takes requests from now on."""

    instance_id: int
    pid: int
    max_model_len: int
    load_seconds: float
    # The fitted latency model (hydrad.engine.latency_model.LatencyModel) and the step
    # bound it fills steps to; None when steps are sized by fixed budgets only.
    latency_model: object | None = None
    latency_bound: float | None = None
    # Its blocks (hydrad.engine.core.PoolGeometry) and the bytes per second of its block
    # copy (None: no KV pool), which the planner replays deployments with.
    geometry: object | None = None
    copy_bandwidth: float | None = None
    # This instance's pools pickled once per peer (peer instance id -> bytes), when the
    # deployment migrates requests between instances.
    pools: dict[int, bytes] = field(default_factory=dict)
    # The latency model while it runs on borrowed cores too (``engine.cores``); None when
    # it never borrows.
    borrow_model: object | None = None
    # Its image cache (blocks, slots per block); None: it holds none. The front ends refuse a
    # request whose images one of them could never hold.
    image_cache: tuple[int, int] | None = None
    # The dtype its model runs in ("float32", "bfloat16", "float16": ``hydrad.dtypes``).
    dtype: str | None = None


@dataclass(frozen=True)
class StepOutput:
    """One engine step: its tokens as columns (``EngineOutput``), migrations, timing."""

    output: EngineOutput = field(default_factory=EngineOutput)
    # Requests whose next stage runs elsewhere (the daemon picks the target).
    offers: list[MigrationOffer] = field(default_factory=list)
    # Every pull finished in this step.
    pulled: list[Pulled] = field(default_factory=list)
    # time.monotonic() when the worker sent it (one clock for every process of the machine),
    # so the daemon sees how long step outputs wait to be read; 0: not stamped.
    sent_at: float = 0.0
    # How many messages the worker had taken from the daemon when this step began (each is
    # applied as it is taken, between steps): the daemon drops what a step says of a request
    # it had aborted there since, which the worker had not read yet (``WorkerClient``).
    received: int = 0


@dataclass(frozen=True)
class PoolsExported:
    """This instance's pools, pickled for ``peer_id`` alone (answer to ``ExportPools``)."""

    instance_id: int
    peer_id: int
    blob: bytes


@dataclass(frozen=True)
class Reconfigured:
    """The answer to ``Reconfigure``: the instance's role now and its latency model and bound
    (``error`` says why it could not, in one line; the role is then unchanged)."""

    instance_id: int
    role: str
    seconds: float
    latency_model: object | None = None
    latency_bound: float | None = None
    error: str | None = None
    geometry: object | None = None
    borrow_model: object | None = None  # as WorkerReady's


@dataclass(frozen=True)
class ModelMeasured:
    """A latency model the worker's start (or a redeploy) left to later, measured between
    its steps: at the count a CPU instance borrows idle cores up to (``borrowed``:
    ``WorkerReady.borrow_model`` from now on), or at its own share, where the machine's
    speed moved while its start measured it (``WorkerReady.latency_model``)."""

    instance_id: int
    threads: int
    model: object
    borrowed: bool


@dataclass(frozen=True)
class Retired:
    """The answer to ``Retire``: the retired stages are dropped; the instance's role now."""

    instance_id: int
    role: str
    seconds: float
    latency_bound: float | None = None


@dataclass(frozen=True)
class StatsReply:
    seq: int
    stats: EngineStats


@dataclass(frozen=True)
class RequestRejected:
    """The engine refused a request at admission (e.g. it can never fit the caches)."""

    req_id: str
    message: str
    # The request field at fault, when known.
    param: str | None = None
    # As ``StepOutput.received``: the messages taken, this request's among them.
    received: int = 0


@dataclass(frozen=True)
class WorkerFailed:
    """The worker hit an unrecoverable error (at start or in a step) and is exiting."""

    instance_id: int
    message: str
    traceback: str = ""


DaemonToWorker = (AddRequest | Abort | GetStats | Shutdown | AttachPeers | ExportPools | DetachPeer | Migrate
                  | Release | Reconfigure | Retire)
WorkerToDaemon = (WorkerReady | StepOutput | StatsReply | PoolsExported | Reconfigured | Retired | RequestRejected
                  | WorkerFailed)


# -- daemon <-> front-end process ([server] frontend_processes > 1) ---------------------------
# A front-end process parses HTTP, prepares requests and streams their tokens; the daemon
# (the first process) routes them to the instances and relays their outputs back. The
# request table's ``Abort`` travels from the front end as it does to a worker.


@dataclass(frozen=True)
class FrontendReady:
    """The front-end process ``index`` has loaded its Request Processor and listens."""

    index: int
    pid: int


@dataclass(frozen=True)
class Listen:
    """The workers are ready: serve ``host:port`` (``SO_REUSEPORT``), pass ``/health``,
    ``/metrics`` and ``/admin/*`` to the daemon at ``socket_path``."""

    host: str
    port: int
    socket_path: str
    max_model_len: int
    # The workers' image caches, (blocks, slots per block) each (``WorkerReady.image_cache``).
    image_caches: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Submit:
    """Route this completion to an instance; the daemon answers ``Admitted``."""

    request: EngineRequest  # its arrival_time is the front end's time.monotonic() (one clock per host)
    key: int  # the front end's number for it: its outputs come back under this key


@dataclass(frozen=True)
class Admitted:
    """The answer to ``Submit``: the request is on an instance, or ``error`` says why not
    (the exception the router or the request table raised)."""

    key: int
    error: Exception | None = None


@dataclass(frozen=True)
class Deltas:
    """What the daemon's delivery passes produced for one front end's requests since the
    last ``Deltas``, as columns: a token per entry of ``keys`` (``Submit.key``), then the
    ends in order. An end is ``(key, finish_reason, stage_times, route, error,
    num_cached_tokens)``: a finish (``error`` None) or a failure (``finish_reason`` None);
    ``route`` lists the instances the request went through."""

    keys: list[int]
    token_ids: list[int]
    logprobs: list | None
    ends: list[tuple]


@dataclass(frozen=True)
class TraceFacts:
    """A finished request's facts for the daemon's request trace (``TraceWriter.record``)."""

    facts: dict


@dataclass(frozen=True)
class KeptQuery:
    """A front end's call on the daemon's response store (``server.response_store``): ``op``
    "keep" (``arg`` a ``KeptResponse``), or "get", "delete", "items", "inputs" (``arg`` a
    response id); answered by ``KeptAnswer`` with the same ``seq``."""

    seq: int
    op: str
    arg: object


@dataclass(frozen=True)
class KeptAnswer:
    seq: int
    result: object  # what ``ResponseStore.answer`` returned


@dataclass(frozen=True)
class GetSnapshot:
    seq: int


@dataclass(frozen=True)
class Snapshot:
    """The answer to ``GetSnapshot``: the front end's metric families (prometheus_client
    ``Metric`` objects), its monitor's status and its rolling window's recent samples."""

    seq: int
    families: list
    monitor: dict
    window: dict


@dataclass(frozen=True)
class Drain:
    """Refuse new requests, let those in flight run up to ``timeout`` seconds, abort the
    rest, then exit."""

    reason: str
    timeout: float


DaemonToFrontend = Listen | Admitted | Deltas | GetSnapshot | Drain | Shutdown
FrontendToDaemon = FrontendReady | Submit | Abort | TraceFacts | Snapshot
