"""An upper bound on the closed-loop peak of any server of a model on this machine's cores.

Every server of the peak workload (one 640x480 JPEG and a 12-token prompt, 32 output tokens,
``C`` requests in flight) does at least this per request, on the same cores: prepare it (decode
the image, the image processor, the chat template and the tokenizer), encode its image,
prefill its prompt, and decode its 31 later tokens in batches of at most ``C``. This script
times the model's parts on the engine's own runner with every core's threads (``EngineTimer``,
the latency model's probe timer: the median of repeated runs) and the preparation's CPU time,
and reports the inverse of

    encode + prefill + 31 * decode_step(C decodes) / C + prepare / cores

as requests per second (the preparation takes one core's time, a share of the machine's).
Nothing a server does can go faster than this on these cores: it counts no scheduling, no
copies, no HTTP, no load generator, and the decodes always in full batches. A measured peak is then put against it (``--peaks NAME=REQ_PER_S ...``, from a
``bench/vs_vllm.py`` run on the same machine at the same time).

    python bench/peak_bound.py --in-flight 16 --peaks vllm=6.39 hydrad-1EP+1D=6.05 --out peak_bound.json
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import time

from common import machine, median_seconds, model_dir, photo_like, write_json


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


def model_seconds(model: str, prompt_tokens: int, image: tuple[int, int], in_flight: int, output_tokens: int) -> dict:
    from hydrad import LLM
    from hydrad.engine.profiler import EngineTimer, Probe

    llm = LLM(model)
    try:
        timer = EngineTimer(llm.engine, repeats=15)
        context = prompt_tokens + output_tokens // 2  # a decode's mean context over its life
        return {
            "encode_s": timer(Probe(images=(image,))),
            "prefill_s": timer(Probe(prefills=((0, prompt_tokens),))),
            "decode_step_s": timer(Probe(decodes=(context,) * in_flight)),
        }
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the built-in small LLaVA)")
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--peaks", nargs="*", default=[], help="NAME=REQ_PER_S measured peaks to put against the bound")
    parser.add_argument("--out", help="JSON results")
    args = parser.parse_args()

    import torch

    model = model_dir(args.model)
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    print(f"preparing a request ({model})", flush=True)
    prepare, prompt_tokens, image_tokens, patches = prepare_seconds(model)
    print(f"  {1e3 * prepare:.1f} ms of CPU; {prompt_tokens} prompt tokens, {image_tokens} image tokens", flush=True)
    print(f"timing the model on {cores} threads", flush=True)
    parts = model_seconds(model, prompt_tokens, (patches, image_tokens), args.in_flight, args.output_tokens)
    decodes = (args.output_tokens - 1) * parts["decode_step_s"] / args.in_flight
    per_request = parts["encode_s"] + parts["prefill_s"] + decodes + prepare / cores
    bound = 1.0 / per_request
    for name, seconds in (("encode", parts["encode_s"]), ("prefill", parts["prefill_s"]),
                          (f"{args.output_tokens - 1} decodes in batches of {args.in_flight}", decodes),
                          (f"preparing, on 1 of {cores} cores", prepare / cores)):
        print(f"  {name}: {1e3 * seconds:.1f} ms", flush=True)
    print(f"bound: {bound:.2f} req/s ({1e3 * per_request:.1f} ms of the machine per request)")
    peaks = {}
    for item in args.peaks:
        name, _, value = item.partition("=")
        peaks[name] = {"req_per_s": float(value), "share_of_bound": float(value) / bound}
        print(f"  {name}: {float(value):.2f} req/s, {100 * float(value) / bound:.0f}% of the bound")
    write_json(args.out, {"machine": machine(), "in_flight": args.in_flight, "output_tokens": args.output_tokens,
                          "prompt_tokens": prompt_tokens, "image_tokens": image_tokens, "prepare_cpu_s": prepare,
                          **parts, "per_request_s": per_request, "bound_req_per_s": bound, "peaks": peaks})


if __name__ == "__main__":
    main()
