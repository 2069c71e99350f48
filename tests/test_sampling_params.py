"""SamplingParams validates its own fields; the sampler honours them."""

from __future__ import annotations

import pytest
import torch

from hydrad.engine.sampler import Sampler
from hydrad.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"stop": ["x"] * 17}, "stop strings"),
])
def test_invalid_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_accepts_one_string_and_drops_empty_ones():
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=["", "a"]).stop == ["a"]


def test_tiny_temperature_is_greedy_instead_of_overflowing():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    params = SamplingParams(temperature=1e-300)
    assert params.greedy
    assert Sampler().sample(logits, [params], [torch.Generator().manual_seed(0)]) == [1]


def test_top_k_and_top_p_restrict_the_candidates():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]])
    sampler = Sampler()
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        assert sampler.sample(logits, [SamplingParams(temperature=1.0, top_k=2)], [gen])[0] in (0, 1)
        gen = torch.Generator().manual_seed(seed)
        # softmax: p0 ~ 0.73, so top_p=0.5 keeps token 0 alone
        assert sampler.sample(logits, [SamplingParams(temperature=1.0, top_p=0.5)], [gen])[0] == 0
