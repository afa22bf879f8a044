"""The research prototypes in experiments/ still run and produce what the README says they do."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from pipeline.config import params_from_dict
from pipeline.metrics import roc_auc
from pipeline.model import create_model
from pipeline.train import load_model, read_history
from tests.conftest import ROOT, tiny_params, venv_env


def test_simsiam_writes_backbone_weights_that_model_pretrained_loads(prepared_project, tmp_path):
    shutil.copytree(prepared_project, tmp_path, dirs_exist_ok=True)
    p = tiny_params(**{"model.name": "test_efficientnet"})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    env = venv_env()
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments/simsiam_pretrain.py"), "--epochs", "2", "--batch-size", "8",
         "--view-size", "32", "--out", "models/simsiam.pth"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "epoch 2/2" in proc.stdout and "collapsed" in proc.stdout
    saved = torch.load(tmp_path / "models/simsiam.pth")
    assert not any(k.startswith("classifier") for k in saved)  # a backbone: the classifier is the task's

    p["model"]["pretrained"] = str(tmp_path / "models/simsiam.pth")
    net = create_model(params_from_dict(p).model, num_classes=4, in_chans=3)
    torch.manual_seed(p["train"]["seed"])  # the script's starting point: the same seed, the same init
    fresh = create_model(params_from_dict(tiny_params(**{"model.name": "test_efficientnet"})).model, 0, 3)
    loaded = net.backbone.state_dict()
    for name, weight in saved.items():
        assert torch.equal(loaded[name], weight), name
    # The pretraining moved the weights away from a fresh start.
    assert not torch.equal(loaded["conv_stem.weight"], fresh.backbone.state_dict()["conv_stem.weight"])


def test_group_folds_keeps_each_part_in_one_fold_and_spreads_every_class():
    from experiments.crossfit import group_folds

    labels = np.array([0] * 30 + [1] * 12)
    groups = np.array([f"ok{i // 3}" for i in range(30)] + [f"d{i // 2}" for i in range(12)])  # 3 and 2 shots each
    fold = group_folds(labels, groups, 3, seed=0)
    for g in set(groups):
        assert len(set(fold[groups == g])) == 1, g  # one part's shots never straddle folds
    for c in (0, 1):
        counts = np.bincount(fold[labels == c], minlength=3)
        assert counts.max() - counts.min() <= 3, (c, counts)  # dealt evenly, to within one part
    assert np.array_equal(fold, group_folds(labels, groups, 3, seed=0))  # the same folds again


def test_crossfit_breaks_the_out_of_fold_figures_down_by_original_image_size(tmp_path, caplog):
    from experiments.crossfit import by_size, longer_sides

    manifest = tmp_path / "manifest.csv"
    rows = [f"s{i}.png,a,x,y,g{i},{100 + i},90,L" for i in range(8)]
    rows += [f"l{i}.png,a,x,y,h{i},300,{800 + i},L" for i in range(8)]  # portrait: the height is the longer side
    manifest.write_text("path,label,sha256,dhash,group,width,height,mode\n" + "\n".join(rows) + "\n")
    paths = np.array([f"s{i}.png" for i in range(8)] + [f"l{i}.png" for i in range(8)])
    sides = longer_sides(manifest, paths)
    assert list(sides) == [100 + i for i in range(8)] + [800 + i for i in range(8)]  # the longer side, either way
    defect = np.array([True, False] * 8)
    # The small images ranked perfectly, the large ones upside down: the breakdown says which.
    oof = np.where(np.arange(16) < 8, np.where(defect, 0.9, 0.1), np.where(defect, 0.1, 0.9))
    rows = by_size(sides, oof, defect, cut=0.5, bins=2)
    assert [r["longer_side"] for r in rows] == [[100, 453], [453, 807]] and [r["images"] for r in rows] == [8, 8]
    figures = [(r["auc"], r["recall_at_cut"], r["false_alarms_at_cut"]) for r in rows]
    assert figures == [(1.0, 1.0, 0.0), (0.0, 0.0, 1.0)]
    assert by_size(np.full(16, 128), oof, defect, cut=0.5) == []  # one size: nothing to break down
    assert longer_sides(tmp_path / "none.csv", paths) is None
    with caplog.at_level(logging.WARNING):  # another dataset's manifest: the run's figures are kept, no breakdown
        assert longer_sides(manifest, np.array(["other.png"])) is None
    assert "1 pooled images not listed (first: other.png)" in caplog.text


def test_crossfit_breaks_the_out_of_fold_figures_down_by_defect_class():
    from experiments.crossfit import by_class

    classes = ["crack", "ok", "spot", "unused"]
    labels = np.array([1] * 6 + [0] * 4 + [2] * 4)
    # OK at 0.1-0.6; the cracks above every OK image, the spots below all but one: the spots are the kind missed.
    oof = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.05, 0.15, 0.25, 0.65])
    rows = by_class(labels, 1, classes, oof, cut=0.55)
    assert [r["class"] for r in rows] == ["crack", "spot"]  # no row for OK or for a class without images
    assert [r["images"] for r in rows] == [4, 4]
    assert rows[0]["auc_against_ok"] == 1.0 and rows[0]["recall_at_cut"] == 1.0
    assert abs(rows[1]["auc_against_ok"] - 9 / 24) < 1e-9  # 9 of the 24 spot-OK pairs ranked right (0.65 over 6, ...)
    assert rows[1]["recall_at_cut"] == 0.25  # only 0.65 reaches the cut


def test_crossfit_fold_cuts_skip_a_fold_without_ok_images_instead_of_losing_the_run():
    from experiments.crossfit import fold_cuts

    fold = np.array([0, 0, 0, 1, 1, 1])
    ok = np.array([True, True, False, False, False, False])  # fold 1 holds defects only
    oof = np.array([0.1, 0.2, 0.9, 0.8, 0.7, 0.6])
    test = [np.array([[0.95, 0.05], [0.3, 0.7]]), np.array([[0.9, 0.1], [0.1, 0.9]])]  # (ok, defect) probs
    rows = fold_cuts(fold, np.arange(6).astype(str), ok, oof, test, 0, 0.03, np.array([False, True]))
    assert rows[0] == {"defect_recall": 1.0, "false_alarm_rate": 0.0, "binary_accuracy": 1.0}
    assert np.isnan(rows[1]["defect_recall"]) and np.isnan(rows[1]["false_alarm_rate"])


def test_crossfit_scores_every_train_and_val_image_with_a_model_that_never_saw_it(prepared_project, tmp_path):
    import csv
    import json

    import mlflow

    shutil.copytree(prepared_project, tmp_path, dirs_exist_ok=True)
    p = tiny_params(**{"model.name": "test_efficientnet"})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    env = venv_env()
    env["PYTHONPATH"] = str(ROOT)

    def crossfit(*extra):
        proc = subprocess.run([sys.executable, str(ROOT / "experiments/crossfit.py"), "--folds", "2", *extra],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc

    crossfit()
    out = tmp_path / "models/crossfit"
    with np.load(tmp_path / "data/prepared/train.npz") as tr, np.load(tmp_path / "data/prepared/val.npz") as va:
        pooled = sorted(map(str, np.concatenate([tr["paths"], va["paths"]])))
    with open(out / "review.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["path"] for r in rows) == pooled  # every train and val image scored, once
    for k in (0, 1):
        with np.load(out / f"fold-{k}/prepared/train.npz") as tr, np.load(out / f"fold-{k}/prepared/val.npz") as va:
            seen, held = set(map(str, tr["paths"])), set(map(str, va["paths"]))
        assert held == {r["path"] for r in rows if r["fold"] == str(k)}
        assert not seen & held and seen | held == set(pooled)  # its model never trained on what it scored
    ok_rows = [float(r["oof_defect_score"]) for r in rows if r["label"] == "ok"]
    assert ok_rows == sorted(ok_rows, reverse=True) and rows[0]["label"] == "ok"  # the OK labels to check first
    m = json.loads((out / "metrics.json").read_text())
    assert 0 <= m["oof_auc"] <= 1 and len(m["test_auc_by_model"]) == 2 and 0 <= m["test_oracle_recall"] <= 1
    assert f"{m['oof_auc']:.3f}" in (out / "report.md").read_text() and (out / "review.png").stat().st_size > 0
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = mlflow.search_runs(
        experiment_names=[p["mlflow"]["experiment"]], filter_string="tags.mlflow.runName = 'crossfit'"
    )
    assert len(run) == 1 and abs(run["metrics.oof_auc"][0] - m["oof_auc"]) < 1e-9
    for r in m["oof_by_class"]:  # every defect class in the report and the run, which kind is missed
        assert f"| {r['class']} | {r['images']} | {r['auc_against_ok']:.3f} |" in (out / "report.md").read_text()
        assert abs(run[f"metrics.oof_recall_class_{r['class']}"][0] - r["recall_at_cut"]) < 1e-9
    info = json.loads((tmp_path / "data/prepared/prepare.json").read_text())
    assert [r["class"] for r in m["oof_by_class"]] == [c for c in info["classes"] if c != info["ok_class"]]

    # Again, as after a kill: the folds' files are kept (their bytes are the trainings' fingerprint) and
    # the finished models are taken as they are, so the figures come out the same.
    stamp = (out / "fold-0/prepared/train.npz").stat().st_mtime_ns
    again = crossfit()
    assert (out / "fold-0/prepared/train.npz").stat().st_mtime_ns == stamp
    assert again.stderr.count("resuming from") == 2, again.stderr[-2000:]  # both folds, no retraining
    assert json.loads((out / "metrics.json").read_text()) == m

    # A second recipe on the same folds, then the two mixed out of fold: the mean of their probabilities.
    p["train"]["seed"] = 7
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    crossfit("--params", "other.yaml", "--out", "models/other")
    crossfit("--combine", "models/crossfit", "models/other", "--out", "models/mix")
    a, b = (np.load(tmp_path / f"models/{d}/oof.npz") for d in ("crossfit", "other"))
    assert np.array_equal(a["fold"], b["fold"]) and not np.allclose(a["probs"], b["probs"])
    info = json.loads((tmp_path / "data/prepared/prepare.json").read_text())
    k = info["classes"].index(info["ok_class"])
    ok = np.array([r["label"] == "ok" for r in sorted(rows, key=lambda r: list(map(str, a["paths"])).index(r["path"]))])
    mixed = json.loads((tmp_path / "models/mix/metrics.json").read_text())
    assert mixed["oof_auc"] == roc_auc(1 - (a["probs"][:, k] + b["probs"][:, k]) / 2, ~ok)
    assert len(mixed["test_auc_by_model"]) == 4
    # The evaluate stage's cut once per fold: fold k's OK parts set it (each part weighing one), the mean of
    # both recipes' fold-k models is judged on the test split.
    from pipeline.metrics import binary_metrics, group_weights, threshold_for_false_alarms

    with np.load(tmp_path / "data/prepared/test.npz") as z:
        test_defect = z["labels"] != k
    groups = np.concatenate([np.load(tmp_path / f"data/prepared/{n}.npz")["groups"] for n in ("train", "val")])
    oof = 1 - (a["probs"][:, k] + b["probs"][:, k]) / 2
    for f in (0, 1):
        held_ok = (a["fold"] == f) & ok
        cut = threshold_for_false_alarms(oof[held_ok], 0.03, group_weights(groups[held_ok]))
        at = binary_metrics(1 - (a["test_probs"][f][:, k] + b["test_probs"][f][:, k]) / 2, test_defect, cut)
        assert mixed["test_recall_at_fold_cuts"][f] == at["defect_recall"]
        assert mixed["test_false_alarms_at_fold_cuts"][f] == at["false_alarm_rate"]
    assert mixed["test_within_at_fold_cuts"] == sum(f <= 0.03 for f in mixed["test_false_alarms_at_fold_cuts"])


def test_tiles_are_cut_at_full_resolution_and_labeled_by_the_defect_mask():
    from pipeline.tiles import tile_labels
    from serving.tiles import cut_tiles, image_probs, spans

    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (200, 300, 3), dtype=np.uint8)
    pieces = cut_tiles(image, 128)
    assert [(x, y) for x, y, _ in pieces] == [(x, y) for y in (0, 72) for x in (0, 86, 172)]
    covered = np.zeros((200, 300), bool)
    for x, y, t in pieces:
        assert t.shape == (128, 128, 3) and np.array_equal(t, image[y : y + 128, x : x + 128])  # 1:1, no resampling
        covered[y : y + 128, x : x + 128] = True
    assert covered.all() and spans(128, 128) == [0] and spans(129, 128) == [0, 1]
    (x, y, small), = cut_tiles(image[:90, :100], 128)  # fmt: skip
    top, left = (128 - 90) // 2, (128 - 100) // 2
    assert np.array_equal(small[top : top + 90, left : left + 100], image[:90, :100])  # padded, not scaled

    mask = np.zeros((200, 300), bool)
    mask[10:15, 10:15] = True  # 25 px in the first tile only
    mask[150:152, 295:299] = True  # 8 px, in the last tile: too few to call it a defect, too many to call it clean
    positions = [(x, y) for x, y, _ in pieces]
    assert tile_labels(mask, 3, 0, positions, 128, 16) == [3, 0, 0, 0, 0, None]
    assert tile_labels(None, 3, 0, positions, 128, 16) == [None] * 6  # a defect without a mask: not known where
    assert tile_labels(None, 0, 0, positions, 128, 16) == [0] * 6  # every tile of an OK image is OK

    # --scale 0.5: the photograph at half its sides (bilinear, like the prepare stage), its 1-px crack kept in the mask
    from PIL import Image

    from experiments.tiles import rescale

    crack = np.zeros((200, 300), bool)
    crack[20:180, 101] = True
    small, small_mask = rescale(image, crack, 0.5)
    expected = np.asarray(Image.fromarray(image).resize((150, 100), Image.Resampling.BILINEAR))
    assert small.shape == (100, 150, 3) and np.array_equal(small, expected)
    assert small_mask.shape == (100, 150) and small_mask.sum() == 80 and small_mask[10:90, 50].all()
    assert [(x, y) for x, y, _ in cut_tiles(small, 128)] == [(0, 0), (22, 0)]  # 2 tiles instead of 6
    assert tile_labels(small_mask, 3, 0, [(0, 0), (22, 0)], 128, 16) == [3, 3]  # the crack at x 50: in both tiles
    odd = np.zeros((199, 333), bool)  # odd sides (333 -> 166): PIL's box filter loses a crack in column 166
    odd[100:120, 166] = True
    odd[50:60, 332] = True
    odd[198, 0] = True
    _, odd_small = rescale(image[:199, :299].repeat(2, axis=1)[:, :333], odd, 0.5)
    assert odd_small.shape == (100, 166) and odd_small[50:60, 82].all() and odd_small[25:30, 165].all()
    assert odd_small[99, 0] and odd_small.sum() == 16  # every marked pixel in exactly its cell, nothing else
    grey, none = rescale(image[:, :, :1], None, 0.5)
    expected = np.asarray(Image.fromarray(image[:, :, 0]).resize((150, 100), Image.Resampling.BILINEAR))
    assert grey.shape == (100, 150, 1) and np.array_equal(grey[:, :, 0], expected) and none is None
    same, same_mask = rescale(image, crack, 1.0)
    assert same is image and same_mask is crack

    probs = np.array([[0.9, 0.1, 0.0], [0.3, 0.2, 0.5], [0.95, 0.05, 0.0], [0.6, 0.4, 0.0]], np.float32)
    out = image_probs(probs, np.array([0, 0, 1, 1]), 2, ok_index=0)
    assert np.array_equal(out, probs[[1, 3]])  # each image: its most suspicious tile's probabilities


def test_tiles_fuses_a_tile_model_with_the_pipelines_model_at_the_evaluate_stages_cut(exported_project, tmp_path):
    import json

    import mlflow

    shutil.copytree(exported_project, tmp_path, dirs_exist_ok=True)
    env = venv_env()
    env["PYTHONPATH"] = str(ROOT)

    def tiles(*extra):
        cmd = [sys.executable, str(ROOT / "experiments/tiles.py"), "--tile", "32", "--epochs", "1", "--lr", "0.0005"]
        return subprocess.run([*cmd, *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    (tmp_path / "nomasks").mkdir()
    proc = tiles("--raw", "nomasks", "--out", "models/none")
    assert proc.returncode != 0 and "nomasks/masks: no defect masks" in proc.stderr, proc.stderr[-2000:]
    proc = tiles("--scale", "2", "--out", "models/none")
    assert proc.returncode != 0 and "--scale 2.0: expected a factor in (0, 1]" in proc.stderr, proc.stderr[-2000:]

    proc = tiles()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = tmp_path / "models/tiles"
    with np.load(tmp_path / "data/prepared/test.npz") as z:
        y_test = z["labels"]
    with np.load(out / "prepared/train.npz") as z:
        assert z["images"].shape[1:3] == (32, 32)
        paths = [str(p) for p in z["paths"]]
    assert all("#" in p for p in paths) and {p.rsplit("#")[1] for p in paths} <= {"0,0", "32,0", "0,32", "32,32"}
    m = json.loads((out / "metrics.json").read_text())
    assert m["tiles_per_image"] == 4.0 and m["scale"] == 1.0  # 64 px images, 32 px tiles at 1:1
    # Whether the tile model learned is said, not left to be guessed from the figures (one epoch rarely does).
    assert m["tile_model_fit"] == (m["tile_train_accuracy"] >= m["epoch_ok_share"] + 0.05)
    assert f"train accuracy {m['tile_train_accuracy']:.2f}" in (out / "report.md").read_text()
    assert m["tile_model_fit"] or "the tile model did not fit" in proc.stderr
    s = np.load(out / "scores.npz")
    assert np.allclose(s["fused_test"], (s["whole_test"] + s["tiles_test"]) / 2)
    info = json.loads((tmp_path / "data/prepared/prepare.json").read_text())
    ok = info["classes"].index(info["ok_class"])
    for view in ("whole", "tiles", "fused"):  # each view judged by the evaluate stage's own figures
        assert m[view]["roc_auc"] == roc_auc(1 - s[f"{view}_test"][:, ok], y_test != ok)
        assert (out / view / "roc.png").stat().st_size > 0
        assert f"| {view} | {m[view]['defect_recall_at_far_threshold']:.2f} " in (out / "report.md").read_text()
    whole = json.loads((tmp_path / "reports/evaluate/metrics.json").read_text())
    assert abs(m["whole"]["roc_auc"] - whole["roc_auc"]) < 1e-6  # the pipeline's model, as its evaluate stage saw it
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = mlflow.search_runs(experiment_names=["defect-detection"], filter_string="tags.mlflow.runName = 'tiles'")
    assert len(run) == 1 and abs(run["metrics.fused_roc_auc"][0] - m["fused"]["roc_auc"]) < 1e-9
    assert run["params.seed"][0] == str(m["seed"]) and run["metrics.tile_train_accuracy"][0] == m["tile_train_accuracy"]
    # The tile model's own learning rate reached the trainer (the params' 0.003 is for whole images).
    assert read_history(out / "reports/history.csv")[0]["lr"] == pytest.approx(0.0005)
    assert m["lr"] == 0.0005 and run["params.lr"][0] == "0.0005"
    # The tile model is --model's network (resnet10t by default), not the params' whole-image one.
    assert m["model"] == "resnet10t" and run["params.model"][0] == "resnet10t" and m["epochs"] == 1
    assert load_model(out / "model/model.pt")[1]["architecture"] == "resnet10t"
    assert "The tile model (resnet10t, epochs: 1) at its last epoch" in (out / "report.md").read_text()

    # Again, as after a kill: the same tiles are not written or trained again, and the figures come out the same.
    # A second --with model (an ensemble's member; here any model.pt) gets its own views beside the same tiles.
    stamp = (out / "prepared/train.npz").stat().st_mtime_ns
    again = tiles("--with", "models/train/model.pt", "models/tiles/model/model.pt")
    assert again.returncode == 0 and "resuming from" in again.stderr, again.stderr[-2000:]
    assert (out / "prepared/train.npz").stat().st_mtime_ns == stamp
    m2 = json.loads((out / "metrics.json").read_text())
    assert {k: m2[k] for k in m} == m and set(m2) - set(m) == {"whole-2", "fused-2"}
    s2 = np.load(out / "scores.npz")
    assert np.allclose(s2["fused-2_test"], (s2["whole-2_test"] + s2["tiles_test"]) / 2)
    assert not np.allclose(s2["whole-2_test"], s2["whole_test"])  # the other model's scores, not the first's
    assert m2["fused-2"]["roc_auc"] == roc_auc(1 - s2["fused-2_test"][:, ok], y_test != ok)
    report = (out / "report.md").read_text()
    assert "whole-2: models/tiles/model/model.pt" in report and "| fused-2 | " in report
