"""``hydractl``: operate a running hydrad daemon (status, bench, ...)."""

from __future__ import annotations

import importlib

import click

from hydrad.cli.common import run_main


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hydrad")
def cli() -> None:
    """hydractl: operator CLI for a hydrad daemon."""


# One module per command; each defines a click command of the same name.
for _name in ("status", "bench"):
    try:
        _mod = importlib.import_module(f"hydrad.cli.{_name}")
    except ImportError:
        continue
    cli.add_command(getattr(_mod, _name))


def main() -> None:
    run_main(cli)


if __name__ == "__main__":
    main()
