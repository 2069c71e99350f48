"""Image inputs: formats, base64, pixel limits (decompression bombs), one-line errors."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from hydrad.errors import RequestError
from hydrad.images import decode_data_url, peek_data_url


def _data_url(image: Image.Image, fmt: str, media: str | None = None, **save) -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return f"data:{media or 'image/' + fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_formats_decode_to_rgb(fmt):
    src = Image.new("RGB", (40, 30), (200, 10, 30))
    out = decode_data_url(_data_url(src, fmt), max_pixels=10_000)
    assert out.mode == "RGB" and out.size == (40, 30)
    r, g, b = out.getpixel((5, 5))
    assert r > 150 and g < 60 and b < 80


def test_gif_takes_the_first_frame():
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    url = "data:image/gif;base64," + base64.b64encode(buf.getvalue()).decode()
    out = decode_data_url(url, max_pixels=10_000)
    r, _, b = out.getpixel((3, 3))
    assert r > 200 and b < 50


@pytest.mark.parametrize(
    "url, message",
    [
        ("data:image/png;base64,@@@not base64@@@", "invalid base64"),
        ("data:image/png;base64," + base64.b64encode(b"hello, not an image").decode(), "could not decode"),
        ("data:image/png," + "abc", "base64-encoded"),
        ("data:image/tiff;base64,AAAA", "unsupported image media type"),
        ("data:image/png;base64", "malformed"),
        ("https://example.com/cat.png", "only data:"),
    ],
)
def test_bad_urls_raise_one_line_errors(url, message):
    with pytest.raises(RequestError, match=message) as e:
        decode_data_url(url, max_pixels=10_000)
    assert "\n" not in str(e.value)


def test_pixel_limit_is_checked_before_decoding():
    # A 4000x4000 PNG of one colour compresses to a few KB: a small bomb.
    url = _data_url(Image.new("RGB", (4000, 4000)), "PNG")
    assert len(url) < 200_000
    with pytest.raises(RequestError, match="16000000 pixels"):
        decode_data_url(url, max_pixels=1_000_000)


def test_unsupported_format_is_refused():
    url = _data_url(Image.new("RGB", (8, 8)), "BMP", media="image/png")
    with pytest.raises(RequestError, match="unsupported image format BMP"):
        decode_data_url(url, max_pixels=10_000)


def test_peek_reads_the_size_from_the_first_bytes_only():
    """The header comes from a prefix of the base64: what follows it is not even decoded
    (here it is not valid base64, which decoding the image would refuse)."""
    url = _data_url(Image.new("RGB", (6000, 4000)), "PNG")
    spoiled = url + "@" * 200_000
    assert peek_data_url(spoiled, max_pixels=40_000_000) == (6000, 4000)
    with pytest.raises(RequestError, match="invalid base64"):
        decode_data_url(spoiled, max_pixels=40_000_000)
    with pytest.raises(RequestError, match="24000000 pixels; the limit is 1000000"):
        peek_data_url(url, max_pixels=1_000_000)


def test_peek_finds_a_jpeg_size_behind_large_metadata():
    image = Image.new("RGB", (300, 200), (10, 200, 30))
    exif = Image.Exif()
    exif[0x010E] = "x" * 60_000  # ImageDescription: the size marker comes after it
    icc = bytes(200_000)  # an ICC profile in APP2 segments, far past the first prefix
    url = _data_url(image, "JPEG", exif=exif, icc_profile=icc)
    assert len(url) > 300_000
    assert peek_data_url(url, max_pixels=100_000) == (300, 200)
    assert decode_data_url(url, max_pixels=100_000).size == (300, 200)


@pytest.mark.parametrize("cut, message", [(6, "not a png, jpeg, webp or gif image, or it is truncated"),
                                          (200, "the image data is truncated")])
def test_a_truncated_image_says_so_in_plain_words(cut, message):
    buf = io.BytesIO()
    Image.effect_noise((64, 64), 50).convert("RGB").save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()[:cut]).decode()
    with pytest.raises(RequestError, match=message) as e:
        decode_data_url(url, max_pixels=10_000)
    assert "0x" not in str(e.value) and "BytesIO" not in str(e.value)


def test_an_rgb_image_is_not_copied_to_be_converted():
    out = decode_data_url(_data_url(Image.new("RGB", (8, 8), (1, 2, 3)), "PNG"), max_pixels=100)
    assert out.mode == "RGB" and out.format == "PNG"  # the decoded image itself
    grey = decode_data_url(_data_url(Image.new("L", (8, 8), 7), "PNG"), max_pixels=100)
    assert grey.mode == "RGB" and grey.getpixel((0, 0)) == (7, 7, 7)
