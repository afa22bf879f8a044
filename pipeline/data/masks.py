"""Defect masks: one PNG per defect image in ``<source>_masks/<class>/<stem>.png`` (any pixel above 0 is the
defect), and the value that marks a mask pixel as not known. Nothing here imports torch or the pipeline's
other modules: the training loop, the prepare stage and the tile cutting all read these."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

MASK_UNKNOWN = 255  # every pixel of a mask that is not known: a defect image without a mask file


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
