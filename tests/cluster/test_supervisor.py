"""How the supervisor words a worker's end and decides whether the daemon can serve on."""

from __future__ import annotations

import asyncio
import signal

import pytest

from hydrad.cluster.worker_client import EXITED
from hydrad.cluster.launch import plan_specs
from hydrad.cluster.supervisor import RestartPolicy, Supervisor, describe_exit, missing_stages


@pytest.mark.parametrize("exitcode, words", [
    (0, "exited with status 0"),
    (1, "exited with status 1"),
    (-signal.SIGKILL, "killed by SIGKILL"),
    (-signal.SIGSEGV, "killed by SIGSEGV"),
    (None, "still running"),
])
def test_describe_exit(exitcode, words):
    assert describe_exit(exitcode) == words


@pytest.mark.parametrize("live_roles, missing", [
    (["EPD"], []),
    (["EPD", "EPD"], []),
    ([], ["E", "P", "D"]),
    (["E"], ["P", "D"]),
    (["E", "P"], ["D"]),
    (["ED", "P"], []),
    (["E", "EP"], ["D"]),
])
def test_missing_stages(live_roles, missing):
    assert missing_stages(live_roles) == missing


class FakeProcess:
    def __init__(self, pid: int):
        self.pid = pid
        self.exitcode: int | None = None

    def join(self, timeout: float | None = None) -> None:
        pass


class FakeClient:
    def __init__(self, instance_id: int, role: str):
        self.instance_id, self.role, self.device = instance_id, role, "cpu"
        self.ready = object()
        self.alive = True
        self.failure: str | None = None

    @property
    def accepting(self) -> bool:
        return self.alive

    def detach_peer(self, peer_id: int) -> None:
        pass


def make_supervisor(roles: list[str]) -> Supervisor:
    """A supervisor over stand-ins for started workers (pid 100 + instance id)."""
    specs = plan_specs([(role, "cpu") for role in roles])
    supervisor = Supervisor(None, specs, restart=RestartPolicy(limit=0))  # restarts: tests/server
    supervisor.clients[:] = [FakeClient(s.instance_id, s.role) for s in specs]  # the router sees this list
    supervisor._processes = {s.instance_id: FakeProcess(100 + s.instance_id) for s in specs}
    return supervisor


async def lose(supervisor: Supervisor, instance_id: int, exitcode: int, failure: str = EXITED) -> None:
    client = supervisor.clients[instance_id]
    client.alive, client.failure = False, failure
    supervisor._processes[instance_id].exitcode = exitcode
    supervisor._on_lost(client)
    await asyncio.gather(*supervisor._tasks)


from hydrad.cluster.supervisor import oom_kills as read_oom_kills  # noqa: E402


@pytest.fixture(autouse=True)
def no_oom_kills(monkeypatch):
    """The host's out-of-memory kills stay still here (a real one meanwhile would change the
    lines these tests read)."""
    from hydrad.cluster import supervisor as supervisor_module

    kills = [5]
    monkeypatch.setattr(supervisor_module, "oom_kills", lambda: kills[0])
    return kills


def test_oom_kills_are_read_from_vmstat(tmp_path):
    oom_kills = read_oom_kills  # as imported, not as the fixture pins it
    (tmp_path / "vmstat").write_text("nr_free_pages 1\noom_kill 7\nother 2\n")
    assert oom_kills(str(tmp_path / "vmstat")) == 7
    (tmp_path / "old").write_text("nr_free_pages 1\n")  # a kernel before 4.13
    assert oom_kills(str(tmp_path / "old")) is None and oom_kills(str(tmp_path / "none")) is None


def test_a_worker_killed_by_the_out_of_memory_killer_is_said_so(caplog, no_oom_kills):
    async def main():
        supervisor = make_supervisor(["E", "EP", "EP", "D"])
        no_oom_kills[0] += 1
        await lose(supervisor, 0, -signal.SIGKILL)
        await lose(supervisor, 1, -signal.SIGKILL)  # no kill since: nothing said
        assert caplog.messages == [
            "worker 0 (cpu, E, pid 100) is down: pipe reached EOF; process killed by SIGKILL (the kernel's "
            "out-of-memory killer killed 1 process(es) meanwhile: likely this one; /proc/vmstat oom_kill); "
            "serving degraded on 3 of 4 instance(s)",
            "worker 1 (cpu, EP, pid 101) is down: pipe reached EOF; process killed by SIGKILL; serving degraded "
            "on 2 of 4 instance(s)"]

    asyncio.run(main())


def test_a_dead_instance_whose_stages_others_hold_leaves_the_daemon_serving(caplog):
    async def main():
        supervisor = make_supervisor(["E", "EP", "D"])
        await lose(supervisor, 0, -signal.SIGKILL)
        assert not supervisor.failed.is_set() and supervisor.failure is None
        assert caplog.messages == ["worker 0 (cpu, E, pid 100) is down: pipe reached EOF; process killed by "
                                   "SIGKILL; serving degraded on 2 of 3 instance(s)"]

    asyncio.run(main())


def test_a_stage_without_a_live_instance_fails_the_supervisor(caplog):
    async def main():
        supervisor = make_supervisor(["E", "P", "D"])
        await lose(supervisor, 2, 1, failure="RuntimeError: boom")
        assert supervisor.failed.is_set()
        assert supervisor.failure == ("worker 2 (cpu, D, pid 102) is down: RuntimeError: boom; "
                                      "process exited with status 1; no live instance holds stage D")
        assert caplog.messages == [supervisor.failure]

    asyncio.run(main())


def test_a_restarted_worker_takes_no_work_until_the_pools_are_shared(monkeypatch):
    """Ready is not enough: a request routed to a restarted worker before its peers' pools
    are attached to it would be refused when it migrates there."""
    from types import SimpleNamespace

    import hydrad.cluster.supervisor as supervisor_module
    from hydrad.cluster.worker_client import WorkerClient

    monkeypatch.setattr(supervisor_module, "_FIRST_BACKOFF", 0.0)

    async def main():
        supervisor = make_supervisor(["EP", "D"])
        supervisor.restart = RestartPolicy(limit=3)
        shared, sharing = asyncio.Event(), asyncio.Event()

        async def spawn(spec):
            client = WorkerClient(spec.instance_id, spec.role, spec.device, supervisor.table)
            ready = SimpleNamespace(pid=200, load_seconds=0.1)
            client.ready = ready
            client._ready_future.set_result(ready)
            return client

        async def share_pools(client):
            sharing.set()
            await shared.wait()

        monkeypatch.setattr(supervisor, "_spawn", spawn)
        monkeypatch.setattr(supervisor, "share_pools", share_pools)
        restart = asyncio.ensure_future(supervisor._restart(supervisor.specs[1], "killed"))
        await asyncio.wait_for(sharing.wait(), 5)
        restarted = supervisor.clients[1]
        assert restarted.ready is not None and not restarted.accepting
        with pytest.raises(Exception, match="stage D"):
            supervisor.router.select_stage("D")
        shared.set()
        await asyncio.wait_for(restart, 5)
        assert restarted.accepting and supervisor.router.select_stage("D") is restarted

    asyncio.run(main())


def test_a_redeploy_that_cannot_complete_is_counted_and_changes_nothing():
    from types import SimpleNamespace

    from hydrad.cluster.supervisor import RedeployError
    from hydrad.cluster.worker_client import WorkerLost

    async def main():
        supervisor = make_supervisor(["EP", "D"])
        supervisor.history.append(SimpleNamespace(deploy="1EP+1D"))
        answers = iter([SimpleNamespace(error="out of memory for the image pool"), WorkerLost("worker 1 is down")])

        async def reconfigure(role, timeout, borrowed=True):
            answer = next(answers)
            if isinstance(answer, Exception):
                raise answer
            return answer

        for client in supervisor.clients:
            client.reconfigure = reconfigure
        # 1EP+1D -> 1E+1PD: instance 1 takes on P first, and cannot; then it is lost doing so.
        with pytest.raises(RedeployError, match="could not take on P: out of memory"):
            await supervisor.redeploy(["E", "PD"])
        with pytest.raises(RedeployError, match="did not complete: worker 1 is down"):
            await supervisor.redeploy(["E", "PD"])
        assert supervisor.num_failed_redeploys == 2
        assert supervisor.deployment == "1EP+1D" and len(supervisor.history) == 1 and supervisor.busy is None

    asyncio.run(main())


def test_a_redeploy_whose_pools_cannot_move_to_shared_memory_is_refused_before_it_starts(monkeypatch, tmp_path):
    """2EPD keeps its pools private; a redeploy to a deployment that moves requests puts
    them in /dev/shm: one that has no room for them is refused before any instance changes."""
    from types import SimpleNamespace

    from hydrad.cluster import preflight
    from hydrad.cluster.supervisor import RedeployError
    from hydrad.config import CacheConfig

    monkeypatch.setattr(preflight, "SHM", str(tmp_path))  # a 64 MiB /dev/shm
    monkeypatch.setattr(preflight.os, "statvfs", lambda path: SimpleNamespace(f_bavail=64 * 256, f_frsize=4096))

    async def main():
        supervisor = make_supervisor(["EPD", "EPD"])
        supervisor.config = SimpleNamespace(cache=CacheConfig())
        supervisor.history.append(SimpleNamespace(deploy="2EPD"))

        async def reconfigure(role, timeout, borrowed=True):
            raise AssertionError("no instance should change")

        for client in supervisor.clients:
            client.reconfigure = reconfigure
        with pytest.raises(RedeployError, match="has 64 MiB free, and the cache pools of 2 CPU instance"):
            await supervisor.redeploy(["EP", "D"])
        assert supervisor.deployment == "2EPD" and supervisor.busy is None and not supervisor.migrates

    asyncio.run(main())


def test_a_long_hand_over_says_what_is_still_held(monkeypatch, caplog):
    """Under load a redeploy's hand-over lasts until the instances taking the stages have
    room: meanwhile the caller (``hydractl redeploy``) and the log hear, every few seconds,
    how many requests each instance losing stages still holds."""
    from types import SimpleNamespace

    from hydrad.cluster import supervisor as supervisor_module

    monkeypatch.setattr(supervisor_module, "HANDOVER_REPORT_SECONDS", 0.05)

    async def main():
        supervisor = make_supervisor(["EPD", "EPD"])
        supervisor.history.append(SimpleNamespace(deploy="2EPD"))
        supervisor.migrates = True  # its pools are shared already
        held = {0: 7, 1: 3}
        monkeypatch.setattr(supervisor.table, "held_by", lambda client: held[client.instance_id])
        released = asyncio.Event()

        async def reconfigure(role, timeout, borrowed=True):
            return SimpleNamespace(error=None, seconds=0.1, latency_model=None, latency_bound=None, geometry=None,
                                   borrow_model=None)

        async def retire(stages, timeout):
            await released.wait()
            return SimpleNamespace(role="E", seconds=0.2, latency_bound=None)

        async def no_op(*args, **kwargs):
            return None

        for client in supervisor.clients:
            client.reconfigure, client.retire = reconfigure, retire
            client.ready = SimpleNamespace(latency_model=None)
        supervisor._share_all_pools = no_op
        supervisor._share_cores = no_op
        lines: list[str] = []
        redeploy = asyncio.ensure_future(supervisor.redeploy(["E", "PD"], progress=lines.append))
        await asyncio.sleep(0.2)
        held[0] = 2
        await asyncio.sleep(0.1)
        released.set()
        await redeploy
        return lines

    with caplog.at_level("INFO", logger="hydrad.supervisor"):
        lines = asyncio.run(main())
    reports = [line for line in lines if line.startswith("handing over for")]
    assert len(reports) >= 3, lines
    # 2EPD -> 1E+1PD: #0 hands P and D over, #1 E.
    assert reports[0].endswith("requests still held: #0 7, #1 3") and reports[-1].endswith("#0 2, #1 3"), reports
    assert lines[-1].startswith("serving as 1E+1PD after")
    assert any("redeploy: handing over for" in r.message for r in caplog.records)


@pytest.mark.parametrize("exitcode, failure, oom, by_request", [
    (-signal.SIGKILL, EXITED, False, False),  # an operator's kill -9
    (-signal.SIGTERM, EXITED, False, False),
    (-signal.SIGKILL, EXITED, True, True),  # the out-of-memory killer: a request may have grown it
    (-signal.SIGKILL, "answered nothing for 60 s while holding 3 request(s): killed", False, True),  # the watchdog
    (-signal.SIGSEGV, EXITED, False, True),
    (1, "RuntimeError: boom", False, True),  # a step that raised
])
def test_a_death_is_judged_for_whether_a_request_may_have_caused_it(no_oom_kills, exitcode, failure, oom,
                                                                     by_request):
    """The request table quarantines the requests that lost two instances only where neither
    death was a kill from outside (``RequestTable.judge``): the supervisor tells which."""
    async def main():
        supervisor = make_supervisor(["EPD", "EPD"])
        verdicts = []
        supervisor.table.judge = lambda instance_id, verdict, how: verdicts.append((instance_id, verdict, how))
        if oom:
            no_oom_kills[0] += 1
        await lose(supervisor, 0, exitcode, failure=failure)
        return verdicts

    [(instance_id, verdict, how)] = asyncio.run(main())
    assert instance_id == 0 and verdict is by_request
    assert how.startswith("killed by" if exitcode < 0 else "exited with status")
    assert ("out-of-memory" in how) is oom


def test_a_long_reconfigure_says_which_instances_still_measure(monkeypatch):
    """An instance taking on stages measures their latency models, on a busy one once its
    requests leave room in its pools: meanwhile the caller hears which ones it waits for."""
    from types import SimpleNamespace

    from hydrad.cluster import supervisor as supervisor_module
    from hydrad.transport.messages import WorkerReady

    monkeypatch.setattr(supervisor_module, "HANDOVER_REPORT_SECONDS", 0.05)

    async def main():
        supervisor = make_supervisor(["EP", "D"])
        supervisor.history.append(SimpleNamespace(deploy="1EP+1D"))
        supervisor.migrates = True
        measured = asyncio.Event()

        def reconfigure_of(instance_id):
            async def reconfigure(role, timeout, borrowed=True):
                if instance_id == 1:
                    await measured.wait()
                return SimpleNamespace(error=None, seconds=0.1, latency_model=None, latency_bound=None,
                                       geometry=None, borrow_model=None)
            return reconfigure

        async def retire(stages, timeout):
            return SimpleNamespace(role="E", seconds=0.2, latency_bound=None)

        async def no_op(*args, **kwargs):
            return None

        for client in supervisor.clients:
            client.reconfigure, client.retire = reconfigure_of(client.instance_id), retire
            client.ready = WorkerReady(client.instance_id, 100 + client.instance_id, 512, 0.1)
        supervisor._share_all_pools = no_op
        supervisor._share_cores = no_op
        lines: list[str] = []
        redeploy = asyncio.ensure_future(supervisor.redeploy(["E", "PD"], progress=lines.append))
        await asyncio.sleep(0.2)
        assert not redeploy.done()
        measured.set()
        await redeploy
        return lines

    lines = asyncio.run(main())
    reports = [line for line in lines if line.startswith("taking on new stages for")]
    # 1EP+1D -> 1E+1PD: #1 takes on P, and only it is waited for.
    assert len(reports) >= 2 and all(line.endswith(": #1 measuring latency models (between their steps, serving)")
                                     for line in reports), lines
    assert lines[-1].startswith("serving as 1E+1PD after")


def test_an_instance_whose_threads_change_after_the_switch_measures_no_model_on_borrowed_cores_before(
        monkeypatch):
    """1EP+1D -> 2EPD on two cores: EP borrows D's core now and no longer once the roles have
    switched, so taking on D it measures nothing on the borrowed core (the threads step that
    follows measures what its new threads need); D keeps its threads and measures all."""
    from types import SimpleNamespace

    from hydrad.cluster import launch
    from hydrad.cluster.launch import plan_threads
    from hydrad.transport.messages import WorkerReady

    monkeypatch.setattr(launch, "usable_cpus", lambda: 2)  # two cores: EP borrows D's

    async def main():
        supervisor = make_supervisor(["EP", "D"])
        supervisor.history.append(SimpleNamespace(deploy="1EP+1D"))
        supervisor.migrates = True
        flags = {}

        def reconfigure_of(instance_id):
            async def reconfigure(role, timeout, borrowed=True):
                flags[instance_id] = borrowed
                return SimpleNamespace(error=None, seconds=0.1, latency_model=None, latency_bound=None,
                                       geometry=None, borrow_model=None)
            return reconfigure

        async def no_op(*args, **kwargs):
            return None

        for client in supervisor.clients:
            client.reconfigure = reconfigure_of(client.instance_id)
            client.ready = WorkerReady(client.instance_id, 100 + client.instance_id, 512, 0.1)
        supervisor._share_all_pools = no_op
        supervisor._share_cores = no_op
        await supervisor.redeploy(["EPD", "EPD"])
        return supervisor, flags

    supervisor, borrowed = asyncio.run(main())
    now = [spec.threads for spec in supervisor.specs]
    after = plan_threads([("EPD", "cpu"), ("EPD", "cpu")])
    assert [now[i] == after[i] for i in (0, 1)] == [borrowed[0], borrowed[1]]
    assert now[0].borrow and not borrowed[0] and borrowed[1]
