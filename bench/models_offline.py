"""Offline throughput per model family: hydrad's ``LLM.chat`` against transformers' batched ``generate``.

    python bench/models_offline.py [--archs llava-next qwen2-vl qwen2.5-vl] [--num 16] [--max-tokens 32]

For each architecture, the ``small`` checkpoint ``hydrad make-model`` writes (built into
``--models-dir`` on first use), the same conversations (photo-like images of 200-800 px,
so image token counts differ per image, and some text-only prompts), greedy, every request
forced to ``--max-tokens`` output tokens. hydrad runs them through one EPD engine in this
process (default budgets); transformers runs them as one left-padded batch, the fastest
way it has to run a known set of requests. Reported: seconds, output tokens/s, the ratio.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import conversations, machine, write_json
from offline_throughput import run_transformers
from rich.console import Console
from rich.table import Table

console = Console()
ARCHS = ("llava-next", "qwen2-vl", "qwen2.5-vl")


def small_model(models_dir: Path, arch: str) -> str:
    from hydrad.models.builder import build_model

    path = models_dir / f"{arch}-small"
    if not path.is_dir():
        build_model(path, arch, "small", 0, progress=False)
    return str(path)


def run_hydrad(path: str, convs, max_tokens: int) -> tuple[float, int, int]:
    from hydrad import LLM, SamplingParams

    llm = LLM(path)
    llm.chat(convs[:2], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm-up
    image_tokens = sum(llm.processor.process_chat(conv).num_image_tokens for conv in convs)
    start = time.perf_counter()
    outs = llm.chat(convs, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.shutdown()
    return seconds, sum(len(o.token_ids) for o in outs), image_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--num", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--models-dir", default=str(Path.home() / ".cache" / "hydrad" / "bench-models"))
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    models_dir = Path(args.models_dir)
    convs = conversations(args.num, seed=0, image_fraction=0.75)
    results = {}
    for arch in args.archs:
        with console.status(f"building {arch} small ..."):
            path = small_model(models_dir, arch)
        with console.status(f"{arch}: hydrad LLM.chat ..."):
            secs, tokens, image_tokens = run_hydrad(path, convs, args.max_tokens)
        with console.status(f"{arch}: transformers generate, padded batch ..."):
            hf_secs, hf_tokens = run_transformers(path, convs, args.max_tokens, batched=True)
        results[arch] = {
            "image_tokens": image_tokens,
            "hydrad": {"seconds": secs, "output_tokens": tokens, "tokens_per_s": tokens / secs},
            "transformers_padded_batch": {"seconds": hf_secs, "output_tokens": hf_tokens,
                                          "tokens_per_s": hf_tokens / hf_secs},
        }
    table = Table(title=f"{args.num} conversations, {args.max_tokens} output tokens each, small models, CPU")
    for col in ("model", "image tokens", "hydrad s", "hydrad tok/s", "transformers batch s",
                "transformers batch tok/s", "hydrad / transformers"):
        table.add_column(col)
    for arch, r in results.items():
        ours, theirs = r["hydrad"], r["transformers_padded_batch"]
        table.add_row(arch, str(r["image_tokens"]), f"{ours['seconds']:.2f}", f"{ours['tokens_per_s']:.1f}",
                      f"{theirs['seconds']:.2f}", f"{theirs['tokens_per_s']:.1f}",
                      f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x")
    console.print(table)
    write_json(args.out, {"machine": machine(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
