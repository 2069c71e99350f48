"""The KV block size follows the attention backend unless configured; the context an instance
serves is what its KV cache holds.

flash-attn's paged kernel takes blocks of a multiple of 256 tokens; SDPA takes any size. A
default configuration must start on either, so an unset ``cache.kv_block_size`` takes the
backend's ``default_block_size``. The CUDA backend cannot run here: a stand-in SDPA backend
with flash-attn's kind of constraint (multiples of 32) checks the wiring.
"""

from __future__ import annotations

import pytest

from hydrad import LLM, SamplingParams
from hydrad.errors import ConfigError
from hydrad.models.attention import SDPA_BLOCK_SIZE
from hydrad.models.attention.sdpa import SdpaBackend

PROMPTS = ["Tell me a story about a brave little robot.", "Hi", "Count: one two three four five six seven"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class Multiple32Backend(SdpaBackend):
    """SDPA that only takes blocks of a multiple of 32 tokens (as flash-attn does of 256)."""

    default_block_size = 32

    def check_block_size(self, block_size: int) -> None:
        if block_size % 32:
            raise ConfigError(f"cache.kv_block_size must be a multiple of 32, got {block_size}")

    def forward(self, q, k, v, kv_cache_layer, meta, scale):
        assert meta.block_size % 32 == 0, meta.block_size
        return super().forward(q, k, v, kv_cache_layer, meta, scale)


@pytest.fixture
def multiple32(monkeypatch):
    monkeypatch.setattr("hydrad.engine.core.get_attn_backend", lambda device, *args: Multiple32Backend(device))


def _tokens(llm: LLM) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_unset_block_size_takes_the_backends_default(tiny_llava_dir, multiple32):
    with LLM(str(tiny_llava_dir), deploy="1EP+1D", devices="cpu:2", worker_processes=False) as llm:
        assert [e.kv_manager.block_size for e in llm.engine.engines] == [32, 32]
        got = _tokens(llm)
    # The same tokens as the SDPA default's 16-token blocks.
    with LLM(str(tiny_llava_dir), deploy="1EP+1D", devices="cpu:2", worker_processes=False) as llm:
        assert got == _tokens(llm)


def test_unset_block_size_on_sdpa_is_its_default(tiny_llava_dir):
    with LLM(str(tiny_llava_dir)) as llm:
        assert llm.engine.kv_manager.block_size == SDPA_BLOCK_SIZE


def test_configured_block_size_the_backend_cannot_use_is_refused(tiny_llava_dir, multiple32):
    with pytest.raises(ConfigError, match="multiple of 32, got 16"):
        LLM(str(tiny_llava_dir), kv_block_size=16)
    with LLM(str(tiny_llava_dir), kv_block_size=64) as llm:
        assert llm.engine.kv_manager.block_size == 64


def test_an_instance_taking_on_language_takes_the_backends_default(tiny_llava_dir, multiple32):
    """An encode-only instance holds no KV cache; given P or D it sizes blocks by the backend."""
    with LLM(str(tiny_llava_dir), deploy="1E+1PD", devices="cpu:2", worker_processes=False) as llm:
        encoder = llm.engine.engines[0]
        assert encoder.kv_manager is None
        encoder.expand("PD")
        assert encoder.kv_manager.block_size == 32
        assert encoder.runner.kv_cache.shape[3] == 32


def test_peers_with_different_block_sizes_are_refused(tiny_llava_dir):
    with LLM(str(tiny_llava_dir), kv_block_size=16) as a, LLM(str(tiny_llava_dir), kv_block_size=8) as b:
        with pytest.raises(ConfigError, match="KV blocks of 8 tokens"):
            a.engine.attach_peer(1, b.engine.pools())


def test_the_context_is_what_the_kv_cache_holds(tiny_llava_dir, caplog):
    """Ten blocks of 4 tokens hold 40: an instance with that KV cache serves contexts of 40
    tokens and says so, and so does an encoder that takes on P and D with it; a longer request
    is refused with the context length, one that fits runs."""
    with LLM(str(tiny_llava_dir), deploy="1E+1PD", devices="cpu:2", worker_processes=False,
             kv_block_size=4, num_kv_blocks=10) as llm:
        encoder, language = llm.engine.engines
        assert language.max_model_len == language.scheduler.max_model_len == 40
        assert encoder.max_model_len > 40 and llm.engine.max_model_len == 40
        assert "its KV cache holds 40 tokens, fewer than max_model_len" in caplog.text
        encoder.expand("PD")
        assert encoder.max_model_len == encoder.scheduler.max_model_len == 40
        with pytest.raises(ValueError, match="context length"):
            llm.generate(["Hi"], SamplingParams(max_tokens=39), use_tqdm=False)
        out = llm.generate(["Hi"], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.token_ids) == 20
