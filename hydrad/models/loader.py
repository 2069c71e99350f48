"""Read local Hugging Face checkpoints: validate the config, stream weights under canonical names.

Canonical names (the contract the model code relies on)::

    language_model.embed_tokens.weight
    language_model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}
    language_model.layers.{i}.mlp.{gate,up,down}_proj.weight
    language_model.layers.{i}.{input_layernorm,post_attention_layernorm}.weight
    language_model.norm.weight
    lm_head.weight                          (absent when the embeddings are tied)
    vision_tower.*                          LLaVA, LLaVA-NeXT: CLIPVisionModel names (embeddings.*,
                                            pre_layrnorm.*, encoder.layers.*, post_layernorm.*);
                                            Qwen2(.5)-VL: the vision transformer's names, merger
                                            included (patch_embed.*, blocks.*, merger.*)
    multi_modal_projector.linear_{1,2}.{weight,bias}
    multi_modal_projector.image_newline     (LLaVA-NeXT)

Every vision weight starts with ``vision_tower.`` or ``multi_modal_projector.`` and every
language weight with ``language_model.`` or ``lm_head.``, whatever the family, so an instance
reads only the part its role needs by prefix.
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
    "llava_next": ("LlavaNextForConditionalGeneration",),
    "qwen2_vl": ("Qwen2VLForConditionalGeneration",),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration",),
}


def _rules(*pairs: tuple[str, str | None]) -> tuple[tuple[re.Pattern[str], str | None], ...]:
    return tuple((re.compile(pattern), replacement) for pattern, replacement in pairs)


# Buffers that older exporters saved; the models recompute them.
_RECOMPUTED = (
    (r"\.rotary_emb\.inv_freq$", None),
    (r"\.rotary_pos_emb\.inv_freq$", None),
    (r"\.embeddings\.position_ids$", None),
)
# LLaVA: the llava-hf hub checkpoints (language_model.model.*, vision_tower.vision_model.*),
# transformers 5 save_pretrained (language_model.model.*, vision_tower.*) and transformers'
# in-memory module names (model.language_model.*, lm_head.*; transformers 4 nests the tower's
# weights one level deeper, model.vision_tower.vision_model.*).
_LLAVA = (
    *_RECOMPUTED,
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
# Qwen2-VL / Qwen2.5-VL: the Qwen hub checkpoints and transformers 5 save_pretrained (model.*
# for the decoder, visual.*, lm_head.*) and transformers' in-memory module names
# (model.language_model.*, model.visual.*), which some checkpoints saved with transformers 4 carry.
_QWEN2_VL = (
    *_RECOMPUTED,
    (r"^model\.language_model\.", "language_model."),
    (r"^model\.visual\.", "vision_tower."),
    (r"^visual\.", "vision_tower."),
    (r"^lm_head\.", "lm_head."),
    (r"^model\.", "language_model."),
)

# model_type -> (on-disk name pattern, canonical prefix); the first matching pattern wins, None
# drops the tensor.
NAME_RULES: dict[str, tuple[tuple[re.Pattern[str], str | None], ...]] = {
    "llava": _rules(*_LLAVA),
    # The newline row is applied after the projector, so it is loaded with it.
    "llava_next": _rules((r"^(model\.)?image_newline$", "multi_modal_projector.image_newline"), *_LLAVA),
    "qwen2_vl": _rules(*_QWEN2_VL),
    "qwen2_5_vl": _rules(*_QWEN2_VL),
}

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


class UnknownTensorName(LookupError):
    """An on-disk tensor name that no rule of ``NAME_RULES`` maps."""


def canonical_name(model_type: str, name: str) -> str | None:
    """The canonical name of an on-disk tensor name of a ``model_type`` checkpoint; None for
    tensors hydrad does not load.

    Raises ``UnknownTensorName`` for a name no rule covers.
    """
    for pattern, replacement in NAME_RULES[model_type]:
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

    supported = ", ".join(arch for archs in SUPPORTED_ARCHITECTURES.values() for arch in archs)
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or ()
    if model_type not in SUPPORTED_ARCHITECTURES:
        named = ", ".join(map(repr, architectures)) or repr(model_type)
        raise CheckpointError(f"{config_file}: unsupported architecture {named} (supported: {supported})")
    for arch in architectures:
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
    config = load_config(path)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    plan = _plan(path, config.model_type)
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


def _plan(path: Path, model_type: str) -> dict[Path, dict[str, str | None]]:
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
            plan[file] = {name: canonical_name(model_type, name) for name in names}
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
