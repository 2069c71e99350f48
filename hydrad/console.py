"""The one rich console that progress displays and one-line errors go to (stderr).

Library code (model builder, ``LLM``, worker start-up) shows progress here without
importing the command-line package, which sits above it."""

import os

from rich.console import Console

# The width a console lays out in when its output is not a terminal: a pipe, a file or the
# journal under systemd get whole lines and whole tables, not 80 columns' worth.
OFF_TERMINAL_WIDTH = 200


def make_console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr): a terminal's width on a terminal, else
    ``OFF_TERMINAL_WIDTH`` (``COLUMNS``, when set, wins either way)."""
    out = Console(stderr=stderr)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(stderr=stderr, width=OFF_TERMINAL_WIDTH)
    return out


console = make_console(stderr=True)
