"""Deterministic synthetic industrial-surface images with defect masks.

The default data set of a fresh clone, built to exercise the real problem rather than a toy.

Surfaces (``TEXTURES``, chosen per image from its own generator, so every class shows every surface):
``brushed_metal`` (anisotropic streaks along a random direction, deeper grooves, glints, a specular band),
``woven_fabric`` (plain weave with jittered period, phase and orientation, uneven threads, knots) and
``stone_grain`` (multi-scale value noise, fine grain, speckles and pits). On top of every image: random
brightness (0.3-0.7) and texture amplitude, a linear lighting gradient or a radial vignette, gaussian noise,
and for RGB a mild per-family tint.

Defects (``DEFECT_CLASSES``) are geometric structures: ``scratch``, a thin (1.5-3 px at 128 px) straight or
slightly bent line, 25-80 % of the image long, mostly bright, fading along its length; ``spot``, a soft
irregular ellipse of radius 4-18 %, darker or lighter, sometimes a dried ring, which also hides the grain
beneath it; ``crack``, a dark jagged random walk (1.5-2 px, 20-60 % long) with 0-2 branches. Position,
orientation and size are random, and all stay inside a 4 px margin. Contrast is in units of the texture std
around the defect (the ``contrast`` of each record): 3-8, with about one defect in seven faint (3-4),
so a faint defect is faint relative to what surrounds it on every surface.

Why it is hard but learnable: the harmless specks, grooves, uneven threads, clouds and lighting put the
global statistics of ok images in the same range as those of defective ones (a logistic regression on
per-image mean, std, min and max separates ok from defect at about 0.6 balanced accuracy), and a thin
scratch sits among streaks of similar width. But the defects are spatially coherent (long thin lines,
compact blobs, zigzag branching paths) while the textures are stationary, so a CNN that integrates along a
structure finds them even where single pixels are within the texture's range.

Thin structures are drawn anti-aliased at twice the size and reduced with ``INTER_AREA``; their mask comes
from the same geometry, thresholded after the reduction. Each image has its own generator seeded from
``(seed, class index, image index)``: image ``i`` of a class does not depend on the other counts or on the
thread that draws it, and the same arguments give byte-identical PNG files.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cv2
import numpy as np
from tqdm import tqdm

TEXTURES = ("brushed_metal", "woven_fabric", "stone_grain")
DEFECT_CLASSES = ("scratch", "spot", "crack")
CLASSES = ("ok", *DEFECT_CLASSES)  # the index in this tuple seeds a class, so it must never be reordered

# Mild multiplicative RGB tints per family; one is picked per image and jittered slightly.
_TINTS = {
    "brushed_metal": ((0.96, 0.99, 1.05), (1.0, 1.0, 1.0)),
    "woven_fabric": ((1.06, 1.0, 0.88), (0.92, 0.98, 1.07), (0.98, 1.04, 0.92)),
    "stone_grain": ((1.05, 1.0, 0.93), (1.0, 0.99, 0.97)),
}
F32 = np.float32
Array = np.ndarray
Surface = tuple[Array, Array | None]  # normalised texture, optional extra lighting factor
Defect = tuple[Array, Array, float, float, float]  # profile 0..1, bool mask, sign, contrast, cover


def _normalise(a: Array) -> Array:
    a = a - a.mean()
    return a / (a.std() + 1e-6)


def _grid_noise(rng: np.random.Generator, s: int, cells: int) -> Array:
    """Smooth value noise: a coarse random grid upsampled bicubically. Coarse grids go bicubic to a quarter
    of the size and bilinear from there, which looks the same and is several times cheaper."""
    grid = rng.standard_normal((cells + 1, cells + 1), dtype=F32)
    if 4 * (cells + 1) <= s // 4:
        grid = cv2.resize(grid, (s // 4, s // 4), interpolation=cv2.INTER_CUBIC)
        return cv2.resize(grid, (s, s), interpolation=cv2.INTER_LINEAR)
    return cv2.resize(grid, (s, s), interpolation=cv2.INTER_CUBIC)


def _specks(rng: np.random.Generator, s: int, count: int, sigma: float, amp: tuple[float, float]) -> Array:
    """Small harmless bright/dark dots (grain, glints, knots); their peaks reach the same range as faint
    defects, which is what keeps max/min pixel rules from working."""
    out = np.zeros((s, s), F32)
    if count:
        ys, xs = rng.integers(0, s, count), rng.integers(0, s, count)
        out[ys, xs] = rng.choice([-1.0, 1.0], count) * rng.uniform(*amp, count)
        out = cv2.GaussianBlur(out, (0, 0), sigma) * (2 * math.pi * sigma**2)  # keep the peak height
    return out


def _brushed_metal(rng: np.random.Generator, s: int, yy: Array, xx: Array) -> Surface:
    n = math.ceil(1.5 * s)  # larger canvas so the rotation leaves no empty corners
    cols = max(2, int(n / rng.uniform(6, 25)))  # stretch factor = streak length in px
    rows = rng.standard_normal((n, cols), dtype=F32)
    rows[rng.integers(0, n, rng.integers(2, 8))] *= F32(rng.uniform(1.3, 2.0))  # a few deeper grooves
    streak = cv2.resize(rows, (n, n), interpolation=cv2.INTER_CUBIC)
    fine = cv2.resize(rng.random((n, cols * 4), dtype=F32) - F32(0.5), (n, n), interpolation=cv2.INTER_LINEAR)
    tex = streak + F32(rng.uniform(0.3, 0.8)) * fine
    angle = rng.uniform(0, 180)
    m = cv2.getRotationMatrix2D((n / 2, n / 2), angle, 1.0)
    m[:, 2] -= (n - s) / 2  # centre crop of the rotated canvas
    tex = _normalise(cv2.warpAffine(tex, m, (s, s), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT))
    tex += _specks(rng, s, int(rng.integers(0, 6)), rng.uniform(0.6, 1.0), (2.5, 6.0))  # glints
    # Specular highlight: a band parallel to the grain, as on a lit cylinder or polished sheet.
    t = math.radians(angle)
    v = (xx - s / 2) * math.sin(t) + (yy - s / 2) * math.cos(t)
    band = np.exp(-(((v - rng.uniform(-0.4, 0.4) * s) / (rng.uniform(0.15, 0.5) * s)) ** 2))
    return tex, 1 + F32(rng.uniform(0.05, 0.3)) * band


def _woven_fabric(rng: np.random.Generator, s: int, yy: Array, xx: Array) -> Surface:
    p = s * rng.uniform(0.035, 0.07)  # thread period: 4.5-9 px at 128 px
    t = math.radians(rng.choice([0.0, 90.0]) + rng.uniform(-20, 20))
    warp = p * F32(rng.uniform(0.1, 0.35))  # slowly wandering threads
    u = (xx * math.cos(t) + yy * math.sin(t) + warp * _grid_noise(rng, s, 4)) / p + rng.uniform(0, 1)
    v = (-xx * math.sin(t) + yy * math.cos(t) + warp * _grid_noise(rng, s, 4)) / (p * rng.uniform(0.85, 1.15))
    iu, iv = np.floor(u), np.floor(v)
    fu, fv = u - iu, v - iv
    over = (iu + iv) % 2 == 0  # plain weave: warp and weft alternate on top
    su, sv = np.sin(np.pi * fu), np.sin(np.pi * fv)  # the rounded cross-section of a thread
    tex = np.where(over, su * (0.7 + 0.3 * sv), sv * (0.7 + 0.3 * su))
    # Uneven threads: each thread gets its own brightness offset (dye/thickness variation).
    lut = rng.normal(0, rng.uniform(0.05, 0.2), 64).astype(F32)
    tex = tex + lut[np.where(over, iu, iv + 32).astype(np.intp) % 64]
    tex = _normalise(cv2.GaussianBlur(tex.astype(F32), (0, 0), 0.5))  # fibres are not pixel-sharp
    tex += _specks(rng, s, int(rng.integers(0, 7)), rng.uniform(0.8, 1.4), (2.5, 5.5))  # knots, slubs
    return tex, None


def _stone_grain(rng: np.random.Generator, s: int, yy: Array, xx: Array) -> Surface:
    beta = rng.uniform(0.2, 0.6)  # spectral slope: from sandy grain to mildly cloudy stone
    tex = sum(_grid_noise(rng, s, c) * F32(c**-beta) for c in (3, 6, 12, 24, 48))
    tex = tex + F32(rng.uniform(0.3, 1.4) * 48**-beta) * (rng.random((s, s), dtype=F32) - F32(0.5))
    tex = _normalise(tex)
    tex += _specks(rng, s, int(rng.integers(10, 70)), rng.uniform(0.5, 1.1), (2.5, 6.0))  # speckles, pits
    return tex, None


_FAMILIES = {"brushed_metal": _brushed_metal, "woven_fabric": _woven_fabric, "stone_grain": _stone_grain}


def _contrast(rng: np.random.Generator, lo: float, mid: float, hi: float) -> float:
    """Defect contrast in units of the local texture std: about one defect in seven is faint (lo..mid),
    the rest clearly visible (mid..hi), so the faint ones are a hard minority rather than label noise."""
    return rng.uniform(lo, mid) if rng.random() < 0.15 else rng.uniform(mid, hi)


def _hires(s: int, draw: Callable[[Array], object]) -> Array:
    """Draw anti-aliased at 2x on uint8, reduce with INTER_AREA; returns a 0..1 profile at size s."""
    canvas = np.zeros((2 * s, 2 * s), np.uint8)
    draw(canvas)
    return cv2.resize(canvas, (s, s), interpolation=cv2.INTER_AREA).astype(F32) / 255


def _poly(canvas: Array, pts: Array, thickness: int) -> None:
    # shift=4 gives cv2 sub-pixel coordinates (1/16 px) so thin lines sit anywhere, not on a grid.
    cv2.polylines(canvas, [np.round(pts * 32).astype(np.int32)], False, 255, thickness, cv2.LINE_AA, 4)


def _scratch(rng: np.random.Generator, s: int, m: float, yy: Array, xx: Array) -> Defect:
    length, ang = rng.uniform(0.25, 0.8) * s, rng.uniform(0, math.pi)
    dx, dy = math.cos(ang) * length / 2, math.sin(ang) * length / 2
    c = np.array([rng.uniform(m + abs(dx), s - m - abs(dx)), rng.uniform(m + abs(dy), s - m - abs(dy))])
    bend = rng.uniform(-0.08, 0.08) * length if rng.random() < 0.5 else 0.0  # half are slightly curved
    tt = np.linspace(0, 1, 32)[:, None]
    half = np.array([dx, dy])
    a, b, ctrl = c - half, c + half, c + bend * np.array([-math.sin(ang), math.cos(ang)])
    pts = (1 - tt) ** 2 * a + 2 * tt * (1 - tt) * ctrl + tt**2 * b  # quadratic Bezier
    geom = _hires(s, lambda cv: _poly(cv, pts, int(rng.integers(3, 7))))  # 1.5-3 px after reduction
    # Depth varies along a real scratch: fade linearly between two random levels from end to end.
    along = np.clip(((xx - a[0]) * (b[0] - a[0]) + (yy - a[1]) * (b[1] - a[1])) / length**2, 0, 1)
    f0, f1 = rng.uniform(0.7, 1.0, 2)
    contrast = _contrast(rng, 3.0, 4.0, 8.0)
    sign = 1.0 if rng.random() < 0.6 else -1.0  # mostly bright: a scratch catches the light
    return geom * (f0 + (f1 - f0) * along), geom >= 0.3, sign, contrast, 0.0


def _spot(rng: np.random.Generator, s: int, m: float, yy: Array, xx: Array) -> Defect:
    r, aspect, ang = rng.uniform(0.04, 0.18) * s, rng.uniform(0.55, 1.0), rng.uniform(0, math.pi)
    # The rim wobbles out by up to 24 % and a ring adds 20 %: keep the whole stain inside the margin.
    cx, cy = (float(v) for v in rng.uniform(m + 1.5 * r, s - m - 1.5 * r, 2))
    # Work in a window around the spot only (its soft edge has faded to ~2 % at the window's border).
    big = math.ceil(2.2 * r + 3)
    win = np.s_[max(int(cy) - big, 0) : int(cy) + big + 1, max(int(cx) - big, 0) : int(cx) + big + 1]
    x, y = xx[win] - cx, yy[win] - cy
    xr, yr = x * math.cos(ang) + y * math.sin(ang), (-x * math.sin(ang) + y * math.cos(ang)) / aspect
    z = (xr + 1j * yr).astype(np.complex64)
    rho = np.abs(z) + F32(1e-6)
    unit = z / rho  # exp(i*phi): the rim harmonics below are sin(k*phi + p) without an arctan
    wobble = np.ones_like(rho)
    for k in (2, 3, 5):
        wobble += F32(rng.uniform(0, 0.08)) * (unit**k * np.exp(1j * rng.uniform(0, 6.3))).imag
    d = rho / (r * wobble)  # 1 on the (irregular) rim
    soft = rng.uniform(0.02, 0.08)  # a stain has a visible boundary; the texture's clouds do not
    profile = 1 / (1 + np.exp(np.clip((d - 1) / soft, -30, 30)))  # soft-edged stain
    extent = 1.0
    if rng.random() < 0.35:  # dried stain: darker/lighter rim, weaker centre
        w = rng.uniform(0.08, 0.2)
        profile = np.maximum(profile * rng.uniform(0.3, 0.8), np.exp(-(((d - 1) / w) ** 2)))
        extent += w
    contrast = _contrast(rng, 3.0, 4.0, 7.0)
    # A stain covers the grain: inside it the texture is pulled towards the surrounding level, so the spot
    # is a blob of its own against whatever cloud of the texture lies beneath it.
    sign, cover = (-1.0 if rng.random() < 0.65 else 1.0), rng.uniform(0.5, 0.9)
    full, mask = np.zeros((s, s), F32), np.zeros((s, s), bool)
    full[win], mask[win] = profile, d <= extent
    return full, mask, sign, contrast, cover


def _walk(rng: np.random.Generator, start: Array, heading: float, length: float, s: int, m: float) -> Array:
    """Jagged crack path: a slowly drifting main direction plus a fresh sharp deviation at every step (the
    zigzag of a fracture, not the smooth curve of a scratch); turned back towards the centre whenever it
    would leave the margin."""
    step = 0.03 * s
    pts = [start]
    for _ in range(max(2, int(length / step))):
        heading += rng.normal(0, 0.12)
        turn = heading + rng.normal(0, 0.7)
        nxt = pts[-1] + step * np.array([math.cos(turn), math.sin(turn)])
        if not (m <= nxt[0] <= s - m and m <= nxt[1] <= s - m):
            heading = math.atan2(s / 2 - pts[-1][1], s / 2 - pts[-1][0]) + rng.normal(0, 0.5)
            nxt = np.clip(pts[-1] + step * np.array([math.cos(heading), math.sin(heading)]), m, s - m)
        pts.append(nxt)
    return np.array(pts)


def _crack(rng: np.random.Generator, s: int, m: float, yy: Array, xx: Array) -> Defect:
    length = rng.uniform(0.2, 0.6) * s
    main = _walk(rng, rng.uniform(0.25 * s, 0.75 * s, 2), rng.uniform(0, 2 * math.pi), length, s, m)
    paths = [(main, int(rng.integers(3, 5)))]  # 1.5-2 px after reduction
    for _ in range(int(rng.integers(0, 3))):  # 0-2 branches forking off the middle part
        i = int(rng.integers(len(main) // 4, max(len(main) // 4 + 1, 3 * len(main) // 4)))
        seg = main[min(i + 1, len(main) - 1)] - main[max(i - 1, 0)]
        head = math.atan2(seg[1], seg[0]) + rng.choice([-1, 1]) * rng.uniform(0.4, 1.1)
        paths.append((_walk(rng, main[i], head, rng.uniform(0.3, 0.6) * length, s, m), 3))
    geom = _hires(s, lambda cv: [_poly(cv, p, t) for p, t in paths])
    contrast = _contrast(rng, 3.0, 4.0, 8.0)
    return geom, geom >= 0.3, -1.0, contrast, 0.0


_DEFECTS = {"scratch": _scratch, "spot": _spot, "crack": _crack}


def _render(
    rng: np.random.Generator, label: str, s: int, yy: Array, xx: Array, scale: float = 1.0
) -> tuple[Array, Array, str, Array, float]:
    """One image as float luminance (about 0..1), its mask, texture family, tint and defect contrast."""
    family = TEXTURES[int(rng.integers(len(TEXTURES)))]
    tints = _TINTS[family]
    # Drawn whatever the channel count, so a grayscale set shows the same geometry as the RGB one.
    tint = np.array(tints[int(rng.integers(len(tints)))]) * rng.uniform(0.98, 1.02, 3)
    tex, light = _FAMILIES[family](rng, s, yy, xx)
    mask, contrast = np.zeros((s, s), bool), 0.0
    if label != "ok":
        profile, mask, sign, contrast, cover = _DEFECTS[label](rng, s, max(4.0, s / 32), yy, xx)
        contrast *= scale
        # Contrast is in units of the texture std around the defect (mask bounding box plus 6 px).
        ys, xs = np.nonzero(mask) if mask.any() else (np.array([s // 2]), np.array([s // 2]))
        sl = np.s_[max(ys.min() - 6, 0) : ys.max() + 7, max(xs.min() - 6, 0) : xs.max() + 7]
        box, around = tex[sl], ~mask[sl]
        level = float(box[around].mean()) if around.any() else 0.0
        tex = tex + profile * (F32(sign * contrast * box.std()) + F32(cover) * (level - tex))
    # Global lighting: linear gradient or radial vignette (plus the specular band of metal).
    if rng.random() < 0.5:
        t = rng.uniform(0, 2 * math.pi)
        g = 1 + F32(rng.uniform(0, 0.4)) * ((xx / s - 0.5) * math.cos(t) + (yy / s - 0.5) * math.sin(t))
    else:
        c = [float(v) * s for v in rng.uniform(0.3, 0.7, 2)]
        g = 1 - F32(rng.uniform(0.05, 0.45)) * (((xx - c[0]) ** 2 + (yy - c[1]) ** 2) / (0.5 * s * s))
    if light is not None:
        g = g * light
    amp = rng.uniform(0.035, 0.1)  # texture contrast, relative to the 0..1 range
    img = (rng.uniform(0.3, 0.7) + F32(amp) * tex) * g
    img = img + F32(amp * rng.uniform(0.1, 0.35)) * rng.standard_normal((s, s), dtype=F32)
    return img, mask, family, tint, contrast


def _png(path: Path, arr: Array) -> None:
    ok, buf = cv2.imencode(".png", arr)
    if not ok:
        raise OSError(f"could not encode {path}")
    path.write_bytes(buf.tobytes())


def generate(
    images_dir: Path,
    masks_dir: Path,
    counts: dict[str, int],
    image_size: int,
    channels: int,
    seed: int,
    progress: bool = True,
    contrast: float = 1.0,
) -> list[dict]:
    """Write ``images_dir/<class>/<class>_<i:05d>.png`` and the mask ``masks_dir/<class>/<same name>``
    (uint8 L, 255 on the defect, all zero for ok) for every class in ``counts``; return one record per image:
    ``{"path", "label", "texture", "mask_area", "contrast"}`` with ``path`` relative to ``images_dir``."""
    unknown = [k for k in counts if k not in CLASSES]
    if unknown:
        raise ValueError(f"unknown class(es) {unknown} in counts; known: {list(CLASSES)}")
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    if image_size < 32:
        raise ValueError(f"image_size must be at least 32, got {image_size}")
    if any(int(n) < 0 for n in counts.values()):
        raise ValueError(f"counts must be non-negative: {counts}")
    images_dir, masks_dir, s = Path(images_dir), Path(masks_dir), int(image_size)
    yy, xx = np.mgrid[0:s, 0:s].astype(F32)
    tasks = [(ci, c, i) for ci, c in enumerate(CLASSES) if c in counts for i in range(int(counts[c]))]
    for label in {label for _, label, _ in tasks}:
        (images_dir / label).mkdir(parents=True, exist_ok=True)
        (masks_dir / label).mkdir(parents=True, exist_ok=True)

    def one(task: tuple[int, str, int]) -> dict:
        ci, label, i = task
        # Own generator per image: image i of a class never depends on the other counts or on thread timing.
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), ci, i]))
        img, mask, family, tint, defect_contrast = _render(rng, label, s, yy, xx, contrast)
        if channels == 3:
            img = img[..., None] * tint.astype(F32)[None, None, ::-1]  # cv2 writes BGR
        name = f"{label}_{i:05d}.png"
        _png(images_dir / label / name, np.clip(img * 255 + 0.5, 0, 255).astype(np.uint8))
        _png(masks_dir / label / name, mask.astype(np.uint8) * 255)
        return {
            "path": f"{label}/{name}",
            "label": label,
            "texture": family,
            "mask_area": float(mask.mean()),
            "contrast": float(defect_contrast),
        }

    # PNG encoding, file creation and cv2 release the GIL, so a few threads overlap I/O with drawing;
    # map keeps the order, and each image's own generator keeps the output independent of scheduling.
    records: list[dict] = []
    with (
        ThreadPoolExecutor(max_workers=min(4, 2 * (os.cpu_count() or 1))) as pool,
        tqdm(total=len(tasks), disable=not progress, desc="synthetic", unit="img") as bar,
    ):
        for rec in pool.map(one, tasks):
            records.append(rec)
            bar.update(1)
    return records
