"""Incremental detokenization: same text as a full decode, stop strings cut it exactly."""

from __future__ import annotations

import pytest

from hydrad.detokenizer import IncrementalDetokenizer
from hydrad.sampling_params import SamplingParams

TEXT = "The quick brown fox — naïve café, 3.14 — jumps over the lazy dog. Zoë's 🙂 emoji!"


@pytest.fixture(scope="module")
def tokenizer(tiny_llava_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llava_dir)


def _stream(tokenizer, params, ids, step=1):
    d = IncrementalDetokenizer(tokenizer, params)
    pieces = []
    for i in range(0, len(ids), step):
        pieces.append(d.add_tokens(ids[i : i + step]))
        if d.stopped:
            break
    pieces.append(d.flush())
    return d, pieces


@pytest.mark.parametrize("step", [1, 3])
def test_streamed_text_equals_full_decode(tokenizer, step):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    d, pieces = _stream(tokenizer, SamplingParams(), ids, step)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == d.text
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_and_is_held_back(tokenizer, include):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(stop=["lazy"], include_stop_str_in_output=include)
    d, pieces = _stream(tokenizer, params, ids)
    expected = TEXT[: TEXT.index("lazy") + (4 if include else 0)]
    assert d.stopped and "".join(pieces) == expected == d.text
    # no piece ever showed a partial stop string
    assert all("laz" not in p or include for p in pieces)


def test_no_stop_match_emits_everything(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    d, pieces = _stream(tokenizer, SamplingParams(stop=["not in there"]), ids)
    assert not d.stopped and "".join(pieces) == TEXT


def test_unfinished_last_character_is_flushed_as_the_decode_gives_it(tokenizer):
    # "🙂" is four bytes; drop the token that carries its last bytes.
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)
    ids = next(ids[:n] for n in range(len(ids), 0, -1) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    d, pieces = _stream(tokenizer, SamplingParams(), ids)
    assert "\ufffd" not in "".join(pieces[:-1])  # held back while more tokens could complete it
    assert "".join(pieces) == d.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert d.text.endswith("\ufffd")


@pytest.mark.parametrize("seed", range(4))
def test_any_token_sequence_streams_to_its_full_decode(tokenizer, seed):
    """What a random model emits: any ids, special tokens and stray UTF-8 bytes included."""
    import random

    rng = random.Random(seed)
    for _ in range(100):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        d, pieces = _stream(tokenizer, SamplingParams(), ids, step=rng.choice([1, 2, 3]))
        assert "".join(pieces) == d.text == tokenizer.decode(ids, skip_special_tokens=True), ids
