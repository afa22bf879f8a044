"""The training loop's parts: data order and sharding, EMA, precision choice, pretrained weights."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
import timm
import torch

from pipeline.config import ConfigError, ModelConfig
from pipeline.model import create_model
from pipeline.runtime import cpu_has_native_bf16, resolve_runtime
from pipeline.seeds import AUGMENT, ORDER, derive_seed
from pipeline.training.loop import EMA, EpochBatches, FocalLoss, RankingLoss
from tests.conftest import ROOT, venv_env

LABELS = np.array([0] * 70 + [1] * 20 + [2] * 10)


def epoch_indices(sampler: EpochBatches, epoch: int, start: int = 0) -> list[int]:
    sampler.set_epoch(epoch, start)
    return [i for batch in sampler for i, _ in batch]


def test_every_image_of_every_epoch_on_every_rank_draws_its_own_augmentation_stream():
    seeds = []
    for epoch in range(3):
        for rank in range(2):
            sampler = EpochBatches(LABELS, 8, seed=0, rank=rank, world=2)
            sampler.set_epoch(epoch)
            seeds += [s for batch in sampler for _, s in batch]
    assert len(seeds) == len(set(seeds)) == 3 * 2 * (100 // 2 // 8) * 8
    assert derive_seed(0, ORDER, 1) != derive_seed(0, AUGMENT, 1) != derive_seed(1, ORDER, 0)  # purposes apart
    assert all(0 <= s < 2**31 for s in seeds)  # what torch, albumentations and numpy all accept


def test_ranks_get_disjoint_equal_shares_of_a_new_order_each_epoch():
    ranks = [EpochBatches(LABELS, 8, seed=3, rank=r, world=3) for r in range(3)]
    shares = [epoch_indices(s, 0) for s in ranks]
    assert len({len(s) for s in shares}) == 1 and len(shares[0]) == 32  # 100 // 3 = 33 -> 4 batches of 8
    assert not set(shares[0]) & set(shares[1]) and not set(shares[1]) & set(shares[2])
    assert epoch_indices(ranks[0], 1) != shares[0]
    assert epoch_indices(ranks[0], 0) == shares[0]  # a function of (seed, epoch) alone


def test_resuming_inside_an_epoch_yields_exactly_the_remaining_batches():
    s = EpochBatches(LABELS, 8, seed=0)
    s.set_epoch(5)
    full = list(s)
    s.set_epoch(5, start=4)
    assert list(s) == full[4:]  # same images and the same augmentation seeds


def test_balanced_sampling_evens_out_the_classes():
    s = EpochBatches(np.repeat(LABELS, 20), 50, seed=0, balanced=True)
    counts = np.bincount(np.repeat(LABELS, 20)[epoch_indices(s, 0)], minlength=3) / (len(s) * 50)
    assert np.allclose(counts, 1 / 3, atol=0.03), counts


def test_majority_per_epoch_draws_a_fresh_share_of_the_largest_class_and_keeps_every_other_image():
    s = EpochBatches(LABELS, 10, seed=0, majority=0.5)  # 70 OK-like images of class 0: 35 per epoch, + 30 others
    assert len(s) == 6  # 65 images per epoch -> 6 batches of 10
    seen = [epoch_indices(s, e) for e in range(4)]
    for indices in seen:
        counts = np.bincount(LABELS[indices], minlength=3)
        assert counts[0] <= 35 and counts[0] >= 25, counts  # the share (less what the last partial batch cuts)
        assert len(set(indices)) == len(indices)  # no image twice in an epoch
    majority_sets = [{i for i in indices if LABELS[i] == 0} for indices in seen]
    assert majority_sets[0] != majority_sets[1]  # a new draw every epoch, so over the run every image is used
    assert len(set().union(*majority_sets)) > 60
    every = EpochBatches(LABELS, 10, seed=0)
    assert len(every) == 10 and sorted(epoch_indices(every, 0)) == list(range(100))


def test_ema_tracks_the_weights_and_is_swapped_in_only_inside_its_block():
    model = torch.nn.Linear(4, 2)
    ema = EMA(model, decay=0.5)
    start = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model)  # warm-up decay min(0.5, 2/11): the average moves most of the way
    averaged = ema.shadow["weight"].clone()
    assert torch.allclose(averaged, start + 1 - 2 / 11)
    with ema.applied(model):
        assert torch.equal(model.weight, averaged)
    assert torch.equal(model.weight, start + 1)
    off = EMA(model, decay=0.0)
    off.update(model)
    with off.applied(model):
        assert torch.equal(model.weight, start + 1)


def test_focal_loss_is_cross_entropy_at_gamma_0_and_mutes_what_the_model_already_gets_right():
    logits = torch.tensor([[4.0, 0.0, 0.0], [0.0, 0.2, 0.0], [0.0, 0.0, 3.0]])
    y = torch.tensor([0, 1, 2])
    weight = torch.tensor([1.0, 3.0, 0.5])
    for w in (None, weight):
        for smoothing in (0.0, 0.1):
            ce = torch.nn.functional.cross_entropy(logits, y, weight=w, label_smoothing=smoothing)
            assert torch.allclose(FocalLoss(0.0, w, smoothing)(logits, y), ce)
    per_image = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    focal = torch.stack([FocalLoss(2.0)(logits[i : i + 1], y[i : i + 1]) for i in range(3)])
    # the confident right answers (images 0 and 2) keep a far smaller share of their loss than the unsure one
    share = focal / per_image
    assert share[1] > 10 * share[0] and share[1] > 10 * share[2]
    saturated = torch.tensor([[60.0, 0.0, 0.0]], requires_grad=True)
    FocalLoss(0.5)(saturated, torch.tensor([0])).backward()  # gamma < 1 at p = 1: a finite gradient
    assert torch.isfinite(saturated.grad).all()


def test_ranking_term_pushes_a_defect_above_the_ok_images_that_outscore_it():
    ce = torch.nn.CrossEntropyLoss()
    ok = 2  # the OK class in the middle, as `free` is among the magnetic tile classes
    y = torch.tensor([ok, ok, 0, 4])  # two OK images, two defects
    ranked_right = torch.full((4, 5), -5.0)
    ranked_right[[0, 1, 2, 3], [ok, ok, 0, 4]] = 5.0
    assert abs(RankingLoss(ok, 1.0, ce)(ranked_right, y) - ce(ranked_right, y)) < 1e-3  # every pair in order
    # the defect score is log(p(any defect) / p(ok)); OK image 1 outscores defect 2 (1.0 against -1.0)
    logits = torch.tensor([[0, 0, 3.0, 0, 0], [0, 1.0, 0, 0, 0], [-1.0, 0, 0, 0, 0], [0, 0, -2.0, 0, 3.0]])
    p = logits.softmax(1)
    score = torch.log((1 - p[:, ok]) / p[:, ok])
    pairs = torch.nn.functional.softplus(score[[0, 1]][None, :] - score[[2, 3]][:, None]).mean()
    assert torch.allclose(RankingLoss(ok, 0.5, ce)(logits, y), ce(logits, y) + 0.5 * pairs, atol=1e-5)
    with_term, plain = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    RankingLoss(ok, 1.0, ce)(with_term, y).backward()
    ce(plain, y).backward()
    extra = with_term.grad - plain.grad
    assert extra[2, ok] > 0 and extra[1, ok] < 0  # beyond cross-entropy: defect 2 away from OK, OK image 1 towards it
    only_ok = torch.full((4,), ok)
    assert torch.equal(RankingLoss(ok, 1.0, ce)(logits, only_ok), ce(logits, only_ok))  # no pair, no term


def test_precision_is_resolved_once_by_device():
    rt = resolve_runtime("cpu", "auto")
    assert rt.precision == ("bf16" if cpu_has_native_bf16() else "fp32")
    assert not rt.scaler.is_enabled()
    with pytest.raises(RuntimeError, match="fp16 autocast is for CUDA"):
        resolve_runtime("cpu", "fp16")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="cuda was asked for"):
            resolve_runtime("cuda", "auto")


def test_local_timm_weights_load_with_a_new_classifier(tmp_path):
    source = timm.create_model("test_efficientnet", num_classes=10)
    path = tmp_path / "weights.pth"
    torch.save(source.state_dict(), path)
    net = create_model(ModelConfig("test_efficientnet", str(path), 0.0, "avg", "dataset"), 4, 3)
    got, want = net.backbone.state_dict(), source.state_dict()
    backbone = [k for k in got if not k.startswith("classifier.")]
    assert all(torch.equal(got[k], want[k]) for k in backbone)
    assert got["classifier.weight"].shape == (4, want["classifier.weight"].shape[1])
    with pytest.raises(ConfigError, match="weights file .* not found"):
        create_model(ModelConfig("test_efficientnet", str(tmp_path / "nope.pth"), 0.0, "avg", "dataset"), 4, 3)


def test_hub_weights_offline_fail_fast_with_advice():
    from pipeline.model import _hub_reachable

    if _hub_reachable():
        pytest.skip("the hub is reachable here; this checks the offline behaviour")
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="set model.pretrained to its local path"):
        create_model(ModelConfig("test_efficientnet", "hub", 0.0, "avg", "dataset"), 4, 3)
    assert time.perf_counter() - t0 < 10


@pytest.mark.slow
def test_throughput_benchmark_runs_both_loops_side_by_side(tmp_path):
    out = tmp_path / "tt.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/train_throughput.py"),
            "--mode",
            "loop",
            "--model",
            "test_efficientnet",
            "--image-size",
            "64",
            "--batch-size",
            "8",
            "--steps",
            "2",
            "--rounds",
            "2",
            "--out",
            str(out),
        ],
        env=venv_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    names = [r["name"] for r in result["results"]]
    assert names[0].startswith("stage loop") and names[-1] == "plain loop"
    assert "data loader alone, 0 workers" in names and "data loader alone, 2 workers" in names
    assert all(r["img_s"] > 0 and len(r["rounds"]) == 2 for r in result["results"])
    assert 0 <= result["stage_loop_data_wait_share"] < 1
