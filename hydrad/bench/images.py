"""Synthetic photo-like images and data URLs for image inputs.

A vision encoder's cost depends on the image size, not its content, but a blank
image compresses to almost nothing and can hit fast paths in decoders and image
caches. These images have smooth gradients, overlapping shapes and grain, so they
encode to JPEG sizes close to real photographs of the same resolution.
"""

from __future__ import annotations

import base64
import io
import mimetypes
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from hydrad.errors import ConfigError

IMAGE_FORMATS = ("jpeg", "png")

# Low-resolution fields upscaled with bilinear filtering: smooth like a photo's
# lighting and grain, and ~10x cheaper than drawing at full resolution.
_FIELD_DOWNSCALE = 8
_GRAIN_DOWNSCALE = 2
_GRAIN_WEIGHT = 0.12
_NUM_SHAPES = 12


def synth_image(width: int, height: int, seed: int) -> Image.Image:
    """A deterministic RGB image of the given size for ``seed``."""
    rng = np.random.default_rng(seed)
    fw, fh = max(2, width // _FIELD_DOWNSCALE), max(2, height // _FIELD_DOWNSCALE)
    ys = np.linspace(0.0, 1.0, fh, dtype=np.float32)[:, None, None]
    xs = np.linspace(0.0, 1.0, fw, dtype=np.float32)[None, :, None]
    top, bottom, side = rng.uniform(0, 255, (3, 3)).astype(np.float32)
    field = top * (1 - ys) + bottom * ys + (side - top) * 0.3 * xs  # [fh, fw, 3]
    image = Image.fromarray(field.clip(0, 255).astype(np.uint8)).resize((width, height), Image.BILINEAR)

    draw = ImageDraw.Draw(image)
    short = min(width, height)
    for _ in range(_NUM_SHAPES):
        x0, y0 = rng.uniform(-0.1 * width, width), rng.uniform(-0.1 * height, height)
        w, h = rng.uniform(0.05, 0.4, 2) * short
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse([x0, y0, x0 + w, y0 + h], fill=color)
        else:
            draw.rectangle([x0, y0, x0 + w, y0 + h], fill=color)

    gw, gh = max(1, width // _GRAIN_DOWNSCALE), max(1, height // _GRAIN_DOWNSCALE)
    grain = rng.integers(0, 256, (gh, gw), dtype=np.uint8)
    grain_image = Image.fromarray(grain).resize((width, height), Image.BILINEAR).convert("RGB")
    return Image.blend(image, grain_image, _GRAIN_WEIGHT)


def image_data_url(image: Image.Image, fmt: str) -> str:
    if fmt not in IMAGE_FORMATS:
        raise ConfigError(f"image format must be one of {', '.join(IMAGE_FORMATS)}, got {fmt!r}")
    buf = io.BytesIO()
    if fmt == "jpeg":
        image.save(buf, "JPEG", quality=85)
    else:
        image.save(buf, "PNG")
    return f"data:image/{fmt};base64,{base64.b64encode(buf.getvalue()).decode('ascii')}"


def file_data_url(path: str | Path, kind: str = "image") -> str:
    """The file's bytes as a data URL, so the server needs no access to the client's disk;
    ``kind``: "image" or "video", what its name must say it holds."""
    path = Path(path)
    mime, _ = mimetypes.guess_type(path.name)
    if mime is None or not mime.startswith(kind + "/"):
        article, examples = ("an", ".jpg, .png") if kind == "image" else ("a", ".mp4, .webm")
        raise ConfigError(f"{path}: not {article} {kind} file name (expected {examples}, ...)")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {kind} {path}: {e.strerror}") from None
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
