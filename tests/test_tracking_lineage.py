"""What a run says about the code it came from (``git.*`` tags) and how it is named: no MLflow store needed."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline import tracking

DVC_YAML = {
    "stages": {
        "train": {
            "cmd": "python train.py",
            "deps": ["train.py"],
            "outs": ["models/train/model.pt", {"models/train/checkpoints": {"persist": True, "cache": False}}],
            "metrics": [{"reports/train/metrics.json": {"cache": False}}],
            "plots": ["reports/train/loss.png"],
        }
    }
}


def git(repo: Path, *args: str) -> None:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
    subprocess.run(cmd, cwd=repo, check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch) -> Path:
    """A committed project whose dvc.yaml declares outputs, some of them kept in git (``cache: false``)."""
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML))
    for name, text in {
        "train.py": "print('train')\n",
        "params.yaml": "train: {lr: 0.1}\n",
        "dvc.lock": "schema: '2.0'\n",
        "reports/train/metrics.json": "{}\n",
        "reports/validate/report.md": "written by a stage, not declared in dvc.yaml\n",
        "models/train/checkpoints/model-run.json": "{}\n",
        ".gitignore": "/mlruns\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "project")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_what_dvc_rewrites_does_not_make_the_code_dirty(repo):
    """A fresh clone after `dvc repro`: dvc.lock, the metrics and the .gitignore entries DVC keeps differ."""
    (repo / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")
    (repo / "reports/train/metrics.json").write_text('{"val_loss": 0.5}\n')
    (repo / "reports/validate/report.md").write_text("this run's report\n")
    (repo / "models/train/checkpoints/model-run.json").write_text('{"run_id": "x"}\n')
    (repo / ".gitignore").write_text("/mlruns\n/model.pt\n")
    (repo / "scratch.py").write_text("untracked files are not the code\n")
    tags = tracking.git_info()
    assert re.fullmatch(r"[0-9a-f]{40}", tags["git.commit"])
    assert tags["git.dirty"] == "false" and tags["git.params_dirty"] == "false"
    assert "git.dirty_files" not in tags


def test_a_params_change_is_told_apart_from_a_code_change(repo):
    (repo / "params.yaml").write_text("train: {lr: 0.01}\n")  # as `dvc exp run -S train.lr=0.01` leaves it
    tags = tracking.git_info()
    assert (tags["git.dirty"], tags["git.params_dirty"], tags["git.dirty_files"]) == ("false", "true", "params.yaml")

    (repo / "train.py").write_text("print('changed')\n")
    git(repo, "mv", "dvc.lock", "renamed.lock")  # a rename lists the new path
    tags = tracking.git_info()
    assert tags["git.dirty"] == "true"
    assert tags["git.dirty_files"] == "params.yaml, renamed.lock, train.py"


def test_outside_a_git_repository_nothing_is_dirty(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert tracking.git_info() == {"git.commit": "unknown", "git.dirty": "false", "git.params_dirty": "false"}


def test_dvc_outputs_are_read_from_dvc_yaml(repo):
    assert tracking.dvc_outputs() == {
        "models/train/model.pt",
        "models/train/checkpoints",
        "reports/train/metrics.json",
        "reports/train/loss.png",
    }


def test_the_part_that_tells_runs_apart_comes_first(monkeypatch):
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    name = tracking.run_name("3xtf_efficientnetv2_b0+tiles", 128, "0123456789abcdef")
    assert re.fullmatch(r"\d{4}-\d{4}-3xtf_efficientnetv2_b0\+tiles-128px-012345", name), name
    monkeypatch.setenv("DVC_EXP_NAME", "lr-low")  # dvc exp run sets it for every stage it runs
    assert tracking.run_name("resnet10t", 64, "abcdef0123") == "lr-low-resnet10t-64px-abcdef"


def test_the_benchmark_gives_the_models_run_a_few_headline_figures():
    """The whole report is one artifact; the run gets latency at the smallest batch, throughput at the largest."""
    from pipeline.export.benchmark import flat_metrics

    timing = {"p50_ms": 2.0, "img_s": 500.0, "vs_eager": 3.0}
    contenders = {"runner fp32": timing, "runner int8": timing, "torch eager": timing, "torch.compile": timing}
    report = {
        "batch_1": contenders,
        "batch_8": contenders,
        "batch_32": contenders,
        "end_to_end": {"fp32": {"png_img_s": 90.0, "jpeg_img_s": 100.0}},
        "http": {"variant": "fp32", "infer_img_s": 80.0, "infer_p99_ms": 30.0, "infer_vs_in_process": 0.9, "x": 1},
    }
    flat = flat_metrics(report, [1, 8, 32])
    assert sorted(flat) == sorted(
        [f"bench_b1_{c}_p50_ms" for c in ("runner_fp32", "runner_int8", "torch_eager", "torch_compile")]
        + [f"bench_b1_{c}_vs_eager" for c in ("runner_fp32", "runner_int8", "torch_compile")]
        + [f"bench_b32_{c}_img_s" for c in ("runner_fp32", "runner_int8", "torch_eager", "torch_compile")]
        + ["bench_e2e_fp32_jpeg_img_s", "bench_http_infer_img_s", "bench_http_infer_p99_ms"]
        + ["bench_http_infer_vs_in_process"]
    )
