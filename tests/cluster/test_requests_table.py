"""The daemon's request table and migration relay, with recording stand-ins for workers."""

from __future__ import annotations

import asyncio

import pytest

from factories import RecordingSink
from hydrad.engine.inputs import EngineOutput, FinishedRequest, TokenLogprobs
from hydrad.engine.migration import MigrationOffer, Pulled
from hydrad.sampling_params import SamplingParams
from hydrad.cluster.worker_client import WorkerLost
from hydrad.cluster.requests import RequestTable, ServiceStopping
from hydrad.cluster.router import Router
from hydrad.transport.messages import Abort, AddRequest, Migrate, Release


class FakeClient:
    """An instance that records the messages the relay would send it."""

    def __init__(self, instance_id: int, role: str):
        self.instance_id, self.role = instance_id, role
        self.alive = True
        self.sent: list = []
        self.table: RequestTable | None = None

    @property
    def accepting(self) -> bool:
        return self.alive

    @property
    def num_inflight(self) -> int:
        return self.table.held_by(self)

    def migrate(self, offer) -> None:
        self.sent.append(Migrate(offer))

    def add_request(self, request, sink) -> None:
        self.table.open(request.req_id, self, sink, request)
        self.sent.append(AddRequest(request))

    def release(self, req_ids) -> None:
        self.sent.append(Release(tuple(req_ids)))

    def abort(self, req_ids) -> None:
        self.sent.append(Abort(tuple(req_ids)))


def make_table(roles=("E", "P", "D")):
    clients = [FakeClient(i, role) for i, role in enumerate(roles)]
    table = RequestTable(Router(clients, "round-robin"))
    for client in clients:
        client.table = table
    return table, clients


def offer(req_id: str, source: int, kind: str) -> MigrationOffer:
    return MigrationOffer(req_id, source, kind, [[0]] if kind == "image" else [0], [1, 2], [], 0,
                          SamplingParams(), [], (2,), None, {})


def opened(table: RequestTable, req_id: str, entry) -> RecordingSink:
    sink = RecordingSink()
    table.open(req_id, entry, sink)
    return sink


def test_migration_relay_through_every_stage():
    async def main():
        table, (e, p, d) = make_table()
        sink = opened(table, "r", e)
        table.on_offer(e, offer("r", 0, "image"))
        assert p.sent == [Migrate(offer("r", 0, "image"))]
        assert len(table) == 1 and (e.num_inflight, p.num_inflight) == (1, 1)  # counted once in all
        table.on_pulled(p, Pulled("r", 0))
        assert e.sent == [Release(("r",))] and e.num_inflight == 0
        table.deliver_output(EngineOutput(["r"], [7]))
        table.on_offer(p, offer("r", 1, "kv"))
        table.on_pulled(d, Pulled("r", 1))
        table.deliver_output(EngineOutput(["r"], [8], finished=[FinishedRequest("r", "length")]))
        assert sink.tokens == [7, 8] and sink.ended == ("finish", "length", None)
        assert len(table) == 0 and not table.relay.holders and all(c.num_inflight == 0 for c in (e, p, d))

    asyncio.run(main())


def test_offer_of_an_aborted_request_is_released():
    async def main():
        table, (e, p, _) = make_table()
        opened(table, "r", e)
        table.abort("r")  # the client left while E was encoding
        table.on_offer(e, offer("r", 0, "image"))  # the offer crossed the Abort in the pipe
        assert e.sent == [Abort(("r",)), Release(("r",))] and p.sent == []
        assert len(table) == 0 and not table.relay.holders

    asyncio.run(main())


def test_finish_in_the_step_that_reports_the_pull_still_releases_the_source():
    async def main():
        table, (_, p, d) = make_table()
        opened(table, "r", p)
        table.on_offer(p, offer("r", 1, "kv"))
        # tokens and ends are dispatched before pulls
        table.deliver_output(EngineOutput(["r"], [9], finished=[FinishedRequest("r", "stop")]))
        table.on_pulled(d, Pulled("r", 1))
        assert p.sent == [Release(("r",))] and not table.relay.holders

    asyncio.run(main())


def test_a_lost_target_and_no_other_fails_the_request_and_frees_the_source():
    async def main():
        table, (e, p, _) = make_table()
        sink = opened(table, "r", e)
        table.on_offer(e, offer("r", 0, "image"))
        p.alive = False
        table.lost(p, WorkerLost("worker 1 (cpu, P) exited"))
        assert e.sent == [Abort(("r",))]
        assert "stage P" in str(sink.ended[1]) and len(table) == 0 and not table.relay.holders

    asyncio.run(main())


def test_a_lost_instance_fails_what_it_had_pulled():
    async def main():
        table, (e, p, _) = make_table()
        sink = opened(table, "r", e)
        table.on_offer(e, offer("r", 0, "image"))
        table.on_pulled(p, Pulled("r", 0))  # P has the blocks; E released them
        p.alive = False
        table.lost(p, WorkerLost("worker 1 (cpu, P) exited"))
        assert isinstance(sink.ended[1], WorkerLost) and len(table) == 0 and not table.relay.holders

    asyncio.run(main())


def test_no_live_target_fails_the_request():
    async def main():
        table, (e, p, _) = make_table()
        sink = opened(table, "r", e)
        p.alive = False
        table.on_offer(e, offer("r", 0, "image"))
        assert e.sent == [Abort(("r",))] and len(table) == 0
        assert "stage P" in str(sink.ended[1])

    asyncio.run(main())


def test_fail_all_ends_every_request_and_refuses_new_ones():
    async def main():
        table, (e, p, _) = make_table()
        first, second = opened(table, "a", e), opened(table, "b", p)
        table.on_offer(e, offer("a", 0, "image"))
        assert table.fail_all("the daemon is stopping: second SIGTERM while draining") == 2
        assert e.sent[-1] == Abort(("a",)) and p.sent[-1] == Abort(("b",))
        for sink in (first, second):
            error = sink.ended[1]
            assert isinstance(error, ServiceStopping) and "second SIGTERM" in str(error)
        assert len(table) == 0 and not table.relay.holders
        with pytest.raises(ServiceStopping, match="second SIGTERM"):
            table.open("c", e, RecordingSink())

    asyncio.run(main())


def test_step_columns_reach_each_request_in_order_with_logprobs_and_ends():
    async def main():
        table, (e, _, _) = make_table()
        a, b, c = (opened(table, r, e) for r in "abc")
        lp = TokenLogprobs(5, -0.1, 1, [5], [-0.1])
        table.deliver_output(EngineOutput(["a", "b"], [5, 6], [lp, None]))
        table.deliver_output(EngineOutput(["b", "a"], [7, 8], None,
                                          [FinishedRequest("a", "length", {"decode_exec": 0.1}),
                                           FinishedRequest("c", "abort")]))
        assert a.events == [("token", 5, lp), ("token", 8, None), ("finish", "length", {"decode_exec": 0.1})]
        assert b.events == [("token", 6, None), ("token", 7, None)]
        assert c.events == [("finish", "abort", None)]
        assert set(table.sinks) == {"b"}

    asyncio.run(main())


def test_an_offer_to_a_target_that_dies_before_pulling_goes_elsewhere_or_waits():
    async def main():
        table, (e, p, d) = make_table(("P", "D", "D"))
        sink = opened(table, "r", e)
        table.on_offer(e, offer("r", 0, "kv"))
        first = p if p.sent else d
        first.alive = False
        table.lost(first, WorkerLost("worker exited"))
        other = d if first is p else p
        assert other.sent == [Migrate(offer("r", 0, "kv"))] and sink.ended is None
        # the only decode instance dies too, while offers are held (a restart is under way)
        table.hold_offers = True
        other.alive = False
        table.lost(other, WorkerLost("worker exited"))
        assert sink.ended is None and len(table) == 1
        other.alive = True
        table.hold_offers = False
        table.retry_parked()
        assert other.sent[-1] == Migrate(offer("r", 0, "kv")) and sink.ended is None

    asyncio.run(main())


def test_new_requests_wait_for_a_restarting_stage_only_while_offers_are_held():
    """``wait_for_stage``: returns at once when a live instance takes the stage or nothing is
    being restarted; else until the parked offers are retried (the restart ended), the daemon
    stops, or the timeout."""
    async def main():
        table, (encoder, _, _) = make_table()

        async def returns_at_once() -> bool:
            task = asyncio.ensure_future(table.wait_for_stage("E", 60.0))
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            done = task.done()
            task.cancel()
            return done

        async def waits_until(event) -> bool:
            task = asyncio.ensure_future(table.wait_for_stage("E", 60.0))
            await asyncio.sleep(0.05)
            waiting = not task.done()
            event()
            await asyncio.wait_for(task, 5.0)
            return waiting

        encoder.alive = False
        assert await returns_at_once()  # no restart: the caller fails the request at once
        table.hold_offers = True
        assert not await returns_at_once()
        await asyncio.wait_for(table.wait_for_stage("E", 0.2), 5.0)  # a restart that does not end in time
        assert await waits_until(lambda: setattr(encoder, "alive", True) or table.retry_parked())
        assert await returns_at_once()  # the encoder is back
        encoder.alive = False
        assert await waits_until(lambda: table.fail_all("stopping"))

    asyncio.run(asyncio.wait_for(main(), 30))


def test_requests_run_again_once_from_their_tokens_when_their_instance_dies(caplog):
    """A request that lost its instance goes to a live instance of its first stage with the
    tokens it had (the others drop its parts), its sink none the wiser, or waits for a
    restart while offers are held; one lost a second time, or with nowhere to go, fails.
    Each death is one warning line however many requests it held."""
    import logging

    from hydrad.engine.inputs import EngineRequest

    def warnings() -> list[str]:
        lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        caplog.clear()
        return lines

    caplog.set_level(logging.INFO, logger="hydrad.migration")

    def request(req_id: str) -> EngineRequest:
        return EngineRequest(req_id, [1, 2, 3], SamplingParams(max_tokens=4))

    table, (p0, p1, d) = make_table(("P", "P", "D"))
    unstarted, started = RecordingSink(), RecordingSink()
    p0.add_request(request("a"), unstarted)
    p0.add_request(request("b"), started)
    table.deliver_output(EngineOutput(req_ids=["b"], token_ids=[7]))
    table.deliver_output(EngineOutput(req_ids=["b"], token_ids=[8]))
    p0.alive = False
    table.lost(p0, WorkerLost("worker gone"))
    assert unstarted.ended is None and started.ended is None and table.num_run_again == 2
    assert warnings() == ["instance 0 held 2 request(s) when it died: 2 run again from the tokens they had "
                          "(0-2 tokens), 0 to be pulled by another instance, 0 failed"]
    sent = {m.request.req_id: m.request for m in p1.sent if isinstance(m, AddRequest)}
    assert sent["a"].output_token_ids == [] and sent["b"].output_token_ids == [7, 8]
    assert sent["b"].prompt_token_ids == [1, 2, 3] and Abort(("a",)) not in p1.sent
    assert table.routes["a"] == table.routes["b"] == [p1.instance_id]
    table.deliver_output(EngineOutput(req_ids=["b"], token_ids=[9]))
    assert started.tokens == [7, 8, 9] and started.ended is None
    p1.alive = False  # lost a second time: they fail
    table.lost(p1, WorkerLost("worker gone again"))
    assert unstarted.ended[0] == "error" and str(unstarted.ended[1]) == "worker gone again"
    assert started.ended[0] == "error" and table.num_lost == 2
    assert not table.sinks and not table._kept and not table._run_again
    assert warnings()[-1] == ("instance 1 held 2 request(s) when it died: 0 run again from the tokens they had, "
                              "0 to be pulled by another instance, 2 failed (2 of them after losing another)")

    # With no live instance of its stage it waits while offers are held (a restart), then
    # goes on; without a restart to wait for it fails at once.
    table, (p0, d) = make_table(("P", "D"))
    sink = RecordingSink()
    p0.add_request(request("c"), sink)
    table.hold_offers = True
    p0.alive = False
    table.lost(p0, WorkerLost("worker gone"))
    assert sink.ended is None
    p0.alive, p0.sent = True, []
    table.hold_offers = False
    table.retry_parked()
    assert [m.request.req_id for m in p0.sent] == ["c"] and sink.ended is None
    table, (p0, d) = make_table(("P", "D"))
    p0.add_request(request("e"), sink := RecordingSink())
    p0.alive = False
    table.lost(p0, WorkerLost("down"))
    assert sink.ended[0] == "error" and str(sink.ended[1]) == "down"
    assert warnings()[-1] == ("instance 0 held 1 request(s) when it died: 0 run again from the tokens they had, "
                              "0 to be pulled by another instance, 1 failed")


def test_pixels_are_kept_to_run_again_within_their_budget():
    """A request's pixels count against ``rerun_image_bytes`` while it is kept; past that a
    request with images is kept until its first token only: streaming when its instance
    dies, it fails, while the others run again; an end gives its bytes back."""
    import torch

    from hydrad.engine.inputs import EngineRequest, ImageInput

    def request(req_id: str) -> EngineRequest:  # 40 bytes of pixels
        return EngineRequest(req_id, [1, 2, 3], SamplingParams(max_tokens=4),
                             images=[ImageInput(torch.zeros(10), 0, 1)])

    table, (ep0, ep1, d) = make_table(("EP", "EP", "D"))
    table.rerun_image_bytes = 100
    sinks = {req_id: RecordingSink() for req_id in "wxyz"}
    for req_id in "wxyz":
        ep0.add_request(request(req_id), sinks[req_id])
        if req_id == "w":
            table.deliver_output(EngineOutput(["w"], [5], finished=[FinishedRequest("w", "length")]))
            assert table.kept_image_bytes == 0
    assert table.kept_image_bytes == 80  # x and y; not z
    table.deliver_output(EngineOutput(["x", "y", "z"], [7, 7, 7]))
    assert set(table._kept) == {"x", "y"}
    ep0.alive = False
    table.lost(ep0, WorkerLost("worker gone"))
    assert sinks["z"].ended[0] == "error" and table.num_lost == 1
    assert sinks["x"].ended is None and sinks["y"].ended is None and table.num_run_again == 2
    assert [m.request.output_token_ids for m in ep1.sent if isinstance(m, AddRequest)] == [[7], [7]]
    assert table.kept_image_bytes == 0  # run again: not kept a second time
    table.rerun_image_bytes = 0  # off: no request with images is kept past its first token
    ep1.add_request(request("v"), RecordingSink())
    table.deliver_output(EngineOutput(["v"], [3]))
    assert "v" not in table._kept and table.kept_image_bytes == 0


def test_choices_sharing_their_pixels_count_them_once():
    """The ``n`` choices of one HTTP request share their images' tensors: those count once
    against ``rerun_image_bytes``, until the last choice holding them ends; a choice whose
    pixels are all held already is kept whole even when the budget has no room left."""
    import torch

    from hydrad.engine.inputs import EngineRequest, ImageInput

    shared, other = torch.zeros(10), torch.zeros(10)  # 40 bytes each

    def request(req_id: str, *pixels) -> EngineRequest:
        return EngineRequest(req_id, [1, 2, 3], SamplingParams(max_tokens=4),
                             images=[ImageInput(p, 0, 1) for p in pixels])

    table, (ep0, ep1, d) = make_table(("EP", "EP", "D"))
    table.rerun_image_bytes = 80
    for req_id in ("a-0", "a-1", "a-2"):
        ep0.add_request(request(req_id, shared), RecordingSink())
    assert table.kept_image_bytes == 40
    ep0.add_request(request("b", other, shared), RecordingSink())  # 40 new bytes: fits
    assert table.kept_image_bytes == 80
    ep0.add_request(request("c", torch.zeros(1)), RecordingSink())  # 4 new bytes: full
    ep0.add_request(request("a-3", shared), RecordingSink())  # nothing new: kept whole
    table.deliver_output(EngineOutput(["a-0", "a-1", "a-2", "a-3", "b", "c"], [7] * 6))
    assert set(table._kept) == {"a-0", "a-1", "a-2", "a-3", "b"}
    table.deliver_output(EngineOutput([], [], finished=[FinishedRequest("b", "length")]))
    assert table.kept_image_bytes == 40  # other's bytes back; shared still held by the a choices
    table.deliver_output(EngineOutput([], [], finished=[FinishedRequest(r, "stop") for r in ("a-0", "a-1", "a-2")]))
    assert table.kept_image_bytes == 40
    ep0.alive = False
    table.lost(ep0, WorkerLost("worker gone"))  # a-3 runs again, not kept a second time
    assert table.num_run_again == 1 and table.num_lost == 1  # c was not kept whole
    assert table.kept_image_bytes == 0 and not table._pixels


def test_a_request_that_loses_two_instances_is_quarantined():
    """A request run again that loses that instance too fails, and the same content (prompt
    tokens and images) is refused for ``quarantine_seconds``, with a 400's one line; other
    requests, the one lost once and the same request after the window are taken."""
    from hydrad.cluster.requests import Quarantine, RequestQuarantined
    from hydrad.engine.inputs import EngineRequest
    from hydrad.server.errors import exception_status

    def request(req_id: str, tokens=(1, 2, 3)) -> EngineRequest:
        return EngineRequest(req_id, list(tokens), SamplingParams(max_tokens=4))

    now = [100.0]
    table, (p0, p1, d) = make_table(("P", "P", "D"))
    table.quarantine = Quarantine(300.0, clock=lambda: now[0])
    poison, bystander = RecordingSink(), RecordingSink()
    p0.add_request(request("poison"), poison)
    p0.alive = False
    table.lost(p0, WorkerLost("worker gone"))
    assert len(table.quarantine) == 0  # lost once: run again, nothing refused
    p0.alive = True
    p0.add_request(request("other", (4, 5)), bystander)  # on p0: it does not lose p1
    table.judge(p0.instance_id, True, "killed by SIGSEGV")
    p1.alive = False
    table.lost(p1, WorkerLost("worker gone again"))
    assert poison.ended[0] == "error" and bystander.ended is None
    assert len(table.quarantine) == 0 and not table._suspects  # until the death is judged
    table.judge(p1.instance_id, True, "killed by SIGSEGV")
    assert len(table.quarantine) == 1 and not table._deaths
    with pytest.raises(RequestQuarantined) as refused:
        p0.add_request(request("again"), RecordingSink())
    assert exception_status(refused.value) == 400 and refused.value.code == "request_quarantined"
    assert "refused for 300 s more" in str(refused.value) and "\n" not in str(refused.value)
    assert "again" not in table.sinks and table.quarantine.num_refused == 1
    p0.add_request(request("different", (1, 2)), RecordingSink())  # other content: taken
    now[0] += 301
    p0.add_request(request("later"), later := RecordingSink())
    assert "later" in table.sinks and later.ended is None and len(table.quarantine) == 0

    # Either death a kill from outside (an operator's SIGKILL): it fails (it ran again once
    # already), and its content is taken again.
    for by_request in ((False, True), (True, False)):
        table, (p0, p1, d) = make_table(("P", "P", "D"))
        p0.add_request(request("bystander"), sink := RecordingSink())
        p0.alive = False
        table.lost(p0, WorkerLost("gone"))
        table.judge(p0.instance_id, by_request[0], "killed")
        p1.alive, p0.alive = False, True
        table.lost(p1, WorkerLost("gone"))
        table.judge(p1.instance_id, by_request[1], "killed")
        assert sink.ended[0] == "error" and len(table.quarantine) == 0
        p0.add_request(request("again"), RecordingSink())
        assert "again" in table.sinks

    # quarantine_seconds = 0: it fails, and nothing is refused.
    table, (p0, p1, d) = make_table(("P", "P", "D"))
    table.quarantine = Quarantine(0.0)
    p0.add_request(request("poison"), RecordingSink())
    p0.alive = False
    table.lost(p0, WorkerLost("gone"))
    p1.alive, p0.alive = False, True
    table.lost(p1, WorkerLost("gone"))
    table.judge(p1.instance_id, True, "killed by SIGSEGV")
    p0.add_request(request("again"), RecordingSink())
    assert "again" in table.sinks and len(table.quarantine) == 0


def test_quarantined_contents_tell_images_apart_and_are_bounded():
    import torch

    from hydrad.cluster.requests import Quarantine, content_digest
    from hydrad.engine.inputs import EngineRequest, ImageInput

    def request(pixels: float) -> EngineRequest:
        return EngineRequest("r", [1, 2, 3], SamplingParams(), images=[ImageInput(torch.full((10,), pixels), 0, 1)])

    assert content_digest(request(0.0)) == content_digest(request(0.0)) != content_digest(request(1.0))
    quarantine = Quarantine(60.0)
    quarantine.MAX_ENTRIES = 3
    for i in range(5):
        quarantine.add(bytes([i]))
    assert len(quarantine) == 3 and list(quarantine._until) == [bytes([2]), bytes([3]), bytes([4])]
