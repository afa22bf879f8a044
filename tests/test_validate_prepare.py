"""Validation quarantines bad files with a reason; the split is stable and leakage-free."""

from __future__ import annotations

import csv
import dataclasses

import numpy as np
import pytest
from PIL import Image

from pipeline.config import params_from_dict
from pipeline.data.prepare import assign_splits, auto_image_size, load_groups, load_split, split_of
from pipeline.data.validate import GateError, gate, validate
from tests.conftest import tiny_params

P = params_from_dict(tiny_params())


def noise_png(path, seed, size=(48, 48)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), np.uint8)).save(path)


@pytest.fixture
def dataset(tmp_path):
    root = tmp_path / "images"
    for i in range(6):
        noise_png(root / "ok" / f"ok{i}.png", i)
        noise_png(root / "dent" / f"dent{i}.png", 100 + i)
    return root


def test_bad_files_are_quarantined_with_a_reason(dataset):
    (dataset / "ok" / "empty.png").write_bytes(b"")
    (dataset / "ok" / "notes.jpg").write_text("not an image")
    (dataset / "ok" / "readme.txt").write_text("hello")
    noise_png(dataset / "ok" / "tiny.png", 7, size=(8, 8))
    (dataset / "stray.png").write_bytes((dataset / "ok" / "ok0.png").read_bytes())
    accepted, quarantined, summary = validate(dataset, ["dent", "ok"], P.validate)
    reasons = {r.path: r.reason for r in quarantined}
    assert "empty file" in reasons["ok/empty.png"]
    assert "not a recognised image format" in reasons["ok/notes.jpg"]
    assert "unknown extension '.txt'" in reasons["ok/readme.txt"]
    assert "too small: 8x8" in reasons["ok/tiny.png"]
    assert "not inside a class folder" in reasons["stray.png"]
    assert summary["accepted"] == 12 and len(accepted) == 12


def test_duplicates_within_and_across_classes(dataset):
    (dataset / "ok" / "ok1_copy.png").write_bytes((dataset / "ok" / "ok1.png").read_bytes())
    (dataset / "dent" / "conflict.png").write_bytes((dataset / "ok" / "ok2.png").read_bytes())
    accepted, quarantined, summary = validate(dataset, ["dent", "ok"], P.validate)
    reasons = {r.path: r.reason for r in quarantined}
    assert reasons["ok/ok1_copy.png"] == "exact duplicate of ok/ok1.png"  # the first path is kept
    assert reasons["dent/conflict.png"].startswith("label conflict: same content as ok/ok2.png")
    assert reasons["ok/ok2.png"].startswith("label conflict")
    assert summary["label_conflicts"] == 2 and summary["exact_duplicates"] == 1


def test_gate_names_the_figure(dataset):
    for i in range(4):
        (dataset / "ok" / f"bad{i}.png").write_bytes(b"junk")
    _, quarantined, summary = validate(dataset, ["dent", "ok"], P.validate)
    with pytest.raises(GateError, match="max_bad_fraction"):
        gate(summary, quarantined, P.validate)
    strict = dataclasses.replace(P.validate, max_bad_fraction=1.0, min_per_class=10)
    with pytest.raises(GateError, match=r"min_per_class=10: dent \(6\), ok \(6\)"):
        gate(summary, quarantined, strict)


def test_each_prepared_image_carries_its_near_duplicate_group(prepared_project):
    """Evaluate counts each val part once by these groups: they must be the validate stage's groups."""
    with open(prepared_project / "data/validated/manifest.csv", newline="") as f:
        group_of = {r["path"]: r["group"] for r in csv.DictReader(f)}
    for split in ("train", "val", "test"):
        _, labels, paths = load_split(prepared_project / "data/prepared", split)
        groups = load_groups(prepared_project / "data/prepared", split)
        assert len(groups) == len(labels) > 0
        assert list(groups) == [group_of[p] for p in paths]


def test_near_duplicates_share_a_group_and_a_split(dataset):
    img = np.asarray(Image.open(dataset / "ok" / "ok3.png")).copy()
    img[0, 0] ^= 1  # one pixel differs: different bytes, same picture
    Image.fromarray(img).save(dataset / "ok" / "ok3_again.png")
    accepted, _, _ = validate(dataset, ["dent", "ok"], P.validate)
    by_path = {r.path: r for r in accepted}
    assert by_path["ok/ok3.png"].group == by_path["ok/ok3_again.png"].group
    assert split_of(by_path["ok/ok3.png"].group, P.prepare) == split_of(by_path["ok/ok3_again.png"].group, P.prepare)


def test_adding_images_keeps_every_existing_split():
    rows = [
        {"path": f"ok/{i}.png", "label": "ok", "group": f"{i * 2654435761 % 2**32:08x}" + "0" * 56} for i in range(200)
    ]
    before = {r["path"]: s for s, rs in assign_splits(rows, P.prepare).items() for r in rs}
    more = rows + [
        {"path": f"ok/new{i}.png", "label": "ok", "group": f"{(i + 7) * 40503 % 2**32:08x}" + "1" * 56}
        for i in range(100)
    ]
    after = {r["path"]: s for s, rs in assign_splits(more, P.prepare).items() for r in rs}
    assert all(after[p] == s for p, s in before.items())
    assert {s for s in after.values()} == {"train", "val", "test"}


def test_auto_input_size_follows_the_images_own_resolution():
    """prepare.image_size auto: the median shorter side, down to a multiple of 32, within 64-192 px."""

    def rows(*sizes):
        return [{"width": w, "height": h} for w, h in sizes]

    assert auto_image_size(rows((200, 200)) * 5)[0] == 192  # NEU's steel strips
    assert auto_image_size(rows((96, 96)))[0] == 96  # the generator's images, as they are
    assert auto_image_size(rows((300, 257), (500, 240), (250, 400)))[0] == 192  # photographs: at most 192
    size, why = auto_image_size(rows((40, 30), (50, 60)))
    assert size == 64 and "median shorter side is 40 px" in why  # min(40, 30), min(50, 60)
