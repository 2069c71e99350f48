"""CPU workers sharing the cores: each one's threads, and lending idle cores through the board."""

from __future__ import annotations

import pytest

from factories import run_through
from hydrad.engine.cores import CoreBoard, CoreLending, CpuThreads, LendersBusy, cpu_threads


def T(own, borrow=0, lenders=()):
    return CpuThreads(own, borrow, lenders)


@pytest.mark.parametrize("roles, cores, threads", [
    (["EPD"], 2, [T(2)]),
    (["EPD", "EPD"], 2, [T(1), T(1)]),
    # The decode-only instance's core idles between requests: the EP instance may borrow it.
    (["EP", "D"], 2, [T(1, 1, (1,)), T(1)]),
    # Instances that decode keep their share, lenders or not.
    (["E", "PD"], 2, [T(1), T(1)]),
    (["EPD", "D"], 2, [T(1), T(1)]),
    # Two borrowers split the two decode-only instances' cores, each borrowing from both.
    (["E", "P", "D", "D"], 4, [T(1, 1, (2, 3)), T(1, 1, (2, 3)), T(1), T(1)]),
    (["EP", "D", "D", "D"], 8, [T(2, 6, (1, 2, 3)), T(2), T(2), T(2)]),
    # An uneven split rounds down; no instance gets more than the cores.
    (["E", "P", "D"], 3, [T(1), T(1), T(1)]),
    (["EP", "D"], 1, [T(1), T(1)]),
])
def test_cpu_threads_lend_the_decode_only_instances_cores(roles, cores, threads):
    assert cpu_threads(roles, cores) == threads
    assert all(t.most <= max(cores, t.own) for t in threads)


def test_threads_are_checked():
    with pytest.raises(ValueError, match="own 0"):
        CpuThreads(0)
    with pytest.raises(ValueError, match="borrow them from"):
        CpuThreads(1, 1)


def test_a_borrower_takes_the_lent_threads_only_while_every_lender_is_idle():
    board = CoreBoard.new()
    d0, d1 = (CoreLending(board, i, T(1)) for i in (1, 2))
    ep = CoreLending(board, 0, T(1, 2, (1, 2)))
    assert ep.threads_now() == 3
    d0.publish(True)
    assert board.busy(1) and ep.threads_now() == 1
    d1.publish(True)
    d0.publish(False)
    assert ep.threads_now() == 1
    d1.publish(False)
    assert ep.threads_now() == 3
    # A worker that starts again in a lender's place starts idle.
    d0.publish(True)
    CoreLending(board, 1, T(1))
    assert ep.threads_now() == 3


def test_without_a_board_nothing_is_borrowed():
    lending = CoreLending(None, 0, T(1, 1, (1,)))
    assert lending.threads == T(1) and lending.threads_now() == 1
    lending.publish(True)  # nothing to write to
    lending.set(T(2, 1, (1,)))
    assert lending.threads == T(2)


def test_the_board_reaches_a_worker_process():
    """The board's memory is handed to a process as it is started and is the same memory."""
    import multiprocessing

    board = CoreBoard.new()
    ctx = multiprocessing.get_context("spawn")
    process = ctx.Process(target=_publish_busy, args=(board.flags, 5))
    process.start()
    process.join(60)
    assert process.exitcode == 0
    assert board.busy(5)


def _publish_busy(flags, instance_id: int) -> None:
    CoreLending(CoreBoard(flags), instance_id, T(1)).publish(True)


def test_a_borrowing_worker_steps_on_the_threads_and_model_of_the_moment(monkeypatch):
    """``StepThreads``: a model measured at each count; before each step the count its lenders
    allow, with the model at that count."""
    from types import SimpleNamespace

    import torch

    import hydrad.engine.profiler as profiler
    from hydrad.config import SLOConfig
    from hydrad.engine.worker import StepThreads

    monkeypatch.setattr(profiler, "fit_latency_model",
                        lambda engine, **kw: f"model at {torch.get_num_threads()} threads")
    used = []
    engine = SimpleNamespace(
        device=torch.device("cpu"), role="EP",
        config=SimpleNamespace(scheduler=SimpleNamespace(derive_budgets=True), slo=SLOConfig(ttft=2.0, tbt=0.1)),
        set_latency_model=lambda model, bound: used.append((model, torch.get_num_threads(), bound)))
    board = CoreBoard.new()
    lender = CoreLending(board, 1, T(1))
    before = torch.get_num_threads()
    try:
        threads = StepThreads(engine, CoreLending(board, 0, T(1, 1, (1,))))
        model, bound, borrow_model = threads.fit("EP", allow_busy=False)
        assert (model, borrow_model) == ("model at 1 threads", "model at 2 threads")
        assert used[-1] == ("model at 1 threads", 1, bound) and bound == pytest.approx(0.9)
        threads.before_step()  # the lender is idle
        assert used[-1] == ("model at 2 threads", 2, bound)
        lender.publish(True)
        threads.before_step()
        assert used[-1] == ("model at 1 threads", 1, bound)
        count = len(used)
        threads.before_step()  # nothing changed: nothing set again
        assert len(used) == count
    finally:
        torch.set_num_threads(before)


def test_a_borrowing_step_follows_its_lenders_within_the_step(monkeypatch):
    """Within a step a borrower re-picks torch's thread count before every layer: it drops
    the lent thread at the next layer once a lender has work, takes it again once the lender
    is idle, and keeps the model the step was filled by. A worker that does not borrow places
    no hook."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    import hydrad.engine.profiler as profiler
    from hydrad.config import SLOConfig
    from hydrad.engine.worker import StepThreads

    monkeypatch.setattr(profiler, "fit_latency_model",
                        lambda engine, **kw: f"model at {torch.get_num_threads()} threads")
    board = CoreBoard.new()
    lender = CoreLending(board, 1, T(1))
    seen = []

    class Layer(nn.Module):
        def __init__(self, flip=None):
            super().__init__()
            self.flip = flip

        def forward(self, x):
            seen.append(torch.get_num_threads())
            if self.flip is not None:
                lender.publish(self.flip)  # the lender starts or stops having work meanwhile
            return x

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer(True), Layer(), Layer(False), Layer()])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    used = []
    engine = SimpleNamespace(
        device=torch.device("cpu"), role="EP", model=Model(),
        config=SimpleNamespace(scheduler=SimpleNamespace(derive_budgets=True), slo=SLOConfig(ttft=2.0, tbt=0.1)),
        set_latency_model=lambda model, bound: used.append(model))
    before = torch.get_num_threads()
    try:
        threads = StepThreads(engine, CoreLending(board, 0, T(1, 1, (1,))))
        threads.fit("EP", allow_busy=False)
        threads.before_step()  # the lender is idle: the step starts on two threads
        assert used[-1] == "model at 2 threads"
        engine.model(torch.zeros(1))
        # Busy during layer 0: layer 1 runs on one thread; idle during layer 2: layer 3 on two.
        assert seen == [2, 1, 1, 2]
        assert used[-1] == "model at 2 threads"  # the step's model does not change mid-step
        lender.publish(True)
        threads.before_step()  # the next step starts on one thread, with its model
        assert used[-1] == "model at 1 threads" and torch.get_num_threads() == 1

        seen.clear()
        torch.set_num_threads(2)
        threads.fit("EPD", T(1), allow_busy=False)  # it no longer borrows: no hooks
        torch.set_num_threads(2)
        lender.publish(False)
        engine.model(torch.zeros(1))
        assert seen == [2, 2, 2, 2]
    finally:
        lender.publish(False)
        torch.set_num_threads(before)


def test_a_busy_borrower_measures_its_new_models_between_steps_on_the_threads_it_serves_on(monkeypatch):
    """``StepThreads.fitting``: each probe runs at the count its model is for, with the hooks
    that follow the lenders left out (a lender's step must not change a probe's count); the
    worker's steps between two probes run on its own threads with the hooks; the models,
    the new threads and the hooks take effect once the last probe has run, and a measurement
    closed before its end changes nothing. A borrowed count is measured only while its
    lenders are idle, and cached only where they were idle before every run; while they
    have work it waits, and past its patience it is left to ``later``, which
    ``measuring_later`` then measures, waiting for the lenders as long as they work."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    import hydrad.engine.profiler as profiler
    import hydrad.engine.worker as worker
    from hydrad.config import SLOConfig
    from hydrad.engine.worker import StepThreads

    board = CoreBoard.new()
    lender = CoreLending(board, 1, T(1))
    seen = []

    class Layer(nn.Module):
        def forward(self, x):
            seen.append(torch.get_num_threads())
            lender.publish(not board_busy())  # the lender flips between every two layers
            return x

    def board_busy() -> bool:
        return CoreLending(board, 0, T(1, 1, (1,))).threads_now() == 1

    model = nn.Sequential(nn.ModuleList([Layer(), Layer(), Layer()]))
    model.forward = lambda x: [layer(x) for layer in model[0]]
    probes = []

    def measuring(engine, cache):
        for _ in range(3):
            seen.clear()
            engine.model(torch.zeros(1))  # a probe: whatever the lender does, one count
            lender.publish(False)
            probes.append((torch.get_num_threads(), list(seen), cache() if callable(cache) else cache))
            yield None
        return f"model at {torch.get_num_threads()} threads"

    monkeypatch.setattr(profiler, "measuring_latency_model", measuring)
    monkeypatch.setattr(profiler, "fit_latency_model",
                        lambda engine, **kw: f"model at {torch.get_num_threads()} threads")
    used = []
    engine = SimpleNamespace(
        device=torch.device("cpu"), role="EP", model=model,
        config=SimpleNamespace(scheduler=SimpleNamespace(derive_budgets=True), slo=SLOConfig(ttft=2.0, tbt=0.1)),
        set_latency_model=lambda model, bound: used.append(model))
    before = torch.get_num_threads()
    try:
        threads = StepThreads(engine, CoreLending(board, 0, T(1, 1, (1,))))  # borrows the lender's core
        threads.fit("EP", allow_busy=False)
        def step_between_runs():
            assert torch.get_num_threads() == 1 and used[-1] == "model at 1 threads"  # serving as before
            seen.clear()
            lender.publish(False)
            engine.model(torch.zeros(1))  # a step between two probes follows the lender
            assert seen == [2, 1, 2]
            lender.publish(False)

        # A live redeploy: the new role's models.
        count, result = run_through(threads.fitting("EPD"), step_between_runs)
        assert count == 6  # three probes at each count, a step after each
        # On borrowed cores: measured while the lender is idle, cached (it was idle throughout).
        assert probes == [(1, [1, 1, 1], True)] * 3 + [(2, [2, 2, 2], True)] * 3
        assert result == ("model at 1 threads", pytest.approx(0.09), "model at 2 threads")  # D's bound

        probes.clear()
        hurried = False
        steps = threads.fitting("EP", hurry=lambda: hurried)
        for _ in range(4):
            assert next(steps) is None
        lender.publish(True)  # the lender gets work: probes on its core would time its steps
        assert isinstance(next(steps), LendersBusy) and isinstance(next(steps), LendersBusy)
        lender.publish(False)
        assert next(steps) is None and len(probes) == 5  # measured on while the lender is idle
        lender.publish(True)
        assert isinstance(next(steps), LendersBusy)
        hurried = True  # no time left to wait: left to later
        with pytest.raises(StopIteration) as stop:
            next(steps)
        assert len(probes) == 5 and stop.value.value[2] is None and threads.later == [2]
        threads.before_step()  # borrowing again, the steps are filled by the share's model
        assert used[-1] == "model at 1 threads"
        lender.publish(False)
        threads.before_step()
        assert used[-1] == "model at 1 threads" and torch.get_num_threads() == 2


        def borrowed_count_with_busy_lenders():
            """A measurement whose own count's probes run, and whose lender then has work: what
            the first call for the borrowed count gives (the measurement left open)."""
            probes.clear()
            steps = threads.fitting("EP")
            for _ in range(3):
                assert next(steps) is None
            lender.publish(True)
            try:
                return next(steps), steps
            except StopIteration as stop:
                return stop.value, None

        # Its lenders stayed busy past its patience: the next measurement does not wait for
        # them again, the borrowed count is left to later at once...
        result, _ = borrowed_count_with_busy_lenders()
        assert result[2] is None and len(probes) == 3
        # ... until one finds them idle and is measured: then it waits for them again.
        lender.publish(False)
        runs, result = run_through(threads.fitting("EP"), lambda: lender.publish(False))
        assert runs == 6 and result[2] == "model at 2 threads"
        waits, steps = borrowed_count_with_busy_lenders()
        assert isinstance(waits, LendersBusy)
        steps.close()
        lender.publish(False)

        # Its threads change right after (a redeploy's next step): on the borrowed core only
        # what the cache has, nothing measured.
        for cached in (None, "cached model at 2 threads"):
            probes.clear()
            monkeypatch.setattr(profiler, "known_latency_model", lambda engine: cached)
            runs, result = run_through(threads.fitting("EPD", borrowed=False))
            assert runs == 3 and [p[0] for p in probes] == [1, 1, 1] and result[2] == cached

        # Left to later (a start takes it from the cache only, and the cache lacks it):
        # measured between steps, its lenders waited for as long as they work (no patience,
        # no hurry), and not cached (they had work between two of its runs).
        monkeypatch.setattr(profiler, "known_latency_model", lambda engine: None)
        run_through(threads.fitting("EP", borrowed=False))
        assert threads.later == [2]
        lender.publish(False)
        threads.before_step()
        assert used[-1] == "model at 1 threads" and torch.get_num_threads() == 2  # borrowing, by its share's
        monkeypatch.setattr(worker, "LENDERS_PATIENCE", 0.0)
        probes.clear()
        later = threads.measuring_later()
        assert next(later) is None and probes[-1][0] == 2
        lender.publish(True)
        assert all(isinstance(next(later), LendersBusy) for _ in range(3))
        lender.publish(False)
        runs, measured = run_through(later)
        assert runs == 2 and measured == (2, "model at 2 threads") and threads.later == []
        assert [p[2] for p in probes] == [True, False, False]  # the lender had work between runs
        assert used[-1] == "model at 2 threads"  # it steps on both cores now: by that model
        assert list(threads.measuring_later()) == []  # nothing left to measure

        probes.clear()
        threads._unhook()  # another worker's step threads on the model now
        steps = StepThreads(engine, CoreLending(board, 0, T(1))).fitting("EP", T(1, 1, (1,)))
        next(steps)
        steps.close()  # superseded: its threads are as they were
        assert torch.get_num_threads() == 1 and len(probes) == 1
    finally:
        lender.publish(False)
        torch.set_num_threads(before)


def _cgroup(tmp_path, proc: str, files: dict[str, str]):
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    (tmp_path / "proc_cgroup").write_text(proc)
    return str(root), str(tmp_path / "proc_cgroup")


@pytest.mark.parametrize("proc, files, quota", [
    # cgroup v2, a container's view: its own group is the root.
    ("0::/\n", {"cpu.max": "200000 100000\n"}, 2.0),
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),
    # v2 on a host: a systemd unit's CPUQuota=150%, nothing above it.
    ("0::/system.slice/hydrad.service\n", {"system.slice/hydrad.service/cpu.max": "150000 100000\n",
                                           "system.slice/cpu.max": "max 100000\n"}, 1.5),
    # A group above is tighter: the tightest applies.
    ("0::/a/b\n", {"a/b/cpu.max": "400000 100000\n", "a/cpu.max": "250000 100000\n"}, 2.5),
    # A path that is not below the mount (a container's namespace): the root is read.
    ("0::/kubepods/pod1\n", {"cpu.max": "300000 100000\n"}, 3.0),
    # cgroup v1: the cpu controller's hierarchy (docker --cpus=4), beside others; -1 is unbounded.
    ("5:memory:/docker/x\n4:cpu,cpuacct:/docker/x\n", {"cpu,cpuacct/docker/x/cpu.cfs_quota_us": "400000\n",
                                                        "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n"}, 4.0),
    ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ("0::/\n", {}, None),
])
def test_the_cgroup_cpu_quota_is_read_from_v1_and_v2(tmp_path, proc, files, quota):
    from hydrad.engine.cores import cgroup_cpu_quota

    root, proc_cgroup = _cgroup(tmp_path, proc, files)
    assert cgroup_cpu_quota(root, proc_cgroup) == quota
    assert cgroup_cpu_quota(root, str(tmp_path / "none")) is None


def test_usable_cpus_are_the_affinity_within_the_quota(monkeypatch):
    """Worker threads follow the CPUs this process may use, not the host's: a container given
    2.5 CPUs of a large host runs 2 threads, not one per host core."""
    import os

    from hydrad.engine import cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(cores, "cgroup_cpu_quota", lambda: 2.5)
    assert cores.usable_cpus() == 2
    monkeypatch.setattr(cores, "cgroup_cpu_quota", lambda: 0.5)
    assert cores.usable_cpus() == 1
    monkeypatch.setattr(cores, "cgroup_cpu_quota", lambda: None)
    assert cores.usable_cpus() == 64
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5, 7}, raising=False)  # taskset, AllowedCPUs=
    assert cores.usable_cpus() == 3


def test_a_starting_worker_leaves_to_later_what_it_cannot_measure_well_before_it_serves(monkeypatch):
    """``StepThreads.fit(start=True)``: the model at its own share is measured once; where the
    machine's speed moved meanwhile (``unsteady``) the worker serves on it and measures it
    again between its steps (``later``, first), as the model at the count it borrows up to
    when the cache lacks it; a steady start leaves nothing but that one."""
    from types import SimpleNamespace

    import torch

    import hydrad.engine.profiler as profiler
    from hydrad.config import SLOConfig
    from hydrad.engine.worker import StepThreads

    def model(name: str, moved: bool = False):
        return SimpleNamespace(name=name, meta={"unsteady": True} if moved else {})

    fits = []

    def fit(engine, **kw):
        fits.append((torch.get_num_threads(), kw.get("once")))
        return model(f"fit at {torch.get_num_threads()}", moved=speed_moved)

    def measuring(engine, cache):
        yield None
        return model(f"measured at {torch.get_num_threads()}")

    monkeypatch.setattr(profiler, "fit_latency_model", fit)
    monkeypatch.setattr(profiler, "measuring_latency_model", measuring)
    monkeypatch.setattr(profiler, "known_latency_model", lambda engine: None)
    used = []
    engine = SimpleNamespace(
        device=torch.device("cpu"), role="EP", model=None,
        config=SimpleNamespace(scheduler=SimpleNamespace(derive_budgets=True), slo=SLOConfig(ttft=2.0, tbt=0.1)),
        set_latency_model=lambda model, bound: used.append(model.name))
    board = CoreBoard.new()
    before = torch.get_num_threads()
    try:
        for speed_moved, later in ((False, [2]), (True, [1, 2])):
            fits.clear()
            threads = StepThreads(engine, CoreLending(board, 0, T(1, 1, (1,))))
            own, _, borrowed = threads.fit("EP", allow_busy=False, start=True)
            assert fits == [(1, True)] and borrowed is None and threads.later == later  # measured once, own only
            assert own.name == "fit at 1" and used[-1] == "fit at 1"
            while threads.later:
                n = threads.later[0]
                runs, (count, measured) = run_through(threads.measuring_later())
                assert runs == 1 and count == n and measured.name == f"measured at {n}"
            if speed_moved:
                assert used[-1] == "measured at 1"  # its steps on its own share: by the new model
            assert list(threads.measuring_later()) == []
        fits.clear()
        threads = StepThreads(engine, CoreLending(board, 0, T(1, 1, (1,))))
        threads.fit("EP", allow_busy=False)  # not a start (a redeploy's fit at once): both measured
        assert fits == [(1, False), (2, False)] and threads.later == []
    finally:
        torch.set_num_threads(before)
