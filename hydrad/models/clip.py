"""CLIP's vision transformer, as LLaVA-1.5 and LLaVA-NeXT read it: only the layers up to
the deepest hidden state the model takes.

A LLaVA checkpoint takes the features of one encoder layer (usually the second to
last, ``vision_feature_layer = -2``), so the layers after it and the post-layernorm
are neither built nor run: one layer of the tower's compute saved per crop. The
module's parameter names are transformers' ``CLIPVisionModel``'s, and its operations
are the same ones in the same order (SDPA attention, the checkpoint's activation), so
its features equal transformers' bit for bit; its weights of the layers not built are
dropped at load (``ignores_weight``). Building it does not import transformers'
modelling code, which is most of a worker's start-up otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN


def feature_layer_indices(vision_config, layers: int | list[int]) -> list[int]:
    """The hidden-state indices (0: the embeddings after the pre-layernorm, k: the output of
    layer k) of ``vision_feature_layer`` (one index or a list; negative from the end)."""
    count = vision_config.num_hidden_layers + 1
    indices = [layers] if isinstance(layers, int) else list(layers)
    resolved = [i + count if i < 0 else i for i in indices]
    for given, index in zip(indices, resolved):
        if not 0 <= index < count:
            raise ValueError(f"vision_feature_layer {given} is out of range for {count - 1} layers")
    return resolved


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        self.image_size, self.patch_size = config.image_size, config.patch_size
        num_positions = (config.image_size // config.patch_size) ** 2 + 1
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype))
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=config.patch_size,
                                         stride=config.patch_size, bias=False, dtype=dtype)
        self.position_embedding = nn.Embedding(num_positions, config.hidden_size, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"image of {height}x{width} pixels, the tower takes {self.image_size}x{self.image_size}")
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)  # [batch, patches, hidden]
        embeddings = torch.cat([self.class_embedding.expand(batch, 1, -1), patches], dim=1)
        return embeddings + self.position_embedding.weight.unsqueeze(0)


class CLIPAttention(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = hidden // config.num_attention_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.k_proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.v_proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.out_proj = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.out_proj(out.transpose(1, 2).contiguous().reshape(*x.shape[:-1], -1))


class CLIPMLP(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        self.activation_fn = ACT2FN[config.hidden_act]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, dtype=dtype)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        self.self_attn = CLIPAttention(config, dtype)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.mlp = CLIPMLP(config, dtype)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config, num_layers: int, dtype: torch.dtype):
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config, dtype) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """Embeddings, pre-layernorm and the first layers of CLIP's encoder: as many as the
    deepest of ``feature_layers`` (``vision_feature_layer``) needs."""

    def __init__(self, vision_config, feature_layers: int | list[int], dtype: torch.dtype):
        super().__init__()
        self.feature_indices = feature_layer_indices(vision_config, feature_layers)
        self.num_layers = max(self.feature_indices)
        self.embeddings = CLIPVisionEmbeddings(vision_config, dtype)
        self.pre_layrnorm = nn.LayerNorm(vision_config.hidden_size, eps=vision_config.layer_norm_eps, dtype=dtype)
        self.encoder = CLIPEncoder(vision_config, self.num_layers, dtype)

    def ignores_weight(self, name: str) -> bool:
        """Whether ``name`` is a checkpoint weight of a part not built (later layers, the post-layernorm)."""
        if name.startswith("post_layernorm."):
            return True
        if name.startswith("encoder.layers."):
            return int(name.split(".", 3)[2]) >= self.num_layers
        return False

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[crops, 3, H, W]`` -> the chosen layers' hidden states side by side,
        ``[crops, positions, hidden * len(feature_layers)]`` (the CLS position first)."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        return torch.cat([states[i] for i in self.feature_indices], dim=-1)
