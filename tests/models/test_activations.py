"""The worker's own activations and LLaVA-NeXT's resolution rule, against transformers'
(which the worker no longer imports: they cost every worker start seconds of imports)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.image_processing_utils import select_best_resolution as transformers_select

from hydrad.models.activations import _ACTIVATIONS, activation
from hydrad.models.llava_next import select_best_resolution


@pytest.mark.parametrize("name", sorted(_ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_activation_is_transformers_bit_for_bit(name, dtype):
    x = torch.randn(4, 257, 96, generator=torch.Generator().manual_seed(0)).to(dtype) * 4
    assert torch.equal(activation(name)(x), ACT2FN[name](x)), name


def test_a_name_not_kept_here_is_transformers_own():
    x = torch.linspace(-8, 8, 101)
    assert torch.equal(activation("relu6")(x), ACT2FN["relu6"](x))
    with pytest.raises(KeyError):
        activation("no-such-activation")


def test_the_resolution_rule_is_transformers():
    rng = random.Random(0)
    pinpoints = [[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
                 [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]],
                 [[384, 384], [384, 768], [768, 384], [768, 768], [1152, 384], [384, 1152]]]
    for _ in range(3000):
        size = (rng.randint(1, 2000), rng.randint(1, 2000))
        for possible in pinpoints:
            assert select_best_resolution(size, possible) == tuple(transformers_select(size, possible)), (size,
                                                                                                          possible)
