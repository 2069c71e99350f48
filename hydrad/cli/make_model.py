"""``hydrad make-model``: build a random-weight checkpoint offline."""

from __future__ import annotations

import click

from hydrad.cli.common import console
from hydrad.models.builder import ARCHS, DEFAULT_LAYOUT, SIZES


@click.command("make-model")
@click.argument("out", type=click.Path(file_okay=False, writable=True))
@click.option("--arch", type=click.Choice(ARCHS), default="llava", show_default=True,
              help="llava (LLaVA-1.5), llava-next (LLaVA-NeXT, anyres), qwen2-vl, qwen2.5-vl.")
@click.option("--size", type=click.Choice(SIZES), default="tiny", show_default=True,
              help="tiny: about 1 MB, for tests; small: ~120 MB, for benchmarks (the default model).")
@click.option("--layout", type=click.Choice(("hub", "hf5")), default=DEFAULT_LAYOUT, show_default=True,
              help="Weight names: as on the Hugging Face hub, or as transformers 5 saves them.")
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same weights.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists and is not empty.")
def make_model(out: str, arch: str, size: str, layout: str, seed: int, force: bool) -> None:
    """Write a complete Hugging Face checkpoint folder with random weights to OUT.

    Nothing is downloaded: the tokenizer is trained on a built-in text.
    """
    from pathlib import Path

    from hydrad.models.builder import build_model

    out_dir = Path(out)
    if not force and out_dir.exists() and any(out_dir.iterdir()):
        raise click.ClickException(f"{out_dir} is not empty; pass --force to replace it")
    path = build_model(out_dir, arch, size, seed, layout=layout, overwrite=force, progress=True)
    num_bytes = sum(f.stat().st_size for f in path.iterdir())
    console.print(f"wrote {arch} {size} (seed {seed}, {layout} layout) to {path} ({num_bytes / 2**20:.1f} MiB)",
                  highlight=False)
