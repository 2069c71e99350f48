"""The Request Processor: OpenAI messages → prompt token ids + preprocessed images.

It applies the checkpoint's chat template, decodes and checks images, runs the
checkpoint's own image processor and tokenizer (so prompts match transformers
exactly), splits the image outputs per image, and finds where each image's placeholder
tokens sit in the prompt; images of one prompt may have different numbers of tokens
(LLaVA-NeXT, Qwen2-VL). Families that take videos (Qwen2-VL) get each video's frames
sampled and decoded (``hydrad.videos``) and processed (``hydrad.models.qwen2_vl_videos``),
its placeholder repeated once per video token, and then carry it as one more image with its
grid. For M-RoPE models (Qwen2-VL) it also computes the prompt's 3-D positions, once. It
holds no model weights. An image file sent before is found preprocessed
(``hydrad.processed_images``: a chat resends its image every turn) instead of being decoded
and processed again. The daemon runs it in a thread pool, off the event loop, several
requests at once: transformers does not promise that a processor is
safe to call from several threads at once (its tokenizer's settings are changed in
place), so each call borrows an instance of its own from a small pool.

Sizes are checked before the expensive work: ``inspect_chat`` / ``inspect_prompt``
count a request's text and read its images' headers (nothing decoded), and refuse a
prompt whose text is too long to fit in ``max_model_len`` tokens however it is
tokenized (``max_prompt_chars``), too many pixels per image or per request.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from jinja2 import TemplateError
from PIL import Image

from hydrad.chat_options import DEFAULT, ChatTemplateOptions
from hydrad.engine.inputs import EngineRequest, ImageInput
from hydrad.errors import CheckpointError, RequestError
from hydrad.images import EncodedImage, check_image_size, data_url_bytes, open_image_bytes, peek_data_url
from hydrad.processed_images import ProcessedImages, file_key
from hydrad.sampling_params import SamplingParams
from hydrad.tool_calls import TAGS, format_of
from hydrad.videos import EncodedVideo, VideoClip, VideoSampling, decode_video, frames_clip, read_header, \
    sample_indices, video_data_url_bytes

_ROLES = ("system", "developer", "user", "assistant")
# Unicode composition (NFC, NFKC) turns at most 4 code points into one (U+1F82 is
# U+03B1 U+0313 U+0300 U+0345): the normalized text is at least a quarter as long.
_MAX_COMPOSITION = 4


@dataclass(frozen=True)
class PromptSize:
    """What a request holds, from a walk over its fields and its images' headers."""

    num_chars: int  # characters of text (message contents or the prompt)
    # (width, height) of each image, and of each frame a video keeps
    image_sizes: tuple[tuple[int, int], ...] = ()

    @property
    def num_pixels(self) -> int:
        return sum(w * h for w, h in self.image_sizes)


@dataclass(frozen=True)
class VideoSource:
    """A video part before decoding: a file (``data``), or frames given as objects (``clip``,
    checked when the part was read)."""

    data: bytes | None = None
    clip: VideoClip | None = None


@dataclass
class PreparedVideo:
    """A video processed for the prompt: its vision input (placed once the prompt is
    tokenized) and the M-RoPE time between its groups of frames."""

    input: ImageInput
    time_interval: float


def holds_videos(messages) -> bool:
    """Whether any message has a video part (its checks read the whole file)."""
    return isinstance(messages, list) and any(
        isinstance(part, dict) and part.get("type") in ("video_url", "video")
        for message in messages if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"])


def encode_text(tokenizer, text: str) -> list[int]:
    """``tokenizer(text)["input_ids"]``, through the fast tokenizer's Rust encode when it has one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=True).ids
    return tokenizer(text)["input_ids"]


@dataclass
class ProcessedPrompt:
    prompt_token_ids: list[int]
    images: list[ImageInput] = field(default_factory=list)
    # M-RoPE models: [3, num_prompt_tokens] positions and the delta of generated tokens
    # (None for a text-only prompt: the flat arange).
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0
    # Of its images, those found preprocessed (``processed_images``): neither decoded nor
    # processed again (the request trace keeps the count for the planner's replay).
    num_images_found: int = 0

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
        max_request_pixels: int | None = None,
        max_model_len: int | None = None,
        max_video_frames: int = 32,
        chat_template: str | Path | None = None,
        processed_image_cache_bytes: int = 0,
    ):
        """``chat_template``: a Jinja file used instead of the checkpoint's chat template;
        ``processed_image_cache_bytes``: pixels of recent images kept preprocessed, by their
        file (``hydrad.processed_images``; 0: none)."""
        from hydrad.models.loader import load_config
        from hydrad.models.registry import get_model_class

        self.model_path = Path(model_path)
        self.model_name = self.model_path.name
        self.hf_config = hf_config = load_config(self.model_path)
        self.model_cls = get_model_class(hf_config)
        self.max_model_len = max_model_len or hf_config.text_config.max_position_embeddings
        self.max_images_per_request = max_images_per_request
        self.max_image_pixels = max_image_pixels
        self.max_request_pixels = max_request_pixels
        self.processed_images = ProcessedImages(processed_image_cache_bytes)
        self.chat_template = None
        if chat_template is not None:
            try:
                self.chat_template = Path(chat_template).read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise CheckpointError(f"cannot read the chat template {chat_template}: {e}") from None
        self.processor = self._load_processor()
        self.tokenizer = self.processor.tokenizer
        # The format the chat template asks the model to write tool calls in (None: none that
        # can be read back, so neither tool_choice "auto" nor earlier calls and their results).
        self.tool_call_format = format_of(self.processor.chat_template)
        # Whether the tags of that format are special tokens, which detokenizing drops unless
        # told not to (then an answer's calls would not be found in its text).
        self.tool_call_tags_special = self.tool_call_format is not None and not set(TAGS).isdisjoint(
            self.tokenizer.all_special_tokens)
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.processor.image_token)
        # Where the tokenizer keeps the image placeholder whole whatever surrounds it (an added
        # token, as every served family's), a prompt is tokenized with one placeholder per
        # image and the ids repeated after: the same ids as tokenizing the repeated text
        # (hundreds of placeholders: most of a found image's turn), checked here once.
        self.expands_image_ids = _placeholder_is_atomic(self.tokenizer, self.processor.image_token,
                                                        self.image_token_id)
        # Families that take videos: their processing, and how frames are drawn from a file.
        self.videos = self.video_sampling = self.video_token = self.video_token_id = None
        self.max_video_frames = max_video_frames
        self._no_videos = f"this model ({hf_config.model_type}) does not take videos"
        if getattr(self.model_cls, "takes_videos", False):
            from hydrad.models.qwen2_vl_videos import Qwen2VLVideos

            try:
                self.videos = Qwen2VLVideos.from_checkpoint(self.model_path)
            except CheckpointError as e:  # images are still served
                self._no_videos = str(e)
        if self.videos is not None:
            self.video_sampling = VideoSampling(fps=self.videos.fps, min_frames=self.videos.min_frames,
                                                max_frames=max_video_frames, temporal_patch=self.videos.temporal)
            self.video_token = self.processor.video_token
            self.video_token_id = self.tokenizer.convert_tokens_to_ids(self.video_token)
        self.eos_token_ids = _eos_token_ids(self.model_path, self.tokenizer, hf_config)
        # A longer text cannot fit in max_model_len tokens (None: the tokenizer may drop text,
        # so only the token count after tokenizing tells).
        chars_per_token = max_chars_per_token(self.tokenizer)
        self.max_prompt_chars = None if chars_per_token is None else self.max_model_len * chars_per_token
        # HF processors not in use. The first is self.processor, which the event loop also uses
        # to decode: safe, since decoding neither changes the tokenizer nor releases the GIL.
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._idle.put(self.processor)

    def add_instances(self, num: int) -> None:
        """Load ``num`` more HF processors now, so that as many calls at once find one ready
        (a call that finds none loads one, which costs that call the load time)."""
        for _ in range(num):
            self._idle.put(self._load_processor())

    def _load_processor(self):
        """The checkpoint's HF processor, its image processor served by the exact fast path
        where one serves its family and settings (``hydrad.models.exact_images``)."""
        from hydrad.models.exact_images import exact_images
        from hydrad.models.hf_processor import load_hf_processor

        processor = load_hf_processor(self.model_path, self.hf_config.model_type)
        if self.chat_template is not None:
            processor.chat_template = self.chat_template
        if getattr(processor, "image_processor", None) is not None:
            processor.image_processor = exact_images(processor.image_processor)
        return processor

    @contextmanager
    def _hf_processor(self) -> Iterator:
        try:
            processor = self._idle.get_nowait()
        except queue.Empty:
            processor = self._load_processor()
        try:
            yield processor
        finally:
            self._idle.put(processor)

    # -- messages ------------------------------------------------------------------------------
    def _normalize(self, messages) -> tuple[list[dict], list[tuple[object, str]], int]:
        """The messages as the chat template takes them, each image's source (a data URL, a PIL
        image, fetched bytes) with the field it came from, and the number of text characters.
        Nothing is decoded."""
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        normalized, images, num_chars = [], [], 0
        for i, message in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(message, dict):
                raise RequestError(f"{where} must be an object", param=where)
            role = message.get("role")
            if role == "function" or message.get("function_call"):
                name = "role" if role == "function" else "function_call"
                raise RequestError(f"{where}: function messages and function_call are the deprecated form of tool "
                                   "calls; send tool messages and tool_calls", param=f"{where}.{name}")
            if role == "tool" or (role == "assistant" and message.get("tool_calls")):
                if self.tool_call_format is None:
                    what = "tool messages" if role == "tool" else "earlier tool_calls"
                    raise RequestError(f"{where}: {what} are not supported: this model's chat template has no tool "
                                       "calls ([model] chat_template sets one)",
                                       param=f"{where}.role" if role == "tool" else f"{where}.tool_calls")
                message, chars = _tool_message(message, where)
                normalized.append(message)
                num_chars += chars
                continue
            if role not in _ROLES:
                raise RequestError(f"{where}.role must be one of {', '.join((*_ROLES, 'tool'))}, got {role!r}",
                                   param=f"{where}.role")
            role = "system" if role == "developer" else role
            content = message.get("content")
            if isinstance(content, str):
                normalized.append({"role": role, "content": [{"type": "text", "text": content}]})
                num_chars += len(content)
                continue
            if not isinstance(content, list) or not content:
                got = "null" if content is None else "an empty list" if content == [] else type(content).__name__
                raise RequestError(f"{where}.content must be a string or a non-empty list of parts, got {got}",
                                   param=f"{where}.content")
            parts = []
            for j, part in enumerate(content):
                pwhere = f"{where}.content[{j}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    if not isinstance(part.get("text"), str):
                        raise RequestError(f"{pwhere}.text must be a string", param=pwhere)
                    parts.append({"type": "text", "text": part["text"]})
                    num_chars += len(part["text"])
                elif kind in ("image_url", "image"):
                    if role != "user":
                        raise RequestError(f"{pwhere}: images are accepted in user messages only", param=pwhere)
                    images.append((self._image_source(part, pwhere), pwhere))
                    parts.append({"type": "image"})
                elif kind in ("video_url", "video"):
                    if self.videos is None:
                        raise RequestError(f"{pwhere}: {self._no_videos}", param=pwhere)
                    if role != "user":
                        raise RequestError(f"{pwhere}: videos are accepted in user messages only", param=pwhere)
                    images.append((self._video_source(part, pwhere), pwhere))
                    parts.append({"type": "video"})
                else:
                    kinds = "'text', 'image_url', 'image', 'video_url' or 'video'" if self.videos else \
                        "'text', 'image_url' or 'image'"
                    raise RequestError(f"{pwhere}.type must be {kinds}, got {kind!r}", param=pwhere)
            normalized.append({"role": role, "content": parts})
        if len(images) > self.max_images_per_request:
            what = "images and videos" if any(isinstance(s, VideoSource) for s, _ in images) else "images"
            raise RequestError(
                f"{len(images)} {what} in one request; the limit is {self.max_images_per_request}", param="messages"
            )
        return normalized, images, num_chars

    def _image_source(self, part: dict, where: str) -> object:
        if part["type"] == "image":
            image = part.get("image")
            if not isinstance(image, (Image.Image, EncodedImage)):
                raise RequestError(f"{where}.image must be a PIL image", param=where)
            return image
        image_url = part.get("image_url")
        url = image_url.get("url") if isinstance(image_url, dict) else image_url
        if not isinstance(url, str):
            raise RequestError(f"{where}.image_url.url must be a string", param=where)
        if not url.strip():
            raise RequestError(f"{where}.image_url.url is empty", param=where)
        if url.startswith(("http://", "https://")):
            raise RequestError("remote image URLs are not enabled on this server; send a data: URL", param=where)
        return url

    def _video_source(self, part: dict, where: str) -> VideoSource:
        if part["type"] == "video":
            video = part.get("video")
            if isinstance(video, EncodedVideo):  # fetched from a remote URL
                return VideoSource(data=video.data)
            return VideoSource(clip=frames_clip(video, part.get("fps"), max_frames=self.max_video_frames,
                                                max_pixels=self.max_image_pixels, param=where))
        video_url = part.get("video_url")
        url = video_url.get("url") if isinstance(video_url, dict) else video_url
        if not isinstance(url, str) or not url.strip():
            raise RequestError(f"{where}.video_url.url must be a non-empty string", param=where)
        if url.startswith(("http://", "https://")):
            raise RequestError("remote video URLs are not enabled on this server; send a data: URL", param=where)
        return VideoSource(data=video_data_url_bytes(url, where))

    def _peek_video(self, source: VideoSource, where: str) -> list[tuple[int, int]]:
        """(width, height) of each frame a video keeps, from its container's header."""
        if source.clip is not None:
            return [source.clip.size] * len(source.clip.frames)
        header = read_header(source.data, max_pixels=self.max_image_pixels, param=where)
        return [(header.width, header.height)] * len(sample_indices(header.num_frames, header.fps,
                                                                    self.video_sampling))

    def _peek(self, source: object, where: str) -> tuple[int, int]:
        """An image's (width, height) from its header, checked against ``max_image_pixels``."""
        if isinstance(source, str):
            return peek_data_url(source, max_pixels=self.max_image_pixels, param=where)
        if isinstance(source, Image.Image):
            check_image_size(source, max_pixels=self.max_image_pixels, param=where)
        return source.size  # EncodedImage: checked when it was fetched

    def _decode(self, source: object, where: str) -> tuple[Image.Image | ImageInput | VideoClip, bytes | None]:
        """The RGB image, or its preprocessed input found in the cache (``processed_images``),
        with its file's key (None for an object); a video's frames with the file they were
        decoded from (None for frames sent as such)."""
        if isinstance(source, VideoSource):
            if source.clip is not None:
                return source.clip, None
            return decode_video(source.data, self.video_sampling, max_pixels=self.max_image_pixels,
                                param=where), source.data
        if isinstance(source, (str, EncodedImage)):
            data = source.data if isinstance(source, EncodedImage) else data_url_bytes(source, where)
            key = file_key(data)
            found = self.processed_images.get(key)
            if found is not None:
                return found, key
            return open_image_bytes(data, max_pixels=self.max_image_pixels, param=where), key
        return (source if source.mode == "RGB" else source.convert("RGB")), None

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuse a text too long for ``max_model_len`` tokens before it reaches the tokenizer."""
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            holder = "the messages hold" if param == "messages" else "the prompt has"
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, which hold at most "
                f"{self.max_prompt_chars} characters of text with its tokenizer; {holder} {num_chars}",
                param=param, code="context_length_exceeded",
            )

    def _check_images(self, sources: list[tuple[object, str]]) -> tuple[tuple[int, int], ...]:
        """Each image's size and each kept video frame's, checked against ``max_request_pixels``."""
        sizes = []
        for source, where in sources:
            if isinstance(source, VideoSource):
                sizes += self._peek_video(source, where)
            else:
                sizes.append(self._peek(source, where))
        num_pixels = sum(w * h for w, h in sizes)
        if self.max_request_pixels is not None and num_pixels > self.max_request_pixels:
            what = "images and video frames" if len(sizes) > len(sources) else "images"
            raise RequestError(f"the request's {len(sizes)} {what} have {num_pixels} pixels in all; the limit is "
                               f"{self.max_request_pixels}", param="messages")
        return tuple(sizes)

    def inspect_chat(self, messages, options: ChatTemplateOptions = DEFAULT) -> PromptSize:
        """Check a chat request's size without decoding an image or running the tokenizer:
        its text (with its template variables: ``options``) against ``max_prompt_chars``,
        each image's header against ``max_image_pixels``, all its pixels against
        ``max_request_pixels``."""
        _, sources, num_chars = self._normalize(messages)
        options.check_messages(messages)
        num_chars += options.num_chars
        self.check_prompt_chars(num_chars, "messages")
        return PromptSize(num_chars, self._check_images(sources))

    def inspect_prompt(self, prompt: str | list[int]) -> PromptSize:
        """A text prompt's size, or a prompt of token ids checked whole (a size of one
        character a token: no text to tokenize)."""
        if isinstance(prompt, list):
            if not prompt:
                raise RequestError("a prompt of token ids must hold at least one", param="prompt")
            if len(prompt) > self.max_model_len:
                raise RequestError(f"this model's maximum context length is {self.max_model_len} tokens; the "
                                   f"prompt has {len(prompt)}", param="prompt", code="context_length_exceeded")
            self.check_token_ids(prompt, "prompt")
            placeholders = {self.image_token_id, self.video_token_id} - {None}
            if not placeholders.isdisjoint(prompt):
                raise RequestError("the prompt contains image or video placeholder tokens, which a prompt of "
                                   "token ids has no image or video for", param="prompt")
            return PromptSize(len(prompt))
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("prompt must be a non-empty string", param="prompt")
        self.check_prompt_chars(len(prompt), "prompt")
        return PromptSize(len(prompt))

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """Refuse (RequestError naming ``param``) token ids the model has no embedding for."""
        vocab_size = self.hf_config.text_config.vocab_size
        for token_id in (min(token_ids), max(token_ids)) if token_ids else ():  # two passes at C speed
            if not 0 <= token_id < vocab_size:
                raise RequestError(f"token id {token_id} is outside the model's vocabulary [0, {vocab_size})",
                                   param=param)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text's ids as a text prompt gets them (``process_prompt``), or without the special
        tokens the tokenizer adds; within the context's bound either way."""
        if add_special_tokens:
            return self.process_prompt(text).prompt_token_ids
        self.inspect_prompt(text)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def tokenizer_info(self) -> dict:
        """What a client tokenizing remotely needs: the special tokens, the chat template, the
        bounds (vLLM's ``/tokenizer_info``)."""
        tokenizer = self.tokenizer
        return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
                "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
                "chat_template": self.processor.chat_template,
                "model_max_length": self.max_model_len, "vocab_size": self.hf_config.text_config.vocab_size}

    def process_chat(self, messages: list[dict], tools: list[dict] | None = None,
                     options: ChatTemplateOptions = DEFAULT) -> ProcessedPrompt:
        """``tools``: the request's (OpenAI's ``tools``), given to the chat template, which puts
        them in the prompt where it has a place for them; ``options``: how the template renders
        the conversation (``hydrad.chat_options``)."""
        normalized, sources, num_chars = self._normalize(messages)
        options.check_messages(messages)
        self.check_prompt_chars(num_chars + options.num_chars, "messages")
        self._check_images(sources)
        decoded = [self._decode(source, where) for source, where in sources]
        images = [(item, data) for item, data in decoded if not isinstance(item, VideoClip)]
        clips = [(item, data) for item, data in decoded if isinstance(item, VideoClip)]
        with self._hf_processor() as processor:
            try:
                text = processor.apply_chat_template(
                    normalized, tools=tools, add_generation_prompt=options.add_generation_prompt,
                    continue_final_message=options.continue_final_message, tokenize=False,
                    **options.template_kwargs(processor.chat_template))
            except TemplateError as e:  # the template's own refusal (a role it does not take, ...)
                raise RequestError(f"the model's chat template refused the messages: {e}", param="messages") from None
            except ValueError as e:  # the final message is not in the rendered text as it was sent
                if not options.continue_final_message:
                    raise
                raise RequestError(f"the final message cannot be continued: {e}", param="messages") from None
            videos = None
            if clips:
                text, videos = self._videos(text, clips)
            return self._tokenize(processor, text, [image for image, _ in images], [key for _, key in images],
                                  videos=videos)

    def process_prompt(self, prompt: str | list[int]) -> ProcessedPrompt:
        """A text prompt tokenized (no chat template), or a prompt of token ids taken as it is."""
        self.inspect_prompt(prompt)
        if isinstance(prompt, list):
            return ProcessedPrompt(list(prompt))
        with self._hf_processor() as processor:
            return self._tokenize(processor, prompt, [], param="prompt")

    def prompt_text(self, prompt: str | list[int]) -> str:
        """A prompt as text: a text prompt as given, token ids decoded (special tokens kept)."""
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(prompt)

    def _videos(self, text: str, clips: list[tuple[VideoClip, bytes | None]]) -> tuple[str, list[PreparedVideo]]:
        """The prompt with each video's placeholder repeated once per video token, and the videos
        processed (their digest over the file they came from and how its frames were drawn)."""
        videos = []
        for clip, data in clips:
            try:
                processed = self.videos(clip.frames)
            except ValueError as e:  # an aspect ratio over 200, as for images
                raise RequestError(f"could not process the video: {e}", param="messages") from None
            t, h, w = processed.grid_thw
            video = ImageInput(pixel_values=processed.pixel_values, offset=-1, length=t * h * w // self.videos.merge**2,
                               image_size=tuple(clip.frames.shape[1:3]), grid_thw=processed.grid_thw,
                               num_patches=t * h * w, attention_span=h * w, frames=len(clip.frames))
            video.digest(None if data is None else repr(clip.sampling).encode() + data)
            interval = self.model_cls.video_time_interval(self.hf_config, self.videos.temporal, clip.fps)
            videos.append(PreparedVideo(video, interval))
        return repeat_placeholders(text, self.video_token, [v.input.length for v in videos], "video"), videos

    # -- tokens ---------------------------------------------------------------------------------
    def _tokenize(self, processor, text: str, images: list[Image.Image | ImageInput],
                  keys: list[bytes | None] | None = None,
                  videos: list[PreparedVideo] | None = None, param: str = "messages") -> ProcessedPrompt:
        """``images``: decoded, or found preprocessed (``_decode``); ``keys``: each image's
        file key, where it came from a file (its digest's source, and where the cache keeps
        it); ``videos``: from ``_videos``, their placeholders already repeated in ``text``;
        ``param``: the request field the text came from, for errors."""
        if not images:
            # Text alone: the processor would only call its tokenizer (special tokens added, no
            # padding); its own encode gives the same ids without the kwargs merging and tensors.
            token_ids = encode_text(processor.tokenizer, text)
            if self.image_token_id in token_ids:
                raise RequestError("the prompt contains image placeholder tokens but no image", param=param)
            if not videos and self.video_token_id is not None and self.video_token_id in token_ids:
                raise RequestError("the prompt contains video placeholder tokens but no video", param=param)
            return self._with_videos(ProcessedPrompt(token_ids), videos) if videos else ProcessedPrompt(token_ids)
        keys = keys or [None] * len(images)
        num_found = sum(1 for image in images if isinstance(image, ImageInput))
        inputs = self._process_images(processor, images, keys)
        # The placeholders repeated as transformers' processors repeat them, then the tokenizer
        # (the processor's own call does the same, with the image processor run inside it);
        # or, the same ids, the tokenizer first and each placeholder's id repeated after.
        lengths = [image.length for image in inputs]
        if self.expands_image_ids:
            token_ids, offsets = expand_placeholder_ids(encode_text(processor.tokenizer, text), self.image_token_id,
                                                        lengths, "image")
        else:
            token_ids = encode_text(processor.tokenizer, repeat_placeholders(text, processor.image_token, lengths,
                                                                             "image"))
            offsets = find_image_runs(token_ids, self.image_token_id, lengths)
        for image, offset in zip(inputs, offsets):
            image.offset = offset
        prompt = ProcessedPrompt(token_ids, inputs, num_images_found=num_found)
        if videos:
            return self._with_videos(prompt, videos)
        if self.model_cls.uses_mrope:
            from hydrad.models.qwen2_vl import get_mrope_positions

            prompt.mrope_positions, prompt.mrope_delta = get_mrope_positions(
                token_ids, self.image_token_id, [image.grid_thw for image in inputs],
                self.hf_config.vision_config.spatial_merge_size,
            )
        return prompt

    def _process_images(self, processor, images: list[Image.Image | ImageInput],
                        keys: list[bytes | None]) -> list[ImageInput]:
        """Each image's input: those found in the cache as they are, the others through the
        image processor (together), digested, and kept in the cache where they have a key."""
        inputs = list(images)
        missing = [k for k, image in enumerate(images) if not isinstance(image, ImageInput)]
        if not missing:
            return inputs
        try:
            out = processor.image_processor(images=[images[k] for k in missing], return_tensors="pt")
        except ValueError as e:
            # The image processor refuses what it cannot resize (e.g. Qwen2-VL: aspect ratio over 200).
            raise RequestError(f"could not process the images: {e}", param="messages") from None
        for k, image in zip(missing, self.model_cls.image_inputs(self.hf_config, out)):
            pil = images[k]
            if image.image_size is None:  # the size as sent, for the request trace
                image.image_size = (pil.height, pil.width)
            image.digest(keys[k])  # here, once: the engine matches cached prefixes by it
            if keys[k] is not None:
                self.processed_images.put(keys[k], image)
            inputs[k] = image
        return inputs

    def _with_videos(self, prompt: ProcessedPrompt, videos: list[PreparedVideo]) -> ProcessedPrompt:
        """The prompt's videos placed beside its images (in prompt order), and its M-RoPE
        positions over both."""
        from hydrad.models.qwen2_vl import get_mrope_positions

        token_ids = prompt.prompt_token_ids
        image_grids = [image.grid_thw for image in prompt.images]
        offsets = find_image_runs(token_ids, self.video_token_id, [v.input.length for v in videos], kind="video")
        for video, offset in zip(videos, offsets):
            video.input.offset = offset
            prompt.images.append(video.input)
        prompt.images.sort(key=lambda image: image.offset)
        prompt.mrope_positions, prompt.mrope_delta = get_mrope_positions(
            token_ids, self.image_token_id, image_grids, self.hf_config.vision_config.spatial_merge_size,
            video_token_id=self.video_token_id, video_grid_thw=[v.input.grid_thw for v in videos],
            video_time_intervals=[v.time_interval for v in videos],
        )
        return prompt

    def make_engine_request(self, req_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                            group: str | None = None) -> EngineRequest:
        """``group``: the id of the first of the prompt's ``n`` completions, where it has more
        than one (``EngineRequest.group``)."""
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
            group=group,
        )


def repeat_placeholders(text: str, placeholder: str, lengths: Sequence[int], kind: str) -> str:
    """``text`` with its k-th ``placeholder`` repeated ``lengths[k]`` times, as transformers'
    processors expand them. RequestError when the text holds another number of them."""
    pieces = text.split(placeholder)
    _check_placeholders(len(pieces) - 1, len(lengths), kind)
    out = [pieces[0]]
    for length, piece in zip(lengths, pieces[1:]):
        out += [placeholder * length, piece]
    return "".join(out)


def _check_placeholders(found: int, wanted: int, kind: str) -> None:
    """RequestError unless the prompt holds one placeholder per image (or video)."""
    if found < wanted:
        raise RequestError(f"this checkpoint's chat template does not place {kind}s", param="messages")
    if found > wanted:
        raise RequestError(f"the prompt contains {kind} placeholder tokens beyond its {kind}s", param="messages")


def expand_placeholder_ids(token_ids: list[int], token_id: int, lengths: Sequence[int],
                           kind: str) -> tuple[list[int], list[int]]:
    """``token_ids`` with their k-th ``token_id`` repeated ``lengths[k]`` times, and each run's
    offset. RequestError, as ``repeat_placeholders``, when they hold another number of them."""
    positions = [i for i, t in enumerate(token_ids) if t == token_id]
    _check_placeholders(len(positions), len(lengths), kind)
    out: list[int] = []
    offsets = []
    start = 0
    for position, length in zip(positions, lengths):
        out += token_ids[start:position]
        offsets.append(len(out))
        out += [token_id] * length
        start = position + 1
    out += token_ids[start:]
    return out, offsets


def _placeholder_is_atomic(tokenizer, placeholder: str, token_id: int) -> bool:
    """Whether tokenizing a text with each ``placeholder`` repeated gives the ids of the text
    with one, each repeated (``expand_placeholder_ids``): the tokenizer keeps it whole beside
    any text (an added token), not merged into or split by what surrounds it."""
    for text in (placeholder, f"a{placeholder}b", f"a {placeholder} b", f"\n{placeholder}\n",
                 f"{placeholder}{placeholder}x", f"USER: {placeholder}\nWhat is this?"):
        count = text.count(placeholder)
        once = encode_text(tokenizer, text)
        if once.count(token_id) != count:
            return False
        expanded, _ = expand_placeholder_ids(once, token_id, [3] * count, "image")
        if encode_text(tokenizer, text.replace(placeholder, placeholder * 3)) != expanded:
            return False
    return True


def find_image_runs(token_ids: Sequence[int], image_token_id: int, lengths: Sequence[int],
                    kind: str = "image") -> list[int]:
    """The offset of each image's (or video's) placeholder run: image k takes the next
    ``lengths[k]`` placeholders, which must be contiguous. Runs are told apart by their lengths,
    so two images whose runs touch are still found."""
    positions = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(positions) != sum(lengths):
        raise RequestError(
            f"the prompt holds {len(positions)} {kind} placeholders for {len(lengths)} {kind}s of "
            f"{sum(lengths)} {kind} tokens",
            param="messages",
        )
    offsets, consumed = [], 0
    for length in lengths:
        run = positions[consumed : consumed + length]
        if run[-1] - run[0] + 1 != length:
            raise RequestError(f"{kind} placeholder tokens are not contiguous", param="messages")
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


# Normalizers that never shorten a text, and those that shorten it at most _MAX_COMPOSITION-fold.
_KEEPING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend"}
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
# Pre-tokenizers that split a text without dropping any of it.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters of a text one token can stand for, or None when the tokenizer may
    drop text (a normalizer or pre-tokenizer that deletes characters, unknown runs fused into
    one token), so that no such bound exists.

    A token stands for at most its own string in the vocabulary (in the byte-level alphabet,
    one character per byte, at least one byte per character), and the text it is cut from
    is the normalized text, at least 1/_MAX_COMPOSITION as long as the input when composed
    (NFC, NFKC). So a text of more than ``n * max_chars_per_token`` characters cannot be
    fewer than ``n`` tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_text(spec.get("pre_tokenizer")):
        return None
    model = spec.get("model") or {}
    vocab = model.get("vocab") or {}
    if not (model.get("byte_fallback") or _covers_every_byte(spec.get("pre_tokenizer"), vocab)
            or (model.get("type") == "BPE" and model.get("unk_token") is not None and not model.get("fuse_unk"))):
        # A character the vocabulary lacks is dropped (BPE without an unknown token), or a
        # run of them of any length becomes one token (fused, and always with Unigram);
        # WordPiece and WordLevel make a whole word one unknown token.
        return None
    if model.get("type") not in ("BPE", "Unigram"):
        return None
    pieces = vocab.keys() if isinstance(vocab, dict) else (piece for piece, _ in vocab)
    added = (token["content"] for token in spec.get("added_tokens") or ())
    return shrink * max(len(piece) for piece in (*pieces, *added))


def _normalizer_shrink(spec: dict | None) -> int | None:
    """How many times shorter a normalizer may make a text (None: without bound)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in spec.get("normalizers", ()):
            inner_factor = _normalizer_shrink(inner)
            if inner_factor is None:
                return None
            factor *= inner_factor
        return factor
    if kind in _KEEPING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return _MAX_COMPOSITION
    if kind == "Replace":
        pattern, content = spec.get("pattern") or {}, spec.get("content") or ""
        if "String" in pattern and pattern["String"] and content:
            return max(1, -(-len(pattern["String"]) // len(content)))
    return None  # Strip, Precompiled, BertNormalizer, regex Replace: may delete characters


def _covers_every_byte(pre_tokenizer: dict | None, vocab) -> bool:
    """Byte-level: every text reaches the model as characters of the 256-byte alphabet, and
    the vocabulary holds them all."""
    from tokenizers.pre_tokenizers import ByteLevel

    def byte_level(spec: dict | None) -> bool:
        if spec is None:
            return False
        if spec.get("type") == "Sequence":
            return any(byte_level(inner) for inner in spec.get("pretokenizers", ()))
        return spec.get("type") == "ByteLevel"

    pieces = vocab if isinstance(vocab, dict) else {piece for piece, _ in vocab}
    return byte_level(pre_tokenizer) and all(char in pieces for char in ByteLevel.alphabet())


def _keeps_text(spec: dict | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_text(inner) for inner in spec.get("pretokenizers", ()))
    if kind in ("Split", "Punctuation"):
        return str(spec.get("behavior", "")).lower() != "removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _tool_message(message: dict, where: str) -> tuple[dict, int]:
    """A tool message, or an assistant message with earlier ``tool_calls``, as chat templates
    with tools take them (their text as a string, each call's arguments as an object), and
    its characters of text."""
    role, content = message["role"], message.get("content")
    if content is None and role == "assistant":
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        text = "".join(p["text"] for p in content)
    else:
        raise RequestError(f"{where}.content must be a string or a non-empty list of text parts",
                           param=f"{where}.content")
    if role == "tool":
        out = {"role": "tool", "content": text}
        for name in ("tool_call_id", "name"):
            value = message.get(name)
            if value is not None and not isinstance(value, str):
                raise RequestError(f"{where}.{name} must be a string", param=f"{where}.{name}")
            if value is not None:
                out[name] = value
        return out, len(text)
    calls = message["tool_calls"]
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be an array of calls", param=f"{where}.tool_calls")
    out_calls, chars = [], len(text)
    for k, call in enumerate(calls):
        cwhere = f"{where}.tool_calls[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), str)):
            raise RequestError(f'{cwhere} must be {{"type": "function", "function": {{"name": ..., "arguments": '
                               '"<a JSON object>"}}', param=cwhere)
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise RequestError(f"{cwhere}.function.arguments must be a JSON object (as a string)",
                               param=f"{cwhere}.function.arguments")
        out_calls.append({"id": call.get("id"), "type": "function",
                          "function": {"name": function["name"], "arguments": arguments}})
        chars += len(function["name"]) + len(function["arguments"])
    return {"role": "assistant", "content": text, "tool_calls": out_calls}, chars
