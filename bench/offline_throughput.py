"""Offline throughput: hydrad's ``LLM.chat`` against transformers' ``generate``, same model, one run.

    python bench/offline_throughput.py [--model DIR] [--num 16] [--max-tokens 32]

Both run greedy on the same conversations on this machine's CPU. transformers runs
each conversation alone (its reference use) and also as one padded batch; hydrad
runs them all through its scheduler. Reported: seconds, output tokens/s, ratios.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import conversations, machine, model_dir, write_json
from rich.console import Console
from rich.table import Table

console = Console()


def run_transformers(path: str, convs, max_tokens: int, batched: bool) -> tuple[float, int]:
    """transformers' model of the checkpoint's architecture, with the checkpoint's processor."""
    import transformers

    from hydrad.models.hf_processor import load_hf_processor
    from hydrad.models.loader import load_config

    config = load_config(path)
    processor = load_hf_processor(path, config.model_type)
    processor.tokenizer.padding_side = "left"
    model = getattr(transformers, config.architectures[0]).from_pretrained(path, dtype=torch.float32).eval()
    prompts, images = [], []
    for conv in convs:
        content = conv[0]["content"]
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        imgs = [p["image"] for p in parts if p["type"] == "image"]
        msg = [{"role": "user", "content": [{"type": "image"} if p["type"] == "image" else p for p in parts]}]
        prompts.append(processor.apply_chat_template(msg, add_generation_prompt=True, tokenize=False))
        images.append(imgs)
    start = time.perf_counter()
    num_tokens = 0
    with torch.inference_mode():
        if batched:
            flat = [i for imgs in images for i in imgs]
            inputs = processor(text=prompts, images=flat or None, return_tensors="pt", padding=True)
            out = model.generate(**inputs, do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
            num_tokens = (out.shape[1] - inputs["input_ids"].shape[1]) * len(prompts)
        else:
            for text, imgs in zip(prompts, images):
                inputs = processor(text=text, images=imgs or None, return_tensors="pt")
                out = model.generate(**inputs, do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
                num_tokens += out.shape[1] - inputs["input_ids"].shape[1]
    return time.perf_counter() - start, num_tokens


def run_hydrad(path: str, convs, max_tokens: int) -> tuple[float, int]:
    from hydrad import LLM, SamplingParams

    llm = LLM(path)
    llm.chat(convs[:2], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    start = time.perf_counter()
    outs = llm.chat(convs, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the built-in default model)")
    parser.add_argument("--num", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    path = model_dir(args.model)
    convs = conversations(args.num, seed=0, image_fraction=0.75)
    results = {}
    for name, fn in (
        ("hydrad LLM.chat", lambda: run_hydrad(path, convs, args.max_tokens)),
        ("transformers generate, one at a time", lambda: run_transformers(path, convs, args.max_tokens, False)),
        ("transformers generate, padded batch", lambda: run_transformers(path, convs, args.max_tokens, True)),
    ):
        with console.status(f"running {name} ..."):
            secs, tokens = fn()
        results[name] = {"seconds": secs, "output_tokens": tokens, "tokens_per_s": tokens / secs}
    base = results["hydrad LLM.chat"]["tokens_per_s"]
    table = Table(title=f"{args.num} conversations, {args.max_tokens} output tokens each, model {path}")
    for col in ("system", "seconds", "output tok/s", "hydrad speed-up"):
        table.add_column(col)
    for name, r in results.items():
        table.add_row(name, f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.1f}", f"{base / r['tokens_per_s']:.2f}x")
    console.print(table)
    write_json(args.out, {"machine": machine(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
