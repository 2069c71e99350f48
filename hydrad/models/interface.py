"""What every vision-language family implements, so the engine treats LLaVA, LLaVA-NeXT and Qwen2-VL alike.

A family is a vision part (stage E: images -> rows of the language model's embedding
space) and a language part (stages P and D: embeddings -> hidden states -> logits). An
instance builds only the parts its role needs. The language part is always our own
Llama-family decoder (``hydrad.models.llama``) over flattened batches and a paged KV cache;
this base class holds it, so a family writes only its vision side.

Weights arrive under the loader's canonical names: the vision part's under ``vision_tower.``
and ``multi_modal_projector.``, the language part's under ``language_model.`` and ``lm_head.``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

from hydrad.models.attention import get_attn_backend
from hydrad.models.attention.metadata import AttentionMetadata
from hydrad.models.inputs import ImageInput
from hydrad.models.linear import pack_linears
from hydrad.models.llama import STACKED_PARAMS, LlamaModel, ParamLoader, head_dim_of, load_weight_groups

VISION_PARTS = ("vision_tower", "multi_modal_projector")
LANGUAGE_PARTS = ("language_model", "lm_head")


@contextmanager
def skip_weight_init() -> Iterator[None]:
    """Build modules without drawing their random initial weights (``load_weights`` writes
    every parameter): ``torch.nn.init``'s in-place initialisers do nothing meanwhile. A
    family whose vision part is a transformers model adds transformers' own guard."""
    names = [name for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")]
    saved = {name: getattr(nn.init, name) for name in names}

    def keep(tensor, *args, **kwargs):
        return tensor

    for name in names:
        setattr(nn.init, name, keep)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


class VisionLanguageModel(nn.Module):
    """Base of every family's ``<Family>ForConditionalGeneration``.

    Subclasses set the class attributes, build their vision modules in ``build_vision``
    (returning them by canonical prefix) and implement ``encode_images`` and ``image_inputs``.
    """

    # Rows of the image cache are the language model's embeddings.
    image_hidden_size: int
    # Image-token slots per image-cache block when the configuration does not say.
    default_image_block_size: int
    # Positions are [3, num_tokens] (M-RoPE) instead of [num_tokens].
    uses_mrope: bool = False

    def __init__(
        self,
        hf_config,
        *,
        load_vision: bool = True,
        load_language: bool = True,
        attn_backend=None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        if not (load_vision or load_language):
            raise ValueError("load at least one of the vision and the language parts")
        text_config = hf_config.text_config
        self.hf_config = hf_config
        self.image_hidden_size = text_config.hidden_size
        self.num_layers = text_config.num_hidden_layers
        self.num_kv_heads = text_config.num_key_value_heads
        self.head_dim = head_dim_of(text_config)
        self.tie_word_embeddings = bool(hf_config.tie_word_embeddings)
        self.dtype = dtype
        self.device = torch.device(device)
        self.has_vision = self.has_language = False
        self.vision_parts: tuple[str, ...] = ()
        self.add_parts(vision=load_vision, language=load_language, attn_backend=attn_backend)

    # -- parts, added and dropped as an instance's role changes -----------------------------------
    def add_parts(self, *, vision: bool = False, language: bool = False, attn_backend=None) -> list[str]:
        """Build the parts not yet held (their weights come with ``load_weights``); returns the
        canonical prefixes of the parts built."""
        built: list[str] = []
        # Every parameter is overwritten by load_weights: skip the random init.
        with skip_weight_init(), self.device:
            if vision and not self.has_vision:
                for name, module in self.build_vision(self.hf_config, self.dtype).items():
                    setattr(self, name, module)
                    self.vision_parts += (name,)
                self.has_vision = True
                built += VISION_PARTS
            if language and not self.has_language:
                text_config = self.hf_config.text_config
                backend = attn_backend or get_attn_backend(self.device, dtype=self.dtype)
                self.language_model = LlamaModel(text_config, backend, self.dtype)
                if not self.tie_word_embeddings:
                    self.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False,
                                             dtype=self.dtype)
                self.has_language = True
                built += LANGUAGE_PARTS
        self.requires_grad_(False)
        self.eval()
        return built

    def drop_parts(self, *, vision: bool = False, language: bool = False) -> None:
        """Free the parts an instance no longer runs."""
        if vision and self.has_vision:
            for name in self.vision_parts:
                delattr(self, name)
            self.vision_parts, self.has_vision = (), False
        if language and self.has_language:
            del self.language_model
            if not self.tie_word_embeddings:
                del self.lm_head
            self.has_language = False

    # -- what a family provides -----------------------------------------------------------------
    def build_vision(self, hf_config, dtype: torch.dtype) -> Mapping[str, nn.Module]:
        """The vision modules by canonical prefix (a subset of ``VISION_PARTS``)."""
        raise NotImplementedError

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """One ``[num_image_tokens_i, hidden]`` matrix per image, in order (batched internally)."""
        raise NotImplementedError

    def num_vision_patches(self, image: ImageInput) -> int:
        """How many patch positions the vision tower runs over for ``image`` (it needs only the
        image's layout, not its pixels): the cost of encoding it, as the latency model counts it;
        an image's ``length`` (its tokens in the language model) is what prefill costs.
        ``image_inputs`` stores the same number in ``ImageInput.num_patches``."""
        raise NotImplementedError

    @classmethod
    def image_inputs(cls, hf_config, processor_output: Mapping[str, torch.Tensor]) -> list[ImageInput]:
        """Split the HF processor's image outputs per image: pixels, layout, ``length`` (its
        number of image tokens) and ``num_patches`` (its encode cost, see ``num_vision_patches``);
        ``offset`` is left for the caller, who finds the placeholders. The image processor's output
        alone is enough (no token ids are read)."""
        raise NotImplementedError

    # -- the language side, the same for every family ----------------------------------------------
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        # [num_tokens] -> [num_tokens, hidden]
        return self.language_model.embed_tokens(input_ids)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        # [num_tokens, hidden], positions [num_tokens] or [3, num_tokens] -> [num_tokens, hidden], final-normed
        return self.language_model(inputs_embeds, positions, kv_cache, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [num_seqs, hidden] -> [num_seqs, vocab] fp32
        if self.tie_word_embeddings:
            return F.linear(hidden_states, self.language_model.embed_tokens.weight).float()
        return self.lm_head(hidden_states).float()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, vision: bool | None = None,
                     language: bool | None = None) -> None:
        """Load canonical-name weights into the parts this instance holds (or only those named:
        ``vision``/``language`` True); weights of the other parts are skipped. CheckpointError
        names every missing and unexpected weight."""
        if vision is None and language is None:
            vision, language = self.has_vision, self.has_language
        groups, skipped = {}, []
        if vision and self.has_vision:
            groups.update({name: ParamLoader(getattr(self, name)) for name in self.vision_parts})
        else:
            skipped += VISION_PARTS
        if language and self.has_language:
            groups["language_model"] = ParamLoader(self.language_model, STACKED_PARAMS)
            if self.tie_word_embeddings:
                # Some tied checkpoints store the head anyway; it is the embedding matrix.
                skipped.append("lm_head")
            else:
                groups["lm_head"] = ParamLoader(self.lm_head)
        else:
            skipped += LANGUAGE_PARTS
        load_weight_groups(groups, skipped, weights)
        # The weights are in: on a CPU the linear layers keep them packed for oneDNN from now on.
        pack_linears(self, list(groups), self.device, self.dtype)
