"""Image inputs: ``data:`` URLs and PIL images, checked before anything is decoded in full.

Sizes come from the header, before the pixels are decoded, so a small file that
claims a huge size (a decompression bomb) costs nothing. ``peek_data_url`` reads
the header from the first few kilobytes of a data URL without decoding the rest
of its base64, so the daemon can weigh a request's images on its event loop
before any of them is decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from hydrad.errors import RequestError

SUPPORTED_FORMATS = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}
_MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"}
# Base64 characters of a data URL decoded to find the header: PNG, GIF and WebP headers
# sit in the first bytes; a JPEG's size follows its metadata segments, so the prefix
# grows until the header is found (rarely past the first step).
_PEEK_CHARS = (1 << 16, 1 << 20)
# "<_io.BytesIO object at 0x7f...>" in Pillow's messages means nothing to a client.
_OBJECT_REPR = re.compile(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>")


@dataclass(frozen=True)
class EncodedImage:
    """Image bytes whose header has been checked, decoded only when the request is processed."""

    data: bytes
    size: tuple[int, int]


def _open_header(data: bytes, *, max_pixels: int, param: str) -> Image.Image:
    """The image with its header read and checked (format, pixels); pixels not decoded."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        image = Image.open(io.BytesIO(data))
    if image.format not in SUPPORTED_FORMATS:
        raise RequestError(
            f"unsupported image format {image.format or 'unknown'!s}; use png, jpeg, webp or gif", param=param
        )
    check_image_size(image, max_pixels=max_pixels, param=param)
    return image


def _decode_error(e: Exception, param: str) -> RequestError:
    if isinstance(e, UnidentifiedImageError):
        message = "the data is not a png, jpeg, webp or gif image, or it is truncated"
    elif "truncated" in str(e).lower():
        message = "the image data is truncated"
    else:
        message = _OBJECT_REPR.sub("", str(e)) or type(e).__name__
    return RequestError(f"could not decode the image: {message}", param=param)


_DECODE_ERRORS = (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning, OSError,
                  ValueError, SyntaxError, EOFError)


def open_image_bytes(data: bytes, *, max_pixels: int, param: str = "messages") -> Image.Image:
    """Decode PNG / JPEG / WebP / GIF (first frame) bytes into an RGB image."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = _open_header(data, max_pixels=max_pixels, param=param)
            image.seek(0)
            image.load()
    except RequestError:
        raise
    except _DECODE_ERRORS as e:
        raise _decode_error(e, param) from None
    # An RGB image is returned as decoded: converting would copy every pixel for nothing.
    return image if image.mode == "RGB" else image.convert("RGB")


def peek_image_bytes(data: bytes, *, max_pixels: int, param: str = "messages") -> tuple[int, int]:
    """(width, height) from the header of image bytes, checked; nothing is decoded."""
    try:
        return _open_header(data, max_pixels=max_pixels, param=param).size
    except RequestError:
        raise
    except _DECODE_ERRORS as e:
        raise _decode_error(e, param) from None


def check_image_size(image: Image.Image, *, max_pixels: int, param: str = "messages") -> None:
    width, height = image.size
    if width < 1 or height < 1:
        raise RequestError("the image is empty", param=param)
    if width * height > max_pixels:
        raise RequestError(
            f"the image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}", param=param
        )


def _data_url_payload(url: str, param: str, *, kind: str = "image", media_types=_MEDIA_TYPES,
                      formats: str = "png, jpeg, webp or gif") -> str:
    """The base64 payload of a ``data:<kind>/...;base64,`` URL (checked, not decoded)."""
    if not url.startswith("data:"):
        raise RequestError(f"only data: {kind} URLs are accepted here", param=param)
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise RequestError("malformed data: URL (no comma)", param=param)
    parts = header.split(";")
    media_type = parts[0].strip().lower()
    if "base64" not in parts[1:]:
        raise RequestError(f"data: {kind} URLs must be base64-encoded", param=param)
    if media_type and media_type not in media_types:
        raise RequestError(f"unsupported {kind} media type {media_type!r}; use {formats}", param=param)
    payload = payload.strip()
    if not payload:
        raise RequestError(f"the {kind} data URL is empty", param=param)
    return payload


def _b64decode(payload: str, param: str, kind: str = "image") -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"invalid base64 in the {kind} data URL", param=param) from None


def data_url_bytes(url: str, param: str = "messages", *, kind: str = "image", media_types=_MEDIA_TYPES,
                   formats: str = "png, jpeg, webp or gif") -> bytes:
    """The image file a ``data:image/png;base64,...`` URL holds (or, with ``kind`` and its media
    types, another kind of file). RequestError for anything else."""
    payload = _data_url_payload(url, param, kind=kind, media_types=media_types, formats=formats)
    data = _b64decode(payload, param, kind)
    if not data:
        raise RequestError(f"the {kind} data URL is empty", param=param)
    return data


def decode_data_url(url: str, *, max_pixels: int, param: str = "messages") -> Image.Image:
    """``data:image/png;base64,...`` → RGB image. RequestError for anything else."""
    return open_image_bytes(data_url_bytes(url, param), max_pixels=max_pixels, param=param)


def peek_data_url(url: str, *, max_pixels: int, param: str = "messages") -> tuple[int, int]:
    """(width, height) of a data URL's image from its header, checked as ``decode_data_url``
    checks it, decoding only as much base64 as the header needs."""
    payload = _data_url_payload(url, param)
    for num_chars in _PEEK_CHARS:
        if num_chars >= len(payload):
            break
        prefix = _b64decode(payload[: num_chars - num_chars % 4], param)
        try:
            return _open_header(prefix, max_pixels=max_pixels, param=param).size
        except RequestError:
            raise
        except _DECODE_ERRORS:
            continue  # the header goes on past the prefix (or the image is bad: decided on all of it)
    return peek_image_bytes(_b64decode(payload, param), max_pixels=max_pixels, param=param)
