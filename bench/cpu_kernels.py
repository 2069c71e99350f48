"""The CPU kernels of one step: linear layers with plain and pre-packed weights, the KV gather,
and whole engine steps with the packing on and off.

Three measurements on the model given (default: the built-in ``small`` LLaVA):

1. every linear shape of its language model (and its LM head), ``F.linear`` on the plain
   weight against oneDNN's matmul on the packed one (``hydrad/models/linear.py``), at
   batches of 1, 16, 64 and 290 rows;
2. the decode attention's KV gather, for 16 sequences at 300 tokens of context: a gather
   along the pool's block dimension (the earlier code) against ``gather_blocks`` (rows);
3. engine steps timed as the latency model's probes time them (``EngineTimer``: the median
   of repeated runs through the real runner), once with ``HYDRAD_CPU_PACKED_LINEAR=0`` and
   once with the packing on: 1 decode, 16 decodes at context 300, the same plus a 40-token
   prefill chunk, and a 290-token prefill (one image request's prompt);
4. decode steps of large batches (8 and 32 decodes at context 1024, 64 at 512, 128 at 300),
   timed the same way, with the decodes' keys and values gathered as before (one padded
   group in fresh memory every layer) and as now (groups of at most ``CPU_GATHER_BYTES``
   in a buffer kept between steps).

    python bench/cpu_kernels.py --out cpu_kernels.json
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.nn import functional as F

from common import machine, median_seconds, model_dir, write_json

ROWS = (1, 16, 64, 290)


def linear_shapes(text_config) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of the decoder's fused projections and the LM head."""
    hidden, inter = text_config.hidden_size, text_config.intermediate_size
    heads, kv_heads = text_config.num_attention_heads, text_config.num_key_value_heads
    head_dim = getattr(text_config, "head_dim", None) or hidden // heads
    return [("qkv_proj", (heads + 2 * kv_heads) * head_dim, hidden), ("o_proj", hidden, heads * head_dim),
            ("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter),
            ("lm_head", text_config.vocab_size, hidden)]


def bench_linears(text_config) -> list[dict]:
    from hydrad.models.linear import PackedLinear

    rows = []
    for name, out_features, in_features in linear_shapes(text_config):
        layer = torch.nn.Linear(in_features, out_features, bias=False)
        packed = PackedLinear(layer)
        for m in ROWS:
            x = torch.randn(m, in_features)
            with torch.inference_mode():
                plain_s = median_seconds(lambda: F.linear(x, layer.weight), 50, warmup=3)
                packed_s = median_seconds(lambda: packed(x), 50, warmup=3)
            rows.append({"layer": name, "shape": [out_features, in_features], "rows": m,
                         "plain_ms": 1e3 * plain_s, "packed_ms": 1e3 * packed_s, "speedup": plain_s / packed_s})
            print(f"  {name} {out_features}x{in_features}, {m} rows: plain {1e3 * plain_s:.3f} ms, "
                  f"packed {1e3 * packed_s:.3f} ms ({plain_s / packed_s:.2f}x)", flush=True)
    return rows


def bench_gather(text_config, num_seqs: int = 16, context: int = 300, block_size: int = 16) -> dict:
    from hydrad.models.attention.sdpa import gather_blocks

    heads, kv_heads = text_config.num_attention_heads, text_config.num_key_value_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    num_blocks = 4096
    pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)
    per_seq = -(-context // block_size)
    ids = torch.randperm(num_blocks)[: num_seqs * per_seq]
    along_blocks = median_seconds(lambda: pool.index_select(1, ids), 200, warmup=3)
    as_rows = median_seconds(lambda: gather_blocks(pool, ids), 200, warmup=3)
    print(f"  KV gather, {num_seqs} x {context} tokens: along the block dimension {1e3 * along_blocks:.3f} ms, "
          f"as rows {1e3 * as_rows:.3f} ms ({along_blocks / as_rows:.2f}x)", flush=True)
    return {"sequences": num_seqs, "context": context, "along_blocks_ms": 1e3 * along_blocks,
            "rows_ms": 1e3 * as_rows, "speedup": along_blocks / as_rows}


def bench_steps(path: str) -> dict:
    from hydrad import LLM
    from hydrad.engine.profiler import EngineTimer, Probe
    from hydrad.models.linear import ENV_SWITCH

    probes = {"1 decode": Probe(decodes=(30,)), "16 decodes at 300": Probe(decodes=(300,) * 16),
              "16 decodes at 300 + 40-token prefill": Probe(decodes=(300,) * 16, prefills=((0, 40),)),
              "290-token prefill": Probe(prefills=((0, 290),))}
    results: dict = {name: {} for name in probes}
    saved = os.environ.get(ENV_SWITCH)
    try:
        for setting, value in (("plain", "0"), ("packed", "1")):
            os.environ[ENV_SWITCH] = value  # read when the weights are loaded
            llm = LLM(path)
            try:
                timer = EngineTimer(llm.engine, repeats=9)
                for name, probe in probes.items():
                    results[name][f"{setting}_ms"] = 1e3 * timer(probe)
            finally:
                llm.shutdown()
    finally:
        if saved is None:
            os.environ.pop(ENV_SWITCH, None)
        else:
            os.environ[ENV_SWITCH] = saved
    for name, r in results.items():
        r["speedup"] = r["plain_ms"] / r["packed_ms"]
        print(f"  step, {name}: plain {r['plain_ms']:.1f} ms, packed {r['packed_ms']:.1f} ms "
              f"({r['speedup']:.2f}x)", flush=True)
    return results


DECODE_BATCHES = ((8, 1024), (32, 1024), (64, 512), (128, 300))


def _time_decode_batches(path: str, setting: str) -> dict[str, float]:
    """In a fresh process (what glibc's allocator maps anew depends on what the process did
    before): each decode batch's step time, milliseconds."""
    from hydrad import LLM
    from hydrad.engine.profiler import EngineTimer, Probe
    from hydrad.models.attention import sdpa

    if setting == "fresh":  # the earlier code: one group, gathered into new memory every layer
        sdpa.CPU_GATHER_BYTES = 1 << 62
        sdpa.SdpaBackend._gather_buffer_for = lambda self, elements, dtype: None
    llm = LLM(path)
    try:
        timer = EngineTimer(llm.engine, repeats=9)
        return {f"{n} decodes at {context}": 1e3 * timer(Probe(decodes=(context,) * n))
                for n, context in DECODE_BATCHES}
    finally:
        llm.shutdown()


def bench_decode_groups(path: str) -> dict:
    import multiprocessing

    results: dict = {}
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        for setting in ("fresh", "kept", "fresh", "kept"):  # alternated, the better of two each
            for name, ms in pool.apply(_time_decode_batches, (path, setting)).items():
                row = results.setdefault(name, {})
                row[f"{setting}_ms"] = min(ms, row.get(f"{setting}_ms", ms))
    for name, r in results.items():
        r["speedup"] = r["fresh_ms"] / r["kept_ms"]
        print(f"  step, {name}: fresh gather {r['fresh_ms']:.1f} ms, kept buffer in groups {r['kept_ms']:.1f} ms "
              f"({r['speedup']:.2f}x)", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the built-in small LLaVA)")
    parser.add_argument("--out", help="JSON results")
    args = parser.parse_args()

    from hydrad.models.linear import packing_supported
    from hydrad.models.loader import load_config

    if not packing_supported("cpu", torch.float32):
        raise SystemExit("this torch has no oneDNN (or HYDRAD_CPU_PACKED_LINEAR=0): nothing to compare")
    path = model_dir(args.model)
    text_config = load_config(path).text_config
    print(f"linear layers of {path} ({torch.get_num_threads()} threads):", flush=True)
    linears = bench_linears(text_config)
    print("KV gather:", flush=True)
    gather = bench_gather(text_config)
    print("engine steps (median of the latency model's probe runs):", flush=True)
    steps = bench_steps(path)
    print("decode steps of large batches (median of the latency model's probe runs):", flush=True)
    decode_groups = bench_decode_groups(path)
    write_json(args.out, {"machine": machine(), "model": path, "linears": linears, "gather": gather,
                          "steps": steps, "decode_groups": decode_groups})


if __name__ == "__main__":
    main()
