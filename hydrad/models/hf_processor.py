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


def save_hf_processor(processor: ProcessorMixin, out_dir: str | os.PathLike) -> None:
    processor.save_pretrained(out_dir)
    config_file = Path(out_dir) / "processor_config.json"
    if not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    for cls in PROCESSOR_CLASSES.values():
        if config.get("processor_class") == cls.__name__:
            config["processor_class"] = cls.__mro__[1].__name__
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
