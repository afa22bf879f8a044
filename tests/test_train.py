"""Training: killed at random moments it resumes to the same weights; bad checkpoints never pass silently."""

from __future__ import annotations

import csv
import json
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from pipeline import checkpoint
from tests.conftest import ROOT, tiny_params, venv_env

EPOCHS = 3


def params(**train) -> dict:
    p = tiny_params(**{"model.name": "test_efficientnet"})
    p["train"].update({"epochs": EPOCHS, "checkpoint_every_steps": 1, "keep_last": 4, "ema": 0.9, **train})
    return p


def start_train(workdir: Path, p: dict, capture: bool = True) -> subprocess.Popen:
    (workdir / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    out = subprocess.PIPE if capture else subprocess.DEVNULL
    return subprocess.Popen(
        [sys.executable, str(ROOT / "stages/train.py")],
        cwd=workdir,
        env=venv_env(),
        stdout=out,
        stderr=out,
        text=True,
    )


def run_train(workdir: Path, p: dict) -> subprocess.CompletedProcess:
    proc = start_train(workdir, p)
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def model_weights(workdir: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(workdir / "models/train/model.pt")["model"]


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def ckpt_dir(workdir: Path) -> Path:
    return workdir / "models/train/checkpoints"


def history(workdir: Path) -> list[list[str]]:
    """reports/train/history.csv without its timing columns (different in every run)."""
    rows = [line.split(",") for line in (workdir / "reports/train/history.csv").read_text().splitlines()]
    keep = [i for i, name in enumerate(rows[0]) if name not in ("train_img_s", "data_wait_share")]
    return [[r[i] for i in keep] for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(prepared_project, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("straight")
    shutil.copytree(prepared_project, work, dirs_exist_ok=True)
    proc = run_train(work, params())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work


def kill_when(proc: subprocess.Popen, condition, timeout: float = 300) -> bool:
    """SIGKILL ``proc`` as soon as ``condition()`` holds; False if it ended first."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if condition():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.0005)
    proc.wait()
    return False


def test_killed_at_random_moments_resumes_to_identical_weights(prepared_project, uninterrupted, tmp_path):
    """SIGKILL during training at random steps and during a checkpoint write; each rerun resumes."""
    shutil.copytree(prepared_project, tmp_path, dirs_exist_ok=True)
    rng = random.Random(1234)
    total_steps = json.loads((uninterrupted / "reports/train/metrics.json").read_text())["steps"]
    kills, during_write = 0, 0
    for target in sorted(rng.sample(range(1, total_steps), 3)):
        proc = start_train(tmp_path, params(), capture=False)

        def reached(target=target) -> bool:
            return any(int(p.name[5:]) >= target for p in checkpoint.step_dirs(ckpt_dir(tmp_path)))

        kills += kill_when(proc, reached)
    # Once more, killed while a checkpoint folder is being written (its temporary name is visible).
    for _ in range(5):
        proc = start_train(tmp_path, params(), capture=False)
        if kill_when(proc, lambda: any(ckpt_dir(tmp_path).glob(".step-*.tmp"))):
            during_write += 1
            break
    assert kills >= 2, "the run finished before it could be killed"
    final = run_train(tmp_path, params())
    assert final.returncode == 0, final.stderr[-3000:]
    assert "resuming from models/train/checkpoints/step-" in final.stderr
    assert same_weights(model_weights(uninterrupted), model_weights(tmp_path))
    assert history(tmp_path) == history(uninterrupted)  # every epoch's losses, as if never interrupted
    assert not list(ckpt_dir(tmp_path).glob(".step-*.tmp")), "an unfinished write was left behind"
    # The MLflow run the first attempt opened is the one the finished model belongs to.
    oldest_kept = checkpoint.load(checkpoint.step_dirs(ckpt_dir(tmp_path))[-1] / "state.pt")
    assert json.loads((tmp_path / "models/train/run.json").read_text())["run_id"] == oldest_kept["run_id"]
    print(f"killed {kills} times at random steps and {during_write} time(s) during a checkpoint write")


def test_corrupt_newest_checkpoint_falls_back_to_the_one_before(uninterrupted, tmp_path):
    shutil.copytree(uninterrupted, tmp_path, dirs_exist_ok=True)
    steps = checkpoint.step_dirs(ckpt_dir(tmp_path))
    newest = steps[0] / "state.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, as a failing disk would leave it
    (tmp_path / "models/train/model.pt").unlink()
    proc = run_train(tmp_path, params())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint {newest.relative_to(tmp_path)} is unreadable" in proc.stderr
    assert f"resuming from {steps[1].relative_to(tmp_path)}" in proc.stderr
    assert same_weights(model_weights(uninterrupted), model_weights(tmp_path))


def test_checkpoint_of_other_params_restarts_loudly_or_stops(uninterrupted, tmp_path):
    shutil.copytree(uninterrupted, tmp_path, dirs_exist_ok=True)
    stop = run_train(tmp_path, params(lr=0.001, on_mismatch="stop"))
    assert stop.returncode == 2
    assert "was trained on other params, code, data or warm start" in stop.stderr
    assert "train.on_mismatch: stop" in stop.stderr
    assert checkpoint.step_dirs(ckpt_dir(tmp_path)), "stopping must not touch the checkpoints"

    restart = run_train(tmp_path, params(lr=0.001))
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert "was trained on other params, code, data or warm start" in restart.stderr
    assert "starting fresh" in restart.stderr
    assert "resuming" not in restart.stderr
    assert (ckpt_dir(tmp_path) / "superseded").is_dir()
    assert not same_weights(model_weights(uninterrupted), model_weights(tmp_path))


def test_operational_settings_do_not_invalidate_a_checkpoint(uninterrupted, tmp_path):
    shutil.copytree(uninterrupted, tmp_path, dirs_exist_ok=True)
    (tmp_path / "models/train/model.pt").unlink()
    proc = run_train(tmp_path, params(keep_last=2, keep_best=1, num_workers=1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stderr and "other params" not in proc.stderr


def test_nan_loss_stops_with_a_message_and_keeps_the_last_good_checkpoint(prepared_project, tmp_path):
    shutil.copytree(prepared_project, tmp_path, dirs_exist_ok=True)
    # An absurd learning rate: the first step is fine, the weights it leaves overflow to inf/NaN.
    proc = run_train(tmp_path, params(lr=1e30, warmup_epochs=0, grad_clip=0.0, ema=0.0))
    assert proc.returncode == 2
    assert re.search(r"(loss became (nan|inf)|weights became inf or NaN) by step \d+ of the epoch", proc.stderr)
    assert "The last good checkpoint is kept" in proc.stderr
    steps = checkpoint.step_dirs(ckpt_dir(tmp_path))
    assert steps, "the steps before the NaN were checkpointed"
    for s in steps:  # every checkpoint left is readable and holds finite weights
        weights = checkpoint.load(s / "state.pt")["model"]
        assert all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point()), s
    assert not (tmp_path / "models/train/model.pt").exists()


def test_early_stopping_ends_the_run_when_val_loss_stalls(prepared_project, tmp_path):
    shutil.copytree(prepared_project, tmp_path, dirs_exist_ok=True)
    stalls = params(lr=0.0, epochs=6, early_stopping_patience=2, monitor="val_loss")  # lr 0: nothing improves
    proc = run_train(tmp_path, stalls)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "reports/train/metrics.json").read_text())
    assert metrics["stopped_early"] and metrics["epochs_run"] == 3 and metrics["best_epoch"] == 1
    assert "early stop" in proc.stderr
    # A finished (early-stopped) run is not trained again when the stage reruns.
    again = run_train(tmp_path, stalls)
    assert again.returncode == 0 and "epoch 4" not in again.stderr


def test_monitor_keeps_the_epoch_with_the_best_val_defect_recall(prepared_project, tmp_path):
    """train.monitor: val_recall_at_far keeps the epoch that catches most val defects at the allowed
    false-alarm rate (AUC breaking ties), not the lowest val_loss, and says so in metrics.json."""
    shutil.copytree(prepared_project, tmp_path, dirs_exist_ok=True)
    proc = run_train(tmp_path, params(epochs=5, monitor="val_recall_at_far", keep_best=1, ema=0.0))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "reports/train/history.csv").open()))
    assert len(rows) == 5 and all(0.0 <= float(r["val_auc"]) <= 1.0 for r in rows)

    def key(r: dict) -> tuple[float, float]:
        return float(r["val_recall_at_far"]), float(r["val_auc"])

    best = max(rows, key=key)  # max() returns the first of equals, as training keeps the first
    metrics = json.loads((tmp_path / "reports/train/metrics.json").read_text())
    assert metrics["monitor"] == "val_recall_at_far"
    assert metrics["best_epoch"] == int(best["epoch"])
    assert metrics["best_val_recall_at_far"] == pytest.approx(float(best["val_recall_at_far"]))
    assert checkpoint.load(tmp_path / "models/train/model.pt")["meta"]["epoch"] == int(best["epoch"])
    assert (tmp_path / "reports/train/val_defect.png").stat().st_size > 0


def test_monitor_last_keeps_the_weights_at_the_end_of_the_schedule(prepared_project, tmp_path):
    """train.monitor: last (the default) keeps the final epoch's weights, whichever epoch val liked best."""
    shutil.copytree(prepared_project, tmp_path, dirs_exist_ok=True)
    proc = run_train(tmp_path, params(monitor="last", ema=0.0, keep_best=1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "reports/train/metrics.json").read_text())
    assert metrics["monitor"] == "last" and metrics["best_epoch"] == metrics["epochs_run"] == EPOCHS
    kept = checkpoint.load(tmp_path / "models/train/model.pt")
    assert kept["meta"]["epoch"] == EPOCHS
    newest = checkpoint.step_dirs(ckpt_dir(tmp_path))[0] / "state.pt"  # the training state after the last step
    trained = torch.load(newest, map_location="cpu", weights_only=True)["model"]
    # all of it but a training-only mask head, where train.mask_loss trains one
    assert set(trained) - set(kept["model"]) <= {"mask_head.bias", "mask_head.weight"}
    assert same_weights(kept["model"], {k: trained[k] for k in kept["model"]})


def test_ensemble_is_the_mean_of_its_members_and_resumes_member_by_member(prepared_project, tmp_path):
    """train.ensemble: 2 trains seeds 0 and 1 as two whole runs; model.pt scores the mean of their
    probabilities; member 0 is exactly the single model of seed 0; a rerun trains nothing again; evaluate
    and export (with its parity gate) take the ensemble like one model."""
    from pipeline.data.prepare import load_split
    from pipeline.metrics import softmax
    from pipeline.model import load_model
    from tests.conftest import run_stages_in

    shutil.copytree(prepared_project, tmp_path, dirs_exist_ok=True)
    p = params(ensemble=2, ema=0.0, epochs=1)
    proc = run_train(tmp_path, p)
    assert proc.returncode == 0, proc.stderr[-3000:]
    net, meta = load_model(tmp_path / "models/train/model.pt")
    assert meta["members"] == 2 and meta["member_seeds"] == [0, 1]
    members = [load_model(ckpt_dir(tmp_path) / f"member-{k}/model.pt")[0] for k in range(2)]
    assert not same_weights(members[0].state_dict(), members[1].state_dict())
    x = torch.from_numpy(load_split(tmp_path / "data/prepared", "test")[0])
    with torch.no_grad():
        mean = (softmax(members[0](x).numpy()) + softmax(members[1](x).numpy())) / 2
        assert abs(softmax(net(x).numpy()) - mean).max() < 1e-5
    metrics = json.loads((tmp_path / "reports/train/metrics.json").read_text())
    assert metrics["ensemble"] == 2 and len(metrics["members"]) == 2 and 0.0 <= metrics["val_auc"] <= 1.0
    for plot in ("loss.png", "val_defect.png"):  # every member's curves (and the ensemble's), not member 0's
        member0 = (ckpt_dir(tmp_path) / "member-0/reports" / plot).read_bytes()
        assert (tmp_path / "reports/train" / plot).read_bytes() != member0, plot

    single = tmp_path / "single"
    shutil.copytree(prepared_project, single)
    assert run_train(single, params(ema=0.0, epochs=1)).returncode == 0
    assert same_weights(members[0].state_dict(), model_weights(single))

    before = model_weights(tmp_path)
    again = run_train(tmp_path, p)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("resuming from") == 2 and "epoch 1/" not in again.stderr
    assert same_weights(before, model_weights(tmp_path))

    run_stages_in(tmp_path, p, ["evaluate", "export"])
    # onnxruntime's temporary files of the int8 shape inference stay out of the project
    assert not [f.name for f in tmp_path.iterdir() if f.suffix in (".data", ".onnx")]
    fp32 = json.loads((tmp_path / "reports/export/parity.json").read_text())["fp32"]
    assert fp32["prob_max_abs_diff"] <= p["export"]["max_abs_diff"] and fp32["decision_flips"] == 0


def test_ensemble_members_train_with_their_own_param_changes(prepared_project, tmp_path):
    """train.ensemble_members: member 1 trains with its own augmentation policy and epochs, and is exactly
    the single model trained with seed 1 and those params; member 0 keeps the params as given."""
    shutil.copytree(prepared_project, tmp_path, dirs_exist_ok=True)
    changes = {"augment.policy": [], "train.epochs": 2}
    p = params(ensemble=2, ema=0.0, epochs=1, ensemble_members=[{}, changes])
    proc = run_train(tmp_path, p)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ensemble member 2 of 2 (train.seed 1, augment.policy changed, train.epochs changed)" in proc.stderr
    meta = checkpoint.load(tmp_path / "models/train/model.pt")["meta"]
    assert meta["member_changes"] == [{}, changes]
    for k, epochs in enumerate((1, 2)):
        rows = list(csv.DictReader((ckpt_dir(tmp_path) / f"member-{k}/reports/history.csv").open()))
        assert len(rows) == epochs, f"member {k}"

    single = tmp_path / "single"
    shutil.copytree(prepared_project, single)
    alone = params(ema=0.0, epochs=2, seed=1)
    alone["augment"]["policy"] = []
    assert run_train(single, alone).returncode == 0
    member1 = checkpoint.load(ckpt_dir(tmp_path) / "member-1/model.pt")["model"]
    assert same_weights(member1, model_weights(single))


def test_an_ensemble_may_mix_networks(prepared_project, tmp_path):
    """train.ensemble_members may change model.*: member 1 is a ResNet beside an EfficientNet. The saved
    ensemble rebuilds each member's own network, its card names both, it exports with parity, and a warm
    start of a ResNet from it takes the ResNet member's weights."""
    from pipeline.model import load_model
    from tests.conftest import run_stages_in

    shutil.copytree(prepared_project, tmp_path, dirs_exist_ok=True)
    p = params(ensemble=2, ema=0.0, epochs=1, ensemble_members=[{}, {"model.name": "test_resnet"}])
    proc = run_train(tmp_path, p)
    assert proc.returncode == 0, proc.stderr[-3000:]
    net, meta = load_model(tmp_path / "models/train/model.pt")
    assert meta["architecture"] == "test_efficientnet + test_resnet"
    assert [m["architecture"] for m in meta["member_models"]] == ["test_efficientnet", "test_resnet"]
    assert [type(m.backbone).__name__ for m in net.members] == ["EfficientNet", "ResNet"]

    single = tmp_path / "single"
    shutil.copytree(prepared_project, single)
    alone = params(ema=0.0, epochs=1, seed=1)
    alone["model"]["name"] = "test_resnet"
    assert run_train(single, alone).returncode == 0
    assert same_weights(net.members[1].state_dict(), model_weights(single))

    run_stages_in(tmp_path, p, ["evaluate", "export"])
    parity = json.loads((tmp_path / "reports/export/parity.json").read_text())["fp32"]
    assert parity["prob_max_abs_diff"] <= p["export"]["max_abs_diff"] and parity["decision_flips"] == 0
    card = json.loads((tmp_path / "models/export/model.card.json").read_text())
    assert card["architecture"] == "test_efficientnet + test_resnet"

    warm = tmp_path / "warm"
    shutil.copytree(prepared_project, warm)
    resnet = params(ema=0.0, epochs=1, init_from=str(tmp_path / "models/train/model.pt"))
    resnet["model"]["name"] = "test_resnet"
    proc = run_train(warm, resnet)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warm start from member 1 of the 2 members" in proc.stderr
