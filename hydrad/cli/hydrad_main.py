"""``hydrad``: start the daemon, build offline checkpoints."""

from __future__ import annotations

import click

from hydrad.cli.common import run_main


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hydrad")
def cli() -> None:
    """hydrad: a serving daemon for vision-language models."""


def _register() -> None:
    from hydrad.cli import make_model

    cli.add_command(make_model.make_model)
    try:
        from hydrad.cli import start
    except ImportError:  # the daemon module lands separately
        return
    cli.add_command(start.start)


_register()


def main() -> None:
    run_main(cli)
