"""Shared fixtures: tiny synthetic data and a tiny trained model, made once per test session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
REAL_DATA = Path(os.environ.get("DEFECT_REAL_DATA", ROOT.parent / "shared" / "datasets" / "magnetic_tile"))


def load_default_params() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def tiny_params(**overrides) -> dict:
    """The default params shrunk to seconds: 64 px, a few images per class, one epoch."""
    p = load_default_params()
    p["data"]["synthetic"] = {
        "counts": {"ok": 24, "scratch": 12, "spot": 12, "crack": 12},
        "image_size": 64,
        "contrast": 1.0,
    }
    p["prepare"]["image_size"] = 64
    p["prepare"]["split"] = {"val": 0.2, "test": 0.2}
    p["validate"]["min_per_class"] = 2
    p["augment"]["preview_per_class"] = 2
    p["train"].update(epochs=1, batch_size=8, num_workers=0, ensemble=1, ensemble_members=[])  # one model
    # whole images only (the default's tile model where data has masks has tests of its own: test_tiles.py)
    p["tiles"]["use"] = "off"
    p["tiles"]["recipe"]["train.epochs"] = 1
    # a one-epoch model misses any recall target and may flag many OK parts: these tests are about the plumbing,
    # so it is deployable and may be crowned (the operating-point policy has tests of its own)
    p["export"]["deploy_below_target"] = True
    p["promote"]["refuse_false_alarm_rate"] = 1.0
    p["benchmark"].update(
        batch_sizes=[1, 4], repeats=5, warmup=1, max_images=16, rounds=1, http_concurrency=4, http_seconds=0.5
    )
    for dotted, value in overrides.items():
        section, key = dotted.split(".", 1)
        p[section][key] = value
    return p


def copy_project(dest: Path) -> Path:
    """A copy of the project's source files (what a fresh clone has) in ``dest``, as a git repo."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for f in files:
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    return dest


def venv_env() -> dict[str, str]:
    """Environment whose PATH finds this interpreter's python and dvc first (as `make` sets it)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("MLFLOW_TRACKING_URI", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# Fixtures that run pipeline stages (a minute or more, once per session): a test using one is slow, and
# `make test-fast` (-m "not slow") leaves it out.
STAGE_FIXTURES = {"prepared_project", "exported_project", "tiled"}


def pytest_collection_modifyitems(config, items):
    """Tests on the trained-model fixtures are marked ``slow``; tests marked ``gpu`` skip, with the reason,
    where torch sees no CUDA device (CI, this machine)."""
    for item in items:
        if STAGE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU, torch sees none (scripts/gpu_check.sh runs these on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_global_tracking_uri(monkeypatch):
    """``mlflow.set_tracking_uri`` also sets ``MLFLOW_TRACKING_URI`` in the environment, which the pipeline
    honours over params: one test's store must not leak into the next test."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture(scope="session")
def real_data() -> Path:
    if not (REAL_DATA / "free").is_dir():
        pytest.skip(f"real defect photographs not found at {REAL_DATA} (set DEFECT_REAL_DATA)")
    return REAL_DATA


def run_stages_in(workdir: Path, params: dict, stages: list[str]) -> None:
    """Run stage entries in-process-free subprocesses, as DVC would, inside ``workdir``."""
    (workdir / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for stage in stages:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "stages" / f"{stage}.py")],
            cwd=workdir,
            env=venv_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0:
            raise AssertionError(f"stage {stage} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


@pytest.fixture(scope="session")
def prepared_project(tmp_path_factory) -> Path:
    """A work folder with ingested, validated and prepared tiny synthetic data."""
    work = tmp_path_factory.mktemp("prepared")
    run_stages_in(work, tiny_params(), ["ingest", "validate", "prepare", "augment"])
    return work


@pytest.fixture(scope="session")
def exported_project(tmp_path_factory, prepared_project) -> Path:
    """The prepared folder copied and carried through train, evaluate and export (timm's tiny test net)."""
    work = tmp_path_factory.mktemp("exported")
    shutil.copytree(prepared_project, work, dirs_exist_ok=True)
    params = tiny_params(**{"model.name": "test_efficientnet"})
    run_stages_in(work, params, ["train", "evaluate", "export"])
    return work
