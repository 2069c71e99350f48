"""Greedy answers in float16 or bfloat16 against a reference run, token by token.

Two runs that round differently may break a near-tie differently, and from there their
answers part. So: equal tokens with log-probabilities within ``LOGPROB_TOL`` until the first
token where they differ, which must be a near-tie in the reference (the other run's token
within ``TIE_TOL`` of the reference's, among its 20 most likely); most answers agree to the
end. The tiny random models' next-token distributions are nearly flat (many tokens within
0.1 of the top), so near-ties do come up.
"""

from __future__ import annotations

from hydrad import SamplingParams

PARAMS = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0, logprobs=20)
# |log-probability - the reference's| before the answers part
LOGPROB_TOL = {"float16": 2e-2, "bfloat16": 1.5e-1}
# where the tokens differ, the reference's log-probabilities of the two are this close
TIE_TOL = {"float16": 5e-2, "bfloat16": 3e-1}
# the share of answers that agree to the end, at least (bfloat16 rounds coarser)
FULL_AGREEMENT = {"float16": 0.8, "bfloat16": 0.5}


def agreed_tokens(got, want, dtype: str) -> int:
    """How many tokens of ``got`` agree with the reference ``want`` (asserting the rules above)."""
    for i, (g, w) in enumerate(zip(got.logprobs, want.logprobs)):
        if g.token_id != w.token_id:
            assert g.token_id in w.top_token_ids, (i, g, w)
            other = w.top_logprobs[w.top_token_ids.index(g.token_id)]
            assert w.logprob - other < TIE_TOL[dtype], (i, g, w)
            return i
        assert abs(g.logprob - w.logprob) < LOGPROB_TOL[dtype], (i, g, w)
    assert len(got.token_ids) == len(want.token_ids)
    return len(got.token_ids)


def check_answers(got_outs, want_outs, dtype: str) -> None:
    agreed = [agreed_tokens(g, w, dtype) for g, w in zip(got_outs, want_outs, strict=True)]
    assert sum(a == PARAMS.max_tokens for a in agreed) >= FULL_AGREEMENT[dtype] * len(agreed), agreed
