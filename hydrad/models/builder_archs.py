"""What ``hydrad make-model`` builds for each architecture and size: configs, tokenizers, processors.

Each architecture is data (``ARCH_SPECS``): its tokenizer's special tokens and chat template,
its sizes, and the transformers classes it is built from. ``tiny`` checkpoints (a few hundred
thousand parameters) are for tests; ``small`` ones, with the language model of the ``small``
LLaVA (hidden 512 x 8 layers, head_dim 64), for CPU benchmarks.

Importing this module is cheap: transformers loads when a config or processor is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from hydrad.models.chat_templates import LLAVA_CHAT_TEMPLATE, MISTRAL_CHAT_TEMPLATE, QWEN2_VL_CHAT_TEMPLATE


@dataclass(frozen=True)
class TokenizerSpec:
    special_tokens: tuple[str, ...]
    eos: str
    pad: str
    image: str
    chat_template: str
    # Prepended to every encoding (None: nothing is, as in Qwen's tokenizers).
    bos: str | None = None
    unk: str | None = None
    # Further named special tokens the processor looks up (e.g. "video_token").
    extra: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SizeSpec:
    vocab_size: int
    vision: Mapping[str, Any]
    text: Mapping[str, Any]
    # Image processor settings: "side" (LLaVA tiles), "pinpoints" (LLaVA-NeXT), "min_pixels" /
    # "max_pixels" (Qwen2-VL).
    image: Mapping[str, Any]


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    architecture: str  # config.json "architectures"; also the transformers model class
    tokenizer: TokenizerSpec
    sizes: Mapping[str, SizeSpec]


LLAVA_TOKENIZER = TokenizerSpec(
    special_tokens=("<unk>", "<s>", "</s>", "<pad>", "<image>"),
    bos="<s>", eos="</s>", pad="<pad>", unk="<unk>", image="<image>",
    chat_template=LLAVA_CHAT_TEMPLATE,
)
QWEN_TOKENIZER = TokenizerSpec(
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                    "<|image_pad|>", "<|video_pad|>"),
    eos="<|im_end|>", pad="<|endoftext|>", image="<|image_pad|>",
    extra={"video_token": "<|video_pad|>"},
    chat_template=QWEN2_VL_CHAT_TEMPLATE,
)

_TINY_CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=56, patch_size=14)
_SMALL_CLIP = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                   image_size=224, patch_size=14)
_TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048)
_SMALL_TEXT = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=2, max_position_embeddings=4096)


def _pinpoints(side: int) -> list[list[int]]:
    # llava-v1.6's grid, [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]], in tiles of `side`.
    return [[side * h, side * w] for h, w in ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))]


ARCH_SPECS: dict[str, ArchSpec] = {
    "llava": ArchSpec(
        model_type="llava",
        architecture="LlavaForConditionalGeneration",
        tokenizer=LLAVA_TOKENIZER,
        sizes={
            # Whole folder well under 1 MB; 16 image tokens per image.
            "tiny": SizeSpec(512, _TINY_CLIP, dict(_TINY_TEXT, head_dim=16), dict(side=56)),
            # Large enough that batching and caching costs show in benchmarks; 256 image tokens.
            "small": SizeSpec(4096, _SMALL_CLIP, dict(_SMALL_TEXT, head_dim=64), dict(side=224)),
        },
    ),
    "llava-next": ArchSpec(
        model_type="llava_next",
        architecture="LlavaNextForConditionalGeneration",
        tokenizer=replace(LLAVA_TOKENIZER, chat_template=MISTRAL_CHAT_TEMPLATE),
        sizes={
            # Tiles of 56 px (16 tokens): an image becomes up to 16 + 8 x (8 + 1) = 88 tokens.
            "tiny": SizeSpec(512, _TINY_CLIP, dict(_TINY_TEXT, head_dim=16),
                             dict(side=56, pinpoints=_pinpoints(56))),
            # Tiles of 224 px (256 tokens): an image becomes up to 256 + 32 x (32 + 1) = 1,312 tokens.
            "small": SizeSpec(4096, _SMALL_CLIP, dict(_SMALL_TEXT, head_dim=64),
                              dict(side=224, pinpoints=_pinpoints(224))),
        },
    ),
    "qwen2-vl": ArchSpec(
        model_type="qwen2_vl",
        architecture="Qwen2VLForConditionalGeneration",
        tokenizer=QWEN_TOKENIZER,
        sizes={
            # head_dim 16: M-RoPE sections 2 + 3 + 3; 4 to 64 tokens per image.
            "tiny": SizeSpec(
                512,
                # hidden_size: the merger's output, the language model's width
                dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=64),
                dict(_TINY_TEXT, mrope_section=[2, 3, 3]),
                dict(min_pixels=56 * 56, max_pixels=28 * 28 * 64),
            ),
            # head_dim 64: sections 8 + 12 + 12 (Qwen2-VL's 16 + 24 + 24, halved); 4 to 256 tokens per image.
            "small": SizeSpec(
                4096,
                dict(depth=4, embed_dim=256, num_heads=4, mlp_ratio=4, hidden_size=512),
                dict(_SMALL_TEXT, mrope_section=[8, 12, 12]),
                dict(min_pixels=56 * 56, max_pixels=28 * 28 * 256),
            ),
        },
    ),
    "qwen2.5-vl": ArchSpec(
        model_type="qwen2_5_vl",
        architecture="Qwen2_5_VLForConditionalGeneration",
        tokenizer=QWEN_TOKENIZER,
        sizes={
            # Windows of 2 x 2 merged tokens (56 px) in layer 0, full attention in layer 1.
            "tiny": SizeSpec(
                512,
                # out_hidden_size: the merger's output, the language model's width
                dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, window_size=56,
                     fullatt_block_indexes=[1], out_hidden_size=64),
                dict(_TINY_TEXT, mrope_section=[2, 3, 3]),
                dict(min_pixels=56 * 56, max_pixels=28 * 28 * 64),
            ),
            # Windows of 4 x 4 merged tokens (112 px), full attention in layers 1 and 3.
            "small": SizeSpec(
                4096,
                dict(depth=4, hidden_size=256, intermediate_size=704, num_heads=4, window_size=112,
                     fullatt_block_indexes=[1, 3], out_hidden_size=512),
                dict(_SMALL_TEXT, mrope_section=[8, 12, 12]),
                dict(min_pixels=56 * 56, max_pixels=28 * 28 * 256),
            ),
        },
    ),
}


def make_config(arch: str, size: str, tokenizer):
    """The transformers config of ``arch`` at ``size``, ids taken from ``tokenizer``, ``architectures`` set."""
    spec = ARCH_SPECS[arch]
    config = _CONFIG_MAKERS[spec.model_type](spec.sizes[size], tokenizer)
    config.architectures = [spec.architecture]
    return config


def make_processor(arch: str, size: str, tokenizer):
    spec = ARCH_SPECS[arch]
    return _PROCESSOR_MAKERS[spec.model_type](spec.sizes[size], tokenizer)


def _token_ids(tokenizer) -> dict[str, int | None]:
    # Ids the tokenizer never emits decode to "", so the LM's vocabulary is exactly the tokenizer's.
    return dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def _llava_config(size: SizeSpec, tokenizer):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(**size.vision, projection_dim=size.vision["hidden_size"])
    text = LlamaConfig(**size.text, **_token_ids(tokenizer), tie_word_embeddings=False)
    num_patches = (size.vision["image_size"] // size.vision["patch_size"]) ** 2
    return LlavaConfig(
        vision_config=vision, text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(tokenizer.image_token),
        image_seq_length=num_patches, vision_feature_layer=-2, vision_feature_select_strategy="default",
        projector_hidden_act="gelu", tie_word_embeddings=False, dtype="float32",
    )


def _llava_next_config(size: SizeSpec, tokenizer):
    from transformers import CLIPVisionConfig, LlavaNextConfig, MistralConfig

    vision = CLIPVisionConfig(**size.vision, projection_dim=size.vision["hidden_size"])
    # No sliding window: every layer attends over the whole context, as in llava-v1.6-mistral.
    text = MistralConfig(**size.text, **_token_ids(tokenizer), sliding_window=None, tie_word_embeddings=False)
    num_patches = (size.vision["image_size"] // size.vision["patch_size"]) ** 2
    return LlavaNextConfig(
        vision_config=vision, text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(tokenizer.image_token),
        image_grid_pinpoints=size.image["pinpoints"], image_seq_length=num_patches,
        vision_feature_layer=-2, vision_feature_select_strategy="default",
        projector_hidden_act="gelu", tie_word_embeddings=False, dtype="float32",
    )


def _qwen2_vl_config(size: SizeSpec, tokenizer, config_cls_name: str):
    import transformers

    text = dict(size.text)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0,
                               "mrope_section": text.pop("mrope_section")}
    ids = _token_ids(tokenizer)
    vision = dict(size.vision, spatial_merge_size=2, patch_size=14, temporal_patch_size=2)
    return getattr(transformers, config_cls_name)(
        vision_config=vision,
        text_config=dict(text, **ids),
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        tie_word_embeddings=False, dtype="float32",
    )


def _clip_processor_kwargs(size: SizeSpec) -> dict:
    side = size.image["side"]
    return dict(size={"shortest_edge": side}, crop_size={"height": side, "width": side})


def _llava_processor(size: SizeSpec, tokenizer):
    from transformers import LlavaProcessor

    try:
        # The PIL backend needs no torchvision and saves as "CLIPImageProcessor", so the folder
        # loads with either backend; naming it avoids transformers' fallback warning.
        from transformers import CLIPImageProcessorPil as CLIPImageProcessor
    except ImportError:
        from transformers import CLIPImageProcessor

    # With CLIP and the "default" strategy the tower emits one CLS token on top of the patches,
    # which the processor must count or the prompt gets one placeholder too few.
    return LlavaProcessor(
        image_processor=CLIPImageProcessor(**_clip_processor_kwargs(size)), tokenizer=tokenizer,
        patch_size=size.vision["patch_size"], vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=tokenizer.chat_template,
    )


def _llava_next_processor(size: SizeSpec, tokenizer):
    from transformers import LlavaNextProcessor

    try:
        from transformers import LlavaNextImageProcessorPil as LlavaNextImageProcessor
    except ImportError:
        from transformers import LlavaNextImageProcessor

    image_processor = LlavaNextImageProcessor(
        **_clip_processor_kwargs(size), image_grid_pinpoints=size.image["pinpoints"]
    )
    return LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=size.vision["patch_size"],
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template,
    )


def _qwen2_vl_processor(size: SizeSpec, tokenizer, processor_cls):
    try:
        from transformers import Qwen2VLImageProcessorPil as Qwen2VLImageProcessor
    except ImportError:
        from transformers import Qwen2VLImageProcessor

    image_processor = Qwen2VLImageProcessor(
        min_pixels=size.image["min_pixels"], max_pixels=size.image["max_pixels"],
        patch_size=14, merge_size=2, temporal_patch_size=2,
    )
    return processor_cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def _qwen_processor_maker(model_type: str):
    def make(size: SizeSpec, tokenizer):
        from hydrad.models.hf_processor import PROCESSOR_CLASSES

        return _qwen2_vl_processor(size, tokenizer, PROCESSOR_CLASSES[model_type])

    return make


# model_type -> the config / processor factory.
_CONFIG_MAKERS = {
    "llava": _llava_config,
    "llava_next": _llava_next_config,
    "qwen2_vl": lambda size, tokenizer: _qwen2_vl_config(size, tokenizer, "Qwen2VLConfig"),
    "qwen2_5_vl": lambda size, tokenizer: _qwen2_vl_config(size, tokenizer, "Qwen2_5_VLConfig"),
}
_PROCESSOR_MAKERS = {
    "llava": _llava_processor,
    "llava_next": _llava_next_processor,
    "qwen2_vl": _qwen_processor_maker("qwen2_vl"),
    "qwen2_5_vl": _qwen_processor_maker("qwen2_5_vl"),
}
