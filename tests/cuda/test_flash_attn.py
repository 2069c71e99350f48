"""The flash-attn backend on a GPU, against the SDPA backend (the tested reference) on the
same GPU in the same dtype (flash-attn takes float16 and bfloat16 only).

The kernel: one mixed batch (a prompt with nothing cached, a chunk over cached context,
decodes of 1 to 600 tokens of context) through both backends, with grouped query heads,
queries that are strided views as the fused projection gives them, and block tables whose
blocks are out of order. The engine: greedy requests with log-probabilities on one instance
(prefill chunks over cached context, KV preemption) and on 1E+1P+1D worker processes sharing
their pools through CUDA IPC, LLaVA-1.5 and the M-RoPE family.

Run only where torch sees a GPU and flash-attn is installed (CI has neither).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from hydrad import LLM

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "engine")]

from agreement import PARAMS, check_answers  # noqa: E402
from test_disaggregation import conversations  # noqa: E402, F401  (fixture)
from factories import FIXED_POOLS  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
    reason="needs a CUDA GPU and flash-attn",
)

BLOCK = 256  # flash-attn's paged kernels take blocks of a multiple of 256 tokens

# |flash - SDPA| on attention outputs of magnitude ~1
KERNEL_TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}

# (query lens, seq lens): a whole prompt (two blocks), a chunk of 100 over 200 cached tokens
# and three decodes; decodes alone (the kernel then folds grouped query heads into rows).
BATCHES = {"mixed": ([300, 100, 1, 1, 1], [300, 300, 1, 257, 600]),
           "decodes": ([1, 1, 1, 1], [1, 100, 257, 600])}


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 16), (8, 8, 64)])
def test_kernel_matches_sdpa(batch, dtype, num_heads, num_kv_heads, head_dim):
    from hydrad.models.attention import AttentionMetadata, get_attn_backend

    device = torch.device("cuda:0")
    gen = torch.Generator(device="cpu").manual_seed(0)
    query_lens, seq_lens = BATCHES[batch]
    num_blocks = 16
    order = torch.randperm(num_blocks, generator=gen).tolist()  # blocks out of order
    tables, taken = [], 0
    for seq_len in seq_lens:
        n = -(-seq_len // BLOCK)
        tables.append(order[taken: taken + n])
        taken += n
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK, device, mask_dtype=dtype)
    cache = torch.randn(2, num_blocks, BLOCK, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    num_tokens = sum(query_lens)
    # q, k, v: views into one fused projection, as the model hands them over
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(device, dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(num_tokens, -1, head_dim) for x in (q, k, v))
    scale = head_dim ** -0.5

    flash, sdpa = get_attn_backend(device, "flash_attn", dtype), get_attn_backend(device, "sdpa", dtype)
    flash_cache, sdpa_cache = cache.clone(), cache.clone()
    got = flash.forward(q, k, v, flash_cache, meta, scale)
    want = sdpa.forward(q, k, v, sdpa_cache, meta, scale)
    assert got.shape == want.shape == (num_tokens, num_heads, head_dim) and got.dtype == dtype
    assert torch.equal(flash_cache, sdpa_cache)  # the same slots written
    torch.testing.assert_close(got.float(), want.float(), atol=KERNEL_TOL[dtype], rtol=KERNEL_TOL[dtype])
    # and not trivially: the sequences' outputs differ
    assert (want[0] - want[1]).abs().max() > 10 * KERNEL_TOL[dtype]


def near_a_block_end(path, conversations, block: int = BLOCK, room: int = 12) -> list:
    """The conversations with filler words before their last turn's content, so that each prompt
    ends within ``room`` tokens of a block's end: every decode then needs a second block."""
    from hydrad.processor import InputProcessor

    processor = InputProcessor(path)

    def padded(conversation, words: int):
        *head, last = conversation
        filler = {"type": "text", "text": "more " * words}
        content = last["content"] if isinstance(last["content"], list) else [{"type": "text", "text": last["content"]}]
        return [*head, {**last, "content": [filler, *content]}]

    def length(conversation) -> int:
        return len(processor.process_chat(conversation).prompt_token_ids)

    out = []
    for conversation in conversations:
        base = length(conversation)
        per_word = (length(padded(conversation, 100)) - base) / 100
        words = int((block - room // 2 - base) / per_word)
        while length(padded(conversation, words)) > block - 1:
            words -= 1
        while length(padded(conversation, words + 1)) <= block - room:
            words += 1
        assert block - room < length(padded(conversation, words)) < block, conversation
        out.append(padded(conversation, words))
    return out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_one_instance_with_chunks_and_preemption(tiny_llava_dir, conversations, dtype):
    conversations = near_a_block_end(tiny_llava_dir, conversations)
    sdpa = LLM(str(tiny_llava_dir), devices="cuda:0", **FIXED_POOLS,
               dtype=dtype, attention_backend="sdpa", token_budget=24)
    want = sdpa.chat(conversations, PARAMS, use_tqdm=False)
    sdpa.shutdown()
    # Three 256-token blocks for the batch, each prompt a few tokens short of a block: three
    # requests run, their decodes each need a second block, and requests are preempted and
    # recomputed.
    llm = LLM(str(tiny_llava_dir), devices="cuda:0", **FIXED_POOLS, dtype=dtype, token_budget=24, num_kv_blocks=3)
    assert llm.engine.attention_backend == "flash_attn" and llm.engine.kv_block_size == BLOCK  # "auto"
    got = llm.chat(conversations, PARAMS, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_manager.num_used_blocks == 0
    check_answers(got, want, dtype)


def test_worker_processes_through_cuda_ipc(tiny_llava_dir, conversations, one_gpu_for_every_instance):
    sdpa = LLM(str(tiny_llava_dir), devices="cuda:0", **FIXED_POOLS,
               dtype="float16", attention_backend="sdpa", token_budget=24)
    want = sdpa.chat(conversations, PARAMS, use_tqdm=False)
    sdpa.shutdown()
    with LLM(str(tiny_llava_dir), deploy="1E+1P+1D", devices="cuda:0", **FIXED_POOLS, dtype="float16",
             attention_backend="flash_attn", token_budget=24) as llm:
        got = llm.chat(conversations, PARAMS, use_tqdm=False)
    assert any("prefill_to_decode_migration" in (o.stage_times or {}) for o in got)
    check_answers(got, want, "float16")


def test_m_rope_family(tiny_checkpoint):
    from factories import mixed_conversations

    path, conversations = tiny_checkpoint("qwen2-vl"), mixed_conversations()
    runs = {}
    for backend in ("sdpa", "flash_attn"):
        llm = LLM(str(path), devices="cuda:0", **FIXED_POOLS,
                  dtype="float16", attention_backend=backend, token_budget=24)
        runs[backend] = llm.chat(conversations, PARAMS, use_tqdm=False)
        llm.shutdown()
    check_answers(runs["flash_attn"], runs["sdpa"], "float16")
