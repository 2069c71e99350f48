"""``hydrad make-model``: build a random-weight checkpoint offline."""

from __future__ import annotations

import click

from hydrad.cli.common import console
from hydrad.models.builder import ARCHS, SIZES


@click.command("make-model")
@click.argument("out", type=click.Path(file_okay=False, writable=True))
@click.option("--arch", type=click.Choice(ARCHS), default="llava", show_default=True)
@click.option("--size", type=click.Choice(list(SIZES)), default="tiny", show_default=True,
              help="tiny: < 1 MB, for tests; small: ~120 MB, for benchmarks (the default model).")
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same weights.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists and is not empty.")
def make_model(out: str, arch: str, size: str, seed: int, force: bool) -> None:
    """Write a complete Hugging Face checkpoint folder with random weights to OUT.

    Nothing is downloaded: the tokenizer is trained on a built-in text.
    """
    from pathlib import Path

    from hydrad.models.builder import build_model

    out_dir = Path(out)
    if not force and out_dir.exists() and any(out_dir.iterdir()):
        raise click.ClickException(f"{out_dir} is not empty; pass --force to replace it")
    path = build_model(out_dir, arch, size, seed, overwrite=force, progress=True)
    num_bytes = sum(f.stat().st_size for f in path.iterdir())
    console.print(f"wrote {arch} {size} (seed {seed}) to {path} ({num_bytes / 2**20:.1f} MiB)", highlight=False)
