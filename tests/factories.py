"""Reusable builders for tests: tiny checkpoints and the same weights in every on-disk layout."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from hydrad.models.builder import SAFETENSORS_INDEX, build_model, write_weights

# Layout fixture name -> (writer layout, max shard size in bytes). The tiny model holds ~0.7 MB
# of weights, so 300 kB gives three shards.
LAYOUTS: dict[str, tuple[str, int | None]] = {
    "hub": ("hub", None),
    "hf5": ("hf5", None),
    "module": ("module", None),
    "hub-sharded": ("hub", 300_000),
}


def make_tiny_llava(out_dir: Path, seed: int = 0) -> Path:
    return build_model(out_dir, "llava", "tiny", seed, progress=False)


def make_tiny(out_dir: Path, arch: str, seed: int = 0, layout: str = "hf5") -> Path:
    """A tiny checkpoint of ``arch`` (a ``hydrad make-model --arch`` name) as ``hydrad make-model`` writes it."""
    return build_model(out_dir, arch, "tiny", seed, layout=layout, progress=False)


def hf_model(path: Path):
    """transformers' model of the checkpoint at ``path`` (its config's architecture), in eval mode."""
    import transformers

    from hydrad.models.loader import load_config

    return getattr(transformers, load_config(path).architectures[0]).from_pretrained(path).eval()


def module_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as transformers holds them in memory (``model.language_model.*``, ...)."""
    return dict(hf_model(path).state_dict())


def canonical_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The reference for the loader: in-memory names without the leading ``model.``."""
    return {name.removeprefix("model."): t for name, t in module_state_dict(path).items()}


def is_weight_file(path: Path) -> bool:
    return path.name == SAFETENSORS_INDEX or path.suffix == ".safetensors"


def copy_without_weights(src_dir: Path, out_dir: Path) -> Path:
    """``src_dir``'s config, tokenizer and processor files, without any weight file."""
    out_dir.mkdir(parents=True)
    for path in src_dir.iterdir():
        if not is_weight_file(path):
            shutil.copy2(path, out_dir / path.name)
    return out_dir


def make_layout(
    src_dir: Path,
    out_dir: Path,
    state_dict: Mapping[str, torch.Tensor],
    layout: str,
    max_shard_size: int | None = None,
    model_type: str = "llava",
) -> Path:
    """A complete checkpoint: ``src_dir``'s other files and ``state_dict`` (in-memory names) in ``layout``."""
    copy_without_weights(src_dir, out_dir)
    write_weights(state_dict, out_dir, layout, max_shard_size=max_shard_size, model_type=model_type)
    return out_dir


def weight_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix == ".safetensors")


# Every deployment method the tests run end to end: (deploy spec, devices).
DEPLOYMENTS = [
    ("1E+1P+1D", "cpu:3"),
    ("1EP+1D", "cpu:2"),
    ("1ED+1P", "cpu:2"),
    ("1E+1PD", "cpu:2"),
    ("2EPD", "cpu:2"),
    ("1E+1EP+1D", "cpu:3"),
]


class RecordingSink:
    """A request sink that records what reaches it: ("token", id, logprobs),
    ("finish", reason, stage_times) and ("error", exception)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_token(self, token_id, logprobs) -> None:
        self.events.append(("token", token_id, logprobs))

    def on_finish(self, finish_reason, stage_times) -> None:
        self.events.append(("finish", finish_reason, stage_times))

    def on_error(self, error) -> None:
        self.events.append(("error", error))

    @property
    def tokens(self) -> list[int]:
        return [e[1] for e in self.events if e[0] == "token"]

    @property
    def ended(self) -> tuple | None:
        return next((e for e in self.events if e[0] in ("finish", "error")), None)

    async def until_ended(self, timeout: float = 5.0) -> tuple:
        import asyncio

        for _ in range(int(timeout / 0.01)):
            if self.ended is not None:
                return self.ended
            await asyncio.sleep(0.01)
        raise AssertionError(f"no end within {timeout} s: {self.events}")
