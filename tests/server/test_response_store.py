"""The kept responses of /v1/responses: the bound, the order they go in, the conversation a
chain of them makes, and the calls front-end processes make on the daemon's store."""

import asyncio
import pickle

import pytest

from hydrad.server.response_store import (CannotCancel, KeptResponse, LocalStore, NotStreamed, RemoteStore,
                                          ResponseGone, ResponseRunning, ResponseStore, output_as_input)
from hydrad.transport.messages import KeptQuery


def kept(n: int, previous: str | None = None, text: str = "x", status: str = "completed",
         background: bool = False) -> KeptResponse:
    response = {"id": f"resp_{n}", "object": "response", "status": status, "background": background, "output": [
        {"type": "message", "id": f"msg_{n}_0", "role": "assistant",
         "content": [{"type": "output_text", "text": text}]},
        {"type": "function_call", "id": f"fc_{n}_1", "call_id": f"call_{n}", "name": "f", "arguments": "{}"}]}
    items = [{"type": "message", "id": f"msg_{n}_in0", "role": "user", "content": f"turn {n}"}]
    return KeptResponse.of(response, items, previous)


def linked(daemon_store: ResponseStore, owner: int | None = None) -> RemoteStore:
    """A front end's face of ``daemon_store`` (front end ``owner``): its messages answered as
    the daemon's end of the link answers them (``ResponseStore.answer``), pickled both ways.
    Made within the running loop."""
    remote = None

    def send(msg: KeptQuery) -> None:
        msg = pickle.loads(pickle.dumps(msg))
        result = pickle.loads(pickle.dumps(daemon_store.answer(msg.op, msg.arg, owner=owner)))
        asyncio.get_running_loop().call_soon(remote.answered, msg.seq, result)

    remote = RemoteStore(send)
    return remote


def test_a_chain_is_its_turns_inputs_and_outputs_oldest_first():
    store = ResponseStore(1 << 20)
    for n, previous in ((1, None), (2, "resp_1"), (3, "resp_2")):
        assert store.keep(kept(n, previous))
    ids = [item["id"] for item in store.items("resp_3", with_output=True)]
    assert ids == ["msg_1_in0", "msg_1_0", "fc_1_1", "msg_2_in0", "msg_2_0", "fc_2_1", "msg_3_in0", "msg_3_0", "fc_3_1"]
    # Its input items: everything before its own output.
    assert [item["id"] for item in store.items("resp_3", with_output=False)] == ids[:-2]
    assert output_as_input(kept(1).response) == kept(1).response["output"]


def test_past_the_bound_the_least_recently_used_go_first():
    size = kept(1).nbytes
    store = ResponseStore(3 * size + size // 2)  # room for three
    for n in (1, 2, 3):
        store.keep(kept(n))
    assert store.get("resp_1") is not None  # used: resp_2 is now the least recently used
    store.keep(kept(4))
    assert [store.get(f"resp_{n}") is not None for n in (1, 2, 3, 4)] == [True, False, True, True]
    assert len(store) == 3 and store.nbytes == sum(store.get(f"resp_{n}").nbytes for n in (1, 3, 4))
    # Reading a chain uses every turn of it: a conversation in use keeps its earlier turns.
    store.keep(kept(5, "resp_3"))  # resp_1 out
    store.items("resp_5", with_output=True)
    store.keep(kept(6))
    assert store.get("resp_3") is not None and store.get("resp_4") is None
    # One larger than the whole bound is not kept, and takes nothing out.
    assert not store.keep(kept(7, text="y" * 4 * size))
    assert store.get("resp_7") is None and len(store) == 3


def test_keeping_an_id_again_replaces_it_and_delete_frees_its_bytes():
    store = ResponseStore(1 << 20)
    store.keep(kept(1))
    store.keep(kept(1, text="longer answer"))
    assert len(store) == 1 and store.nbytes == kept(1, text="longer answer").nbytes
    assert store.delete("resp_1") and not store.delete("resp_1")
    assert store.nbytes == 0 and len(store) == 0


def test_a_chain_with_a_turn_not_kept_names_that_turn():
    store = ResponseStore(1 << 20)
    store.keep(kept(1))
    store.keep(kept(2, "resp_1"))
    store.keep(kept(3, "resp_2"))
    store.delete("resp_2")
    with pytest.raises(ResponseGone) as info:
        store.items("resp_3", with_output=True)
    assert info.value.response_id == "resp_2"
    with pytest.raises(ResponseGone) as info:
        store.items("resp_9", with_output=False)
    assert info.value.response_id == "resp_9"


def test_a_front_end_calls_the_daemons_store_over_its_link():
    """RemoteStore's messages, answered as the daemon's end of the link answers them
    (``ResponseStore.answer``), pickled both ways: the same results as the daemon's own
    LocalStore, a response not kept raised as ResponseGone."""
    daemon_store = ResponseStore(1 << 20)

    async def main():
        remote = linked(daemon_store)
        local = LocalStore(daemon_store)
        assert await remote.call("keep", kept(1)) is True
        await local.call("keep", kept(2, "resp_1"))
        for store in (remote, local):
            assert (await store.call("get", "resp_2"))["id"] == "resp_2"
            assert await store.call("get", "resp_9") is None
            assert len(await store.call("items", "resp_2")) == 6
            assert len(await store.call("inputs", "resp_2")) == 4
            with pytest.raises(ResponseGone):
                await store.call("items", "resp_9")
        assert await remote.call("delete", "resp_1") is True
        with pytest.raises(ResponseGone) as info:
            await local.call("items", "resp_2")
        assert info.value.response_id == "resp_1"

        # A daemon that stops answering: the waiting call fails with what failed it.
        silent = RemoteStore(lambda msg: None)
        call = asyncio.ensure_future(silent.call("get", "resp_2"))
        await asyncio.sleep(0)
        silent.fail_all(ConnectionError("the daemon is gone"))
        with pytest.raises(ConnectionError):
            await call

    asyncio.run(main())


def test_a_background_response_runs_kept_and_is_answered_in_place():
    """Kept as created (queued), in progress once it runs, then its answer in its place;
    while it runs it is never evicted, and its chain cannot be continued."""
    aborted = []
    size = kept(1).nbytes
    store = ResponseStore(3 * size + size // 2, abort=aborted.extend)  # room for three
    assert store.start(kept(1, status="queued", background=True), ("resp_1",))
    assert store.num_running == 1 and store.get("resp_1").response["status"] == "queued"
    assert store.progress("resp_1") and store.get("resp_1").response["status"] == "in_progress"
    with pytest.raises(ResponseRunning):
        store.items("resp_1", with_output=True)
    assert len(store.items("resp_1", with_output=False)) == 1  # its input items are there already
    # Four more kept past the bound: the oldest that does not run goes each time, never resp_1.
    for n in (2, 3, 4, 5):
        assert store.keep(kept(n))
    assert store.get("resp_1") is not None and [store.get(f"resp_{n}") is None for n in (2, 3)] == [True, True]
    # Three running fill the bound: a fourth finds no room, and nothing is evicted for it.
    for n in (6, 7):
        assert store.start(kept(n, status="queued", background=True), (f"resp_{n}",))
    assert not store.start(kept(8, status="queued", background=True), ("resp_8",))
    assert store.num_running == 3 and len(store) == 3 and store.get("resp_8") is None
    # Answered: kept as answered, no longer running, and the store's size follows.
    assert store.finish(kept(1, background=True, text="the answer"))
    assert store.get("resp_1").response["status"] == "completed" and store.num_running == 2
    assert store.get("resp_1").response["output"][0]["content"][0]["text"] == "the answer"
    assert store.nbytes == sum(store.get(i).nbytes for i in ("resp_1", "resp_6", "resp_7"))
    assert not store.finish(kept(1, background=True))  # it no longer runs: a second answer is dropped
    assert aborted == []


def test_cancel_ends_a_running_background_response_and_nothing_else():
    aborted = []
    store = ResponseStore(1 << 20, abort=aborted.extend)
    store.start(kept(1, status="queued", background=True), ("resp_1",))
    store.progress("resp_1")
    cancelled = store.cancel("resp_1")
    assert cancelled["status"] == "cancelled" and aborted == ["resp_1"] and store.num_running == 0
    assert store.cancel("resp_1") == cancelled and aborted == ["resp_1"]  # again: the same, nothing aborted
    # Its task's answer, coming after, is dropped; so is the move to in progress (it should stop).
    assert not store.finish(kept(1, background=True)) and not store.progress("resp_1")
    assert store.get("resp_1").response["status"] == "cancelled"
    # Not a running background response: why not, as OpenAI says it.
    store.keep(kept(2))
    with pytest.raises(CannotCancel, match="synchronous"):
        store.cancel("resp_2")
    store.start(kept(3, status="queued", background=True), ("resp_3-0", "resp_3-1"))
    store.finish(kept(3, background=True))
    with pytest.raises(CannotCancel, match="already completed"):
        store.cancel("resp_3")
    assert store.cancel("resp_9") is None
    # Deleting one that runs ends it too, and its answer does not bring it back.
    store.start(kept(4, status="queued", background=True), ("resp_4",))
    assert store.delete("resp_4") and aborted == ["resp_1", "resp_4"]
    assert not store.finish(kept(4, background=True)) and store.get("resp_4") is None and store.num_running == 0


def test_the_background_responses_of_a_front_end_that_died_fail_with_it():
    store = ResponseStore(1 << 20)
    store.answer("start", (kept(1, status="queued", background=True), ("resp_1",), False), owner=0)
    store.answer("start", (kept(2, status="queued", background=True), ("resp_2",), False), owner=1)
    store.answer("start", (kept(3, status="queued", background=True), ("resp_3",), False))  # the daemon's own
    assert store.orphaned(1, "exit code -9") == 1
    failed = store.get("resp_2").response
    assert failed["status"] == "failed" and "exit code -9" in failed["error"]["message"]
    assert [store.get(f"resp_{n}").response["status"] for n in (1, 3)] == ["queued", "queued"]
    assert store.num_running == 2 and store.orphaned(1, "again") == 0


def test_cancel_and_its_refusals_cross_a_front_ends_link():
    daemon_store = ResponseStore(1 << 20)

    async def main():
        remote = linked(daemon_store, owner=0)
        assert await remote.call("start", (kept(1, status="queued", background=True), ("resp_1",), False)) is True
        assert await remote.call("progress", "resp_1") is True
        with pytest.raises(ResponseRunning):
            await remote.call("items", "resp_1")
        assert (await remote.call("cancel", "resp_1"))["status"] == "cancelled"
        await remote.call("keep", kept(2))
        with pytest.raises(CannotCancel, match="synchronous"):
            await remote.call("cancel", "resp_2")
        with pytest.raises(CannotCancel):
            await LocalStore(daemon_store).call("cancel", "resp_2")

    asyncio.run(main())


def test_a_streamed_background_responses_events_are_kept_counted_and_read_after_a_number():
    """Created with ``stream``: its events are kept in order (read after a sequence number),
    counted in its size while it runs and once answered, and make finished responses go;
    they end with it (cancelled: no more are taken), and go with it."""
    aborted = []
    size = kept(1).nbytes
    store = ResponseStore(4 * size, abort=aborted.extend)
    assert store.start(kept(1, status="queued", background=True), ("resp_1",), streamed=True)
    events = [b"event: e%d\ndata: {}\n\n" % i for i in range(6)]
    assert store.add_events("resp_1", events[:4]) is False  # no process has read them here yet
    assert store.events("resp_1", -1) == (events[:4], False)  # one that does not run it follows it
    assert store.add_events("resp_1", events[4:]) is True  # whose runner hands them on sooner
    assert store.events("resp_1", -1) == (events, False) and store.events("resp_1", 3) == (events[4:], False)
    assert store.events("resp_1", 5) == ([], False)
    queued = store.get("resp_1").nbytes
    assert store.nbytes == queued + sum(map(len, events))
    # Finished responses make room for more events; the running one stays.
    assert store.keep(kept(2)) and store.keep(kept(3))
    big = [b"x" * size]
    assert store.add_events("resp_1", big) is True
    assert store.get("resp_2") is None and store.get("resp_3") is not None
    assert store.nbytes == queued + store.get("resp_3").nbytes + sum(map(len, events + big))
    # Answered: its events stay with its answer, and it has ended.
    assert store.finish(kept(1, background=True, text="the answer"))
    assert store.events("resp_1", 5) == (big, True) and store.num_running == 0
    assert store.nbytes == store.get("resp_1").nbytes + store.get("resp_3").nbytes + sum(map(len, events + big))
    assert store.add_events("resp_1", events) is None  # it no longer runs: dropped
    # A response kept without them, and one not kept at all.
    with pytest.raises(NotStreamed):
        store.events("resp_3", -1)
    assert store.events("resp_9", -1) is None
    # Cancelled: ended for its followers, no event taken after; evicted or deleted: its events
    # go with it.
    assert store.start(kept(4, status="queued", background=True), ("resp_4",), streamed=True)
    assert store.get("resp_1") is None  # the least recently used made room for it
    assert store.add_events("resp_4", events[:2]) is False
    store.cancel("resp_4")
    assert store.events("resp_4", -1) == (events[:2], True) and store.add_events("resp_4", events[2:]) is None
    assert aborted == ["resp_4"]
    for response_id in ("resp_3", "resp_4"):
        assert store.delete(response_id)
    assert store.nbytes == 0 and len(store) == 0


def test_a_front_end_reads_a_streamed_responses_events_over_its_link():
    daemon_store = ResponseStore(1 << 20)

    async def main():
        remote = linked(daemon_store, owner=0)
        assert await remote.call("start", (kept(1, status="queued", background=True), ("resp_1",), True))
        assert await remote.call("add_events", ("resp_1", [b"a\n\n", b"b\n\n"])) is False
        assert await remote.call("events", ("resp_1", 0)) == ([b"b\n\n"], False)
        assert await remote.call("add_events", ("resp_1", [b"c\n\n"])) is True
        await remote.call("keep", kept(2))
        with pytest.raises(NotStreamed):
            await remote.call("events", ("resp_2", -1))

    asyncio.run(main())
