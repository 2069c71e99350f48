"""LLaVA-1.5: a CLIP vision tower, a two-layer projector, and a Llama-family decoder.

An instance builds only the parts its role needs: the vision tower and projector turn
images into rows of the language model's embedding space (stage E), the decoder turns
embeddings into hidden states and logits (stages P and D). The caller places the image
rows at the prompt's placeholder positions.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoModel
from transformers.activations import ACT2FN
from transformers.initialization import no_init_weights

from hydrad.engine.attention import get_attn_backend
from hydrad.engine.attention.metadata import AttentionMetadata
from hydrad.errors import CheckpointError
from hydrad.models.llama import STACKED_PARAMS, LlamaModel, ParamLoader, head_dim_of, load_weight_groups

_VISION_PARTS = ("vision_tower", "multi_modal_projector")
_LANGUAGE_PARTS = ("language_model", "lm_head")


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, hf_config, dtype: torch.dtype):
        super().__init__()
        layers = hf_config.vision_feature_layer
        num_feature_layers = 1 if isinstance(layers, int) else len(layers)
        vision_hidden = hf_config.vision_config.hidden_size * num_feature_layers
        text_hidden = hf_config.text_config.hidden_size
        bias = hf_config.multimodal_projector_bias
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias, dtype=dtype)
        self.act = ACT2FN[hf_config.projector_hidden_act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias, dtype=dtype)

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(image_features)))


class LlavaForConditionalGeneration(nn.Module):
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
        vision_config, text_config = hf_config.vision_config, hf_config.text_config
        self.vision_feature_layer = hf_config.vision_feature_layer
        self.vision_feature_select_strategy = hf_config.vision_feature_select_strategy
        if self.vision_feature_select_strategy not in ("default", "full"):
            raise CheckpointError(
                f"vision_feature_select_strategy {self.vision_feature_select_strategy!r} is not supported"
            )
        num_patches = (vision_config.image_size // vision_config.patch_size) ** 2
        # "default" drops the CLS token, "full" keeps it.
        self.num_image_tokens_per_image = num_patches + (self.vision_feature_select_strategy == "full")
        self.image_hidden_size = text_config.hidden_size
        self.num_layers = text_config.num_hidden_layers
        self.num_kv_heads = text_config.num_key_value_heads
        self.head_dim = head_dim_of(text_config)
        self.tie_word_embeddings = hf_config.tie_word_embeddings
        self.dtype = dtype
        self.device = torch.device(device)
        self.has_vision, self.has_language = load_vision, load_language

        # Every parameter is overwritten by load_weights: skip the random init.
        with no_init_weights(), self.device:
            if load_vision:
                self.vision_tower = AutoModel.from_config(vision_config, dtype=dtype)
                self.multi_modal_projector = LlavaMultiModalProjector(hf_config, dtype)
            if load_language:
                backend = attn_backend or get_attn_backend(self.device)
                self.language_model = LlamaModel(text_config, backend, dtype)
                if not self.tie_word_embeddings:
                    self.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False, dtype=dtype)
        self.requires_grad_(False)
        self.eval()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        groups, skipped = {}, []
        if self.has_vision:
            groups["vision_tower"] = ParamLoader(self.vision_tower)
            groups["multi_modal_projector"] = ParamLoader(self.multi_modal_projector)
        else:
            skipped += _VISION_PARTS
        if self.has_language:
            groups["language_model"] = ParamLoader(self.language_model, STACKED_PARAMS)
            if self.tie_word_embeddings:
                # Some tied checkpoints store the head anyway; it is the embedding matrix.
                skipped.append("lm_head")
            else:
                groups["lm_head"] = ParamLoader(self.lm_head)
        else:
            skipped += _LANGUAGE_PARTS
        load_weight_groups(groups, skipped, weights)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [num_images, 3, H, W] -> [num_images, num_image_tokens, hidden]
        out = self.vision_tower(pixel_values.to(self.dtype), output_hidden_states=True)
        layers = self.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else layers
        # The chosen layers' hidden states, side by side: [num_images, 1 + num_patches, vision_hidden * len(layers)]
        features = torch.cat([out.hidden_states[layer] for layer in layers], dim=-1)
        if self.vision_feature_select_strategy == "default":
            features = features[:, 1:]
        return self.multi_modal_projector(features)

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
        # [num_tokens, hidden] -> [num_tokens, hidden], final-normed
        return self.language_model(inputs_embeds, positions, kv_cache, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [num_seqs, hidden] -> [num_seqs, vocab] fp32
        head = self.language_model.embed_tokens if self.tie_word_embeddings else self.lm_head
        return F.linear(hidden_states, head.weight).float()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
