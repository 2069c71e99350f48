"""The batched sampler against transformers' logits processors, and its draws against the
distribution they define.

Masks: top-k, top-p and min-p equal transformers' TopK/TopP/MinP warpers (applied after
its temperature warper) row for row, in one batch that mixes settings. Penalties:
repetition equals RepetitionPenaltyLogitsProcessor; presence and frequency follow
OpenAI's formula. Draws: token frequencies match the filtered distribution.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hydrad.engine.sampler import PenaltyCache, Sampler, SamplingMetadata, allowed_tokens, top_p_cut

VOCAB = 300


def settings_grid():
    """(temperature, top_k, top_p, min_p) rows mixing every filter and none."""
    rows = []
    for temperature in (0.5, 1.0, 1.7):
        for top_k in (0, 1, 5, 40):
            for top_p in (1.0, 0.9, 0.5, 0.05):
                for min_p in (0.0, 0.05, 0.3):
                    rows.append((temperature, top_k, top_p, min_p))
    return rows


def hf_allowed(logits_row: torch.Tensor, temperature, top_k, top_p, min_p) -> torch.Tensor:
    scores = logits_row[None].clone()
    ids = torch.zeros((1, 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(ids, scores)
    return torch.isfinite(scores[0])


def test_filters_equal_transformers_warpers_row_for_row_in_a_mixed_batch():
    grid = settings_grid()
    generator = torch.Generator().manual_seed(0)
    # Peaked and flat rows, so every filter cuts somewhere different.
    logits = torch.randn(len(grid), VOCAB, generator=generator) * torch.linspace(0.5, 6, len(grid))[:, None]
    t, k, p, m = (torch.tensor(col) for col in zip(*grid))
    ours = allowed_tokens(logits, t.float(), k.long(), p.float(), m.float())
    for row, (temperature, top_k, top_p, min_p) in enumerate(grid):
        expected = hf_allowed(logits[row], temperature, top_k, top_p, min_p)
        assert torch.equal(ours[row], expected), (row, grid[row], int(ours[row].sum()), int(expected.sum()))


@pytest.mark.parametrize("vocab", [4096, 32000])
@pytest.mark.parametrize("candidates", [True, False])
def test_top_p_cut_keeps_what_transformers_top_p_keeps_on_wide_rows(vocab, candidates, monkeypatch):
    """Top-p without top-k is a threshold on the weights: on rows from flat to peaked, with
    masked (-inf) tokens in some, the tokens at or above the cut are exactly those
    transformers' TopP warper keeps, whether the cut is found among the largest blocks'
    tokens or by sorting the row (``candidates=False``), and the sampler draws only among
    them."""
    import hydrad.engine.sampler as sampler_module

    if not candidates:
        monkeypatch.setattr(sampler_module, "_CUT_BLOCKS", 0)
    generator = torch.Generator().manual_seed(vocab)
    top_p = torch.tensor([0.95, 0.9, 0.5, 0.05, 0.999, 0.7, 0.9, 0.3])
    logits = torch.randn(len(top_p), vocab, generator=generator) * torch.tensor([0.5, 1, 2, 3, 4, 6, 10, 1])[:, None]
    logits[1, ::3] = float("-inf")  # a grammar's mask
    scores = logits - logits.amax(dim=-1, keepdim=True)
    cut = top_p_cut(scores.exp(), top_p)
    kept_sizes = []
    for row in range(len(top_p)):
        expected = torch.isfinite(TopPLogitsWarper(float(top_p[row]))(None, scores[row][None].clone())[0])
        assert torch.equal(scores[row].exp() >= cut[row], expected), row
        kept_sizes.append(int(expected.sum()))
    assert min(kept_sizes) < 10 < vocab // 2 < max(kept_sizes)  # cuts near the top and deep in the tail
    meta = metadata(len(top_p), top_p=top_p.numpy())
    for seed in range(5):
        tokens = Sampler(seed=seed).sample(logits, meta).token_ids
        assert all(scores[row, token].exp() >= cut[row] for row, token in enumerate(tokens))


@pytest.mark.parametrize("split", [True, False])
def test_rows_sorted_in_two_halves_equal_one_sort(split, monkeypatch):
    """The top-p cut's sort of a row's values (numpy's, in place), whole or in two halves on
    two threads: the same ascending rows as torch's sort, -inf and ties included."""
    import hydrad.engine.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "_SPLIT_SORT_AT", 0 if split else 1 << 62)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    generator = torch.Generator().manual_seed(3)
    for rows in (1, 2, 7):
        x = torch.randn(rows, 1000, generator=generator).round(decimals=1)  # ties
        x[:, ::7] = float("-inf")
        out = torch.empty(rows, 1000)
        assert torch.equal(sampler_module._sorted(x, out), x.sort(dim=-1).values)
        assert torch.equal(sampler_module._sorted(x), x.sort(dim=-1).values)


def test_repetition_penalty_equals_transformers_and_openai_penalties_follow_the_formula():
    generator = torch.Generator().manual_seed(1)
    rows = 6
    logits = torch.randn(rows, VOCAB, generator=generator) * 3
    prompts = [torch.randint(VOCAB, (n,), generator=generator) for n in (5, 20, 1, 50, 7, 3)]
    outputs = [torch.randint(VOCAB, (n,), generator=generator) for n in (0, 4, 9, 30, 2, 1)]
    cache = PenaltyCache(VOCAB, torch.device("cpu"))
    slots = [cache.allocate(p.tolist(), o.tolist()) for p, o in zip(prompts, outputs)]
    repetition = torch.tensor([1.0, 1.3, 0.7, 2.0, 1.0, 1.1])
    presence = torch.tensor([0.0, 0.5, -1.0, 0.0, 2.0, 0.3])
    frequency = torch.tensor([0.0, 0.2, 0.0, -0.5, 1.0, 0.3])
    every_row = torch.arange(rows)

    only_repetition = logits.clone()
    cache.penalize(only_repetition, every_row, slots, repetition, torch.zeros(rows), torch.zeros(rows))
    for row in range(rows):
        seen = torch.cat([prompts[row], outputs[row]])[None]
        expected = RepetitionPenaltyLogitsProcessor(float(repetition[row]))(seen, logits[row][None].clone())[0]
        assert torch.equal(only_repetition[row], expected)

    everything = logits.clone()
    cache.penalize(everything, every_row, slots, repetition, presence, frequency)
    for row in range(rows):
        counts = torch.bincount(outputs[row], minlength=VOCAB).float()
        expected = only_repetition[row] - counts * frequency[row] - (counts > 0).float() * presence[row]
        torch.testing.assert_close(everything[row], expected)

    # Counts move with the sampled tokens, never rebuilt from the lists; new tokens join.
    fresh = next(t for t in range(VOCAB) if t not in prompts[0].tolist())
    cache.add_tokens([slots[0], slots[0], slots[1]], [fresh, fresh, 7])
    after = logits.clone()
    cache.penalize(after, every_row[:1], slots[:1], torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([1.0]))
    assert float(after[0, fresh]) == pytest.approx(float(logits[0, fresh]) - 2.0)
    cache.free(slots[0])
    assert cache.allocate([1], []) == slots[0]  # a freed slot is reused, empty


def metadata(rows: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generators=()) -> SamplingMetadata:
    meta = SamplingMetadata.greedy(rows)
    meta.temperature[:] = temperature
    meta.top_k[:] = top_k
    meta.top_p[:] = top_p
    meta.min_p[:] = min_p
    meta.generators = list(generators)
    return meta


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0),  # the API's defaults: plain softmax
    (0.8, 5, 0.9, 0.0),  # top-k then top-p
    (1.2, 0, 0.7, 0.0),  # top-p alone
    (1.0, 0, 1.0, 0.1),  # min-p alone
    (0.7, 8, 1.0, 0.05),
])
def test_sampled_frequencies_match_the_filtered_distribution(temperature, top_k, top_p, min_p):
    """40,000 draws per setting; every frequency within 0.012 of its probability (more than
    4 standard deviations at this sample size), and no filtered-out token ever drawn."""
    vocab, copies, rounds = 12, 2000, 20
    logits_row = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.5, 0.2, 0.0, -0.3, -1.0, -2.0, -3.0, -4.0])
    sampler = Sampler(seed=1234)
    meta = metadata(copies, temperature, top_k, top_p, min_p)
    counts = np.zeros(vocab)
    for _ in range(rounds):
        tokens = sampler.sample(logits_row.repeat(copies, 1), meta).token_ids
        counts += np.bincount(tokens, minlength=vocab)
    freq = counts / counts.sum()
    allowed = hf_allowed(logits_row, temperature, top_k, top_p, min_p)
    probs = torch.softmax((logits_row / temperature).masked_fill(~allowed, float("-inf")), dim=-1).numpy()
    assert (counts[~allowed.numpy()] == 0).all()
    assert np.abs(freq - probs).max() < 0.012, (freq.round(3), probs.round(3))


@pytest.mark.parametrize("rounds", [3, 0])
@pytest.mark.parametrize("top_p, min_p", [(0.9, 0.0), (0.3, 0.0), (0.6, 0.2)])
def test_top_p_by_rejection_draws_top_ps_distribution(top_p, min_p, rounds, monkeypatch):
    """Top-p without top-k draws, rejects a token whose heavier tokens already hold top-p of
    the mass, and draws again above it; rows still drawing after the rounds (``rounds=0``:
    every row rejected once) take the exact cut. Over a 1,024-token row (8 blocks) with its
    mass on 12 tokens in different blocks and a tail on the rest: 40,000 draws, each
    frequency within 0.012 of transformers' filtered distribution, no token outside it."""
    import hydrad.engine.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "_NUCLEUS_ROUNDS", rounds)
    vocab, copies, draws = 1024, 2000, 20
    logits_row = torch.full((vocab,), -6.0)
    hot = torch.tensor([3, 100, 130, 257, 300, 511, 512, 640, 700, 800, 1000, 1023])
    logits_row[hot] = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.5, 0.2, 0.0, -0.3, -1.0, -2.0, -3.0, -4.0])
    sampler = Sampler(seed=5)
    meta = metadata(copies, 1.0, 0, top_p, min_p)
    counts = np.zeros(vocab)
    for _ in range(draws):
        counts += np.bincount(sampler.sample(logits_row.repeat(copies, 1), meta).token_ids, minlength=vocab)
    allowed = hf_allowed(logits_row, 1.0, 0, top_p, min_p)
    probs = torch.softmax(logits_row.masked_fill(~allowed, float("-inf")), dim=-1).numpy()
    assert 1 < int(allowed.sum()) < len(hot)
    assert (counts[~allowed.numpy()] == 0).all()
    assert np.abs(counts / counts.sum() - probs).max() < 0.012, (counts[hot] / counts.sum(), probs[hot])


def test_a_seeded_top_p_row_draws_again_from_its_own_seed_alone_or_in_a_crowd():
    """A seeded row that top-p rejects draws again from uniforms of its seed (not from the
    instance's generator): the same tokens alone and among other rows, and its generator
    moves by one uniform per token, as ``generator_for`` replays it after a migration."""
    logits = torch.randn(64, 2048, generator=torch.Generator().manual_seed(8)) * 2
    crowd = metadata(64, top_p=0.5)
    crowd.top_p[32:] = 1.0
    rejected_once = 0
    for seed in range(30):
        alone = Sampler(seed=1).sample(logits[:1], metadata(1, top_p=0.5, generators=[(0, torch.Generator().manual_seed(seed))]))
        crowd.generators = [(0, generator := torch.Generator().manual_seed(seed))]
        together = Sampler(seed=2 + seed).sample(logits, crowd)
        assert together.token_ids[0] == alone.token_ids[0]
        assert torch.equal(generator.get_state(), Sampler.generator_for(seed, 1).get_state())
        first = torch.rand(1, generator=torch.Generator().manual_seed(seed))  # the draw before any rejection
        weights = (logits[0] - logits[0].max()).exp()
        target = float(first) * float(weights.sum())
        rejected_once += int(torch.searchsorted(weights.cumsum(0), torch.tensor([target]), right=True)) != alone.token_ids[0]
    assert rejected_once > 0  # some seeds did draw again


def test_scores_far_below_the_largest_weigh_nothing_and_the_rest_keep_their_share():
    """Scores are clamped at -87 (less the row's largest) before ``exp`` (the CPU's slow path
    lies below): a token 200 below the largest or masked to -inf is never drawn, and a token
    80 below keeps its (tiny) weight while the others keep the distribution."""
    from hydrad.engine.sampler import _draw_unsorted

    logits = torch.tensor([[0.0, -0.5, -200.0, float("-inf"), -80.0, -1.0]]).repeat(4000, 1)
    tokens = torch.cat([_draw_unsorted(logits, None, torch.rand(4000, generator=torch.Generator().manual_seed(s)))
                        for s in range(5)])
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[2] == counts[3] == 0
    probs = torch.softmax(logits[0].double(), dim=-1)
    assert (counts / counts.sum() - probs).abs().max() < 0.01
    # The weights themselves: 80 below stays above zero, 200 below is zero.
    out = torch.empty(1, 128)
    _draw_unsorted(logits[:1], None, torch.zeros(1), out=out)
    assert out[0, 4] > 0 and out[0, 2] == 0 and out[0, 3] == 0


def test_greedy_rows_take_the_argmax_after_bias_and_min_tokens():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0], [3.0, 0.0, 0.0, 9.0]])
    meta = metadata(2, temperature=0.0)
    assert Sampler().sample(logits, meta).token_ids == [1, 3]
    meta.bias = ([0], [2], [10.0])  # row 0: token 2 += 10
    meta.min_tokens_mask = ([1], [3])  # row 1: token 3 (say EOS) not yet
    assert Sampler().sample(logits, meta).token_ids == [2, 0]


def test_seeded_rows_draw_from_their_own_generator():
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(3))
    alone = Sampler(seed=1).sample(logits[:1], metadata(1, generators=[(0, torch.Generator().manual_seed(42))]))
    crowd = metadata(64, generators=[(0, torch.Generator().manual_seed(42))])
    crowd.top_k[10:20] = 5  # other rows take other paths
    crowd.top_p[20:30] = 0.8
    together = Sampler(seed=99).sample(logits, crowd)
    assert together.token_ids[0] == alone.token_ids[0]


def test_logprobs_of_the_raw_distribution_with_rank_and_top_tokens():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    meta = metadata(1, temperature=0.0)
    meta.num_logprobs[:] = 2
    meta.bias = ([0], [0], [100.0])  # the processed argmax is token 0; logprobs stay raw
    out = Sampler().sample(logits, meta)
    raw = torch.log_softmax(logits[0], dim=-1)
    (lp,) = out.logprobs
    assert out.token_ids == [0]
    assert lp.logprob == pytest.approx(float(raw[0])) and lp.rank == 3
    assert lp.top_token_ids == [1, 2] and lp.top_logprobs == pytest.approx(raw[[1, 2]].tolist())


@pytest.mark.parametrize("min_p", [0.0, 0.3])
def test_unfiltered_draws_across_vocabulary_blocks_match_the_distribution(min_p):
    """The inverse CDF finds the block, then the token in it: mass spread over tokens in
    different 128-token blocks (first and last token included) is drawn in proportion."""
    vocab, copies, rounds = 384, 2000, 20
    hot = torch.tensor([0, 5, 130, 131, 260, 383])
    logits_row = torch.full((vocab,), -1e9)
    logits_row[hot] = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.5, 0.2])
    sampler = Sampler(seed=7)
    counts = np.zeros(vocab)
    for _ in range(rounds):
        counts += np.bincount(sampler.sample(logits_row.repeat(copies, 1), metadata(copies, min_p=min_p)).token_ids,
                              minlength=vocab)
    probs = torch.softmax(logits_row, dim=-1)
    probs[probs < min_p * probs.max()] = 0
    probs = (probs / probs.sum()).numpy()
    assert counts[probs == 0].sum() == 0
    assert np.abs(counts / counts.sum() - probs).max() < 0.012


def test_the_draw_never_lands_on_a_token_without_weight_at_the_ends_of_the_uniform():
    """The largest uniforms (up to 1 - 2^-24) and the smallest, on rows whose mass ends early
    in their last block or in an earlier one (masked tokens after it, as a grammar or top-p
    leaves them): rounding can put the target at the end of the mass, and the token drawn is
    still one of some weight."""
    from hydrad.engine.sampler import _draw_unsorted

    vocab, rows = 384, 64
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(rows, vocab, generator=generator) * 4
    ends = torch.randint(1, vocab, (rows,), generator=generator)
    ends[:4] = torch.tensor([1, 128, 129, 383])
    logits[torch.arange(vocab)[None, :] >= ends[:, None]] = float("-inf")
    logits[5, 1:100] = float("-inf")  # a gap before the last tokens of weight
    top = torch.tensor(float(np.nextafter(np.float32(1.0), np.float32(0.0))))
    for uniform in (top.expand(rows), torch.zeros(rows), (1 - torch.rand(rows, generator=generator) * 1e-6).clamp(max=top)):
        tokens = _draw_unsorted(logits, None, uniform.contiguous())
        assert torch.isfinite(logits.gather(1, tokens[:, None])).all()
    tokens = _draw_unsorted(logits, None, top.expand(rows).contiguous())
    assert (tokens == ends - 1).float().mean() > 0.5  # the top uniform draws the last token of weight
    # Sorted candidates (top-k) with fewer tokens of weight than k: the same at the top.
    from hydrad.engine.sampler import _draw_sorted

    values, ids = logits.sort(dim=-1, descending=True)
    tokens = _draw_sorted(values[:, :50], ids[:, :50], None, None, top.expand(rows).contiguous())
    assert torch.isfinite(logits.gather(1, tokens[:, None])).all()


def test_the_batch_looks_up_generators_and_biases_only_of_rows_that_have_them():
    import numpy as np

    from hydrad.engine.input_batch import InputBatch
    from hydrad.engine.inputs import EngineRequest
    from hydrad.engine.request import Request
    from hydrad.sampling_params import SamplingParams

    def request(req_id, **params):
        return Request(EngineRequest(req_id, [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.7, **params)))

    batch = InputBatch(8, 32, Sampler(0), torch.device("cpu"))
    plain, seeded, biased = request("a"), request("b", seed=3), request("c", logit_bias={4: 5.0})
    rows = np.array([batch.add(r) for r in (plain, seeded, biased)])
    assert (batch.num_seeded, batch.num_biased) == (1, 1)
    meta = batch.sampling_metadata(rows, [plain, seeded, biased])
    assert [i for i, _ in meta.generators] == [1] and meta.bias == ([2], [4], [5.0])
    batch.remove(seeded)
    batch.remove(biased)
    assert (batch.num_seeded, batch.num_biased) == (0, 0)
    meta = batch.sampling_metadata(rows[:1], [plain])
    assert meta.generators == [] and meta.bias is None


@pytest.mark.parametrize("vocab", [4096, 6421, 32064])  # blocks of 16, 32, 32 for k = 50
def test_blockwise_top_k_equals_torch_topk_on_wide_rows(vocab):
    """On a CPU ``topk_rows`` ranks blocks by their maximum before the top k: the values are
    torch's, in its order, and each id points at its value, wherever the maxima sit (in one
    block, spread, in the tail past the last whole block, among -inf)."""
    from hydrad.engine.sampler import topk_rows

    generator = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=generator)
    x[1, 64:96] += 50.0  # every top-k entry of the row in one block
    x[2, -(vocab % 32 or 32):] += 50.0  # in the tail
    x[3, 40:] = float("-inf")  # fewer finite entries than k
    x[4, ::97] += 20.0  # one per block, spread
    for k in (1, 7, 50):
        values, ids = topk_rows(x, k)
        expected, _ = x.topk(k, dim=-1)
        assert torch.equal(values, expected)
        assert torch.equal(x.gather(1, ids), values)
        assert (ids.sort(dim=-1).values.diff(dim=-1) > 0).all()  # no entry twice


def test_argmax_rows_takes_the_first_of_equal_maxima_as_torch():
    from hydrad.engine.sampler import argmax_rows

    x = torch.randn(5, 1000, generator=torch.Generator().manual_seed(1))
    x[2, [10, 500, 900]] = 99.0
    x[3] = 0.0
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x).tolist()[2:4] == [10, 0]
    assert torch.equal(argmax_rows(x[1::2]), x[1::2].argmax(dim=-1))  # a strided view
    assert torch.equal(argmax_rows(x.bfloat16()), x.bfloat16().argmax(dim=-1))
