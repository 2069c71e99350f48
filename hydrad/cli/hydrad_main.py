"""``hydrad``: start the daemon, build offline checkpoints."""

from __future__ import annotations

import click

from hydrad.cli.common import run_main
from hydrad.cli.make_model import make_model
from hydrad.cli.start import start


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hydrad")
def cli() -> None:
    """hydrad: a serving daemon for vision-language models."""


cli.add_command(start)
cli.add_command(make_model)


def main() -> None:
    run_main(cli)
