"""Shared pieces of the benchmark scripts: the model, synthetic conversations, reporting."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import numpy as np
from PIL import Image


def model_dir(path: str | None) -> str:
    """A model folder: the one given, else the built-in default model (built on first use)."""
    from hydrad.models.default import resolve_model_path

    return str(resolve_model_path(path))


def photo_like(width: int, height: int, seed: int) -> Image.Image:
    """Deterministic image with gradients, shapes and noise (not blank)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / max(1, width - 1), y / max(1, height - 1), (x + y) / max(1, width + height - 2)], -1)
    img = (base * rng.uniform(80, 255, 3)).astype(np.float32)
    for _ in range(6):
        cx, cy, r = rng.integers(0, width), rng.integers(0, height), rng.integers(5, max(6, min(width, height) // 3))
        img[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 12, img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def conversations(num: int, seed: int = 0, image_fraction: float = 1.0) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    convs = []
    for i in range(num):
        text = "Describe this picture in detail, please." if i % 2 else "What is shown here?"
        if rng.random() < image_fraction:
            image = photo_like(int(rng.integers(200, 800)), int(rng.integers(200, 600)), seed * 1000 + i)
            content = [{"type": "image", "image": image}, {"type": "text", "text": text}]
        else:
            content = text + " " + "Tell me more. " * int(rng.integers(1, 20))
        convs.append([{"role": "user", "content": content}])
    return convs


def machine() -> dict:
    import torch

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
    }


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2))
