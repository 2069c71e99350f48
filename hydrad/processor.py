"""The Request Processor: OpenAI messages → prompt token ids + preprocessed images.

It applies the checkpoint's chat template, decodes and checks images, runs the
checkpoint's own image processor and tokenizer (so prompts match transformers
exactly), splits the image outputs per image, and finds where each image's placeholder
tokens sit in the prompt; images of one prompt may have different numbers of tokens
(LLaVA-NeXT, Qwen2-VL). For M-RoPE models (Qwen2-VL) it also computes the prompt's 3-D
positions, once. It holds no model weights; the daemon runs it in a thread pool, off the
event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image

from hydrad.engine.inputs import EngineRequest, ImageInput
from hydrad.errors import RequestError
from hydrad.images import check_image_size, decode_data_url
from hydrad.sampling_params import SamplingParams

_ROLES = ("system", "developer", "user", "assistant")


@dataclass
class ProcessedPrompt:
    prompt_token_ids: list[int]
    images: list[ImageInput] = field(default_factory=list)
    # M-RoPE models: [3, num_prompt_tokens] positions and the delta of generated tokens
    # (None for a text-only prompt: the flat arange).
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0

    @property
    def num_image_tokens(self) -> int:
        return sum(image.length for image in self.images)


class InputProcessor:
    def __init__(
        self,
        model_path: str | Path,
        *,
        max_images_per_request: int = 8,
        max_image_pixels: int = 40_000_000,
        max_model_len: int | None = None,
    ):
        from hydrad.models.hf_processor import load_hf_processor
        from hydrad.models.loader import load_config
        from hydrad.models.registry import get_model_class

        self.model_path = Path(model_path)
        self.model_name = self.model_path.name
        self.hf_config = hf_config = load_config(self.model_path)
        self.model_cls = get_model_class(hf_config)
        self.max_model_len = max_model_len or hf_config.text_config.max_position_embeddings
        self.max_images_per_request = max_images_per_request
        self.max_image_pixels = max_image_pixels
        self.processor = load_hf_processor(self.model_path, hf_config.model_type)
        self.tokenizer = self.processor.tokenizer
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.processor.image_token)
        self.eos_token_ids = _eos_token_ids(self.model_path, self.tokenizer, hf_config)
        # transformers' processors are not safe to call from several threads at once.
        self._lock = threading.Lock()

    # -- messages ------------------------------------------------------------------------------
    def _normalize(self, messages) -> tuple[list[dict], list[Image.Image]]:
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        normalized, images = [], []
        for i, message in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(message, dict):
                raise RequestError(f"{where} must be an object", param=where)
            role = message.get("role")
            if role not in _ROLES:
                raise RequestError(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", param=f"{where}.role")
            role = "system" if role == "developer" else role
            content = message.get("content")
            if isinstance(content, str):
                normalized.append({"role": role, "content": [{"type": "text", "text": content}]})
                continue
            if not isinstance(content, list) or not content:
                raise RequestError(f"{where}.content must be a string or a non-empty list of parts", param=f"{where}.content")
            parts = []
            for j, part in enumerate(content):
                pwhere = f"{where}.content[{j}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    if not isinstance(part.get("text"), str):
                        raise RequestError(f"{pwhere}.text must be a string", param=pwhere)
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in ("image_url", "image"):
                    if role != "user":
                        raise RequestError(f"{pwhere}: images are accepted in user messages only", param=pwhere)
                    images.append(self._image_of(part, pwhere))
                    parts.append({"type": "image"})
                else:
                    raise RequestError(
                        f"{pwhere}.type must be 'text', 'image_url' or 'image', got {kind!r}", param=pwhere
                    )
            normalized.append({"role": role, "content": parts})
        if len(images) > self.max_images_per_request:
            raise RequestError(
                f"{len(images)} images in one request; the limit is {self.max_images_per_request}", param="messages"
            )
        return normalized, images

    def _image_of(self, part: dict, where: str) -> Image.Image:
        if part["type"] == "image":
            image = part.get("image")
            if not isinstance(image, Image.Image):
                raise RequestError(f"{where}.image must be a PIL image", param=where)
            check_image_size(image, max_pixels=self.max_image_pixels, param=where)
            return image.convert("RGB")
        image_url = part.get("image_url")
        url = image_url.get("url") if isinstance(image_url, dict) else image_url
        if not isinstance(url, str) or not url:
            raise RequestError(f"{where}.image_url.url must be a string", param=where)
        if url.startswith(("http://", "https://")):
            raise RequestError("remote image URLs are not enabled on this server; send a data: URL", param=where)
        return decode_data_url(url, max_pixels=self.max_image_pixels, param=where)

    def process_chat(self, messages: list[dict]) -> ProcessedPrompt:
        normalized, images = self._normalize(messages)
        with self._lock:
            text = self.processor.apply_chat_template(normalized, add_generation_prompt=True, tokenize=False)
        return self._tokenize(text, images)

    def process_prompt(self, prompt: str) -> ProcessedPrompt:
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("prompt must be a non-empty string", param="prompt")
        return self._tokenize(prompt, [])

    # -- tokens ---------------------------------------------------------------------------------
    def _tokenize(self, text: str, images: list[Image.Image]) -> ProcessedPrompt:
        try:
            with self._lock:
                out = self.processor(text=text, images=images or None, return_tensors="pt")
        except ValueError as e:
            if images:
                # The image processor refuses what it cannot resize (e.g. Qwen2-VL: aspect ratio over 200).
                raise RequestError(f"could not process the images: {e}", param="messages") from None
            if self.processor.image_token in text:
                # transformers 5's processors refuse placeholders without images themselves.
                raise RequestError("the prompt contains image placeholder tokens but no image", param="messages") from None
            raise
        token_ids = out["input_ids"][0].tolist()
        if not images:
            if self.image_token_id in token_ids:
                raise RequestError("the prompt contains image placeholder tokens but no image", param="messages")
            return ProcessedPrompt(token_ids)
        inputs = self.model_cls.image_inputs(self.hf_config, out)
        offsets = find_image_runs(token_ids, self.image_token_id, [image.length for image in inputs])
        for image, offset, pil in zip(inputs, offsets, images):
            image.offset = offset
            if image.image_size is None:  # the size as sent, for the request trace
                image.image_size = (pil.height, pil.width)
        prompt = ProcessedPrompt(token_ids, inputs)
        if self.model_cls.uses_mrope:
            from hydrad.models.qwen2_vl import get_mrope_positions

            prompt.mrope_positions, prompt.mrope_delta = get_mrope_positions(
                token_ids, self.image_token_id, [image.grid_thw for image in inputs],
                self.hf_config.vision_config.spatial_merge_size,
            )
        return prompt

    def make_engine_request(self, req_id: str, prompt: ProcessedPrompt, params: SamplingParams) -> EngineRequest:
        num_prompt = len(prompt.prompt_token_ids)
        if num_prompt + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request has "
                f"{num_prompt} prompt tokens and asks for {params.max_tokens} more",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return EngineRequest(
            req_id=req_id,
            prompt_token_ids=prompt.prompt_token_ids,
            sampling_params=params,
            images=prompt.images,
            eos_token_ids=self.eos_token_ids,
            mrope_positions=prompt.mrope_positions,
            mrope_delta=prompt.mrope_delta,
        )


def find_image_runs(token_ids: Sequence[int], image_token_id: int, lengths: Sequence[int]) -> list[int]:
    """The offset of each image's placeholder run: image k takes the next ``lengths[k]``
    placeholders, which must be contiguous. Runs are told apart by their lengths, so two images
    whose runs touch are still found."""
    positions = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(positions) != sum(lengths):
        raise RequestError(
            f"the prompt holds {len(positions)} image placeholders for {len(lengths)} images of "
            f"{sum(lengths)} image tokens",
            param="messages",
        )
    offsets, consumed = [], 0
    for length in lengths:
        run = positions[consumed : consumed + length]
        if run[-1] - run[0] + 1 != length:
            raise RequestError("image placeholder tokens are not contiguous", param="messages")
        offsets.append(run[0])
        consumed += length
    return offsets


def _eos_token_ids(model_path: Path, tokenizer, hf_config) -> tuple[int, ...]:
    # Generation stops at the tokenizer's EOS, the model's, and those of generation_config.json
    # (Qwen2-VL's list <|im_end|> and <|endoftext|>), as transformers' generate does.
    eos = [tokenizer.eos_token_id, getattr(hf_config.text_config, "eos_token_id", None)]
    generation_config = model_path / "generation_config.json"
    if generation_config.is_file():
        from transformers import GenerationConfig

        eos.append(GenerationConfig.from_pretrained(model_path).eos_token_id)
    flat = [t for item in eos for t in (item if isinstance(item, list) else [item])]
    return tuple(sorted({t for t in flat if isinstance(t, int)}))
