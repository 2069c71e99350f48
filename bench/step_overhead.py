"""CPU time of one engine step outside the model forward, with a fake executor.

The model's forward is replaced by a stand-in that returns at once (its attention
metadata is still built, as a backend would ask for it), so what is timed is hydrad's
own work per step: scheduling, building the runner's inputs (block tables, positions,
slot mappings), sampling bookkeeping and the step's output. The logits are a small
vocabulary, so the sampler's arithmetic is not counted here (``bench/sampler.py``
measures that).

    python bench/step_overhead.py --decodes 64 256 1024 --out step_overhead.json

``--arch qwen2-vl`` measures a decoder with M-RoPE: every request then carries 3-D prompt
positions and a position delta, as requests with images do, so each step builds its
positions from them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import machine, write_json


class FakeModel(torch.nn.Module):
    """The model interface with an instant forward: hidden size 8, a tiny vocabulary."""

    def __init__(self, real, vocab_size: int):
        super().__init__()
        self.real = real
        self.vocab_size = vocab_size

    def embed_tokens(self, input_ids):
        return torch.zeros(input_ids.shape[0], 8)

    def forward(self, embeds, positions, kv_cache, meta):
        meta.decode_batch, meta.prefill_chunks  # what the attention backend builds from the metadata
        return torch.zeros(embeds.shape[0], 8)

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], self.vocab_size)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.real, name)


def make_engine(model_dir: str, num_decodes: int):
    from hydrad.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from hydrad.engine.core import EngineCore

    config = EngineConfig(
        model=ModelConfig(path=model_dir),
        cache=CacheConfig(num_kv_blocks=num_decodes * 40, kv_block_size=16),
        scheduler=SchedulerConfig(token_budget=1_000_000, max_num_seqs=num_decodes, derive_budgets=False),
    )
    engine = EngineCore(config)
    engine.runner.model = FakeModel(engine.runner.model, vocab_size=64)
    return engine


def measure(model_dir: str, num_decodes: int, params, steps: int) -> dict:
    from hydrad.engine.inputs import EngineRequest

    engine = make_engine(model_dir, num_decodes)
    mrope = {}
    if engine.model.uses_mrope:
        # What a prompt with an image carries: its own positions, generated tokens shifted by a delta.
        mrope = {"mrope_positions": torch.arange(24).expand(3, -1).clone(), "mrope_delta": -5}
    for i in range(num_decodes):
        engine.add_request(EngineRequest(f"r{i}", [5 + (i + j) % 50 for j in range(24)], params, **mrope))
    while engine.scheduler.prefilling or engine.scheduler.waiting:  # every request decoding
        engine.step()
    scheduler, runner = engine.scheduler, engine.runner
    phases = {"schedule": [], "inputs_and_sampling": [], "update_and_output": [], "step": []}
    wrapped_execute, wrapped_schedule, wrapped_update = runner.execute, scheduler.schedule, \
        scheduler.update_after_language

    def timed(name, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name].append(time.perf_counter() - start)
        return run

    runner.execute = timed("inputs_and_sampling", wrapped_execute)
    scheduler.schedule = timed("schedule", wrapped_schedule)
    scheduler.update_after_language = timed("update_and_output", wrapped_update)
    for _ in range(steps):
        start = time.perf_counter()
        out = engine.step()
        phases["step"].append(time.perf_counter() - start)
        assert len(out.req_ids) == num_decodes
    engine.shutdown()
    return {name: 1e3 * statistics.median(values) for name, values in phases.items()}


def main() -> None:
    from hydrad.models.builder import build_model
    from hydrad.sampling_params import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decodes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--arch", default="llava", help="the tiny checkpoint's architecture (make-model --arch)")
    parser.add_argument("--out")
    args = parser.parse_args()
    settings = {
        "greedy": SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True),
        "defaults": SamplingParams(max_tokens=100_000, ignore_eos=True),
        "top_p": SamplingParams(max_tokens=100_000, temperature=0.7, top_p=0.95, ignore_eos=True),
        "filtered": SamplingParams(max_tokens=100_000, temperature=0.8, top_p=0.9, top_k=50, ignore_eos=True),
    }
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_model(Path(tmp) / "tiny", args.arch, "tiny", 0, progress=False))
        for num_decodes in args.decodes:
            for name, params in settings.items():
                row = {"decodes": num_decodes, "sampling": name, **measure(model_dir, num_decodes, params, args.steps)}
                results.append(row)
                print(f"{num_decodes:5d} decodes {name:9s} step {row['step']:.3f} ms  (schedule "
                      f"{row['schedule']:.3f}, inputs+sampling {row['inputs_and_sampling']:.3f}, update+output "
                      f"{row['update_and_output']:.3f})", flush=True)
    write_json(args.out, {"machine": machine(), "results": results})


if __name__ == "__main__":
    main()
