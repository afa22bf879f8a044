"""Ingest: the synthetic default and a user's folder; bad sources stop with one clear message."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml
from PIL import Image

from pipeline.config import ConfigError, params_from_dict
from pipeline.data.check import check_data
from pipeline.data.ingest import ingest, ingest_masks
from tests.conftest import REAL_DATA, ROOT, tiny_params


def data_cfg(**kw):
    p = params_from_dict(tiny_params())
    return dataclasses.replace(p.data, **kw)


def write_png(path, value=128, size=(40, 40)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((*size, 3), value, np.uint8)).save(path)


def test_synthetic_default_writes_images_and_masks(tmp_path):
    summary = ingest(data_cfg(), tmp_path / "raw")
    assert summary["counts"] == {"ok": 24, "scratch": 12, "spot": 12, "crack": 12}
    assert len(list((tmp_path / "raw/images/crack").glob("*.png"))) == 12
    assert len(list((tmp_path / "raw/masks/crack").glob("*.png"))) == 12
    written = json.loads((tmp_path / "raw/ingest.json").read_text())
    assert written["total"] == 60 and written["ok_class"] == "ok"
    assert written["masks"] == {"folders": [], "kind": "masks", "images": 60, "from_boxes": 0, "problems": []}


def test_folder_source_is_copied_not_touched(tmp_path):
    src = tmp_path / "line7"
    for cls in ("good", "dent"):
        for i in range(3):
            write_png(src / cls / f"{i}.png", 50 * i)
    before = {p: p.read_bytes() for p in src.rglob("*.png")}
    summary = ingest(data_cfg(source=str(src), ok_class="good"), tmp_path / "raw")
    assert summary["counts"] == {"dent": 3, "good": 3}
    assert {p: p.read_bytes() for p in src.rglob("*.png")} == before
    assert (tmp_path / "raw/images/dent/2.png").read_bytes() == (src / "dent/2.png").read_bytes()
    assert summary["masks"] == {"folders": [], "kind": None, "images": 0, "from_boxes": 0, "problems": []}


@pytest.mark.parametrize(
    "layout, message",
    [
        (None, "does not exist"),
        ([], "has no class subfolders"),
        (["good"], "single class folder (good)"),
        (["dent", "scratch"], "data.ok_class: 'good' is not a class folder"),
        (["dent", "scratch"], "use data.ok_class: none for defect-type sorting without an OK class"),
    ],
)
def test_bad_source_folder_is_one_clear_error(tmp_path, layout, message):
    src = tmp_path / "src"
    if layout is not None:
        src.mkdir()
        for cls in layout:
            write_png(src / cls / "a.png")
    with pytest.raises(ConfigError) as exc:
        ingest(data_cfg(source=str(src), ok_class="good"), tmp_path / "raw")
    assert message in str(exc.value) and "data." in str(exc.value)


def test_no_ok_class_sorts_defect_types_and_needs_two_of_them(tmp_path, capsys):
    src = tmp_path / "steel"
    for cls in ("inclusion", "scratches"):
        for i in range(3):
            write_png(src / cls / f"{i}.png", 40 * i)
    summary = ingest(data_cfg(source=str(src), ok_class="none"), tmp_path / "raw")
    assert summary["counts"] == {"inclusion": 3, "scratches": 3}
    assert json.loads((tmp_path / "raw/ingest.json").read_text())["ok_class"] is None
    p = params_from_dict(tiny_params())
    check_data(dataclasses.replace(p, data=dataclasses.replace(p.data, source=str(src), ok_class="none")))
    assert "problem" not in capsys.readouterr().out.lower()

    shutil.rmtree(src / "scratches")
    with pytest.raises(ConfigError) as exc:
        ingest(data_cfg(source=str(src), ok_class="none"), tmp_path / "raw")
    assert str(exc.value) == (
        f"data.source: {src} has a single class folder (inclusion); defect-type sorting (data.ok_class: none) "
        "needs at least two defect classes"
    )
    problems = check_data(dataclasses.replace(p, data=dataclasses.replace(p.data, source=str(src), ok_class="none")))
    assert problems == [str(exc.value)]


@pytest.mark.skipif(not REAL_DATA.is_dir(), reason=f"the magnetic tile photographs are not at {REAL_DATA}")
def test_magnetic_tile_masks_are_found_for_every_image():
    classes = sorted(p.name for p in REAL_DATA.iterdir() if p.is_dir())
    masks = ingest_masks(REAL_DATA, classes, "free", None)
    assert masks == {
        "folders": [str(REAL_DATA.with_name(REAL_DATA.name + "_masks"))],
        "kind": "masks",
        "images": 1344,
        "from_boxes": 0,
        "problems": [],
    }


def test_stage_prints_one_line_not_a_traceback(tmp_path):
    p = tiny_params()
    p["data"]["source"] = str(tmp_path / "missing")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "stages/ingest.py")], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "ingest: error: data.source: folder" in proc.stderr and "Traceback" not in proc.stderr
