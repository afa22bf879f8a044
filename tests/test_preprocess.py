"""The one decode+resize function: every image mode becomes (S, S, C) uint8; bad files say why."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from serving.preprocess import ImageDecodeError, decode_image, load_image, resize_image


def encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA", "P", "CMYK", "I;16", "LA"])
@pytest.mark.parametrize("channels", [1, 3])
def test_every_mode_becomes_uint8_hwc(mode, channels):
    img = Image.new(mode, (50, 30))
    fmt = "TIFF" if mode == "CMYK" else "PNG"
    arr = decode_image(encode(img, fmt), channels)
    assert arr.dtype == np.uint8 and arr.shape == (30, 50, channels)


def test_16_bit_range_is_stretched_not_clipped():
    ramp = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000).astype(np.uint16)
    arr = decode_image(encode(Image.fromarray(ramp)), 1)
    assert arr.min() == 0 and arr.max() == 255


def test_exif_orientation_is_applied():
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    arr = decode_image(encode(img, "JPEG", exif=exif), 3)
    assert arr.shape == (40, 20, 3)


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "empty file"),
        (b"this is not an image", "not a recognised image format"),
        (b"<html><body>502 Bad Gateway</body></html>", "not a recognised image format"),
    ],
)
def test_unreadable_bytes_say_why(data, reason):
    with pytest.raises(ImageDecodeError, match=reason):
        decode_image(data, 3)


def test_truncated_jpeg_fails_at_decode():
    full = encode(Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)), "JPEG")
    with pytest.raises(ImageDecodeError, match="cannot decode"):
        decode_image(full[: len(full) // 2], 3)


def test_decompression_bomb_is_refused_before_decoding():
    big = encode(Image.new("L", (4000, 3000)))
    with pytest.raises(ImageDecodeError, match="exceeds the limit"):
        decode_image(big, 1, max_pixels=1_000_000)


def test_letterbox_keeps_aspect_and_squash_fills():
    img = np.zeros((50, 200, 1), np.uint8)
    img[20:30, :, 0] = 255  # a horizontal bright band across the whole width
    lb = resize_image(img, 64, "letterbox")
    sq = resize_image(img, 64, "squash")
    assert lb.shape == sq.shape == (64, 64, 1)
    band_rows_lb = np.nonzero(lb[:, 32, 0] > 128)[0]
    band_rows_sq = np.nonzero(sq[:, 32, 0] > 128)[0]
    assert len(band_rows_lb) < len(band_rows_sq)  # squash stretches the band 4x taller than letterbox


def test_load_image_is_deterministic(tmp_path):
    path = tmp_path / "a.jpg"
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (300, 500, 3), np.uint8)).save(path)
    a, b = load_image(path, 96, 3, "letterbox"), load_image(path.read_bytes(), 96, 3, "letterbox")
    assert a.shape == (96, 96, 3) and np.array_equal(a, b)
