"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Greedy rows take the argmax of the whole batch at once. Sampled rows draw from
their own ``torch.Generator`` when the request has a seed, so the same seed gives
the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import torch

from hydrad.sampling_params import SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    # logits: [vocab] float32, already divided by the temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the mass before it already reaches top_p (the first always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


class Sampler:
    def __init__(self, seed: int = 0):
        # Seeds for requests that bring none, drawn from one engine-wide generator.
        self._seed_source = torch.Generator().manual_seed(seed)

    def generator_for(self, params: SamplingParams) -> torch.Generator:
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
        return torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
        # logits: [num_seqs, vocab] float32; generators[i] is used only for non-greedy rows
        token_ids = torch.argmax(logits, dim=-1).tolist()
        for i, p in enumerate(params):
            if p.greedy:
                continue
            row = _filter_top_k_top_p(logits[i].float().cpu() / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(row, dim=-1)
            token_ids[i] = int(torch.multinomial(probs, 1, generator=generators[i]))
        return token_ids
