"""Pull-based migration between instances (HydraInfer §4.3), the engine's side.

The protocol, for a request whose next stage runs on another instance:

1. **offer** — the source's scheduler hands the request over (``MigrationOffer``: ids,
   block ids, the request's state; no data) and keeps its blocks;
2. the control plane picks a target holding the next stage and hands it the offer;
3. **pull** — the target queues the request at the head of its queue; when it
   schedules it, it allocates its own blocks (it never receives data it has no room
   for) and copies the source's blocks straight out of the source's pool
   (``PullCopier``, on a copy thread / CUDA stream), then reports ``Pulled``;
4. **release** — the control plane tells the source, which frees the blocks.

Pools are shared once at start (``export_pools``): shared memory on CPU, CUDA IPC
handles on GPU. The relay between instances is ``hydrad.cluster.relay``.
"""

from __future__ import annotations

import dataclasses
import pickle
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from hydrad.engine.inputs import ImageInput
from hydrad.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from hydrad.engine.request import Request
    from hydrad.transport.sharing import HandleLedger

# Idle wait for a copy to finish when a step has nothing else to do.
PULL_POLL_SECS = 0.005
# A pull whose copy is predicted to take at most this share of the instance's step bound
# is waited for before the step is built, so the pulled request runs in that very step
# instead of the next one (a copy of an image or a short prompt's KV takes milliseconds,
# a step up to the bound).
QUICK_PULL_SHARE = 0.1


def quick_pull_seconds(step_bound: float) -> float:
    """The longest predicted copy a step waits for (``QUICK_PULL_SHARE`` of its bound)."""
    return QUICK_PULL_SHARE * step_bound


@dataclass
class MigrationOffer:
    """A request whose next stage runs on another instance.

    The source keeps the blocks until the target has copied them and says so; the
    target allocates its own blocks when it schedules the request, then copies
    ``block_ids`` straight out of the source's pool.
    """

    req_id: str
    source: int  # instance id of the source
    # "image" (encode -> prefill), "kv" (prefill -> decode), or "prompt": a request that has
    # not started here (nothing computed, no blocks) moves whole, its images' pixels with it.
    kind: str
    # kind "image": one block list per image; kind "kv": the KV blocks of num_computed_tokens.
    block_ids: list
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    images: list[ImageInput]  # placements and layouts only (pixel_values None)
    eos_token_ids: tuple[int, ...]
    # Seeded sampling continues where it stopped: torch.Generator.get_state().
    generator_state: torch.Tensor | None
    # Monotonic timestamps (system-wide clock) and exec seconds so far, for the latency breakdown.
    timeline: dict[str, float]
    # M-RoPE models: the prompt's positions and the generated tokens' delta, as computed once by
    # the processor (``EngineRequest.mrope_positions``); they travel, never recomputed.
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0
    # When its latest token was sampled (system-wide monotonic clock): the target's next
    # token is due one TBT after it (``Scheduler``'s deadlines). None: no token yet.
    last_token_time: float | None = None
    # Its gaps between two tokens so far that passed the step bound (``Request.num_long_gaps``).
    num_long_gaps: int = 0
    # Prompt tokens the request found cached where its prefill started (None: not there yet).
    num_cached_tokens: int | None = None
    # One of a prompt's ``n`` completions (``EngineRequest.group``): the router sends each
    # stage of them to one instance.
    group: str | None = None

    @property
    def next_stage(self) -> str:
        if self.kind == "prompt":
            return "E" if self.images else "P"
        return "P" if self.kind == "image" else "D"


@dataclass(frozen=True)
class Pulled:
    """A target finished copying ``req_id``'s blocks out of instance ``source``."""

    req_id: str
    source: int


@dataclass
class Pull:
    """Copy ``src_block_ids`` of instance ``source``'s pool into our ``dst_block_ids``."""

    req: Request
    kind: str  # "image" or "kv"
    source: int
    src_block_ids: list[int]
    dst_block_ids: list[int]


def offer_for(req: Request, kind: str, instance_id: int) -> MigrationOffer:
    """The offer of a request whose ``kind`` stage ("image" or "kv") is done here, or that
    moves before it started ("prompt"); "forward": an offer this instance received and will
    not pull (the stage it was offered for is being handed over here), passed on as it came,
    its blocks still at its source."""
    if kind == "forward":
        pull_kind, source, block_ids, num_computed = req.pull
        return dataclasses.replace(offer_for(req, pull_kind, source), block_ids=list(block_ids),
                                   num_computed_tokens=num_computed)
    if kind == "prompt":
        block_ids: list = []
    else:
        block_ids = [list(ids) for ids in req.image_block_ids] if kind == "image" else list(req.kv_block_ids)
    return MigrationOffer(
        req_id=req.req_id,
        source=instance_id,
        kind=kind,
        block_ids=block_ids,
        prompt_token_ids=req.prompt_token_ids,
        output_token_ids=list(req.output_token_ids),
        num_computed_tokens=req.num_computed_tokens,
        sampling_params=req.sampling_params,
        # The layout (grid, size, patches) stays: the target schedules by it. A request that
        # has not started takes its pixels along (shared memory: handles, not bytes).
        images=list(req.images) if kind == "prompt" else [dataclasses.replace(image, pixel_values=None)
                                                          for image in req.images],
        eos_token_ids=tuple(sorted(req.eos_token_ids)),
        generator_state=req.generator.get_state() if req.generator is not None else None,
        timeline=dict(req.timeline),
        mrope_positions=req.mrope_positions,
        mrope_delta=req.mrope_delta,
        last_token_time=req.last_token_time,
        num_long_gaps=req.num_long_gaps,
        num_cached_tokens=req.num_cached_tokens,
        group=req.group,
    )


def export_pools(pools: dict[str, torch.Tensor | None], peer_ids,
                 ledgers: dict[int, HandleLedger] | None = None) -> dict[int, bytes]:
    """Pickle the pools once per peer: each pickle hands out its shared-memory file
    descriptors (or CUDA IPC handles) to exactly one receiver. ``ledgers[peer]`` records the
    descriptors handed to ``peer`` (made if missing), to close those it never fetches."""
    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

    from hydrad.transport.sharing import HandleLedger, dumps_recording

    ledgers = {} if ledgers is None else ledgers
    return {peer: dumps_recording(pools, ledgers.setdefault(peer, HandleLedger())) for peer in peer_ids}


def import_pools(blob: bytes) -> dict[str, torch.Tensor | None]:
    """A peer's pools from ``export_pools``'s bytes: views of the peer's memory."""
    return pickle.loads(blob)


class PullCopier:
    """Runs the copies of pulls on a thread (and a CUDA stream on GPU), off the step."""

    def __init__(self, device: torch.device, copy_in: Callable[[str, torch.Tensor, list[int], list[int]], None]):
        # torch is imported where copies run: the scheduler and the planner's simulator use
        # this module's records (offers, pulls) and import no torch.
        import torch

        self._copy_in = copy_in
        self.peers: dict[int, dict[str, torch.Tensor | None]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hydrad-copy")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._inflight: list[tuple[Future, Pull]] = []

    @property
    def busy(self) -> bool:
        return bool(self._inflight)

    def start(self, pull: Pull) -> None:
        if pull.source not in self.peers:
            raise ValueError(f"instance {pull.source} is not attached as a peer")
        self._inflight.append((self._pool.submit(self._copy, pull), pull))

    def _copy(self, pull: Pull) -> None:
        src_pool = self.peers[pull.source][pull.kind]
        if self._stream is None:
            self._copy_in(pull.kind, src_pool, pull.src_block_ids, pull.dst_block_ids)
            return
        import torch

        with torch.cuda.stream(self._stream):
            self._copy_in(pull.kind, src_pool, pull.src_block_ids, pull.dst_block_ids)
        self._stream.synchronize()

    def wait_all(self) -> None:
        """Block until every copy started so far is done."""
        wait([f for f, _ in self._inflight])

    def finished(self, block: bool) -> list[Pull]:
        """The pulls whose copy is done (waiting briefly for one when ``block``)."""
        if block and self._inflight:
            wait([f for f, _ in self._inflight], timeout=PULL_POLL_SECS, return_when=FIRST_COMPLETED)
        done, still = [], []
        for future, pull in self._inflight:
            if not future.done():
                still.append((future, pull))
                continue
            future.result()  # a failed copy is a bug: let it surface
            done.append(pull)
        self._inflight = still
        return done

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
