"""Shared CLI plumbing: one rich console, and known errors shown as one line."""

from __future__ import annotations

import os
import sys

import click

from hydrad.console import console  # noqa: F401  (the CLI's console is the library's)


def debug_enabled() -> bool:
    return os.environ.get("HYDRAD_DEBUG", "") not in ("", "0")


def run_main(group: click.Group) -> None:
    """Run a click group; user-caused errors print one line unless HYDRAD_DEBUG=1."""
    from hydrad.errors import HydradError

    try:
        group(standalone_mode=False)
    except click.exceptions.Abort:
        console.print("aborted")
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except BrokenPipeError:
        # The reader went away (``hydractl status --json --watch | head -1``): end quietly, and
        # keep the interpreter's last flush of stdout from raising it again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except (HydradError, OSError) as e:
        if debug_enabled():
            raise
        console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
