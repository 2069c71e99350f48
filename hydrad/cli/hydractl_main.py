"""``hydractl``: operate a running hydrad daemon (status, redeploy, bench, profile)."""

from __future__ import annotations

import signal

import click

from hydrad.cli.bench import bench
from hydrad.cli.common import run_main
from hydrad.cli.profile import profile
from hydrad.cli.redeploy import redeploy
from hydrad.cli.status import status


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hydrad")
def cli() -> None:
    """hydractl: operator CLI for a hydrad daemon."""


cli.add_command(status)
cli.add_command(redeploy)
cli.add_command(bench)
cli.add_command(profile)


def main() -> None:
    # ``status --watch`` and ``bench`` run until Ctrl-C. A shell without job control starts
    # background commands with SIGINT ignored, and Python keeps an ignored SIGINT ignored:
    # such a hydractl could never be interrupted. Take SIGINT back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    run_main(cli)


if __name__ == "__main__":
    main()
