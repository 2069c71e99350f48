"""Workers launched before the daemon's own imports: planning and launching import neither
torch nor transformers, the supervisor adopts the launched workers, the ones no
supervisor took are stopped, and a port that cannot be bound is said before any loads."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from hydrad.cluster import launch
from hydrad.cluster.launch import launch_all, plan_specs, stop_unadopted
from hydrad.cluster.preflight import check_listen
from hydrad.engine.cores import CpuThreads
from hydrad.cluster.supervisor import Supervisor
from hydrad.config_file import load_config
from hydrad.errors import HydradError

NO_GPU_DRIVER = not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd"))


def test_planning_the_instances_and_launching_imports_no_torch(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from hydrad.config_file import load_config
        from hydrad.cluster.deploy import plan_instances
        from hydrad.cluster.launch import cuda_device_count, launch_worker, plan_specs
        from hydrad.cluster.preflight import check_memory, check_shared_memory
        from hydrad.models.default import resolve_model_path
        from hydrad.planner.auto import choose_deployment

        config = load_config(None, {{"model.path": {str(tmp_path)!r}, "parallel.devices": "cpu:2"}})
        assert resolve_model_path(config.engine.model.path).is_dir()
        assert cuda_device_count("cpu:2") == 0
        assert len(plan_specs(plan_instances("1EP+1D", "cpu:2", 0))) == 2
        check_shared_memory(config.engine.cache, ["cpu"], True)
        check_memory(config.engine, ["cpu"], resolve_model_path(config.engine.model.path))
        if {NO_GPU_DRIVER}:
            assert cuda_device_count("auto") == 0
            assert choose_deployment(config)[0] == "2EPD"  # no trace in a fresh state folder
        print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
    """)
    # A fresh state folder: the suite's own (HYDRAD_STATE_DIR, which would win) holds the traces
    # of every daemon started before this test.
    env = {k: v for k, v in os.environ.items() if k != "HYDRAD_STATE_DIR"}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def engine_config(model_dir):
    return load_config(None, {"model.path": str(model_dir), "scheduler.derive_budgets": False}).engine


def test_the_supervisor_adopts_the_launched_worker(tiny_llava_dir):
    config = engine_config(tiny_llava_dir)
    specs = plan_specs([("EPD", "cpu")])
    launched = launch_all(config, specs)
    process = launched[0].process

    async def main():
        supervisor = Supervisor(config, specs, launched=launched)
        try:
            readies = await supervisor.start()
            assert [r.pid for r in readies] == [process.pid]
            assert supervisor.process(0) is process
            assert launched == {}  # taken over: nothing left for stop_unadopted
        finally:
            await supervisor.stop()

    try:
        asyncio.run(main())
    finally:
        stop_unadopted(launched)
    process.join(10)
    assert process.exitcode == 0


@pytest.mark.parametrize("free_mb", [4096, 100])
def test_cpu_workers_make_their_pools_shared_where_requests_move_or_dev_shm_has_room(tiny_llava_dir, tmp_path,
                                                                                     monkeypatch, free_mb):
    """What each worker is started with (its peers, and whether its pools are made in shared
    memory): 2EPD moves no request, but with room in /dev/shm for both pools (768 MiB each
    by default) they are made there, for a redeploy that would move requests; one that moves
    requests always makes them there (its start is refused before any worker loads when they
    do not fit: ``check_shared_memory``); one instance never."""
    from types import SimpleNamespace

    from hydrad.cluster import preflight

    monkeypatch.setattr(preflight, "SHM", str(tmp_path))
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=free_mb * 256, f_frsize=4096))
    started = []
    monkeypatch.setattr(launch, "_launch", lambda workers, board: started.append(
        [(spec.instance_id, peers, shared) for _, spec, peers, shared in workers]) or [None] * len(workers))
    config = engine_config(tiny_llava_dir)
    launch_all(config, plan_specs([("EPD", "cpu"), ("EPD", "cpu")]))
    launch_all(config, plan_specs([("EP", "cpu"), ("D", "cpu")]))
    launch_all(config, plan_specs([("EPD", "cpu")]))
    room = free_mb >= 2 * 768 + preflight.SHM_SPARE_MB
    assert started == [[(0, (), room), (1, (), room)], [(0, (1,), True), (1, (0,), True)], [(0, (), False)]]


def test_pools_made_shared_at_start_are_not_moved_when_shared_again(tiny_llava_dir):
    """A redeploy asks each worker to share its pools (``ExportPools``): pools made private
    are moved to shared memory then (the bytes moved are returned, and the worker logs them);
    pools made there at the start are not moved again."""
    from hydrad.engine.core import EngineCore

    config = load_config(None, {"model.path": str(tiny_llava_dir), "scheduler.derive_budgets": False,
                                "cache.num_kv_blocks": 64, "cache.num_image_blocks": 8}).engine
    private = EngineCore(config, role="EPD", device="cpu", instance_id=0)
    kv = private.runner.kv_cache
    kv.view(-1)[:3] = 7.0
    assert not kv.is_shared()
    assert private.share_pools() == kv.untyped_storage().nbytes() + private.runner.image_cache.untyped_storage().nbytes()
    assert private.runner.kv_cache.is_shared() and private.runner.kv_cache.view(-1)[:3].tolist() == [7.0] * 3
    assert private.share_pools() == 0
    shared = EngineCore(config, role="EPD", device="cpu", instance_id=1, shared_pools=True)
    assert shared.runner.kv_cache.is_shared() and shared.runner.image_cache.is_shared()
    assert shared.share_pools() == 0


def test_the_pools_of_new_stages_made_ahead_are_taken_by_expand(tiny_llava_dir):
    """``pools_to_add`` names the pools a role's new stages need whose shape is known before
    their parts load (a worker makes them on a thread while it steps), and ``expand`` takes
    them as they are; a KV pool of an instance without a language model waits for it."""
    from hydrad.engine.core import EngineCore

    config = load_config(None, {"model.path": str(tiny_llava_dir), "scheduler.derive_budgets": False,
                                "cache.num_kv_blocks": 64, "cache.num_image_blocks": 8}).engine
    d = EngineCore(config, role="D", device="cpu", instance_id=0, shared_pools=True)
    shapes = d.pools_to_add("EP")
    assert list(shapes) == ["image"] and shapes["image"][0] == 8  # D holds its KV pool already
    made = {kind: d.runner.new_pool(shape) for kind, shape in shapes.items()}
    assert made["image"].is_shared()
    assert d.expand("EP", made) == "EPD"
    assert d.runner.image_cache is made["image"] and d.image_manager.num_blocks == 8
    assert d.pools_to_add("EPD") == {}
    e = EngineCore(config, role="E", device="cpu", instance_id=1, shared_pools=True)
    assert e.pools_to_add("EP") == {}  # its KV block size follows the attention backend it loads
    assert e.expand("EP", {}) == "EP" and e.kv_manager.num_blocks == 64


@pytest.mark.parametrize("wait", [True, False], ids=["started", "starting"])
def test_workers_no_supervisor_took_are_stopped(tiny_llava_dir, wait):
    launched = launch_all(engine_config(tiny_llava_dir), plan_specs([("E", "cpu"), ("PD", "cpu")]))
    processes = [item.process for item in launched.values()]
    if wait:  # else stopped while the starts may still be under way (stop_unadopted waits for them)
        for item in launched.values():
            item.started.wait()
        assert all(p.is_alive() for p in processes)
    stop_unadopted(launched)
    assert launched == {}
    assert all(not p.is_alive() and p.exitcode is not None for p in processes)


def test_a_port_that_cannot_be_bound_is_reported_before_any_worker_loads(tiny_llava_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(HydradError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            check_listen("127.0.0.1", port)
        result = subprocess.run([sys.executable, "-m", "hydrad", "start", "--model", str(tiny_llava_dir),
                                 "--devices", "cpu:1", "--port", str(port)],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert "worker" not in result.stderr  # refused before launching one
    with pytest.raises(HydradError, match="cannot listen on no.such.host.invalid:8000"):
        check_listen("no.such.host.invalid", 8000)
    check_listen("127.0.0.1", 0)  # an ephemeral port is always free


def test_the_fork_server_preload_imports_what_an_engine_build_needs(tiny_llava_dir):
    """The fork server drops a preload that fails to import without a word (workers would then
    import everything themselves again): it must import, leave CUDA alone, and leave an engine
    build next to nothing to import."""
    code = textwrap.dedent(f"""
        import sys
        import hydrad.engine.preload
        import torch
        from hydrad.config_file import load_config
        from hydrad.engine.core import EngineCore

        assert not torch.cuda.is_initialized()
        import gc
        assert gc.get_freeze_count() > 100_000, gc.get_freeze_count()  # frozen before any fork
        config = load_config(None, {{"model.path": {str(tiny_llava_dir)!r},
                                     "scheduler.derive_budgets": False}}).engine
        before = set(sys.modules)
        EngineCore(config, role="EPD", device="cpu", instance_id=0)
        print(len(set(sys.modules) - before))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # The checkpoint's own configuration modules (CLIP's, Llama's) and a few of hydrad's; without
    # the preload the build imports over a thousand.
    assert int(result.stdout.strip()) < 30


def test_cpu_workers_that_share_the_cores_spin_briefly(monkeypatch):
    from hydrad.cluster.launch import share_cpu_cores

    monkeypatch.setattr(launch, "usable_cpus", lambda: 2)
    specs = plan_specs([("EP", "cpu"), ("D", "cpu")])
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    share_cpu_cores(plan_specs([("EPD", "cpu")]))  # one worker: OpenMP's defaults
    assert "GOMP_SPINCOUNT" not in os.environ
    share_cpu_cores(specs)
    assert os.environ["GOMP_SPINCOUNT"] == "30000"
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")  # the operator's choice stays
    share_cpu_cores(specs)
    assert os.environ["GOMP_SPINCOUNT"] == "1000"


def test_plan_specs_names_the_lenders_by_instance_id(monkeypatch):
    monkeypatch.setattr(launch, "usable_cpus", lambda: 4)
    specs = plan_specs([("D", "cpu"), ("EPD", "cuda:0"), ("EP", "cpu"), ("D", "cpu")])
    assert [s.threads for s in specs] == [CpuThreads(1), CpuThreads(1), CpuThreads(1, 2, (0, 3)), CpuThreads(1)]


def test_a_starting_cpu_worker_lends_no_core_until_its_loop_runs(monkeypatch):
    """A lender's byte on the board reads busy from before its process starts (a restart
    too) until its worker loop says it is idle: a borrower's probes on its core beside its
    start (loading, measuring its own model) slowed that start."""
    import multiprocessing
    import threading
    import time
    from types import SimpleNamespace

    from hydrad.config import EngineConfig
    from hydrad.engine.cores import CoreBoard, CoreLending
    from hydrad.engine.worker import StepThreads, run_worker
    from hydrad.transport.messages import Shutdown

    board = CoreBoard.new()
    seen = {}

    class Process:  # records the board as the process starts
        def __init__(self, target, args, name):
            self.instance_id = args[0]

        def start(self):
            seen[self.instance_id] = board.flags[self.instance_id]

    monkeypatch.setattr(launch, "usable_cpus", lambda: 2)
    monkeypatch.setattr(launch, "_context", lambda: SimpleNamespace(Process=Process, Pipe=multiprocessing.Pipe))
    specs = plan_specs([("EP", "cpu"), ("D", "cpu")])
    board.flags[1] = 0  # idle when it died: started again
    for item in launch._launch([(EngineConfig(), spec, (), False) for spec in specs], board):
        assert item.started.wait(10)
    assert seen == {0: 1, 1: 1}

    idle = SimpleNamespace(instance_id=1, has_work=lambda: False, has_unfinished_requests=lambda: False,
                           take_offers=list, take_pulled=list)
    lending = CoreLending(board, 1, CpuThreads(1), busy=True)  # as worker_main makes it
    assert board.flags[1] == 1
    daemon_end, worker_end = multiprocessing.Pipe()
    loop = threading.Thread(target=run_worker, args=(idle, worker_end, StepThreads(idle, lending)))
    loop.start()
    deadline = time.monotonic() + 10
    while board.flags[1] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert board.flags[1] == 0  # its loop runs, idle: it lends
    daemon_end.send(Shutdown(finish_running=False))
    loop.join(10)
    assert not loop.is_alive()
