"""Defect masks: one PNG per defect image, ``data/raw/masks/<class>/<stem>.png`` (any pixel above 0 is the
defect), and the value that marks a mask pixel as not known. Nothing here imports torch or the pipeline's
other modules: the training loop, the prepare stage and the tile cutting all read these.

Ingest copies PNG masks as they are and paints Pascal VOC boxes (``<class>/<stem>.xml``, what LabelImg and
CVAT export) into the same kind of PNG: ``voc_boxes`` reads one file safely, ``box_mask`` paints its boxes,
so nothing downstream knows a mask came from boxes.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from pathlib import Path
from xml.parsers import expat

import numpy as np
from PIL import ExifTags, Image

MASK_UNKNOWN = 255  # every pixel of a mask that is not known: a defect image without a mask file
MAX_XML_BYTES = 1 << 20  # a VOC file is a few KiB; anything larger is refused unread
BOX_FIELDS = ("xmin", "ymin", "xmax", "ymax")

Box = tuple[int, int, int, int]  # (left, top, right, bottom) 0-based, right and bottom exclusive: array slices


def mask_path(masks_dir: Path, rel_path: str) -> Path:
    return masks_dir / Path(rel_path).parent / f"{Path(rel_path).stem}.png"


def read_mask(masks_dir: Path, rel_path: str) -> np.ndarray | None:
    """The full-resolution defect mask of image ``rel_path`` (``<class>/<stem>.png``), True where the defect
    is: any pixel above 0, so the anti-aliased rim of a drawn defect counts; None where there is no such file
    or it marks nothing."""
    path = mask_path(masks_dir, rel_path)
    if not path.is_file():
        return None
    with Image.open(path) as m:
        mask = np.asarray(m.convert("L")) > 0
    return mask if mask.any() else None


class _Declaration(Exception):
    """Raised by the parser's handler at a DOCTYPE or entity declaration, before anything is expanded."""


def parse_xml(path: Path) -> ET.Element:
    """The root element of a small, plain XML file; ValueError (its message says what was expected) when it
    cannot be read, is larger than ``MAX_XML_BYTES``, declares a DOCTYPE or an entity, or is not well-formed.

    defusedxml is not installed, so the standard library's expat parser is driven here with a handler that
    stops at the first DOCTYPE or entity declaration, before anything could be expanded (an "XML bomb");
    expat reads the encoding itself (a byte search for "<!DOCTYPE" would miss a UTF-16 file)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_XML_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read ({exc.strerror or exc}); expected a readable Pascal VOC file") from None
    if len(data) > MAX_XML_BYTES:
        raise ValueError(f"more than {MAX_XML_BYTES} bytes; expected a Pascal VOC file of a few KiB")

    def refuse(*_args: object) -> None:
        raise _Declaration

    builder = ET.TreeBuilder()
    parser = expat.ParserCreate()
    parser.StartDoctypeDeclHandler = refuse
    parser.EntityDeclHandler = refuse
    parser.StartElementHandler = builder.start
    parser.EndElementHandler = builder.end
    parser.CharacterDataHandler = builder.data
    try:
        parser.Parse(data, True)
    except _Declaration:
        raise ValueError("declares a DOCTYPE or entity; expected a plain Pascal VOC <annotation> (refused)") from None
    except (expat.ExpatError, LookupError, ValueError) as exc:  # LookupError, ValueError: an unknown encoding
        raise ValueError(f"not readable as XML ({exc}); expected a Pascal VOC <annotation>") from None
    return builder.close()


def shown_size(path: Path) -> tuple[int, int] | None:
    """(width, height) of an image as it is decoded (EXIF orientation applied, as ``decode_image`` does), from
    its header alone; None when Pillow cannot open it (the validate stage quarantines it and says why)."""
    try:
        with Image.open(path) as img:
            w, h = img.size
            turned = img.getexif().get(ExifTags.Base.Orientation) in (5, 6, 7, 8)
    except Exception:  # noqa: BLE001 (any decoder failure: the image's own problem, reported by validate)
        return None
    return (h, w) if turned else (w, h)


def _pixel(text: str | None) -> int | None:
    """A VOC coordinate rounded to a whole pixel (CVAT writes fractions); None when it is not a finite number."""
    try:
        v = float(text or "")
    except ValueError:
        return None
    return math.floor(v + 0.5) if math.isfinite(v) else None


def voc_boxes(path: Path, image_size: tuple[int, int]) -> tuple[list[Box], list[str]]:
    """The boxes of a Pascal VOC file for an image of ``image_size`` (width, height), clipped to it, and the
    problems found (one line each, saying what was expected; the caller names the file).

    VOC coordinates are 1-based and inclusive: ``xmin=1, xmax=200`` is every column of a 200 px wide image,
    so a box covers 0-based columns ``xmin - 1`` to ``xmax - 1``. A 0 from a 0-based exporter is clipped to
    the first pixel, and any part outside the image is clipped; a box with no pixel inside is a problem.
    ``<filename>`` is ignored (copied files keep stale names); ``<size>``, when given, must be the image's.
    No objects: ([], []), the caller decides whether that is a problem."""
    try:
        root = parse_xml(path)
    except ValueError as exc:
        return [], [str(exc)]
    if root.tag != "annotation":
        return [], [f"root element <{root.tag}>; expected a Pascal VOC <annotation>"]
    width, height = image_size
    declared = (_pixel(root.findtext("size/width")), _pixel(root.findtext("size/height")))
    if all(declared) and declared != image_size:
        return [], [
            f"<size> is {declared[0]}x{declared[1]} but the image is {width}x{height} (EXIF orientation applied); "
            "expected the size of the image the boxes were drawn on"
        ]
    boxes: list[Box] = []
    problems: list[str] = []
    for i, obj in enumerate(root.findall("object"), 1):
        where = f"<object> {i} ({obj.findtext('name') or 'unnamed'})"
        if obj.find("bndbox") is None:
            problems.append(f"{where} has no <bndbox>; expected xmin, ymin, xmax, ymax in pixels")
            continue
        values = [_pixel(obj.findtext(f"bndbox/{k}")) for k in BOX_FIELDS]
        if None in values:
            got = ", ".join(f"{k}={obj.findtext(f'bndbox/{k}')!r}" for k in BOX_FIELDS)
            problems.append(f"{where}: {got}; expected four numbers of pixels")
            continue
        xmin, ymin, xmax, ymax = values
        if xmin > xmax or ymin > ymax:
            problems.append(
                f"{where}: ({xmin}, {ymin}, {xmax}, {ymax}) is inverted; expected xmin <= xmax and ymin <= ymax"
            )
            continue
        box = (max(xmin - 1, 0), max(ymin - 1, 0), min(xmax, width), min(ymax, height))
        if box[0] >= box[2] or box[1] >= box[3]:
            problems.append(
                f"{where}: ({xmin}, {ymin}, {xmax}, {ymax}) lies outside the {width}x{height} image; expected "
                f"x in 1..{width} and y in 1..{height}"
            )
            continue
        boxes.append(box)
    return boxes, problems


def box_mask(boxes: list[Box], image_size: tuple[int, int]) -> np.ndarray:
    """(H, W) uint8 mask of an image of ``image_size`` (width, height): 255 inside the union of the boxes
    (``voc_boxes``' 0-based, right/bottom-exclusive slices), 0 elsewhere."""
    mask = np.zeros(image_size[::-1], np.uint8)
    for left, top, right, bottom in boxes:
        mask[top:bottom, left:right] = 255
    return mask
