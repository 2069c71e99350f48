"""The kept responses of /v1/responses: the bound, the order they go in, the conversation a
chain of them makes, and the calls front-end processes make on the daemon's store."""

import asyncio
import pickle

import pytest

from hydrad.server.response_store import (KeptResponse, LocalStore, RemoteStore, ResponseGone, ResponseStore,
                                          output_as_input)
from hydrad.transport.messages import KeptQuery


def kept(n: int, previous: str | None = None, text: str = "x") -> KeptResponse:
    response = {"id": f"resp_{n}", "object": "response", "status": "completed", "output": [
        {"type": "message", "id": f"msg_{n}_0", "role": "assistant",
         "content": [{"type": "output_text", "text": text}]},
        {"type": "function_call", "id": f"fc_{n}_1", "call_id": f"call_{n}", "name": "f", "arguments": "{}"}]}
    items = [{"type": "message", "id": f"msg_{n}_in0", "role": "user", "content": f"turn {n}"}]
    return KeptResponse.of(response, items, previous)


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
        remote = None

        def send(msg: KeptQuery) -> None:
            msg = pickle.loads(pickle.dumps(msg))
            result = pickle.loads(pickle.dumps(daemon_store.answer(msg.op, msg.arg)))
            asyncio.get_running_loop().call_soon(remote.answered, msg.seq, result)

        remote = RemoteStore(send)
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
