"""The one rich console that progress displays and one-line errors go to (stderr).

Library code (model builder, ``LLM``, worker start-up) shows progress here without
importing the command-line package, which sits above it."""

import atexit
import io
import os
import sys

from rich.console import Console

# The width a console lays out in when its output is not a terminal: a pipe, a file or the
# journal under systemd get whole lines and whole tables, not 80 columns' worth.
OFF_TERMINAL_WIDTH = 200


class WholeLines(io.TextIOBase):
    """Standard output or error, written a whole line at a time. Off a terminal the daemon,
    its workers and its front-end processes write into one file or pipe; rich writes a
    line's text and its newline in two writes (a progress display's last line: the text,
    a flush, then the newline), and a worker's log line written in between would land after
    that text, on its line. Here a partial line waits for its end (flushed at exit)."""

    def __init__(self, stderr: bool):
        self._stderr = stderr
        self._pending = ""
        atexit.register(self._write_pending)

    @property
    def _stream(self):
        # Looked up at each write: whatever the process (or a test) has made its stdout now.
        return sys.stderr if self._stderr else sys.stdout

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", None) or "utf-8"

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        pending = self._pending + text
        end = pending.rfind("\n") + 1
        self._pending = pending[end:]
        if end:
            stream = self._stream
            stream.write(pending[:end])
            stream.flush()
        return len(text)

    def flush(self) -> None:
        """Complete lines are written as they come; a partial one waits for its end."""

    def _write_pending(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, ""
            try:
                self._stream.write(pending)
                self._stream.flush()
            except (OSError, ValueError):
                pass  # at exit, into a closed pipe or stream: nothing to tell anyone


def make_console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr): a terminal's width on a terminal, else
    ``OFF_TERMINAL_WIDTH`` (``COLUMNS``, when set, wins either way) and whole lines
    (``WholeLines``)."""
    out = Console(stderr=stderr)
    if not out.is_terminal:
        width = None if "COLUMNS" in os.environ else OFF_TERMINAL_WIDTH
        out = Console(file=WholeLines(stderr), width=width)
    return out


console = make_console(stderr=True)
