"""`defect check` and `defect exp --profile`: what a user runs before spending minutes on `dvc repro`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml

from pipeline.config import params_from_dict
from pipeline.data.synthetic import generate
from pipeline.sweep import stage_env

ROOT = Path(__file__).resolve().parents[1]


def defect(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args], cwd=cwd, env=stage_env(), text=True, capture_output=True
    )


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """params.yaml and profiles/ of the repository, in a folder of their own."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(ROOT / "profiles", tmp_path / "profiles")
    return tmp_path


@pytest.fixture
def images(tmp_path: Path) -> Path:
    folder = tmp_path / "photos"
    generate(folder, tmp_path / "photos_masks", {"ok": 6, "scratch": 6}, 48, 3, 0, progress=False)
    return folder


def test_every_profile_loads_over_params_yaml():
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    from pipeline.config import apply_changes

    for path in sorted((ROOT / "profiles").glob("*.yaml")):
        changes = yaml.safe_load(path.read_text())
        p = params_from_dict(apply_changes(base, changes, path.name), source_file=path.name)
        assert p.source_file == path.name


def test_check_passes_the_default_and_a_good_folder(project: Path, images: Path):
    out = defect(project, "check")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ready: dvc repro" in out.stdout and "built-in generator" in out.stdout
    out = defect(project, "check", "--profile", "photographs", "-S", f"data.source={images}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"data: {images}: 12 files, 12 usable" in out.stdout
    assert f"masks: {images}_masks" in out.stdout


def test_check_names_the_key_the_file_and_the_class(project: Path, images: Path):
    out = defect(project, "check", "-S", "train.epochs=many")
    assert out.returncode == 1 and "train.epochs" in out.stdout and "many" in out.stdout
    out = defect(project, "check", "-S", "train.epochz=3")
    assert out.returncode == 1 and "train.epochz" in out.stdout
    out = defect(project, "check", "--profile", "nosuch")
    assert out.returncode == 1 and "profiles/nosuch.yaml not found" in out.stdout and "photographs" in out.stdout
    (images / "ok" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    cv2.imwrite(str(images / "scratch" / "tiny.png"), np.zeros((8, 8, 3), np.uint8))
    out = defect(project, "check", "-S", f"data.source={images}", "-S", "data.ok_class=good")
    assert out.returncode == 1, out.stdout
    assert "data.ok_class: 'good' is not a class folder" in out.stdout
    assert f"left out: {images}/ok/broken.png" in out.stdout
    assert f"left out: {images}/scratch/tiny.png: too small: 8x8" in out.stdout
    assert "validate.max_bad_fraction" in out.stdout  # 2 of 14 files: over the gate's 5%
    assert not (project / "data").exists()  # nothing ran, nothing was written


def test_exp_dry_run_prints_the_dvc_command_of_the_profile(project: Path, images: Path):
    out = defect(project, "exp", "--dry-run", "--profile", "photographs", "-S", f"data.source={images}", "-n", "tiles")
    assert out.returncode == 0, out.stdout + out.stderr
    command = out.stdout.strip().splitlines()[-1]
    assert command.startswith("dvc exp run -n tiles -S data.source=")
    profile = yaml.safe_load((ROOT / "profiles/photographs.yaml").read_text())
    for key in profile:
        assert f"-S {key}=" in command, key
    assert (project / "params.yaml").read_text() == (ROOT / "params.yaml").read_text()  # untouched
