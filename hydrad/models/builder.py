"""Build complete Hugging Face checkpoints with random weights, offline.

A built folder holds config.json, generation_config.json, safetensors weights,
a byte-level BPE tokenizer trained on a built-in text, and the processor files,
and loads with ``LlavaForConditionalGeneration`` / ``AutoProcessor`` /
``AutoTokenizer``. Weights are a function of the seed only.

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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hydrad.errors import CheckpointError

if TYPE_CHECKING:
    import torch

ARCHS = ("llava",)

UNK, BOS, EOS, PAD, IMAGE = "<unk>", "<s>", "</s>", "<pad>", "<image>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD, IMAGE)

# LLaVA-1.5's conversation format (vicuna_v1): "[system ]USER: <image>\n<text> ASSISTANT: <reply></s>".
# Images come before the text of a turn, as in LLaVA's training data. Every tag strips the
# whitespace around it, so the layout below is free; the one newline is an expression.
LLAVA_CHAT_TEMPLATE = """
{%- macro render(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content if part['type'] in ('image', 'image_url') -%}
            {{- '<image>' + '\\n' -}}
        {%- endfor -%}
        {%- for part in content if part['type'] == 'text' -%}
            {{- (' ' if not loop.first else '') + part['text'] -}}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- for message in messages -%}
    {%- if message['role'] == 'system' -%}
        {{- render(message['content']) + ' ' -}}
    {%- elif message['role'] == 'user' -%}
        {{- 'USER: ' + render(message['content']) + ' ' -}}
    {%- elif message['role'] == 'assistant' -%}
        {{- 'ASSISTANT: ' + render(message['content']) + '</s>' -}}
    {%- else -%}
        {{- raise_exception('unsupported role: ' + message['role']) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- 'ASSISTANT:' -}}
{%- endif -%}
"""


@dataclass(frozen=True)
class LlavaSize:
    vocab_size: int
    vision: Mapping[str, int]
    text: Mapping[str, int]


SIZES: dict[str, LlavaSize] = {
    # Whole folder well under 1 MB; 16 image tokens per image.
    "tiny": LlavaSize(
        vocab_size=512,
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    image_size=56, patch_size=14),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=2048),
    ),
    # Large enough that batching and caching costs show in benchmarks; 256 image tokens.
    "small": LlavaSize(
        vocab_size=4096,
        vision=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                    image_size=224, patch_size=14),
        text=dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=4096),
    ),
}

# How each on-disk layout names a tensor, as renames of transformers' in-memory module names
# (first matching rule wins). "hf5" is what transformers 5 ``save_pretrained`` writes, "hub" is
# the llava-hf checkpoints on the Hugging Face hub, "module" the in-memory names unchanged.
WEIGHT_LAYOUTS: dict[str, tuple[tuple[str, str], ...]] = {
    "hf5": (
        (r"^model\.language_model\.", "language_model.model."),
        (r"^lm_head\.", "language_model.lm_head."),
        (r"^model\.", ""),
    ),
    "hub": (
        (r"^model\.language_model\.", "language_model.model."),
        (r"^lm_head\.", "language_model.lm_head."),
        (r"^model\.vision_tower\.", "vision_tower.vision_model."),
        (r"^model\.", ""),
    ),
    "module": (),
}
DEFAULT_LAYOUT = "hf5"

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def layout_name(name: str, layout: str) -> str:
    """The on-disk name of the in-memory tensor ``name`` in ``layout``."""
    for pattern, replacement in WEIGHT_LAYOUTS[layout]:
        renamed, n = re.subn(pattern, replacement, name, count=1)
        if n:
            return renamed
    return name


def write_weights(
    state_dict: Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike,
    layout: str = DEFAULT_LAYOUT,
    max_shard_size: int | None = None,
) -> list[Path]:
    """Write a state dict (transformers' in-memory names) as safetensors in ``layout``.

    With ``max_shard_size`` (bytes) the tensors are split, in order, into
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``;
    without it they go into one ``model.safetensors``. Returns the files written.
    """
    from safetensors.torch import save_file

    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"unknown weight layout {layout!r} (known: {', '.join(WEIGHT_LAYOUTS)})")
    out_dir = Path(out_dir)
    tensors = {layout_name(k, layout): v.detach().contiguous() for k, v in state_dict.items()}
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


def train_tokenizer(vocab_size: int, chat_template: str = LLAVA_CHAT_TEMPLATE):
    """A byte-level BPE tokenizer trained on the built-in text; ``<s>`` starts every encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from hydrad.models.tokenizer_data import TRAINING_TEXT

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([TRAINING_TEXT], trainer=trainer)
    bos_id = bpe.token_to_id(BOS)
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        extra_special_tokens={"image_token": IMAGE},
        chat_template=chat_template,
    )


def llava_config(size: str, tokenizer):
    """The ``LlavaConfig`` of a built-in size, with ids taken from ``tokenizer``."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    spec = SIZES[size]
    vision = CLIPVisionConfig(**spec.vision, projection_dim=spec.vision["hidden_size"])
    text = LlamaConfig(
        **spec.text,
        # Ids the tokenizer never emits decode to "", so the LM's vocabulary is exactly the tokenizer's.
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    num_patches = (spec.vision["image_size"] // spec.vision["patch_size"]) ** 2
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE),
        image_seq_length=num_patches,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
        dtype="float32",
    )


def llava_processor(size: str, tokenizer):
    from transformers import LlavaProcessor

    try:
        # The PIL backend needs no torchvision and saves as "CLIPImageProcessor", so the folder
        # loads with either backend; naming it avoids transformers' fallback warning.
        from transformers import CLIPImageProcessorPil as CLIPImageProcessor
    except ImportError:
        from transformers import CLIPImageProcessor

    vision = SIZES[size].vision
    side = vision["image_size"]
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    # With CLIP and the "default" strategy the tower emits one CLS token on top of the patches,
    # which the processor must count or the prompt gets one placeholder too few.
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=vision["patch_size"],
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template,
    )


def random_llava(config, seed: int):
    """A randomly initialised ``LlavaForConditionalGeneration``; a function of (config, seed) only."""
    import torch
    from transformers import LlavaForConditionalGeneration

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlavaForConditionalGeneration(config).eval()


def build_model(
    out_dir: str | os.PathLike,
    arch: str = "llava",
    size: str = "tiny",
    seed: int = 0,
    *,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Build a checkpoint into ``out_dir`` and return its path.

    The folder is assembled beside ``out_dir`` and renamed into place, so a reader
    never sees a half-written checkpoint and concurrent builders cannot mix files.
    An existing non-empty ``out_dir`` is replaced only with ``overwrite``.
    """
    if arch not in ARCHS:
        raise CheckpointError(f"cannot build unknown architecture {arch!r} (supported: {', '.join(ARCHS)})")
    if size not in SIZES:
        raise CheckpointError(f"unknown model size {size!r} (sizes: {', '.join(SIZES)})")
    out_dir = Path(out_dir).expanduser().absolute()
    if not overwrite and _is_non_empty(out_dir):
        raise CheckpointError(f"{out_dir} already exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        with _steps(f"building {arch} {size} (seed {seed})", 4, progress) as step:
            _build_into(tmp_dir, size, seed, step)
        # mkdtemp makes the folder private; the result is a shareable cache entry.
        tmp_dir.chmod(0o755)
        for path in tmp_dir.iterdir():
            path.chmod(0o644)
        _publish(tmp_dir, out_dir, overwrite)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def _build_into(out_dir: Path, size: str, seed: int, step) -> None:
    from transformers import GenerationConfig

    step("training the tokenizer")
    tokenizer = train_tokenizer(SIZES[size].vocab_size)
    step("initialising weights")
    config = llava_config(size, tokenizer)
    model = random_llava(config, seed)
    step("writing weights")
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    write_weights(model.state_dict(), out_dir)
    step("writing the tokenizer and processor")
    tokenizer.save_pretrained(out_dir)
    llava_processor(size, tokenizer).save_pretrained(out_dir)


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
    """Yield ``step(description)``; each call finishes the previous step and starts the next."""
    if not enabled:
        yield lambda description: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from hydrad.cli.common import console

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
