"""Read local Hugging Face checkpoints: validate the config, stream weights under canonical names.

Canonical names (the contract the model code relies on)::

    language_model.embed_tokens.weight
    language_model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}
    language_model.layers.{i}.mlp.{gate,up,down}_proj.weight
    language_model.layers.{i}.{input_layernorm,post_attention_layernorm}.weight
    language_model.norm.weight
    lm_head.weight                          (absent when the embeddings are tied)
    vision_tower.<CLIPVisionModel names: embeddings.*, pre_layrnorm.*, encoder.layers.*, post_layernorm.*>
    multi_modal_projector.linear_{1,2}.{weight,bias}

They are transformers' in-memory names without the leading ``model.``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from hydrad.errors import CheckpointError

# model_type -> the architectures (config.json "architectures") hydrad serves for it.
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "llava": ("LlavaForConditionalGeneration",),
}

# On-disk name -> canonical name; the first matching pattern wins, None drops the tensor.
# Covers the llava-hf hub checkpoints (language_model.model.*, vision_tower.vision_model.*),
# transformers 5 save_pretrained (language_model.model.*, vision_tower.*) and transformers'
# in-memory module names (model.language_model.*, lm_head.*; transformers 4 nests the tower's
# weights one level deeper, model.vision_tower.vision_model.*).
NAME_RULES: tuple[tuple[re.Pattern[str], str | None], ...] = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        # Buffers that older exporters saved; the model recomputes them.
        (r"\.rotary_emb\.inv_freq$", None),
        (r"\.embeddings\.position_ids$", None),
        (r"^model\.language_model\.", "language_model."),
        (r"^model\.vision_tower\.vision_model\.", "vision_tower."),
        (r"^model\.vision_tower\.", "vision_tower."),
        (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
        (r"^lm_head\.", "lm_head."),
        (r"^language_model\.model\.", "language_model."),
        (r"^language_model\.lm_head\.", "lm_head."),
        (r"^vision_tower\.vision_model\.", "vision_tower."),
        (r"^vision_tower\.", "vision_tower."),
        (r"^multi_modal_projector\.", "multi_modal_projector."),
    )
)

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


class UnknownTensorName(LookupError):
    """An on-disk tensor name that no rule of ``NAME_RULES`` maps."""


def canonical_name(name: str) -> str | None:
    """The canonical name of an on-disk tensor name; None for tensors hydrad does not load.

    Raises ``UnknownTensorName`` for a name no rule covers.
    """
    for pattern, replacement in NAME_RULES:
        match = pattern.search(name)
        if match is None:
            continue
        if replacement is None:
            return None
        return replacement + name[match.end():]
    raise UnknownTensorName(name)


def load_config(path: str | os.PathLike):
    """The checkpoint's ``transformers.PretrainedConfig``, once the architecture is known to be served."""
    from transformers import AutoConfig

    path = _checkpoint_dir(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face model folder)")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object")

    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{config_file}: unsupported architecture {model_type!r} (supported: {supported})")
    for arch in raw.get("architectures") or ():
        if arch not in SUPPORTED_ARCHITECTURES[model_type]:
            raise CheckpointError(f"{config_file}: unsupported architecture {arch!r} (supported: {supported})")
    return AutoConfig.from_pretrained(path, local_files_only=True)


def iter_weights(
    path: str | os.PathLike,
    dtype: torch.dtype,
    prefixes: tuple[str, ...] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(canonical name, tensor)`` for every weight of the checkpoint, cast to ``dtype``.

    With ``prefixes`` only tensors whose canonical name starts with one of them are
    read; shards holding none of them are never opened. Every name is mapped and
    every shard found before the first tensor is yielded, so most damage fails up front.
    """
    path = _checkpoint_dir(path)
    tied = bool(getattr(load_config(path), "tie_word_embeddings", False))
    plan = _plan(path)
    for file, names in plan.items():
        wanted = {
            name: canonical
            for name, canonical in names.items()
            if canonical is not None
            and not (tied and canonical.startswith("lm_head."))
            and (prefixes is None or canonical.startswith(prefixes))
        }
        if not wanted:
            continue
        yield from _read_file(file, wanted, dtype)


def _read_file(file: Path, wanted: dict[str, str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    with _open_safetensors(file) as f:
        missing = sorted(set(wanted) - set(f.keys()))
        if missing:
            raise CheckpointError(f"{file}: lacks tensor {missing[0]!r} that the index places in it")
        for name, canonical in wanted.items():
            tensor = f.get_tensor(name)
            yield canonical, tensor.to(dtype) if tensor.is_floating_point() else tensor


def _plan(path: Path) -> dict[Path, dict[str, str | None]]:
    """Weight file -> {on-disk name: canonical name or None}, all names validated."""
    index_file = path / WEIGHTS_INDEX
    single_file = path / WEIGHTS_FILE
    if index_file.is_file():
        names_by_file = _read_index(index_file)
    elif single_file.is_file():
        names_by_file = {single_file: _safetensors_keys(single_file)}
    else:
        found = sorted(p.name for p in path.glob("*.bin"))
        hint = f"; found {found[0]} (only safetensors is supported)" if found else ""
        raise CheckpointError(f"{path}: no weights ({WEIGHTS_FILE} or {WEIGHTS_INDEX}){hint}")

    plan: dict[Path, dict[str, str | None]] = {}
    for file, names in names_by_file.items():
        try:
            plan[file] = {name: canonical_name(name) for name in names}
        except UnknownTensorName as e:
            raise CheckpointError(f"{file}: unrecognised tensor name {e.args[0]!r}") from None
    return plan


def _read_index(index_file: Path) -> dict[Path, list[str]]:
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_file}: not a safetensors index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
        raise CheckpointError(f"{index_file}: not a safetensors index (weight_map is not a name -> file map)")
    names_by_file: dict[Path, list[str]] = {}
    for name, shard in weight_map.items():
        names_by_file.setdefault(index_file.parent / shard, []).append(name)
    for file in names_by_file:
        if not file.is_file():
            raise CheckpointError(f"{index_file}: names shard {file.name!r}, which does not exist")
    return dict(sorted(names_by_file.items()))


def _safetensors_keys(file: Path) -> list[str]:
    with _open_safetensors(file) as f:
        return list(f.keys())


def _open_safetensors(file: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(file, framework="pt")
    except SafetensorError as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def _checkpoint_dir(path: str | os.PathLike) -> Path:
    path = Path(path).expanduser()
    if not path.is_dir():
        what = "is not a folder" if path.exists() else "does not exist"
        raise CheckpointError(f"model folder {path} {what}")
    return path
