"""Worker processes driven synchronously: the engine of ``hydrad.LLM`` for deployments
of several instances.

The supervisor, the worker pipes, the request table and the migration relay are
the daemon's own; they run on a private event loop in a background thread, and
``step()`` hands the caller every delta that has arrived since the last call.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Iterable

from hydrad.cluster.launch import plan_specs
from hydrad.cluster.supervisor import Supervisor
from hydrad.config import EngineConfig
from hydrad.engine.inputs import EngineOutput, EngineRequest, FinishedRequest
from hydrad.errors import RequestError

# How long step() waits for a delta before it lets the caller look again.
_POLL_SECS = 0.5


class ProcessCluster:
    def __init__(self, config: EngineConfig, instances: list[tuple[str, str]], *, policy: str = "round-robin",
                 console=None):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hydrad-workers", daemon=True)
        self._thread.start()
        try:
            self.supervisor = self._call(self._create_supervisor(config, instances, policy))
            readies = self._call(self.supervisor.start(console))
        except BaseException:
            self._stop_loop()
            raise
        self.router = self.supervisor.router
        self.max_model_len = min(r.max_model_len for r in readies)
        self._deltas: queue.SimpleQueue = queue.SimpleQueue()
        # Requests submitted and not yet finished as seen by the caller (set only from its thread).
        self._open: set[str] = set()

    @staticmethod
    async def _create_supervisor(config: EngineConfig, instances: list[tuple[str, str]], policy: str) -> Supervisor:
        # Created on the private loop: its futures belong to it.
        return Supervisor(config, plan_specs(instances), router_policy=policy)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # -- the engine interface ------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        for image in req.images:
            image.pixel_values.share_memory_()  # crosses to the worker as a handle, not bytes
        if req.mrope_positions is not None:
            req.mrope_positions.share_memory_()
        self._call(self._submit(req))
        self._open.add(req.req_id)

    async def _submit(self, req: EngineRequest) -> None:
        entry = self.router.select(has_images=bool(req.images), request=req)
        entry.add_request(req, _Forward(req.req_id, self._deltas))

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        req_ids = [r for r in req_ids if r in self._open]
        self._open.difference_update(req_ids)
        if req_ids:
            self._loop.call_soon_threadsafe(lambda: [self.supervisor.table.abort(r) for r in req_ids])

    def has_unfinished_requests(self) -> bool:
        return bool(self._open)

    def step(self) -> EngineOutput:
        """The tokens that arrived since the last call (waiting briefly for the first)."""
        try:
            items = [self._deltas.get(timeout=_POLL_SECS)]
        except queue.Empty:
            return EngineOutput()
        while True:
            try:
                items.append(self._deltas.get_nowait())
            except queue.Empty:
                break
        output = EngineOutput()
        for req_id, kind, value, extra in items:
            if req_id not in self._open:
                continue  # aborted by the caller meanwhile
            if kind == "error":
                self.abort_requests([req_id])
                if isinstance(value, RequestError):
                    raise ValueError(str(value))
                raise RuntimeError(f"request {req_id}: {value}")
            if kind == "token":
                if extra is not None and output.logprobs is None:
                    output.logprobs = [None] * len(output.req_ids)
                output.req_ids.append(req_id)
                output.token_ids.append(value)
                if output.logprobs is not None:
                    output.logprobs.append(extra)
            else:
                self._open.discard(req_id)
                output.finished.append(FinishedRequest(req_id, value, *extra))
        return output

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._call(self.supervisor.stop())
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


class _Forward:
    """The request table's sink for one request: hands its outputs to the caller's thread."""

    def __init__(self, req_id: str, outputs: queue.SimpleQueue):
        self.req_id = req_id
        self.outputs = outputs

    def on_token(self, token_id, logprobs) -> None:
        self.outputs.put((self.req_id, "token", token_id, logprobs))

    def on_finish(self, finish_reason, stage_times, num_cached_tokens=0) -> None:
        self.outputs.put((self.req_id, "finish", finish_reason, (stage_times, num_cached_tokens)))

    def on_error(self, error) -> None:
        self.outputs.put((self.req_id, "error", error, None))
