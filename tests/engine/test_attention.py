import random

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from hydrad.models.attention import AttentionMetadata, get_attn_backend
from hydrad.models.attention.sdpa import SdpaBackend
from hydrad.errors import ConfigError

HEAD_DIM = 16
# (query_len, seq_len) per sequence: decodes, whole prompts, and chunks after cached context,
# in an order that interleaves them.
SEQS = [(1, 37), (20, 20), (1, 1), (9, 50), (1, 16), (33, 33), (16, 48), (1, 64)]


def reference_attention(q, k, v, scale):
    # q: [query_len, Hq, D]; k, v: [seq_len, Hkv, D]; fp64, dense, bottom-right causal
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    k = k.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    visible = torch.ones(query_len, seq_len, dtype=torch.bool).tril(seq_len - query_len)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def make_paged_batch(block_size, num_heads, num_kv_heads, dtype, seed=0, seqs=SEQS):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_seq = [-(-s // block_size) for _, s in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    block_ids = rng.sample(range(num_blocks), sum(blocks_per_seq))  # shuffled, non-contiguous
    block_tables, start = [], 0
    for n in blocks_per_seq:
        block_tables.append(block_ids[start : start + n])
        start += n

    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, HEAD_DIM, dtype=dtype)
    contexts, new_q, new_k, new_v = [], [], [], []
    for (query_len, seq_len), table in zip(seqs, block_tables):
        k = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        q = torch.randn(query_len, num_heads, HEAD_DIM, generator=gen).to(dtype)
        # Earlier steps cached positions 0 ... seq_len - query_len - 1.
        for pos in range(seq_len - query_len):
            block, offset = table[pos // block_size], pos % block_size
            kv_cache[0, block, offset], kv_cache[1, block, offset] = k[pos], v[pos]
        contexts.append((k, v))
        new_q.append(q)
        new_k.append(k[seq_len - query_len :])
        new_v.append(v[seq_len - query_len :])
    meta = AttentionMetadata.build(
        [q for q, _ in seqs], [s for _, s in seqs], block_tables, block_size, torch.device("cpu"), mask_dtype=dtype
    )
    return kv_cache, meta, contexts, torch.cat(new_q), torch.cat(new_k), torch.cat(new_v)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_sdpa_paged_matches_dense_causal(block_size, num_heads, num_kv_heads, dtype, atol):
    kv_cache, meta, contexts, q, k, v = make_paged_batch(block_size, num_heads, num_kv_heads, dtype)
    scale = HEAD_DIM**-0.5

    # Every call must take torch's fused kernel (the math fallback is several times slower):
    # with only that kernel allowed, SDPA raises instead of falling back.
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = SdpaBackend(torch.device("cpu")).forward(q, k, v, kv_cache, meta, scale)

    assert out.shape == q.shape and out.dtype == dtype
    starts = meta.query_start_loc.tolist()
    for b, (ctx_k, ctx_v) in enumerate(contexts):
        tokens = slice(starts[b], starts[b + 1])
        ref = reference_attention(q[tokens], ctx_k, ctx_v, scale)
        torch.testing.assert_close(out[tokens].double(), ref, atol=atol, rtol=atol, msg=f"sequence {b}")
        # The new keys and values landed in the sequence's blocks, after its cached context.
        table = meta.block_tables[b]
        positions = torch.arange(meta.seq_lens_cpu[b])
        slots = table[positions // block_size].long() * block_size + positions % block_size
        cached = kv_cache.flatten(1, 2)[:, slots]
        assert torch.equal(cached[0], ctx_k) and torch.equal(cached[1], ctx_v)


def test_masks_take_the_models_dtype(tiny_llava_dir, monkeypatch):
    """Every mask SDPA is handed is in the queries' dtype: torch's cuDNN kernel (the default on
    Hopper GPUs) reads a float32 mask beside bfloat16 or float16 queries as if it were in their
    dtype, without a word, and every masked call (prefill chunks after cached context, decodes)
    came out wrong there. The engine builds them so, in its model's dtype."""
    import hydrad.models.attention.sdpa as sdpa
    from hydrad import LLM, SamplingParams

    seen = []
    attend = sdpa.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        if attn_mask is not None:
            seen.append((q.dtype, attn_mask.dtype))
        return attend(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", spy)
    llm = LLM(str(tiny_llava_dir), dtype="bfloat16", token_budget=8)
    llm.generate(["a prompt of more than eight tokens, chunked"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert seen and all(mask == q == torch.bfloat16 for q, mask in seen), set(seen)
    meta = AttentionMetadata.build([1, 3], [3, 4], [[0, 1], [2, 3]], 2, torch.device("cpu"), mask_dtype=torch.float16)
    assert {c.mask.dtype for c in meta.prefill_chunks} == {meta.decode_batch.mask.dtype} == {torch.float16}
    assert meta.decode_batch.mask.isneginf().any() and (meta.decode_batch.mask == 0).any()
    # Masks of another dtype than the queries' are refused, not read wrong.
    q = torch.randn(4, 2, HEAD_DIM, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 2, 1, HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="masks built in torch.float16 for torch.bfloat16 queries"):
        sdpa.SdpaBackend(torch.device("cpu")).forward(q, q[:, :1], q[:, :1], cache, meta, HEAD_DIM**-0.5)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_sdpa_whole_prompt_chunks_and_decodes_agree(block_size):
    # One 40-token prompt attended three ways: whole (causal over its own keys, nothing read from
    # the cache), as chunks of 15, 15, 10 after cached context (masked, keys gathered from the
    # cache), and one decode per token (the padded decode batch).
    seq_len, scale = 40, HEAD_DIM**-0.5
    gen = torch.Generator().manual_seed(block_size)
    q = torch.randn(seq_len, 4, HEAD_DIM, generator=gen)
    k = torch.randn(seq_len, 2, HEAD_DIM, generator=gen)
    v = torch.randn(seq_len, 2, HEAD_DIM, generator=gen)
    num_blocks = -(-seq_len // block_size)
    block_ids = random.Random(block_size).sample(range(num_blocks + 4), num_blocks)
    backend = SdpaBackend(torch.device("cpu"))

    def attend(bounds):
        kv_cache = torch.zeros(2, num_blocks + 4, block_size, 2, HEAD_DIM)
        outs = []
        for start, end in zip(bounds, bounds[1:]):
            meta = AttentionMetadata.build([end - start], [end], [block_ids], block_size, torch.device("cpu"))
            assert (meta.decode_batch is None) == (end - start > 1)
            outs.append(backend.forward(q[start:end], k[start:end], v[start:end], kv_cache, meta, scale))
        return torch.cat(outs)

    whole = attend([0, seq_len])
    ref = reference_attention(q, k, v, scale)
    torch.testing.assert_close(whole.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attend([0, 15, 30, seq_len]), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attend(list(range(seq_len + 1))), whole, atol=1e-5, rtol=1e-5)


def test_metadata_prefill_chunks_and_decode_batch():
    # Sequences: a decode at position 4, a whole 3-token prompt, a 2-token chunk after 3 cached
    # tokens, a decode at position 0; blocks of 2.
    tables = [[7, 2, 4], [1, 3], [6, 0, 5], [8]]
    meta = AttentionMetadata.build([1, 3, 2, 1], [5, 3, 5, 1], tables, 2, torch.device("cpu"))

    whole, chunk = meta.prefill_chunks
    assert whole.tokens == slice(1, 4) and whole.block_ids is None and whole.mask is None
    assert chunk.tokens == slice(4, 6) and chunk.block_ids.tolist() == [6, 0, 5]
    # Query 0 sits at position 3 and sees keys 0 ... 3; query 1 sees all five.
    assert torch.isinf(chunk.mask).tolist() == [[False] * 4 + [True], [False] * 5]

    group = meta.decode_batch
    assert group.token_ids.tolist() == [0, 6]
    # Padded to the longer sequence's 3 blocks; the shorter one's extra slots are masked out.
    assert group.block_ids.tolist() == [[7, 2, 4], [8, 0, 0]]
    assert group.mask.shape == (2, 1, 1, 6)
    assert torch.isinf(group.mask[:, 0, 0]).tolist() == [[False] * 5 + [True], [False] + [True] * 5]
    assert not torch.isnan(group.mask).any() and group.mask.max() == 0


def test_decode_groups_stay_within_their_size_and_cover_every_decode():
    # Decodes of context 9, 3, 20, 5, 1 and 12 (blocks of 4) around one prefill chunk.
    lens = [9, 3, 20, 5, 1, 12]
    query_lens = [1, 1, 1, 4, 1, 1, 1]
    seq_lens = lens[:3] + [8] + lens[3:]
    tables = [list(range(10 * b, 10 * b + -(-n // 4))) for b, n in enumerate(seq_lens)]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, 4, torch.device("cpu"))
    rows = [0, 1, 2, 7, 8, 9]  # each decode's row of the flattened batch
    (whole,) = meta.decode_groups(10_000)
    assert whole.token_ids.tolist() == rows  # it fits: one group, in batch order
    grouped = meta.decode_groups(24)
    assert meta.decode_groups(24) is grouped  # built once for every layer
    seen = []
    for group in grouped:
        n, width = group.block_ids.shape
        assert n * width * 4 <= 24 or n == 1
        token_rows = group.token_ids.tolist()
        seen += token_rows
        for i, row in enumerate(token_rows):
            b = rows.index(row)
            length, seq = lens[b], [0, 1, 2, 4, 5, 6][b]  # the decode's sequence in the batch
            assert group.block_ids[i, : -(-length // 4)].tolist() == tables[seq]
            assert torch.isinf(group.mask[i, 0, 0]).tolist() == [False] * length + [True] * (4 * width - length)
    assert sorted(seen) == rows
    # Rows of similar lengths together: the 20-token decode pads nobody else.
    assert [len(g.token_ids) for g in grouped if 20 in [lens[rows.index(r)] for r in g.token_ids.tolist()]] == [1]


def test_decode_masks_are_windows_of_one_ramp_whatever_came_before():
    """A decode batch's mask is a gather of windows of one cached ramp (zeros, then -infs),
    which grows when a wider mask is asked for: masks of growing and shrinking widths, in
    two dtypes, equal the comparison they stand for, and a decodes-only step's block table
    is its whole table."""
    generator = torch.Generator().manual_seed(5)
    for width_blocks in (3, 1, 40, 7, 130, 2):
        for dtype in (torch.float32, torch.bfloat16):
            lens = torch.randint(1, 4 * width_blocks + 1, (17,), generator=generator)
            lens[0] = 4 * width_blocks  # one row fills its blocks
            tables = [list(range(-(-int(n) // 4))) for n in lens]
            meta = AttentionMetadata.build([1] * len(lens), lens.tolist(), tables, 4, torch.device("cpu"),
                                           mask_dtype=dtype)
            group = meta.decode_batch
            expected = torch.where(torch.arange(4 * width_blocks)[None, :] < lens[:, None], 0.0, float("-inf"))
            assert group.mask.dtype == dtype and group.mask.shape == (len(lens), 1, 1, 4 * width_blocks)
            assert torch.equal(group.mask[:, 0, 0].float(), expected)
            assert torch.equal(group.block_ids, meta.block_tables_cpu)


@pytest.mark.parametrize("gather_bytes", [1, 32 << 10, 96 << 10])
def test_sdpa_decode_groups_give_the_same_attention(monkeypatch, gather_bytes):
    """Decodes gathered a few rows at a time into the kept buffer (or one row at a time, or all
    at once) attend exactly as in one group."""
    import hydrad.models.attention.sdpa as sdpa

    gen = torch.Generator().manual_seed(0)
    lens = [37, 5, 64, 18, 1, 50, 23]
    block_size, num_blocks = 4, 200
    tables = [random.Random(i).sample(range(num_blocks), -(-n // block_size)) for i, n in enumerate(lens)]
    kv_cache = torch.randn(2, num_blocks, block_size, 2, HEAD_DIM, generator=gen)
    q = torch.randn(len(lens), 4, HEAD_DIM, generator=gen)
    k = torch.randn(len(lens), 2, HEAD_DIM, generator=gen)
    v = torch.randn(len(lens), 2, HEAD_DIM, generator=gen)

    def attend():
        meta = AttentionMetadata.build([1] * len(lens), lens, tables, block_size, torch.device("cpu"))
        return SdpaBackend(torch.device("cpu")).forward(q, k, v, kv_cache.clone(), meta, HEAD_DIM**-0.5)

    whole = attend()
    monkeypatch.setattr(sdpa, "CPU_GATHER_BYTES", gather_bytes)
    torch.testing.assert_close(attend(), whole, atol=1e-6, rtol=1e-6)


def test_metadata_slot_mapping_and_offsets():
    meta = AttentionMetadata.build([3, 1], [5, 2], [[7, 2, 4], [5]], 2, torch.device("cpu"))
    # Sequence 0 adds positions 2, 3, 4 -> blocks 2, 2, 4; sequence 1 adds position 1 -> block 5.
    assert meta.slot_mapping.tolist() == [2 * 2 + 0, 2 * 2 + 1, 4 * 2 + 0, 5 * 2 + 1]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.seq_start_loc.tolist() == [0, 5, 7]
    assert meta.block_tables.tolist() == [[7, 2, 4], [5, 0, 0]]
    assert (meta.max_query_len, meta.max_seq_len) == (3, 5)
    assert meta.slot_mapping.dtype == torch.int64 and meta.block_tables.dtype == torch.int32


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "tables"),
    [([3], [2], [[0]]), ([1], [5], [[0]]), ([1, 1], [1], [[0]])],
)
def test_metadata_rejects_inconsistent_batches(query_lens, seq_lens, tables):
    with pytest.raises(ValueError):
        AttentionMetadata.build(query_lens, seq_lens, tables, 4, torch.device("cpu"))


def test_backend_registry():
    assert get_attn_backend(torch.device("cpu")).name == "sdpa"
    assert get_attn_backend("cpu", "sdpa").name == "sdpa"
    with pytest.raises(ConfigError, match="CUDA"):
        get_attn_backend("cpu", "flash_attn")
    with pytest.raises(ConfigError, match="unknown attention backend"):
        get_attn_backend("cpu", "xformers")


def test_auto_takes_flash_attn_only_where_its_kernels_run(monkeypatch):
    """"auto" picks flash-attn on CUDA in float16 or bfloat16 when it is installed; float32,
    a CPU, a configured KV block size it cannot page, or no flash-attn take SDPA. Asked for
    by name, flash-attn refuses float32 in one line."""
    import importlib.util

    from hydrad.config import _ATTENTION_BACKENDS, ModelConfig
    from hydrad.models.attention import BACKENDS, backend_name
    from hydrad.models.attention.flash_attn import FlashAttnBackend

    assert _ATTENTION_BACKENDS == ("auto", *BACKENDS)
    with pytest.raises(ConfigError, match="model.attention_backend"):
        ModelConfig(attention_backend="xformers")
    find_spec = importlib.util.find_spec
    installed = {"flash_attn": True}
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if installed.get(name) else find_spec(name, *a))
    assert backend_name("cuda:0", "auto", torch.bfloat16) == "flash_attn"
    assert backend_name("cuda:0", None, torch.float16) == "flash_attn"
    assert backend_name("cuda:0", "auto", torch.float32) == "sdpa"
    assert backend_name("cpu", "auto", torch.bfloat16) == "sdpa"
    assert backend_name("cuda:0", "sdpa", torch.bfloat16) == "sdpa"
    # a configured block size flash-attn cannot page: "auto" keeps SDPA; 512 suits both
    assert backend_name("cuda:0", "auto", torch.bfloat16, block_size=16) == "sdpa"
    assert backend_name("cuda:0", "auto", torch.bfloat16, block_size=512) == "flash_attn"
    installed["flash_attn"] = False
    assert backend_name("cuda:0", "auto", torch.bfloat16) == "sdpa"
    with pytest.raises(ConfigError, match="float16 or bfloat16, got float32"):
        FlashAttnBackend(torch.device("cuda:0"), torch.float32)
