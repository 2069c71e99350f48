"""The daemon's end of a worker pipe reads whole frames whatever pieces the bytes come in.

``multiprocessing.Connection.send`` writes a message over 16 KB as a header and a
payload in two writes, and a large message reaches the reader in many pieces. The
frame decoder must yield exactly the frames sent, split at any boundary; the link
must carry messages from a few bytes to tens of MB in both directions, under the
standard event loop and under uvloop.
"""

from __future__ import annotations

import asyncio
import os
import random
import struct
import threading
from multiprocessing.reduction import ForkingPickler

import pytest
import torch.multiprocessing as mp

from hydrad.transport.framing import FrameDecoder, encode_frame
from hydrad.transport.link import EOF, LinkClosed, WorkerLink

SMALL_SIZES = [0, 1, 2, 3, 4, 5, 7, 16, 255, 256, 4095, 4096, 16383, 16384, 16385]


def payloads(sizes, seed=0):
    rng = random.Random(seed)
    return [rng.randbytes(n) for n in sizes]


def feed_pieces(decoder: FrameDecoder, data: bytes, cuts: list[int]) -> list[bytes]:
    frames, last = [], 0
    for cut in [*cuts, len(data)]:
        frames += decoder.feed(data[last:cut])
        last = cut
    return frames


def test_small_frames_split_at_every_boundary():
    msgs = payloads(SMALL_SIZES[:9])
    data = b"".join(encode_frame(m) for m in msgs)
    for cut in range(len(data) + 1):
        decoder = FrameDecoder()
        assert feed_pieces(decoder, data, [cut]) == msgs, cut
        assert decoder.num_buffered_bytes == 0
    for first in range(0, len(data), 7):  # every pair of cuts, thinned
        for second in range(first, len(data), 5):
            assert feed_pieces(FrameDecoder(), data, [first, second]) == msgs


def test_byte_by_byte_and_all_at_once():
    msgs = payloads(SMALL_SIZES)
    data = b"".join(encode_frame(m) for m in msgs)
    assert feed_pieces(FrameDecoder(), data, list(range(1, len(data)))) == msgs
    assert FrameDecoder().feed(data) == msgs


@pytest.mark.parametrize("size", [1 << 20, 24 << 20])
def test_large_frames_split_around_every_header_and_in_random_pieces(size):
    msgs = payloads([size, 3, size // 3, 0], seed=size)
    data = b"".join(encode_frame(m) for m in msgs)
    # Cuts inside and around each header, and at each frame's last bytes.
    edges, offset = [], 0
    for m in msgs:
        edges += [offset + d for d in (0, 1, 2, 3, 4, 5)]
        offset += 4 + len(m)
        edges += [offset - 1, offset]
    for cut in sorted({e for e in edges if 0 <= e <= len(data)}):
        assert feed_pieces(FrameDecoder(), data, [cut]) == msgs
    rng = random.Random(1)
    cuts, pos = [], 0
    while pos < len(data):
        pos += rng.choice([1, 3, 4, 1000, 65536, 1 << 20])
        cuts.append(min(pos, len(data)))
    assert feed_pieces(FrameDecoder(), data, cuts) == msgs


def test_long_header_form_and_corrupt_header():
    payload = b"hello"
    long_form = struct.pack("!i", -1) + struct.pack("!Q", len(payload)) + payload
    assert feed_pieces(FrameDecoder(), long_form, list(range(1, len(long_form)))) == [payload]
    with pytest.raises(ValueError, match="corrupt"):
        FrameDecoder().feed(struct.pack("!i", -7))


def test_same_bytes_as_multiprocessing_connection():
    a, b = mp.Pipe()
    try:
        for m in payloads([0, 5, 16384, 100_000]):
            a.send_bytes(m)  # its own framing, read back as raw bytes
            decoder, got = FrameDecoder(), []
            while not got:
                got = decoder.feed(os.read(b.fileno(), 1 << 16))
            assert got == [m]
            os.write(a.fileno(), encode_frame(m))  # ours, read back by multiprocessing
            assert b.recv_bytes() == m
    finally:
        a.close()
        b.close()


# -- the link, under both event loops --------------------------------------------------------

LOOPS = ["asyncio", "uvloop"]


def run(loop_name: str, coro):
    if loop_name == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_link_carries_messages_of_every_size_both_ways(loop_name):
    sizes = [1, 100, 16383, 16384, 16385, 70_000, 1 << 20, 32 << 20, 5, 200_000]
    msgs = [("m", i, os.urandom(n)) for i, n in enumerate(sizes)]

    def worker(conn):  # a blocking Connection, as a worker process holds it
        for msg in msgs:
            conn.send(msg)
        echoed = [conn.recv() for _ in msgs]
        conn.send(("echoed", echoed == msgs))
        conn.close()

    async def main():
        daemon_end, worker_end = mp.Pipe()
        received, closed = [], asyncio.get_running_loop().create_future()
        link = await WorkerLink.open(daemon_end, received.append, closed.set_result)
        thread = threading.Thread(target=worker, args=(worker_end,), daemon=True)
        thread.start()
        for msg in msgs:  # queued at once, written as the worker reads
            link.send(msg)
        assert await asyncio.wait_for(closed, 60) == EOF
        thread.join(10)
        assert received[: len(msgs)] == msgs
        assert received[len(msgs)] == ("echoed", True)
        assert link.num_messages_received == len(msgs) + 1
        with pytest.raises(LinkClosed):
            link.send("late")

    run(loop_name, main())


@pytest.mark.parametrize("loop_name", LOOPS)
def test_link_survives_a_flood_of_mid_sized_messages(loop_name):
    """Thousands of messages just over the size multiprocessing writes in two pieces."""
    count = 2000

    def worker(conn):
        for i in range(count):
            conn.send((i, b"x" * (16_384 + i % 97)))
        conn.close()

    async def main():
        daemon_end, worker_end = mp.Pipe()
        received, closed = [], asyncio.get_running_loop().create_future()
        await WorkerLink.open(daemon_end, received.append, closed.set_result)
        thread = threading.Thread(target=worker, args=(worker_end,), daemon=True)
        thread.start()
        assert await asyncio.wait_for(closed, 60) == EOF
        thread.join(10)
        assert [i for i, _ in received] == list(range(count))
        assert all(len(blob) == 16_384 + i % 97 for i, blob in received)

    run(loop_name, main())


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_frame_cut_off_by_eof_closes_the_link_without_a_message(loop_name):
    async def main():
        daemon_end, worker_end = mp.Pipe()
        received, closed = [], asyncio.get_running_loop().create_future()
        await WorkerLink.open(daemon_end, received.append, closed.set_result)
        frame = encode_frame(ForkingPickler.dumps(("big", b"y" * 100_000)))
        os.write(worker_end.fileno(), frame[: len(frame) // 2])
        await asyncio.sleep(0.05)
        assert not received and not closed.done()  # half a message: wait, do not fail
        worker_end.close()
        assert await asyncio.wait_for(closed, 10) == EOF
        assert not received

    run(loop_name, main())


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_failing_handler_does_not_close_the_link(loop_name):
    async def main():
        daemon_end, worker_end = mp.Pipe()
        received, closed = [], asyncio.get_running_loop().create_future()

        def on_message(msg):
            if msg == "bad":
                raise RuntimeError("handler bug")
            received.append(msg)

        link = await WorkerLink.open(daemon_end, on_message, closed.set_result)
        worker_end.send("bad")
        worker_end.send("good")
        for _ in range(100):
            if received:
                break
            await asyncio.sleep(0.01)
        assert received == ["good"] and link.is_open
        worker_end.close()
        assert await asyncio.wait_for(closed, 10) == EOF

    run(loop_name, main())


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_peer_gone_with_unread_bytes_counts_as_eof(loop_name):
    """Closing an end that has unread data resets the socket (ECONNRESET): still the
    worker's end going away, not a failure of the pipe."""
    async def main():
        daemon_end, worker_end = mp.Pipe()
        received, closed = [], asyncio.get_running_loop().create_future()
        link = await WorkerLink.open(daemon_end, received.append, closed.set_result)
        link.send(("unread", b"z" * 100_000))  # the worker never reads this
        await asyncio.sleep(0.05)
        worker_end.close()
        assert await asyncio.wait_for(closed, 10) == EOF

    run(loop_name, main())


@pytest.mark.parametrize("loop_name", LOOPS)
def test_unread_bytes_count_the_socket_and_a_partial_frame(loop_name):
    async def main():
        daemon_end, worker_end = mp.Pipe()
        received, closed = [], asyncio.get_running_loop().create_future()
        link = await WorkerLink.open(daemon_end, received.append, closed.set_result)
        frame = encode_frame(ForkingPickler.dumps(("big", b"y" * 10_000)))
        os.write(worker_end.fileno(), frame[:1000])  # read at once: a partial frame, buffered
        for _ in range(100):
            if link.num_bytes_unread == 1000:
                break
            await asyncio.sleep(0.01)
        assert link.num_bytes_unread == 1000
        link._transport.pause_reading()
        os.write(worker_end.fileno(), frame[1000:])  # waits in the socket
        await asyncio.sleep(0.05)
        assert link.num_bytes_unread == len(frame) and not received
        link._transport.resume_reading()
        for _ in range(100):
            if received:
                break
            await asyncio.sleep(0.01)
        assert received == [("big", b"y" * 10_000)] and link.num_bytes_unread == 0
        worker_end.close()
        assert await asyncio.wait_for(closed, 10) == EOF

    run(loop_name, main())
