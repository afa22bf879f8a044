"""The data gate on a corpus of bad files the test builds itself, and new labeled batches."""

from __future__ import annotations

import dataclasses
import io
import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.config import ConfigError, params_from_dict
from pipeline.data.augment import balance_copies, build_policy
from pipeline.data.batches import add_batch
from pipeline.data.validate import GateError, gate, validate
from tests.conftest import ROOT, run_stages_in, tiny_params, venv_env

P = params_from_dict(tiny_params())


def noise(seed: int, size=(48, 64), channels=3) -> np.ndarray:
    shape = (*size, channels) if channels > 1 else size
    return np.random.default_rng(seed).integers(0, 255, shape, np.uint8)


def save(img: Image.Image, path: Path, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, **kw)
    return path


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height 8-bit gray pixels: a decompression bomb's header, no pixels."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def jpeg_bytes(img: np.ndarray, exif_orientation: int | None = None) -> bytes:
    pil = Image.fromarray(img)
    buf = io.BytesIO()
    if exif_orientation:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        pil.save(buf, "JPEG", quality=95, exif=exif.tobytes())
    else:
        pil.save(buf, "JPEG", quality=95)
    return buf.getvalue()


# file name (under its class folder) -> the quarantine reason it must get
BAD = {
    "ok/empty.png": "empty file (0 bytes)",
    "ok/notes.jpg": "not a recognised image format",  # a text file named .jpg
    "ok/error_page.png": "not a recognised image format",  # an HTML error page saved as .png
    "ok/truncated.jpg": "cannot decode",
    "ok/tiny.png": "too small: 8x8",
    "ok/bomb.png": "exceeds the limit of 40000000 pixels",
    "ok/readme.txt": "unknown extension '.txt'",
    "ok/no_extension": "unknown extension '(none)'",
    "stray.png": "not inside a class folder",
}


@pytest.fixture
def corpus(tmp_path) -> Path:
    root = tmp_path / "images"
    for i in range(6):
        save(Image.fromarray(noise(i)), root / "ok" / f"ok{i}.png")
        save(Image.fromarray(noise(100 + i)), root / "dent" / f"dent{i}.png")
    (root / "ok/empty.png").write_bytes(b"")
    (root / "ok/notes.jpg").write_text("meeting notes, not a picture")
    (root / "ok/error_page.png").write_text("<!DOCTYPE html><html><body>502 Bad Gateway</body></html>")
    (root / "ok/truncated.jpg").write_bytes(jpeg_bytes(noise(7))[:600])
    save(Image.fromarray(noise(8, (8, 8))), root / "ok/tiny.png")
    (root / "ok/bomb.png").write_bytes(png_header_only(100_000, 100_000))  # 10^10 pixels, 80 bytes
    (root / "ok/readme.txt").write_text("hello")
    (root / "ok/no_extension").write_bytes((root / "ok/ok0.png").read_bytes())
    (root / "stray.png").write_bytes((root / "dent/dent0.png").read_bytes())
    # Every pixel format a camera or an export tool produces is accepted and converted.
    save(Image.fromarray(noise(20, channels=1)), root / "ok/gray.png")
    save(Image.fromarray(noise(21, channels=1).astype(np.uint16) * 257), root / "ok/gray16.png")
    save(Image.fromarray(noise(22)).convert("RGBA"), root / "ok/rgba.png")
    save(Image.fromarray(noise(23)).convert("P"), root / "ok/palette.png")
    save(Image.fromarray(noise(24)).convert("CMYK"), root / "ok/cmyk.jpg", quality=95)
    (root / "ok/rotated.jpg").write_bytes(jpeg_bytes(noise(25, (40, 60)), exif_orientation=6))
    (root / "empty_class").mkdir()
    return root


def test_every_bad_file_is_quarantined_with_its_reason_and_good_formats_pass(corpus):
    classes = ["dent", "empty_class", "ok"]
    accepted, quarantined, summary = validate(corpus, classes, P.validate)
    reasons = {r.path: r.reason for r in quarantined}
    for path, reason in BAD.items():
        assert reason in reasons.get(path, ""), f"{path}: expected {reason!r}, got {reasons.get(path)!r}"
    assert set(reasons) == set(BAD)
    modes = {r.path: r.mode for r in accepted}
    assert {modes["ok/gray.png"], modes["ok/gray16.png"], modes["ok/rgba.png"], modes["ok/palette.png"]} == {
        "L",
        "I;16",
        "RGBA",
        "P",
    }
    assert modes["ok/cmyk.jpg"] == "CMYK"
    rotated = next(r for r in accepted if r.path == "ok/rotated.jpg")
    assert (rotated.width, rotated.height) == (40, 60)  # EXIF orientation 6 applied: 60x40 turned upright
    assert summary["empty_classes"] == 1 and summary["per_class"]["empty_class"] == 0
    with pytest.raises(GateError, match=r"min_per_class=2: empty_class \(0, empty\)"):
        gate(summary, quarantined, dataclasses.replace(P.validate, max_bad_fraction=1.0))


def test_a_decompression_bomb_is_refused_before_decoding(corpus, tmp_path):
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    validate(corpus, ["dent", "ok"], P.validate)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 500_000  # KiB: 10 GB never allocated


def test_label_conflicts_cross_the_gate_and_name_the_files(corpus):
    (corpus / "dent/mislabeled.png").write_bytes((corpus / "ok/ok2.png").read_bytes())
    _, quarantined, summary = validate(corpus, ["dent", "ok"], P.validate)
    assert summary["label_conflicts"] == 2
    lenient = dataclasses.replace(P.validate, max_bad_fraction=1.0)
    with pytest.raises(GateError, match=r"max_label_conflicts=0.*dent/mislabeled.png.*same content as ok/ok2.png"):
        gate(summary, quarantined, lenient)
    gate(summary, quarantined, dataclasses.replace(lenient, max_label_conflicts=2))  # at the threshold: passes


def test_balancing_copies_raise_rare_classes_in_train_only():
    images = np.stack([noise(i, (32, 32)) for i in range(30)])
    labels = np.array([0] * 20 + [1] * 6 + [2] * 4)
    policy = build_policy(P.augment.policy)
    x, y, src = balance_copies(images, labels, policy, 0.5, seed=0)
    assert np.bincount(np.concatenate([labels, y]), minlength=3).tolist() == [20, 10, 10]
    assert all(labels[s] == c for s, c in zip(src, y, strict=True))  # a copy keeps its source's label
    again = balance_copies(images, labels, build_policy(P.augment.policy), 0.5, seed=0)[0]
    assert np.array_equal(x, again)  # reproducible
    assert len(balance_copies(images, labels, policy, 0.0, seed=0)[1]) == 0


@pytest.fixture
def project_with_data(prepared_project, tmp_path) -> Path:
    import shutil

    shutil.copytree(prepared_project, tmp_path, dirs_exist_ok=True)
    return tmp_path


def defect_ingest(workdir: Path, folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "ingest", str(folder), "--no-dvc", *args],
        cwd=workdir,
        env={**venv_env(), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_a_new_batch_adds_only_new_sound_images_and_keeps_every_split(project_with_data, tmp_path_factory):
    work = project_with_data
    before = {r: s for s in ("train", "val", "test") for r in np.load(work / f"data/prepared/{s}.npz")["paths"]}
    existing_ok = sorted((work / "data/raw/images/ok").glob("*.png"))
    new = tmp_path_factory.mktemp("new_batch")
    for i in range(3):
        save(Image.fromarray(noise(500 + i, (64, 64))), new / "ok" / f"fresh{i}.png")
        save(Image.fromarray(noise(600 + i, (64, 64))), new / "crack" / f"fresh{i}.png")
    (new / "ok/again.png").write_bytes(existing_ok[0].read_bytes())  # already in the dataset
    (new / "crack/mislabeled.png").write_bytes(existing_ok[1].read_bytes())  # an OK image labeled crack
    (new / "crack/broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    proc = defect_ingest(work, new, "--name", "line7-week48")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((work / "batches/line7-week48.json").read_text())
    assert report["counts"] == {"crack": 3, "ok": 3}
    reasons = {d["path"]: d["reason"] for d in report["dropped"]}
    assert reasons["ok/again.png"].startswith("duplicate of ok/")
    assert reasons["crack/mislabeled.png"].startswith(f"label conflict: same content as ok/{existing_ok[1].name}")
    assert "cannot decode" in reasons["crack/broken.png"] or "not a recognised" in reasons["crack/broken.png"]
    assert "label conflict" in proc.stdout

    # Adding the same folder again adds nothing: every image is now a known duplicate.
    again = defect_ingest(work, new, "--name", "again")
    assert json.loads((work / "batches/again.json").read_text())["added"] == []
    assert again.returncode == 0

    run_stages_in(work, tiny_params(), ["ingest", "validate", "prepare"])
    after = {r: s for s in ("train", "val", "test") for r in np.load(work / f"data/prepared/{s}.npz")["paths"]}
    assert all(after[p] == s for p, s in before.items()), "an existing image changed split"
    added = [p for p in after if "/batch-line7-week48/" in p]
    assert len(added) == 6


def test_a_batch_with_an_unknown_class_is_refused_unless_allowed(project_with_data, tmp_path_factory):
    new = tmp_path_factory.mktemp("odd")
    save(Image.fromarray(noise(700)), new / "dnet" / "a.png")  # a typo of "dent"
    proc = defect_ingest(project_with_data, new)
    assert proc.returncode == 2 and "class folder(s) dnet are not classes of the dataset" in proc.stderr
    with pytest.raises(ConfigError, match="not a folder"):
        add_batch(new / "missing", P)


@pytest.mark.real_data
def test_the_magnetic_tile_photographs_pass_the_gate(real_data):
    """1,344 grayscale JPEGs of almost all different sizes: every one decodes, none is a duplicate."""
    classes = sorted(p.name for p in real_data.iterdir() if p.is_dir())
    accepted, quarantined, summary = validate(real_data, classes, P.validate)
    gate(summary, quarantined, P.validate)
    assert summary["per_class"]["free"] == 952 and summary["classes"] == 6
    assert summary["bad_fraction"] <= P.validate.max_bad_fraction
    assert {r.mode for r in accepted} == {"L"}
    assert len({(r.width, r.height) for r in accepted}) > 100  # many different sizes, all accepted
