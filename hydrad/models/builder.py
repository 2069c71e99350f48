"""Build complete Hugging Face checkpoints with random weights, offline.

A built folder holds config.json (with ``architectures``), generation_config.json,
safetensors weights, a byte-level BPE tokenizer trained on a built-in text, and the
processor files, and loads with the architecture's transformers class and
``AutoTokenizer`` (and ``AutoProcessor``, or ``hydrad.models.hf_processor`` for the Qwen
families, whose stock processor wants torchvision). Weights are a function of the seed only.
What each architecture and size is lives in ``builder_archs``.

Importing this module is cheap (the CLI reads ``ARCHS`` and ``SIZES``); torch,
tokenizers and transformers load when a build starts.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from hydrad.errors import CheckpointError
from hydrad.models.builder_archs import ARCH_SPECS, TokenizerSpec, make_config, make_processor

if TYPE_CHECKING:
    import torch

ARCHS = tuple(ARCH_SPECS)
SIZES = ("tiny", "small")

_LLAVA_LAYOUTS = {
    # What transformers 5 save_pretrained writes.
    "hf5": (
        (r"^model\.language_model\.", "language_model.model."),
        (r"^lm_head\.", "language_model.lm_head."),
        (r"^model\.", ""),
    ),
    # The llava-hf checkpoints on the Hugging Face hub: the CLIP tower one level deeper.
    "hub": (
        (r"^model\.language_model\.", "language_model.model."),
        (r"^lm_head\.", "language_model.lm_head."),
        (r"^model\.vision_tower\.", "vision_tower.vision_model."),
        (r"^model\.", ""),
    ),
    "module": (),
}
# The Qwen hub checkpoints and transformers 5 save_pretrained name the weights alike.
_QWEN_HUB = (
    (r"^model\.language_model\.", "model."),
    (r"^model\.visual\.", "visual."),
)
_QWEN_LAYOUTS = {"hf5": _QWEN_HUB, "hub": _QWEN_HUB, "module": ()}

# model_type -> layout -> how the layout names a tensor, as renames of transformers' in-memory
# module names (first matching rule wins); "module" is the in-memory names unchanged.
WEIGHT_LAYOUTS: dict[str, dict[str, tuple[tuple[str, str], ...]]] = {
    "llava": _LLAVA_LAYOUTS,
    "llava_next": _LLAVA_LAYOUTS,
    "qwen2_vl": _QWEN_LAYOUTS,
    "qwen2_5_vl": _QWEN_LAYOUTS,
}
LAYOUTS = ("hub", "hf5", "module")
DEFAULT_LAYOUT = "hf5"

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def layout_name(name: str, layout: str, model_type: str = "llava") -> str:
    """The on-disk name of the in-memory tensor ``name`` in ``layout``."""
    for pattern, replacement in WEIGHT_LAYOUTS[model_type][layout]:
        renamed, n = re.subn(pattern, replacement, name, count=1)
        if n:
            return renamed
    return name


def write_weights(
    state_dict: Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike,
    layout: str = DEFAULT_LAYOUT,
    max_shard_size: int | None = None,
    model_type: str = "llava",
) -> list[Path]:
    """Write a state dict (transformers' in-memory names) of a ``model_type`` model as safetensors in ``layout``.

    With ``max_shard_size`` (bytes) the tensors are split, in order, into
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``;
    without it they go into one ``model.safetensors``. Returns the files written.
    """
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"unknown weight layout {layout!r} (known: {', '.join(LAYOUTS)})")
    out_dir = Path(out_dir)
    tensors = {layout_name(k, layout, model_type): v.detach().contiguous() for k, v in state_dict.items()}
    shards = list(_split_shards(tensors, max_shard_size))
    if len(shards) == 1:
        path = out_dir / SAFETENSORS_FILE
        save_file(shards[0], path, metadata={"format": "pt"})
        return [path]

    paths, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        path = out_dir / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, path.name))
        paths.append(path)
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    index_path = out_dir / SAFETENSORS_INDEX
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*paths, index_path]


def _split_shards(
    tensors: dict[str, torch.Tensor], max_shard_size: int | None
) -> Iterator[dict[str, torch.Tensor]]:
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shard and max_shard_size is not None and size + nbytes > max_shard_size:
            yield shard
            shard, size = {}, 0
        shard[name] = tensor
        size += nbytes
    yield shard


def train_tokenizer(vocab_size: int, spec: TokenizerSpec = ARCH_SPECS["llava"].tokenizer):
    """A byte-level BPE tokenizer trained on the built-in text, with ``spec``'s special tokens and
    chat template; ``spec.bos`` (if any) starts every encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from hydrad.models.tokenizer_data import TRAINING_TEXT

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(spec.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([TRAINING_TEXT], trainer=trainer)
    if spec.bos is not None:
        bos_id = bpe.token_to_id(spec.bos)
        bpe.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos} $B", special_tokens=[(spec.bos, bos_id)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=spec.bos,
        eos_token=spec.eos,
        unk_token=spec.unk,
        pad_token=spec.pad,
        extra_special_tokens={"image_token": spec.image, **spec.extra},
        chat_template=spec.chat_template,
    )


def random_model(config, seed: int):
    """A randomly initialised transformers model of ``config``'s architecture; a function of (config, seed) only."""
    import torch
    import transformers

    model_cls = getattr(transformers, config.architectures[0])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_cls(config).eval()


def build_model(
    out_dir: str | os.PathLike,
    arch: str = "llava",
    size: str = "tiny",
    seed: int = 0,
    *,
    layout: str = DEFAULT_LAYOUT,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Build a checkpoint of ``arch`` (one of ``ARCHS``) into ``out_dir``, weights named as
    ``layout`` names them, and return its path.

    The folder is assembled beside ``out_dir`` and renamed into place, so a reader
    never sees a half-written checkpoint and concurrent builders cannot mix files.
    An existing non-empty ``out_dir`` is replaced only with ``overwrite``.
    """
    if arch not in ARCHS:
        raise CheckpointError(f"cannot build unknown architecture {arch!r} (supported: {', '.join(ARCHS)})")
    if size not in SIZES:
        raise CheckpointError(f"unknown model size {size!r} (sizes: {', '.join(SIZES)})")
    if layout not in LAYOUTS:
        raise CheckpointError(f"unknown weight layout {layout!r} (layouts: {', '.join(LAYOUTS)})")
    out_dir = Path(out_dir).expanduser().absolute()
    if not overwrite and _is_non_empty(out_dir):
        raise CheckpointError(f"{out_dir} already exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        with _steps(f"building {arch} {size} (seed {seed})", 4, progress) as step:
            _build_into(tmp_dir, arch, size, seed, layout, step)
        # mkdtemp makes the folder private; the result is a shareable cache entry.
        tmp_dir.chmod(0o755)
        for path in tmp_dir.iterdir():
            path.chmod(0o644)
        _publish(tmp_dir, out_dir, overwrite)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def _build_into(out_dir: Path, arch: str, size: str, seed: int, layout: str, step) -> None:
    from transformers import GenerationConfig

    from hydrad.models.hf_processor import save_hf_processor

    spec = ARCH_SPECS[arch]
    step("training the tokenizer")
    tokenizer = train_tokenizer(spec.sizes[size].vocab_size, spec.tokenizer)
    step("initialising weights")
    config = make_config(arch, size, tokenizer)
    model = random_model(config, seed)
    step("writing weights")
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    write_weights(model.state_dict(), out_dir, layout, model_type=spec.model_type)
    step("writing the tokenizer and processor")
    tokenizer.save_pretrained(out_dir)
    save_hf_processor(make_processor(arch, size, tokenizer), out_dir)


def _publish(tmp_dir: Path, out_dir: Path, overwrite: bool) -> None:
    try:
        # Renaming onto an empty directory succeeds; onto a non-empty one it fails.
        os.replace(tmp_dir, out_dir)
        return
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR, errno.ENOTDIR):
            raise CheckpointError(f"cannot move the built model into {out_dir}: {e.strerror}") from None
        if not overwrite:
            raise CheckpointError(f"{out_dir} was created by another process while building") from None
    # Move the old folder aside first so out_dir is never missing a file it claims to have.
    old_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
    os.replace(out_dir, old_dir / out_dir.name)
    os.replace(tmp_dir, out_dir)
    shutil.rmtree(old_dir, ignore_errors=True)


def _is_non_empty(path: Path) -> bool:
    if not path.exists():
        return False
    if not path.is_dir():
        return True
    return any(path.iterdir())


@contextlib.contextmanager
def _steps(title: str, num_steps: int, enabled: bool):
    """Yield ``step(description)``; each call finishes the previous step and starts the next.
    On a terminal a progress bar shows them; off one (a pipe, a file, the journal) each step
    is a line of its own, and the build's end one more."""
    if not enabled:
        yield lambda description: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from hydrad.console import console

    if not console.is_terminal:
        start, count = time.monotonic(), 0

        def log_step(description: str) -> None:
            nonlocal count
            count += 1
            console.print(f"{title}: {description} ({count}/{num_steps})", highlight=False)

        yield log_step
        console.print(f"{title}: done in {time.monotonic() - start:.1f} s", highlight=False)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(title, total=num_steps)
        started = 0

        def step(description: str) -> None:
            nonlocal started
            if started:
                bar.advance(task)
            started += 1
            bar.update(task, description=f"{title}: {description}")

        yield step
        bar.update(task, completed=num_steps)
