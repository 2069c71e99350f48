"""SamplingParams validates its own fields; the sampler honours them."""

from __future__ import annotations

import pytest
import torch

from hydrad.engine.sampler import Sampler, SamplingMetadata
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


def meta_for(params: SamplingParams, rows: int = 1) -> SamplingMetadata:
    meta = SamplingMetadata.greedy(rows)
    meta.temperature[:], meta.top_k[:], meta.top_p[:] = params.temperature, params.top_k, params.top_p
    return meta


def test_tiny_temperature_is_greedy_instead_of_overflowing():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    params = SamplingParams(temperature=1e-300)
    assert params.greedy
    assert Sampler().sample(logits, meta_for(params)).token_ids == [1]


def test_top_k_and_top_p_restrict_the_candidates():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]]).repeat(200, 1)
    sampler = Sampler(seed=3)
    top_k = sampler.sample(logits, meta_for(SamplingParams(temperature=1.0, top_k=2), 200)).token_ids
    assert set(top_k) == {0, 1}
    # softmax: p0 ~ 0.73, so top_p=0.5 keeps token 0 alone
    assert set(sampler.sample(logits, meta_for(SamplingParams(temperature=1.0, top_p=0.5), 200)).token_ids) == {0}


def test_a_language_is_compiled_once_and_a_schema_keeps_its_order_of_keys():
    """The same schema again takes the kept grammar; a schema whose properties come in another
    order is another language (its properties are generated in that order)."""
    from hydrad import grammar
    from hydrad.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "string"}},
              "required": ["zeta", "alpha"]}
    first = StructuredOutputsParams(json=schema).compiled
    hits = grammar._compile_cached.cache_info().hits
    assert StructuredOutputsParams(json=dict(schema)).compiled == first
    assert grammar._compile_cached.cache_info().hits == hits + 1
    swapped = dict(schema, properties=dict(reversed(list(schema["properties"].items()))))
    assert StructuredOutputsParams(json=swapped).compiled != first
    choices = StructuredOutputsParams(choice=["a\nb", "c"]).compiled
    assert StructuredOutputsParams(choice=["a", "b\nc"]).compiled != choices  # not joined by lines
