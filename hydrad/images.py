"""Image inputs: ``data:`` URLs and PIL images, checked before anything is decoded in full.

The pixel limit is checked on the header, before the pixels are decoded, so a
small file that claims a huge size (a decompression bomb) costs nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings

from PIL import Image, UnidentifiedImageError

from hydrad.errors import RequestError

SUPPORTED_FORMATS = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}
_MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"}


def open_image_bytes(data: bytes, *, max_pixels: int, param: str = "messages") -> Image.Image:
    """Decode PNG / JPEG / WebP / GIF (first frame) bytes into an RGB image."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format not in SUPPORTED_FORMATS:
                raise RequestError(
                    f"unsupported image format {image.format or 'unknown'!s}; use png, jpeg, webp or gif",
                    param=param,
                )
            check_image_size(image, max_pixels=max_pixels, param=param)
            image.seek(0)
            image.load()
    except RequestError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise RequestError(f"could not decode the image: {e}", param=param) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise RequestError(f"could not decode the image: {e}", param=param) from None
    return image.convert("RGB")


def check_image_size(image: Image.Image, *, max_pixels: int, param: str = "messages") -> None:
    width, height = image.size
    if width < 1 or height < 1:
        raise RequestError("the image is empty", param=param)
    if width * height > max_pixels:
        raise RequestError(
            f"the image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}", param=param
        )


def decode_data_url(url: str, *, max_pixels: int, param: str = "messages") -> Image.Image:
    """``data:image/png;base64,...`` → RGB image. RequestError for anything else."""
    if not url.startswith("data:"):
        raise RequestError("only data: image URLs are accepted here", param=param)
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise RequestError("malformed data: URL (no comma)", param=param)
    parts = header.split(";")
    media_type = parts[0].strip().lower()
    if "base64" not in parts[1:]:
        raise RequestError("data: image URLs must be base64-encoded", param=param)
    if media_type and media_type not in _MEDIA_TYPES:
        raise RequestError(f"unsupported image media type {media_type!r}; use png, jpeg, webp or gif", param=param)
    try:
        data = base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("invalid base64 in the image data URL", param=param) from None
    if not data:
        raise RequestError("the image data URL is empty", param=param)
    return open_image_bytes(data, max_pixels=max_pixels, param=param)
