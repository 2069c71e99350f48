"""The sampler's time per step against the greedy argmax, by batch size, vocabulary and setting.

For each number of rows and vocabulary size, random logits are sampled with each
setting; the time is the median over repeats of ``Sampler.sample`` (everything the
engine does with a step's logits: processing, filtering, drawing, bookkeeping). The
reference is the argmax of the same logits, the whole of a greedy step's sampling.

    python bench/sampler.py --rows 1 64 256 1024 --vocab 32000 152064 --out sampler.json

The logits are standard normal times ``--scales`` (default 3): 1 gives flat rows (top-p
0.95 at temperature 0.7 keeps ~60% of a 32k vocabulary), 6 peaked ones (a handful of
tokens, as a trained model's rows mostly are).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from common import machine, median_seconds, write_json

SETTINGS = ("greedy", "defaults", "top_p", "filtered", "filtered+penalties+min_p", "quarter_seeded")


def metadata(setting: str, rows: int, sampler, vocab: int):
    from hydrad.engine.sampler import SamplingMetadata

    meta = SamplingMetadata.greedy(rows)
    if setting == "greedy":
        return meta
    meta.temperature[:] = 1.0
    if setting == "top_p":  # the OpenAI API's filter: top-p without top-k
        meta.temperature[:] = 0.7
        meta.top_p[:] = 0.95
    if setting.startswith("filtered"):
        meta.temperature[:] = 0.8
        meta.top_p[:] = 0.9
        meta.top_k[:] = 50
    if setting == "filtered+penalties+min_p":
        meta.min_p[:] = 0.05
        meta.repetition_penalty[:] = 1.1
        meta.presence_penalty[:] = 0.5
        meta.frequency_penalty[:] = 0.3
        generator = torch.Generator().manual_seed(0)
        slots = [sampler.penalties.allocate(torch.randint(vocab, (200,), generator=generator).tolist(),
                                            torch.randint(vocab, (50,), generator=generator).tolist())
                 for _ in range(rows)]
        meta.penalty_slots[:] = slots
    if setting == "quarter_seeded":
        meta.generators = [(i, torch.Generator().manual_seed(i)) for i in range(0, rows, 4)]
    return meta


def main() -> None:
    from hydrad.engine.sampler import PenaltyCache, Sampler

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 152064])
    parser.add_argument("--scales", type=float, nargs="+", default=[3.0], help="standard deviations of the logits")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out")
    args = parser.parse_args()
    results = []
    for vocab, rows, scale in ((v, r, s) for v in args.vocab for r in args.rows for s in args.scales):
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * scale
        argmax = median_seconds(lambda: logits.argmax(dim=-1).tolist(), args.repeats)
        row = {"vocab": vocab, "rows": rows, "scale": scale, "argmax_ms": 1e3 * argmax}
        for setting in SETTINGS:
            sampler = Sampler(seed=0)
            sampler.penalties = PenaltyCache(vocab, torch.device("cpu"))
            meta = metadata(setting, rows, sampler, vocab)
            seconds = median_seconds(lambda: sampler.sample(logits, meta), args.repeats)
            row[f"{setting}_ms"] = 1e3 * seconds
            row[f"{setting}_vs_argmax"] = seconds / argmax
        results.append(row)
        cells = "  ".join(f"{s} {row[f'{s}_ms']:.2f} ms ({row[f'{s}_vs_argmax']:.1f}x)" for s in SETTINGS)
        print(f"vocab {vocab:6d} rows {rows:4d} scale {scale:g}: argmax {row['argmax_ms']:.2f} ms  {cells}", flush=True)
    write_json(args.out, {"machine": machine(), "threads": torch.get_num_threads(), "results": results})


if __name__ == "__main__":
    np.random.seed(0)
    main()
