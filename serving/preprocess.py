"""Decode and resize one image: the single implementation shared by training, evaluation and the runner.

Everything after this step (uint8 -> float, normalization, layout) lives inside the exported ONNX
graph, so an image file gets the same score in PyTorch, in ONNX and in the runner as long as all of
them call ``load_image`` with the model card's ``input`` settings.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

# Refuse images above this many pixels before decoding them (a "decompression bomb" is a small file
# that expands to gigabytes). 40 MP covers any line camera; callers may pass their own limit.
DEFAULT_MAX_PIXELS = 40_000_000


class ImageDecodeError(ValueError):
    """The file is not an image this project can read; the message says why."""


def _to_mode(img: Image.Image, channels: int) -> Image.Image:
    """Convert any Pillow mode (L, RGB, RGBA, P, CMYK, I;16, I, F, ...) to 'L' or 'RGB'."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        # 16-bit and float images: stretch the actual range to 8 bits rather than clip at 255.
        arr = np.asarray(img, dtype=np.float64)
        lo, hi = float(arr.min()), float(arr.max())
        arr = (arr - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(arr)
        img = Image.fromarray(arr.round().astype(np.uint8), mode="L")
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        # Composite transparent pixels over black so they do not carry random colour values.
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (0, 0, 0, 255))
        img = Image.alpha_composite(background, rgba)
    target = "L" if channels == 1 else "RGB"
    return img if img.mode == target else img.convert(target)


def decode_image(
    source: str | Path | bytes,
    channels: int,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    draft_size: int | None = None,
) -> np.ndarray:
    """Read an image file (or its bytes) fully, EXIF orientation applied.

    Returns a uint8 array of shape (H, W, channels). ``draft_size`` lets the JPEG decoder skip work by
    decoding at 1/2, 1/4 or 1/8 scale while keeping both sides >= draft_size (much faster for large
    photos, and identical everywhere because every caller goes through this function).
    Raises ImageDecodeError naming the problem (empty, not an image, truncated, too large).
    """
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    name = "<bytes>" if isinstance(source, bytes) else str(source)
    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    if not data:
        raise ImageDecodeError(f"{name}: empty file (0 bytes)")
    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            if w * h > max_pixels:
                raise ImageDecodeError(
                    f"{name}: {w}x{h} = {w * h} pixels exceeds the limit of {max_pixels} pixels (not decoded)"
                )
            if draft_size and img.format == "JPEG":
                img.draft("L" if channels == 1 else "RGB", (draft_size, draft_size))
            img.load()  # full decode now: a truncated file fails here, not later
            img = ImageOps.exif_transpose(img)
            img = _to_mode(img, channels)
            arr = np.asarray(img, dtype=np.uint8)
    except ImageDecodeError:
        raise
    except Image.DecompressionBombError as exc:  # Pillow's own guard fired first, at open
        raise ImageDecodeError(
            f"{name}: declared size exceeds the limit of {max_pixels} pixels, refused before decoding ({exc})"
        ) from None
    except UnidentifiedImageError:
        raise ImageDecodeError(f"{name}: not a recognised image format") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageDecodeError(f"{name}: cannot decode ({exc})") from None
    return arr.reshape(arr.shape[0], arr.shape[1], channels)


def resize_bilinear(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """(H, W, C) uint8 resized to (height, width, C) uint8, bilinear (PIL; a downscale averages over the
    source pixels it covers): the one resampling of the pipeline's images."""
    c = img.shape[2]
    pil = Image.fromarray(img[:, :, 0] if c == 1 else img)
    return np.asarray(pil.resize((width, height), Image.Resampling.BILINEAR), dtype=np.uint8).reshape(height, width, c)


def resize_image(img: np.ndarray, size: int, mode: str, fill: int | None = None) -> np.ndarray:
    """Resize (H, W, C) uint8 to (size, size, C) uint8.

    ``squash`` stretches to a square. ``letterbox`` keeps the aspect ratio (thin defects in long images
    stay thin lines instead of being squeezed away) and pads the short side with the image's mean
    colour, so the padding adds no strong artificial edge; ``fill`` pads with that value instead (a
    defect mask: its padding is no defect, whatever share of the image the defect covers).
    """
    h, w, c = img.shape
    if mode not in ("letterbox", "squash"):
        raise ValueError(f"resize mode must be 'letterbox' or 'squash', got {mode!r}")
    if mode == "squash" or h == w:
        return resize_bilinear(img, size, size)
    scale = size / max(h, w)
    nw, nh = max(1, round(w * scale)), max(1, round(h * scale))
    small = resize_bilinear(img, nw, nh)
    pad = img.reshape(-1, c).mean(axis=0).round().astype(np.uint8) if fill is None else np.uint8(fill)
    out = np.empty((size, size, c), dtype=np.uint8)
    out[:] = pad
    top, left = (size - nh) // 2, (size - nw) // 2
    out[top : top + nh, left : left + nw] = small
    return out


def load_image(
    source: str | Path | bytes, size: int, channels: int, mode: str, max_pixels: int = DEFAULT_MAX_PIXELS
) -> np.ndarray:
    """Decode + resize: the model input for one image, (size, size, channels) uint8."""
    return resize_image(decode_image(source, channels, max_pixels, draft_size=size), size, mode)
