"""Videos' and images' encodes: what the instance's latency model predicts against what they take.

    PYTHONPATH=. python bench/encode_price.py --model <Qwen2-VL or Qwen2.5-VL checkpoint> \
        [--repeats 5] [--out encode_price.json]

One EPD instance in this process (the engine's default threads), its latency model read from
the cache or fitted as the daemon fits it (``hydrad.engine.profiler.fit_latency_model``).
Each input is processed as the daemon processes it (a video as frames at 2 a second, all
kept), then its encode alone (``encode_images``, the vision tower and merger) is timed
``--repeats`` times after a warm-up (median), and priced by the model: as one image of all
its patches (square term patches^2), by its attention span (patches * span), and as the
engine schedules it, by its groups (``ImageInput.groups``: a video's groups of frames each an
input; an image one). The groups are also timed encoded a group a call, as the scheduler may
spread them over steps, against the model's price for a step each. Inputs: photo-like frames
panning 4 pixels a frame, 8 and 16 frames at 320x240 and 8 at 640x480; images of 448x336,
640x480 and 1024x768.
"""

from __future__ import annotations

import argparse

import numpy as np
from common import machine, median_seconds, model_dir, photo_like, write_json
from rich.console import Console
from rich.table import Table

console = Console(width=200)  # fifteen columns
VIDEOS = ((8, 320, 240), (16, 320, 240), (8, 640, 480))  # frames, width, height
IMAGES = ((448, 336), (640, 480), (1024, 768))
PAN_PIXELS = 4


def frames(num: int, width: int, height: int) -> np.ndarray:
    base = np.asarray(photo_like(width, height, seed=num))
    return np.stack([np.roll(base, PAN_PIXELS * i, axis=1) for i in range(num)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint that takes videos (Qwen2-VL, Qwen2.5-VL)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()

    import torch

    from hydrad import LLM
    from hydrad.engine.profiler import fit_latency_model
    from hydrad.processor import InputProcessor

    path = model_dir(args.model)
    llm = LLM(path)
    engine = llm.engine
    model = fit_latency_model(engine)
    console.print(f"latency model: {model.summary()}", highlight=False)
    processor = InputProcessor(path)
    inputs = [(f"video, {n} frames {w}x{h}", {"type": "video", "video": frames(n, w, h), "fps": 2.0})
              for n, w, h in VIDEOS]
    inputs += [(f"image {w}x{h}", {"type": "image", "image": photo_like(w, h, seed=w)}) for w, h in IMAGES]
    rows = []
    table = Table(title="encode seconds: predicted as one image of all its patches, by attention span, by "
                        "groups, against measured; and a group a step")
    for column in ("input", "grid", "patches", "span", "whole", "by span", "by groups", "measured",
                   "whole / measured", "by span / measured", "by groups / measured", "groups",
                   "a group a step: predicted", "measured", "predicted / measured"):
        table.add_column(column)
    with torch.inference_mode():
        for name, part in inputs:
            prompt = processor.process_chat([{"role": "user", "content": [part, {"type": "text", "text": "What?"}]}])
            (item,) = prompt.images
            whole = model.v_fixed + model.image_seconds(item.num_patches, item.length)
            by_span = model.v_fixed + model.image_seconds(item.num_patches, item.length, item.attention_span)
            groups = item.groups()
            priced = [model.image_seconds(g.num_patches, g.length, g.attention_span) for g in groups]
            by_groups = model.v_fixed + sum(priced)
            apart = len(groups) * model.v_fixed + sum(priced)
            encode = engine.runner.model.encode_images
            measured = median_seconds(lambda: encode([item]), args.repeats)
            measured_apart = median_seconds(lambda: [encode([g]) for g in groups], args.repeats)
            span = item.attention_span or item.num_patches
            rows.append({"input": name, "grid_thw": item.grid_thw, "patches": item.num_patches, "span": span,
                         "groups": len(groups), "predicted_whole_s": whole, "predicted_by_span_s": by_span,
                         "predicted_by_groups_s": by_groups, "measured_s": measured,
                         "predicted_a_group_a_step_s": apart, "measured_a_group_a_call_s": measured_apart})
            table.add_row(name, str(item.grid_thw), str(item.num_patches), str(span), f"{whole:.3f}",
                          f"{by_span:.3f}", f"{by_groups:.3f}", f"{measured:.3f}", f"{whole / measured:.2f}",
                          f"{by_span / measured:.2f}", f"{by_groups / measured:.2f}", str(len(groups)),
                          f"{apart:.3f}", f"{measured_apart:.3f}", f"{apart / measured_apart:.2f}")
    llm.shutdown()
    console.print(table)
    write_json(args.out, {"model": path, "machine": machine(), "latency_model": model.summary(), "rows": rows})


if __name__ == "__main__":
    main()
