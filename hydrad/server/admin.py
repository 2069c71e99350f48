"""The admin API (``GET /admin/status``), read by ``hydractl status``.

Open to loopback clients; others need ``Authorization: Bearer <server.admin_token>``.
Front-end processes pass these requests on over the daemon's private Unix socket
after making that check themselves.
Instance numbers are fresh: each call asks every worker for its ``EngineStats``.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import socket
import time

from aiohttp import web

from hydrad.engine.inputs import EngineStats
from hydrad.cluster.usage import ProcessUsage, UsageWindow
from hydrad.cluster.worker_client import WorkerClient, WorkerLost
from hydrad.server.errors import APIError


def check_admin_access(request: web.Request, admin_token: str) -> None:
    if _on_private_socket(request):  # from a front-end process, which checked the client
        return
    try:
        if request.remote and ipaddress.ip_address(request.remote).is_loopback:
            return
    except ValueError:
        pass
    given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    if admin_token and given and hmac.compare_digest(given, admin_token):
        return
    raise APIError(403, "the admin API accepts loopback connections or the admin token only")


def _on_private_socket(request: web.Request) -> bool:
    """The request came over the daemon's Unix socket (in a folder only its user can open)."""
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    return sock is not None and sock.family == socket.AF_UNIX


async def instance_stats(clients: list[WorkerClient], timeout: float = 2.0) -> list[EngineStats | None]:
    """Fresh stats per instance; None for an instance that is down or does not answer."""

    async def one(client: WorkerClient) -> EngineStats | None:
        try:
            return await client.get_stats(timeout)
        except (WorkerLost, asyncio.TimeoutError):
            return None

    return list(await asyncio.gather(*(one(c) for c in clients)))


def pid_of(client: WorkerClient) -> int | None:
    """The process of a live worker (None: down, or not ready yet)."""
    return client.ready.pid if client.ready is not None and client.alive else None


def worker_pids(clients: list[WorkerClient]) -> list[int]:
    return [pid for c in clients if (pid := pid_of(c)) is not None]


def _reading(client: WorkerClient, usage: UsageWindow | None) -> tuple[int, ProcessUsage] | None:
    """A live worker's pid and what the daemon last read of its process (None: down, or not read)."""
    pid = pid_of(client)
    latest = usage.latest(pid) if usage is not None and pid is not None else None
    return None if latest is None else (pid, latest)


def worker_usage(clients: list[WorkerClient], usage: UsageWindow) -> dict[int, ProcessUsage]:
    """instance -> its live worker's CPU time and memory, as last read (for ``/metrics``)."""
    return {c.instance_id: reading[1] for c in clients if (reading := _reading(c, usage)) is not None}


def _usage(client: WorkerClient, usage: UsageWindow | None) -> dict:
    """The worker process's share of a core over the last seconds, its resident memory and how
    much of that is shared memory (cache pools other processes map too)."""
    reading = _reading(client, usage)
    if reading is None:
        return {"cpu_share": None, "rss_bytes": None, "shared_bytes": None}
    pid, latest = reading
    return {"cpu_share": usage.cpu_share(pid), "rss_bytes": latest.rss_bytes, "shared_bytes": latest.shared_bytes}


def _latency(ready) -> dict:
    """The instance's latency model: its bound, a one-line summary and its held-out error."""
    model = ready.latency_model if ready is not None else None
    if model is None:
        return {"latency_model": None, "latency_bound": None, "latency_error": None, "borrow_latency_model": None}
    error = model.error
    borrow = getattr(ready, "borrow_model", None)
    return {
        "latency_model": model.summary(),
        "latency_bound": ready.latency_bound,
        "latency_error": {"median": error.median, "max": error.max, "num_probes": error.num_probes} if error else None,
        # On borrowed cores too (engine.cores); None when it never borrows, or until it is
        # measured between its steps (after the start, or after a redeploy that found its
        # lenders busy: worker._MeasuredLater): its own model stands in meanwhile.
        "borrow_latency_model": borrow.summary() if borrow is not None else None,
    }


def _state(client: WorkerClient, stats: EngineStats | None, supervisor) -> str:
    if client.instance_id in supervisor.crash_loops:
        return "crash loop"
    if client.instance_id in supervisor.restarting:
        return "restarting"
    if stats is not None:
        return "ready"
    return "unresponsive" if client.alive else "down"


def status_body(supervisor, stats: list[EngineStats | None], *, model: str,
                max_model_len: int, started: float, num_requests: int, window: dict,
                usage: UsageWindow | None = None) -> dict:
    """``num_requests``: requests in flight; an instance's ``num_inflight`` also counts
    those migrating to or from it, so the per-instance numbers may add up to more.
    ``usage``: the workers' CPU and memory, as the daemon's monitor last read them."""
    instances = []
    for client, s in zip(supervisor.clients, stats):
        instances.append({
            "id": client.instance_id,
            "device": client.device,
            "role": client.role,
            "dtype": getattr(client.ready, "dtype", None),  # what its model runs in (hydrad.dtypes)
            # On a CPU: its torch threads, and those it borrows while the instances it borrows from idle.
            "threads": supervisor.specs[client.instance_id].threads.own if client.device == "cpu" else None,
            "borrowed_threads": supervisor.specs[client.instance_id].threads.borrow if client.device == "cpu" else None,
            "pid": client.ready.pid if client.ready else None,
            # Its process: CPU seconds per second over the last seconds (1.0: one core), resident
            # memory now and the shared part of it (pools in /dev/shm, counted by each process mapping them).
            **_usage(client, usage),
            "state": _state(client, s, supervisor),
            "restarts": supervisor.num_restarts.get(client.instance_id, 0),
            "num_inflight": client.num_inflight,
            "num_running": s.num_running if s else None,
            "num_waiting": s.num_waiting if s else None,
            "kv_usage": s.kv_usage if s else None,
            "image_usage": s.image_usage if s else None,
            "num_kv_blocks_used": s.num_kv_blocks_used if s else None,
            "num_image_blocks_used": s.num_image_blocks_used if s else None,
            "num_preemptions": s.num_preemptions if s else None,
            # Prefix caching: tokens looked up and found, images not encoded, blocks kept now.
            "prefix_cache_queries": s.prefix_cache_queries if s else None,
            "prefix_cache_hits": s.prefix_cache_hits if s else None,
            "prefix_cache_images": s.images_cached if s else None,
            "num_kv_blocks_cached": s.num_kv_blocks_cached if s else None,
            "latency_calibration": s.latency_calibration if s else None,
            # Measured / predicted seconds of its recent steps, by kind of work.
            "live_speed": s.live_speed if s else None,
            "live_speed_steps": s.live_speed_steps if s else None,
            "live_speed_spread": s.live_speed_spread if s else None,
            # A worker that is down makes no tokens, whatever it made in its last seconds.
            "tokens_per_second": (None if not client.alive else
                                  client.tokens_per_second() if client.accepting else 0.0),
            **_latency(client.ready),
        })
    table = supervisor.table
    return {
        "model": model,
        "max_model_len": max_model_len,
        "uptime_seconds": time.monotonic() - started,
        "instances": instances,
        "requests": {"num_inflight": num_requests, **window},
        # Since start: workers restarted, and what became of the requests they held.
        "failures": {
            "worker_restarts": sum(supervisor.num_restarts.values()),
            "requests_run_again": table.num_run_again,
            "requests_lost": table.num_lost,
            "rerun_image_bytes": table.kept_image_bytes,
            "quarantined": len(table.quarantine),
            "requests_refused_quarantined": table.quarantine.num_refused,
        },
    }
