"""The activations of transformers' ``ACT2FN`` that the served families' configs name,
without importing ``transformers.activations``.

Importing it pulls in transformers' kernel hub and weight-conversion code (about a second
of CPU); with ``transformers.image_processing_utils`` (``llava_next.select_best_resolution``)
it was half of the fork server's imports, which every worker start waits for. Each
activation here is the same operation as transformers' class of that name
(``tests/models/test_activations.py`` checks them against it, bit for bit); a name not
here is taken from transformers' table, imported then.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class QuickGELU(nn.Module):
    """``x * sigmoid(1.702 x)`` (CLIP's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class GELU(nn.Module):
    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.approximate)


_ACTIVATIONS = {
    "gelu": GELU,
    "gelu_pytorch_tanh": lambda: GELU("tanh"),
    "quick_gelu": QuickGELU,
    "silu": nn.SiLU,
    "swish": nn.SiLU,
    "relu": nn.ReLU,
}


def activation(name: str) -> nn.Module:
    """The module of transformers' activation ``name``."""
    make = _ACTIVATIONS.get(name)
    if make is not None:
        return make()
    from transformers.activations import ACT2FN

    return ACT2FN[name]

