"""Llama-family decoders (Llama, Vicuna, Mistral, Qwen2, Qwen2-VL's) over flattened batches and a paged KV cache.

A batch is the new tokens of many sequences laid end to end (prefill chunks and decodes
mixed); attention finds each sequence's context through ``AttentionMetadata``. The
projections that read the same input are fused (``qkv_proj``, ``gate_up_proj``); the
checkpoint keeps them apart, and ``STACKED_PARAMS`` says where each part goes.

Positions are ``[num_tokens]``, or ``[3, num_tokens]`` for the decoders of Qwen2-VL and
Qwen2.5-VL (M-RoPE): there each token has a temporal, a height and a width position, and
the rotary frequencies are split into three sections (``mrope_section``) that rotate by
one of the three each.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from hydrad.models.attention.metadata import AttentionMetadata
from hydrad.errors import CheckpointError

# Checkpoint module name -> (our fused module name, shard index).
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen2_vl_text", "qwen2_5_vl_text")
# Qwen2 puts a bias on q/k/v (not on o) without saying so in its config.
_QKV_BIAS_MODEL_TYPES = ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text")
# Decoders whose rotary embedding is M-RoPE (3-D positions), sections in rope_parameters["mrope_section"].
_MROPE_MODEL_TYPES = ("qwen2_vl_text", "qwen2_5_vl_text")


class MergedLinear(nn.Linear):
    """Several linear layers over the same input, as one matmul; shard i is rows of output_sizes[i]."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype):
        super().__init__(in_features, sum(output_sizes), bias=bias, dtype=dtype)
        self.output_sizes = output_sizes

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        return param.narrow(0, sum(self.output_sizes[:index]), self.output_sizes[index])


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32, scale in the model dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config) -> torch.Tensor:
    # [head_dim // 2] fp32
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise CheckpointError(f"rope_type {rope_type!r} is not supported (only 'default')")
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise CheckpointError("the text config has no rope_theta")
    head_dim = head_dim_of(config)
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def mrope_section_of(config) -> tuple[int, ...] | None:
    """The M-RoPE sections (temporal, height, width) of a decoder config; None for 1-D RoPE."""
    if config.model_type not in _MROPE_MODEL_TYPES:
        return None
    rope = getattr(config, "rope_parameters", None) or {}
    section = rope.get("mrope_section")
    if not section or len(section) != 3:
        raise CheckpointError(f"{config.model_type}: rope_parameters needs a 3-part mrope_section, got {section!r}")
    if sum(section) != head_dim_of(config) // 2:
        raise CheckpointError(
            f"{config.model_type}: mrope_section {list(section)} must sum to head_dim / 2 = {head_dim_of(config) // 2}"
        )
    return tuple(section)


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, mrope_section: tuple[int, ...] | None = None
):
    # positions: [num_tokens], or [3, num_tokens] with mrope_section
    # -> cos, sin: [num_tokens, 1, head_dim] (broadcast over heads), angles in fp32
    if mrope_section is None:
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [num_tokens, head_dim // 2]
    else:
        if positions.dim() == 1:
            # A text-only sequence: its three positions are equal.
            positions = positions.expand(3, -1)
        by_axis = positions.float()[..., None] * inv_freq  # [3, num_tokens, head_dim // 2]
        # Frequency section i turns with position axis i: temporal, then height, then width.
        sections = by_axis.split(list(mrope_section), dim=-1)
        freqs = torch.cat([section[i] for i, section in enumerate(sections)], dim=-1)
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_heads, head_dim]; the two halves of head_dim form the rotated pairs
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, attn_backend, dtype: torch.dtype):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        self.attn_backend = attn_backend
        attention_bias = getattr(config, "attention_bias", False)
        qkv_bias = attention_bias or config.model_type in _QKV_BIAS_MODEL_TYPES
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size], qkv_bias, dtype)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=attention_bias, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # x: [num_tokens, hidden]
        qkv = self.qkv_proj(x).unflatten(-1, (self.num_heads + 2 * self.num_kv_heads, self.head_dim))
        # q and k rotate as one tensor: [num_tokens, num_heads + num_kv_heads, head_dim]
        qk = apply_rotary(qkv[:, : self.num_heads + self.num_kv_heads], cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads :]  # [num_tokens, num_kv_heads, head_dim]
        o = self.attn_backend.forward(q, k, v, kv_cache, meta, self.scale)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(o.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        if config.hidden_act != "silu":
            raise CheckpointError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        bias = getattr(config, "mlp_bias", False)
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], bias, dtype)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [num_tokens, intermediate]
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, attn_backend, dtype: torch.dtype):
        super().__init__()
        self.self_attn = LlamaAttention(config, attn_backend, dtype)
        self.mlp = LlamaMLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, h, cos, sin, kv_cache, meta) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


def _check_full_attention(config) -> None:
    # Sliding-window layers would need their own mask; every layer here attends over the whole context.
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise CheckpointError(f"{config.model_type}: sliding-window attention layers are not supported")
    window = getattr(config, "sliding_window", None) if config.model_type == "mistral" else None
    if window is not None and window < config.max_position_embeddings:
        raise CheckpointError(
            f"mistral: sliding-window attention (sliding_window={window} < max_position_embeddings="
            f"{config.max_position_embeddings}) is not supported"
        )


class LlamaModel(nn.Module):
    """The decoder stack without the LM head: embeddings in, final-normed hidden states out."""

    def __init__(self, config, attn_backend, dtype: torch.dtype):
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"language model type {config.model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        _check_full_attention(config)
        self.mrope_section = mrope_section_of(config)
        self.dtype = dtype
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attn_backend, dtype) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # inputs_embeds: [num_tokens, hidden]; positions: [num_tokens], or [3, num_tokens] with M-RoPE
        # kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        if positions.dim() == 2 and self.mrope_section is None:
            raise ValueError("3-D positions given to a decoder without M-RoPE")
        cos, sin = rotary_cos_sin(positions, self.inv_freq, self.dtype, self.mrope_section)
        h = inputs_embeds
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_cache[i], meta)
        return self.norm(h)  # [num_tokens, hidden]


class ParamLoader:
    """Copies checkpoint tensors (named relative to ``module``) into its parameters.

    A name whose module is a key of ``stacked`` loads into its shard of a fused
    ``MergedLinear``; every other name must be a parameter of ``module`` itself.
    """

    def __init__(self, module: nn.Module, stacked: dict[str, tuple[str, int]] | None = None):
        # A module built without some of the checkpoint's parts (``CLIPVisionTower``) names them.
        self.ignores = getattr(module, "ignores_weight", None)
        parts_of: dict[str, dict[int, str]] = {}
        for part, (fused, shard) in (stacked or {}).items():
            parts_of.setdefault(fused, {})[shard] = part
        # Checkpoint name -> the tensor (a parameter, or a view of one shard of it) it fills.
        self.targets: dict[str, torch.Tensor] = {}
        for name, param in module.named_parameters():
            path, _, kind = name.rpartition(".")
            scope, _, owner = path.rpartition(".")
            if owner in parts_of:
                fused = module.get_submodule(path)
                for shard, part in parts_of[owner].items():
                    self.targets[_join(scope, part, kind)] = fused.shard(param.detach(), shard)
            else:
                self.targets[name] = param.detach()
        self.loaded: set[str] = set()

    def load(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy one tensor in (or drop one the module does not use); False if ``name`` is not
        a weight of the module."""
        dst = self.targets.get(name)
        if dst is None:
            return self.ignores is not None and self.ignores(name)
        if dst.shape != tensor.shape:
            raise CheckpointError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        self.loaded.add(name)
        return True

    def missing(self) -> set[str]:
        return self.targets.keys() - self.loaded


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def load_weight_groups(
    groups: dict[str, ParamLoader], skipped: Iterable[str], weights: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Route each ``prefix.rest`` weight to ``groups[prefix]``; drop those of ``skipped`` prefixes.

    Raises CheckpointError naming every missing and unexpected weight.
    """
    skipped = set(skipped)
    unexpected = []
    for name, tensor in weights:
        prefix, _, rest = name.partition(".")
        if prefix in skipped:
            continue
        if prefix not in groups or not groups[prefix].load(rest, tensor):
            unexpected.append(name)
    missing = sorted(f"{prefix}.{name}" for prefix, loader in groups.items() for name in loader.missing())
    if missing or unexpected:
        lines = []
        if missing:
            lines.append(f"missing weights: {', '.join(missing)}")
        if unexpected:
            lines.append(f"unexpected weights: {', '.join(sorted(unexpected))}")
        raise CheckpointError("checkpoint does not match the model; " + "; ".join(lines))
