"""Length-prefixed frames, exactly as ``multiprocessing.Connection`` writes them.

A frame is a signed 4-byte big-endian length and that many bytes of payload; a
payload of 2 GiB or more has the length -1 followed by an unsigned 8-byte length.
The worker side of a pipe keeps using ``Connection.send``/``recv`` (it blocks on
purpose); the daemon side reads raw bytes as they come and cuts them into frames
here, so a message that arrives in several pieces is never mistaken for a broken
pipe, whatever the descriptor's blocking mode.
"""

from __future__ import annotations

import struct

_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!Q")
_SHORT_MAX = 0x7FFFFFFF


def encode_frame(payload: bytes | bytearray | memoryview) -> bytes:
    """``payload`` with the header ``Connection.recv`` expects."""
    n = len(payload)
    if n > _SHORT_MAX:
        return _SHORT.pack(-1) + _LONG.pack(n) + bytes(payload)
    return _SHORT.pack(n) + bytes(payload)


class FrameDecoder:
    """Bytes in, complete frames out; keeps the tail of a frame until the rest arrives."""

    def __init__(self) -> None:
        self._buf = bytearray()
        # Length of the frame at the head of the buffer (header included), once known.
        self._need = 0
        self._header = 0

    @property
    def num_buffered_bytes(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Take ``data``; return every frame it completes, in order."""
        buf = self._buf
        buf += data
        frames: list[bytes] = []
        start = 0
        end = len(buf)
        view = memoryview(buf)
        try:
            while True:
                if not self._need:
                    if end - start < 4:
                        break
                    (n,) = _SHORT.unpack_from(buf, start)
                    if n == -1:
                        if end - start < 12:
                            break
                        (n,) = _LONG.unpack_from(buf, start + 4)
                        self._header = 12
                    elif n < 0:
                        raise ValueError(f"corrupt frame header (length {n})")
                    else:
                        self._header = 4
                    self._need = self._header + n
                if end - start < self._need:
                    break
                with view[start + self._header : start + self._need] as frame:
                    frames.append(frame.tobytes())
                start += self._need
                self._need = 0
        finally:
            view.release()  # a bytearray with a live view cannot shrink
        if start:
            del buf[:start]
        return frames
