"""Which of our model classes serves a checkpoint, by its config's ``model_type``."""

from __future__ import annotations

import importlib

from hydrad.errors import CheckpointError

# model_type -> (module, class); imported only when asked for.
MODELS = {
    "llava": ("hydrad.models.llava", "LlavaForConditionalGeneration"),
    "llava_next": ("hydrad.models.llava_next", "LlavaNextForConditionalGeneration"),
    "qwen2_vl": ("hydrad.models.qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": ("hydrad.models.qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
}


def get_model_class(hf_config) -> type:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MODELS:
        raise CheckpointError(
            f"model type {model_type!r} is not supported; hydrad serves: {', '.join(sorted(MODELS))}"
        )
    module, cls = MODELS[model_type]
    return getattr(importlib.import_module(module), cls)
