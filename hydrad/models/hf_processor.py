"""A checkpoint's own Hugging Face processor (chat template, tokenizer, image processor), offline.

Qwen2-VL's and Qwen2.5-VL's processors insist on a video processor, and every video processor
needs torchvision, which this torch cannot use. hydrad serves images only, so those two
families get a subclass that takes no video processor; the files it saves say the
transformers class, so the folder stays a standard checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import AutoProcessor, ProcessorMixin, Qwen2_5_VLProcessor, Qwen2VLProcessor


class Qwen2VLProcessorWithoutVideo(Qwen2VLProcessor):
    # The processor's sub-processors are the arguments of __init__: no video_processor here.
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class Qwen2_5_VLProcessorWithoutVideo(Qwen2_5_VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


# model_type -> our processor class; every other family loads with AutoProcessor.
PROCESSOR_CLASSES: dict[str, type[ProcessorMixin]] = {
    "qwen2_vl": Qwen2VLProcessorWithoutVideo,
    "qwen2_5_vl": Qwen2_5_VLProcessorWithoutVideo,
}


def load_hf_processor(path: str | os.PathLike, model_type: str) -> ProcessorMixin:
    cls = PROCESSOR_CLASSES.get(model_type, AutoProcessor)
    return cls.from_pretrained(path, local_files_only=True)


# A video processor's settings, taken from the image processor's, for the families whose
# transformers processor requires one (and torchvision to build it).
_VIDEO_SETTINGS = ("size", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "resample",
                   "rescale_factor", "do_resize", "do_rescale", "do_normalize", "do_convert_rgb")


def save_hf_processor(processor: ProcessorMixin, out_dir: str | os.PathLike) -> None:
    """Save as transformers saves the family's processor. Qwen2-VL's and Qwen2.5-VL's also get
    the video processor they require where torchvision is installed (``Qwen2VLVideoProcessor``,
    the image processor's settings), so that other servers load the folder; hydrad ignores it."""
    processor.save_pretrained(out_dir)
    config_file = Path(out_dir) / "processor_config.json"
    if not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    for cls in PROCESSOR_CLASSES.values():
        if config.get("processor_class") == cls.__name__:
            config["processor_class"] = cls.__mro__[1].__name__
            image = config.get("image_processor", {})
            config.setdefault("video_processor", {
                "video_processor_type": "Qwen2VLVideoProcessor",
                **{key: image[key] for key in _VIDEO_SETTINGS if key in image},
            })
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
