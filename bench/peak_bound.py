"""How far the closed-loop peak of a model can go on this machine's cores: the best of the
step shapes a server could run.

Every server of the peak workload (one 640x480 JPEG and a 12-token prompt, 32 output tokens,
``C`` requests in flight) does this per request, on the same cores: prepare it (decode the
image, the image processor, the chat template and the tokenizer), encode its image, prefill
its prompt, and decode its 31 later tokens in batches of at most ``C``. Work batched in one
step costs less than apart (each step reads all the weights; a longer matrix runs the
kernels closer to their peak): two prompts prefilled in one step cost less than twice one,
and a full batch of decodes riding a prefill step costs little more than the prefills. So
this script times, on the engine's own runner with every core's threads (``EngineTimer``,
the latency model's probe timer: the median of repeated runs), steps of ``k`` images, of
``k`` prompts with ``C`` decodes riding them (k = 1 .. ``--max-batch``), and of ``C``
decodes alone, and the preparation's CPU time. A request's share of the machine is then,
for the best ``k``,

    min_k encode(k images) / k  +  min_k [ mixed(k prompts + C decodes) / k
                                           + max(0, 31 - C / k) * decode_step(C) / C ]
    + prepare / cores

(in a steady state each prefill step carries C decode tokens, the rest of a request's 31
decodes go in full decode-only steps). Its inverse, in requests per second, is what no
server reaches with these step shapes: it counts no scheduling, no copies, no HTTP, no load
generator, and every batch full. A server could beat it only with shapes it does not time
(more than ``--max-batch`` prompts in a step). A measured peak is then put against it
(``--peaks NAME=REQ_PER_S ...``, from a ``bench/vs_vllm.py`` run on the same machine at the
same time). ``unbatched_req_per_s`` in the JSON is the same sum with one prompt and one image
per step (this script's bound before it timed batches).

    python bench/peak_bound.py --in-flight 16 --peaks vllm=6.39 hydrad-1EP+1D=6.05 --out peak_bound.json
"""

from __future__ import annotations

import argparse
import base64
import io
import time

from common import machine, model_dir, photo_like, write_json


def prepare_seconds(model: str, prompt_words: int = 12) -> tuple[float, int, int, int]:
    """CPU seconds to turn one chat request (data-URL JPEG + prompt) into engine inputs, and
    its prompt tokens, image tokens and vision patches."""
    from hydrad.processor import InputProcessor

    processor = InputProcessor(model)
    buf = io.BytesIO()
    photo_like(640, 480, 1).save(buf, "JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": " ".join(["word"] * prompt_words)}]}]
    prompt = processor.process_chat(messages)

    def cpu() -> float:
        start = time.process_time()
        processor.process_chat(messages)
        return time.process_time() - start

    samples = sorted(cpu() for _ in range(31))
    return samples[len(samples) // 2], len(prompt.prompt_token_ids), prompt.images[0].length, prompt.images[0].num_patches


def model_seconds(model: str, prompt_tokens: int, image: tuple[int, int], in_flight: int, output_tokens: int,
                  max_batch: int, dtype: str = "auto") -> dict:
    """Seconds of each step shape: ``encode[k]`` (k images), ``prefill[k]`` (k prompts),
    ``mixed[k]`` (k prompts and ``in_flight`` decodes), ``decode_step`` (``in_flight`` decodes),
    for k = 1 .. ``max_batch``."""
    from hydrad import LLM
    from hydrad.engine.profiler import EngineTimer, Probe

    llm = LLM(model, dtype=dtype)
    try:
        timer = EngineTimer(llm.engine, repeats=15)
        decodes = (prompt_tokens + output_tokens // 2,) * in_flight  # a decode's mean context over its life
        ks = range(1, max_batch + 1)
        return {
            "encode": {k: timer(Probe(images=(image,) * k)) for k in ks},
            "prefill": {k: timer(Probe(prefills=((0, prompt_tokens),) * k)) for k in ks},
            "mixed": {k: timer(Probe(prefills=((0, prompt_tokens),) * k, decodes=decodes)) for k in ks},
            "decode_step": timer(Probe(decodes=decodes)),
        }
    finally:
        llm.shutdown()


def per_request(parts: dict, in_flight: int, output_tokens: int, prepare_share: float) -> dict:
    """A request's share of the machine (seconds) over the best step shapes, and its parts."""
    decode_token = parts["decode_step"] / in_flight
    later = output_tokens - 1

    def language(k: int) -> float:
        return parts["mixed"][k] / k + max(0.0, later - in_flight / k) * decode_token

    encode_k = min(parts["encode"], key=lambda k: parts["encode"][k] / k)
    language_k = min(parts["mixed"], key=language)
    unbatched = parts["encode"][1] + parts["prefill"][1] + later * decode_token + prepare_share
    best = parts["encode"][encode_k] / encode_k + language(language_k) + prepare_share
    return {"seconds": best, "encode_batch": encode_k, "language_batch": language_k,
            "encode_s": parts["encode"][encode_k] / encode_k, "language_s": language(language_k),
            "unbatched_seconds": unbatched}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the built-in small LLaVA)")
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=4, help="most prompts (and images) in one timed step")
    parser.add_argument("--peaks", nargs="*", default=[], help="NAME=REQ_PER_S measured peaks to put against the bound")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="the dtype the model's steps are timed in (auto: the device's default)")
    parser.add_argument("--prepare-only", action="store_true",
                        help="time only the preparation of a request (the daemon's CPU), not the model's steps")
    parser.add_argument("--out", help="JSON results")
    args = parser.parse_args()

    import torch

    model = model_dir(args.model)
    from hydrad.engine.cores import usable_cpus

    cores = usable_cpus()
    torch.set_num_threads(cores)
    print(f"preparing a request ({model})", flush=True)
    prepare, prompt_tokens, image_tokens, patches = prepare_seconds(model)
    print(f"  {1e3 * prepare:.1f} ms of CPU; {prompt_tokens} prompt tokens, {image_tokens} image tokens", flush=True)
    if args.prepare_only:
        write_json(args.out, {"machine": machine(), "prompt_tokens": prompt_tokens, "image_tokens": image_tokens,
                              "prepare_cpu_s": prepare})
        return
    print(f"timing the model ({args.dtype}) on {cores} threads, steps of 1-{args.max_batch} prompts and images",
          flush=True)
    parts = model_seconds(model, prompt_tokens, (patches, image_tokens), args.in_flight, args.output_tokens,
                          args.max_batch, args.dtype)
    for k in range(1, args.max_batch + 1):
        print(f"  {k} image(s): {1e3 * parts['encode'][k]:.1f} ms; {k} prompt(s): {1e3 * parts['prefill'][k]:.1f} ms, "
              f"with {args.in_flight} decodes: {1e3 * parts['mixed'][k]:.1f} ms", flush=True)
    print(f"  {args.in_flight} decodes: {1e3 * parts['decode_step']:.1f} ms", flush=True)
    share = per_request(parts, args.in_flight, args.output_tokens, prepare / cores)
    bound, unbatched = 1.0 / share["seconds"], 1.0 / share["unbatched_seconds"]
    print(f"per request: encode {1e3 * share['encode_s']:.1f} ms (images {share['encode_batch']} a step), prefill "
          f"and {args.output_tokens - 1} decodes {1e3 * share['language_s']:.1f} ms (prompts "
          f"{share['language_batch']} a step), preparing {1e3 * prepare / cores:.1f} ms on 1 of {cores} cores")
    print(f"bound: {bound:.2f} req/s ({1e3 * share['seconds']:.1f} ms of the machine per request; one prompt and "
          f"one image a step: {unbatched:.2f} req/s)")
    peaks = {}
    for item in args.peaks:
        name, _, value = item.partition("=")
        peaks[name] = {"req_per_s": float(value), "share_of_bound": float(value) / bound}
        print(f"  {name}: {float(value):.2f} req/s, {100 * float(value) / bound:.0f}% of the bound")
    write_json(args.out, {"machine": machine(), "dtype": args.dtype, "in_flight": args.in_flight, "output_tokens": args.output_tokens,
                          "prompt_tokens": prompt_tokens, "image_tokens": image_tokens, "prepare_cpu_s": prepare,
                          **parts, **share, "bound_req_per_s": bound, "unbatched_req_per_s": unbatched,
                          "peaks": peaks})

if __name__ == "__main__":
    main()
