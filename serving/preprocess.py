"""Decode and resize one image: the single implementation shared by training, evaluation and the runner.

Everything after this step (uint8 -> float, normalization, layout) lives inside the exported ONNX
graph, so an image file gets the same score in PyTorch, in ONNX and in the runner as long as all of
them call ``load_image`` with the model card's ``input`` settings.
"""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

# Refuse images above this many pixels before decoding them (a "decompression bomb" is a small file
# that expands to gigabytes). 40 MP covers any line camera; callers may pass their own limit.
DEFAULT_MAX_PIXELS = 40_000_000

# Peak memory of one decode, bytes per declared pixel: the RSS high-water mark over decoding a 10 MP image,
# measured, rounded up. Pillow holds 1-4 bytes a pixel, and ``np.asarray`` goes through ``tobytes``, which
# joins chunks (twice the array for a moment): 10 for RGB, L, P and 16-bit; 12 for float and CMYK; 14 with
# transparency. WebP and AVIF decoders keep their own buffer (18-20), openjpeg (JPEG 2000) its int32 planes
# (31). Callers size memory pools by it (``decode_bytes_per_pixel``).
DECODE_BYTES_PER_PIXEL = 16
DECODE_BYTES_PER_PIXEL_BY_FORMAT = {"WEBP": 20, "AVIF": 20, "JPEG2000": 32}

# An encoded file larger than this many bytes per allowed pixel is refused before it is read: no format
# this project reads needs more (float RGBA is 16), and a 10 GB "image" must not be read into memory.
MAX_FILE_BYTES_PER_PIXEL = 16

# Pillow can open EPS files but decodes them by running Ghostscript, an external program whose time and
# memory nothing here bounds: refused by name.
REFUSED_FORMATS = {"EPS": "EPS is decoded by running Ghostscript, an external program: not accepted"}

# Rows of a 16-bit or float image stretched to 8 bits at a time (float64 rows: about 8 MB per block).
STRETCH_BLOCK_PIXELS = 1 << 20


class ImageDecodeError(ValueError):
    """The file is not an image this project can read; the message says why."""


class ImageTooLarge(ImageDecodeError):
    """The image's declared size (or the work it implies) is over a limit; refused before decoding."""


SizeCheck = Callable[[int, int], None]  # (width, height) as declared -> None, or raise ImageTooLarge


def _stretch_to_uint8(img: Image.Image) -> Image.Image:
    """16-bit and float images: stretch the actual range to 8 bits rather than clip at 255.

    Row blocks of float64 (the same arithmetic as one whole-image float64 array, so the same pixels),
    not a float64 copy of the whole image (8 bytes a pixel more at the peak)."""
    arr = np.asarray(img)
    lo, hi = (float(arr.min()), float(arr.max())) if arr.size else (0.0, 0.0)
    out = np.zeros(arr.shape, np.uint8)
    if hi > lo:
        rows = max(1, STRETCH_BLOCK_PIXELS // max(1, arr.shape[1]))
        for top in range(0, arr.shape[0], rows):
            block = arr[top : top + rows].astype(np.float64)
            block -= lo
            block *= 255.0 / (hi - lo)
            out[top : top + rows] = block.round()
    return Image.fromarray(out, mode="L")


def read_image_file(path: str | Path, max_pixels: int = DEFAULT_MAX_PIXELS) -> bytes:
    """The bytes of a regular file, refused without reading when it is not one (a FIFO would block, a
    folder or device is no image) or larger than ``MAX_FILE_BYTES_PER_PIXEL`` x ``max_pixels``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ImageDecodeError(f"{path}: cannot open ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageDecodeError(f"{path}: not a regular file")
        limit = MAX_FILE_BYTES_PER_PIXEL * max_pixels + (1 << 20)
        if st.st_size > limit:
            raise ImageTooLarge(f"{path}: {st.st_size} bytes exceeds the limit of {limit} bytes for an image file")
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise ImageDecodeError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(data) > limit:  # it grew after the size check
        raise ImageTooLarge(f"{path}: more than {limit} bytes, the limit for an image file")
    return data


def _open_checked(data: bytes, name: str, max_pixels: int, check_size: SizeCheck | None) -> Image.Image:
    """Open from the header only (Pillow's ``Image.open`` is lazy) and check the declared size."""
    img = Image.open(io.BytesIO(data))
    if img.format in REFUSED_FORMATS:
        raise ImageDecodeError(f"{name}: {REFUSED_FORMATS[img.format]}")
    w, h = img.size
    if w * h > max_pixels:
        raise ImageTooLarge(f"{name}: {w}x{h} = {w * h} pixels exceeds the limit of {max_pixels} pixels (not decoded)")
    if check_size is not None:
        check_size(w, h)
    return img


def _reason(name: str, exc: BaseException, max_pixels: int) -> ImageDecodeError:
    """Any exception a decoder raised, as the ImageDecodeError that names it (type and message kept)."""
    if isinstance(exc, ImageDecodeError):
        return exc
    if isinstance(exc, Image.DecompressionBombError):  # Pillow's own guard fired first, at open
        return ImageTooLarge(
            f"{name}: declared size exceeds the limit of {max_pixels} pixels, refused before decoding ({exc})"
        )
    if isinstance(exc, UnidentifiedImageError):
        return ImageDecodeError(f"{name}: not a recognised image format")
    if isinstance(exc, MemoryError):
        return ImageTooLarge(f"{name}: decoding needs more memory than this process may use (MemoryError)")
    if isinstance(exc, OSError | SyntaxError | ValueError):
        return ImageDecodeError(f"{name}: cannot decode ({exc})")
    return ImageDecodeError(f"{name}: cannot decode ({type(exc).__name__}: {exc})")


def probe_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int, str]:
    """(width, height, format) as the header declares them, nothing decoded: what budgets are checked on.

    Raises ImageDecodeError (ImageTooLarge above ``max_pixels``) as ``decode_image`` would."""
    if not data:
        raise ImageDecodeError("<bytes>: empty file (0 bytes)")
    try:
        with _open_checked(data, "<bytes>", max_pixels, None) as img:
            return img.size[0], img.size[1], img.format or ""
    except Exception as exc:  # noqa: BLE001 (every decoder failure is this image's error, never the caller's)
        raise _reason("<bytes>", exc, max_pixels) from None


def decode_image(
    source: str | Path | bytes,
    channels: int,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    draft_size: int | None = None,
    check_size: SizeCheck | None = None,
) -> np.ndarray:
    """Read an image file (or its bytes) fully, EXIF orientation applied.

    Returns a uint8 array of shape (H, W, channels). ``draft_size`` lets the JPEG decoder skip work by
    decoding at 1/2, 1/4 or 1/8 scale while keeping both sides >= draft_size (much faster for large
    photos, and identical everywhere because every caller goes through this function). ``check_size``
    sees the declared (width, height) before anything is decoded (a caller's own budget, e.g. tiles).
    Raises ImageDecodeError naming the problem (empty, not an image, truncated, too large, or any other
    exception of the decoder, its type and message kept): one bad file is that file's error, whatever
    Pillow raised. ImageTooLarge is the subclass for limits.
    """
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    name = "<bytes>" if isinstance(source, bytes) else str(source)
    data = source if isinstance(source, bytes) else read_image_file(source, max_pixels)
    if not data:
        raise ImageDecodeError(f"{name}: empty file (0 bytes)")
    try:
        arr = _decode(_open_checked(data, name, max_pixels, check_size), channels, draft_size)
    except Exception as exc:  # noqa: BLE001 (every decoder failure is this image's error, never the caller's)
        raise _reason(name, exc, max_pixels) from None
    return arr.reshape(arr.shape[0], arr.shape[1], channels)


def _decode(img: Image.Image, channels: int, draft_size: int | None) -> np.ndarray:
    """An opened (not yet decoded) image -> (H, W) or (H, W, C) uint8, any Pillow mode (L, RGB, RGBA, P,
    CMYK, I;16, I, F, ...) converted to 'L' or 'RGB'. The caller passes its only reference and each step
    rebinds ``img``, so an intermediate is freed as soon as the next exists (``DECODE_BYTES_PER_PIXEL``)."""
    if draft_size and img.format == "JPEG":
        img.draft("L" if channels == 1 else "RGB", (draft_size, draft_size))
    img.load()  # full decode now: a truncated file fails here, not later
    ImageOps.exif_transpose(img, in_place=True)
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        img = _stretch_to_uint8(img)
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        # Composite transparent pixels over black so they do not carry random colour values.
        img = img.convert("RGBA")
        background = Image.new("RGBA", img.size, (0, 0, 0, 255))
        background.alpha_composite(img)
        img = background
    target = "L" if channels == 1 else "RGB"
    if img.mode != target:
        img = img.convert(target)
    return np.asarray(img, dtype=np.uint8)


def resize_bilinear(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """(H, W, C) uint8 resized to (height, width, C) uint8, bilinear (PIL; a downscale averages over the
    source pixels it covers): the one resampling of the pipeline's images."""
    c = img.shape[2]
    pil = Image.fromarray(img[:, :, 0] if c == 1 else img)
    return np.asarray(pil.resize((width, height), Image.Resampling.BILINEAR), dtype=np.uint8).reshape(height, width, c)


def channel_mean(img: np.ndarray) -> np.ndarray:
    """(H, W, C) uint8 -> (C,) float64 mean of each channel: ``img.reshape(-1, C).mean(axis=0)``, the same
    values (integer sums below 2**53 are exact in any order), 15x faster on large photographs (numpy's
    reduction over a 3-wide axis is slow): rows of C x 4096 bytes are summed as contiguous blocks."""
    c = img.shape[2]
    flat = img.reshape(-1)
    width = c * 4096
    n = len(flat) // width * width
    total = flat[:n].reshape(-1, width).sum(axis=0, dtype=np.uint64).reshape(-1, c).sum(axis=0)
    total += flat[n:].reshape(-1, c).sum(axis=0, dtype=np.uint64)
    return total / (img.shape[0] * img.shape[1])


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
    pad = channel_mean(img).round().astype(np.uint8) if fill is None else np.uint8(fill)
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


def decode_bytes_per_pixel(image_format: str) -> int:
    """Peak decode memory per declared pixel for an image of this format (``probe_image``'s third value)."""
    return DECODE_BYTES_PER_PIXEL_BY_FORMAT.get(image_format, DECODE_BYTES_PER_PIXEL)
