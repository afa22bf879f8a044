"""Defect masks as a training signal (``train.mask_loss``): prepared with their images, moved by the same
augmentation, learned by a training-only head that never reaches the saved model."""

from __future__ import annotations

import csv
import dataclasses
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline import checkpoint
from pipeline.config import load_params
from pipeline.data.augment import ImageDataset, build_policy
from pipeline.data.masks import MASK_UNKNOWN
from pipeline.data.prepare import load_mask, load_masks, load_split, prepare
from pipeline.model import create_model, load_model
from pipeline.training.loop import MaskLoss
from tests.conftest import ROOT, run_stages_in, tiny_params

P = load_params(ROOT / "params.yaml")


def write_png(path, array) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


def test_prepared_masks_follow_their_images_and_say_what_is_not_known(tmp_path):
    images, masks = tmp_path / "images", tmp_path / "masks"
    rng = np.random.default_rng(0)
    rows = []
    for label, names in (("ok", ["a", "b"]), ("dent", ["c", "d", "e"])):
        for n in names:
            write_png(images / label / f"{n}.png", rng.integers(0, 255, (40, 80, 3), np.uint8))  # wide: letterboxed
            rows.append({"path": f"{label}/{n}.png", "label": label, "group": "f" * 64})  # one group, in train
    dent = np.zeros((40, 80), np.uint8)
    dent[10:14, 60:70] = 255  # right half, upper part
    write_png(masks / "dent" / "c.png", dent)  # d.png has no mask file; the OK images have none either
    speck = np.zeros((40, 80), np.uint8)
    speck[20, 40] = 255  # one pixel: gone at 32 px
    write_png(masks / "dent" / "e.png", speck)
    cfg = dataclasses.replace(P.prepare, image_size=32)

    prepare(rows, images, ["dent", "ok"], "ok", 3, cfg, tmp_path / "out", masks_dir=masks)
    _, _, paths = load_split(tmp_path / "out", "train")
    got = dict(zip(paths, load_masks(tmp_path / "out", "train"), strict=True))
    assert got["dent/c.png"].any() and set(np.unique(got["dent/c.png"])) == {0, 1}
    assert np.array_equal(got["dent/c.png"], load_mask(masks, "dent/c.png", 32, "letterbox"))
    ys, xs = np.nonzero(got["dent/c.png"])
    assert xs.min() >= 16 and ys.min() >= 8 and ys.max() < 16  # letterbox: 80x40 -> 32x16, 8 px pad above
    assert (got["dent/d.png"] == MASK_UNKNOWN).all()  # a defect with no mask: not known, not "clean"
    assert (got["dent/e.png"] == MASK_UNKNOWN).all()  # nor one whose mask vanished in the resize
    assert (got["ok/a.png"] == 0).all() and (got["ok/b.png"] == 0).all()  # OK: nothing to find, known

    shutil.rmtree(masks)  # a dataset without masks: nothing is known, OK images included
    prepare(rows, images, ["dent", "ok"], "ok", 3, cfg, tmp_path / "out2", masks_dir=masks)
    assert (load_masks(tmp_path / "out2", "train") == MASK_UNKNOWN).all()


def test_the_letterbox_padding_of_a_mask_is_no_defect_however_large_the_defect(tmp_path):
    big = np.zeros((40, 80), np.uint8)
    big[:, 10:] = 255  # the defect covers 7/8 of a wide image: its mean colour is "defect"
    write_png(tmp_path / "dent" / "a.png", big)
    m = load_mask(tmp_path, "dent/a.jpg", 32, "letterbox")  # 80x40 -> 32x16, 8 px padding above and below
    assert not m[:8].any() and not m[24:].any()
    assert m[8:24, 8:].all() and not m[8:24, :3].any()


def test_the_augmentation_moves_a_mask_exactly_as_its_image():
    img = np.zeros((1, 16, 16, 3), np.uint8)
    img[0, 2:5, 1:3] = 200  # a bright mark, upper left
    mask = np.zeros((1, 16, 16), np.uint8)
    mask[0, 2:5, 1:3] = 1
    policy = build_policy(
        [
            {"name": "HorizontalFlip", "p": 1.0},
            {"name": "RandomRotate90", "p": 1.0},
            {"name": "RandomGamma", "gamma_limit": [80, 120], "p": 1.0},
        ]
    )
    for seed in range(6):
        x, label, m = ImageDataset(img, np.array([1]), policy, masks=mask)[(0, seed)]
        assert label == 1 and m.dtype == torch.uint8 and set(m.unique().tolist()) == {0, 1}
        assert np.array_equal(m.numpy() == 1, x.numpy()[..., 0] > 100)  # the mark moved, the mask with it
    unknown = np.full((1, 16, 16), MASK_UNKNOWN, np.uint8)
    _, _, m = ImageDataset(img, np.array([1]), policy, masks=unknown)[(0, 1)]
    assert (m.numpy() == MASK_UNKNOWN).all()
    # a rotation fills the new corners of a moved mask with 0: an unknown mask must not come out "clear there"
    turn = build_policy([{"name": "Affine", "rotate": [40, 50], "p": 1.0}])
    for seed in range(3):
        _, _, m = ImageDataset(img, np.array([1]), turn, masks=unknown)[(0, seed)]
        assert (m.numpy() == MASK_UNKNOWN).all()
    crop = build_policy([{"name": "RandomCrop", "height": 12, "width": 12}])  # a crop: the mask shrinks with it
    x, _, m = ImageDataset(img, np.array([1]), crop, masks=unknown)[(0, 1)]
    assert m.shape == x.shape[:2] == (12, 12) and (m.numpy() == MASK_UNKNOWN).all()


def test_mask_loss_marks_the_cell_of_a_one_pixel_defect_and_skips_unknown_masks():
    masks = torch.zeros(3, 32, 32, dtype=torch.uint8)
    masks[0, 5, 29] = 1  # one pixel: cell (0, 3) of the 4 x 4 grid of 8 px cells
    masks[2] = MASK_UNKNOWN
    right = torch.full((3, 1, 4, 4), -6.0)
    right[0, 0, 0, 3] = 6.0
    wrong = torch.full((3, 1, 4, 4), -6.0)
    wrong[0, 0, 3, 0] = 6.0  # a cell far from the defect
    loss = MaskLoss(1.0)
    assert loss(right, masks) < 0.01 < 1.0 < loss(wrong, masks)
    # the image whose mask is not known adds nothing, whatever its head says
    noisy = right.clone()
    noisy[2] = torch.randn(1, 4, 4) * 5
    assert torch.allclose(loss(noisy, masks), loss(right[:2], masks[:2]))
    # the one defect cell weighs as much as the 31 clean cells together
    only_miss = torch.full((3, 1, 4, 4), -6.0)
    only_false = right.clone()
    only_false[1, 0, 2, 2] = 6.0
    assert torch.allclose(loss(only_miss, masks), torch.tensor(0.5 * 6.0025), atol=0.01)
    assert loss(only_false, masks) < loss(only_miss, masks) / 10
    assert loss(right[2:], masks[2:]) == 0  # nothing known in the batch: no loss, and no error
    head = right[2:].clone().requires_grad_()
    loss(head, masks[2:]).backward()
    assert head.grad is not None and not head.grad.any()  # still in the graph (DDP needs it), zero gradient
    inf = right.clone()
    inf[2] = float("inf")  # an unknown image whose head overflowed (fp16) leaves the loss finite
    assert torch.isfinite(loss(inf, masks))
    assert MaskLoss(3.0)(wrong, masks) == pytest.approx(3 * loss(wrong, masks).item())


def test_mask_loss_cells_are_cut_as_the_network_strides_when_the_side_is_no_multiple_of_16():
    masks = torch.zeros(1, 40, 40, dtype=torch.uint8)  # 40 px at stride 16: a 3 x 3 grid, cells 0-15, 16-31, 32-39
    masks[0, 30, 30] = 1  # in cell (1, 1); an even split of 40 px into 3 bins would say (2, 2)
    right = torch.full((1, 1, 3, 3), -6.0)
    right[0, 0, 1, 1] = 6.0
    even = torch.full((1, 1, 3, 3), -6.0)
    even[0, 0, 2, 2] = 6.0
    assert MaskLoss(1.0)(right, masks) < 0.01 < 1.0 < MaskLoss(1.0)(even, masks)


def test_the_mask_head_sees_the_stride_16_features_and_trains_them():
    net = create_model(dataclasses.replace(P.model, name="test_efficientnet"), 3, 3)
    net.add_mask_head()
    x = torch.randint(0, 255, (2, 64, 64, 3), dtype=torch.uint8)
    logits, mask_logits = net(x, with_mask=True)
    assert logits.shape == (2, 3) and mask_logits.shape == (2, 1, 4, 4)
    assert torch.equal(net(x).detach(), logits.detach())  # the classifier is the same with or without the head
    masks = torch.zeros(2, 64, 64, dtype=torch.uint8)
    masks[0, 10:20, 40:50] = 1
    MaskLoss(1.0)(mask_logits, masks).backward()
    stem = net.backbone.conv_stem.weight.grad
    assert stem is not None and stem.abs().sum() > 0  # the mask's gradient reaches the features


def test_a_network_without_a_spatial_grid_names_the_knob_to_turn_off():
    import timm

    from pipeline.config import ConfigError
    from pipeline.model import DefectNet

    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=3, pretrained=False)
    net = DefectNet(vit, (0.5,) * 3, (0.5,) * 3)
    net.add_mask_head()
    x = torch.randint(0, 255, (2, 32, 32, 3), dtype=torch.uint8)
    assert net(x).shape == (2, 3)  # the classifier alone still works
    with pytest.raises(ConfigError, match=r"train.mask_loss: .* not a spatial grid .* set train.mask_loss: 0"):
        net(x, with_mask=True)


def test_train_loss_is_the_class_loss_and_the_mask_loss_is_reported_beside_it():
    from torch import nn

    from pipeline.distributed import Dist
    from pipeline.runtime import resolve_runtime
    from pipeline.training.loop import EMA, EpochProgress, train_one_epoch

    class Fixed(nn.Module):  # a loss of a known value that still reaches the weights
        def __init__(self, value: float) -> None:
            super().__init__()
            self.value = value

        def forward(self, out: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
            return self.value + 0.0 * out.float().sum()

    net = create_model(dataclasses.replace(P.model, name="test_efficientnet"), 3, 3)
    net.add_mask_head()
    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, 255, (4, 32, 32, 3), dtype=torch.uint8, generator=g),
            torch.tensor([0, 1, 2, 0]),
            torch.zeros(4, 32, 32, dtype=torch.uint8),
        )
        for _ in range(3)
    ]
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    rt = resolve_runtime("cpu", "fp32")
    out = train_one_epoch(
        net,
        batches,
        Fixed(1.0),
        opt,
        sched,
        rt,
        EMA(net, 0.0),
        EpochProgress(),
        Dist("none"),
        mask_criterion=Fixed(0.5),
    )
    assert out["train_loss"] == pytest.approx(1.0) and out["train_mask_loss"] == pytest.approx(0.5)


@pytest.mark.slow
def test_training_with_masks_shows_the_mask_loss_and_saves_the_plain_network(prepared_project, tmp_path):
    shutil.copytree(prepared_project, tmp_path, dirs_exist_ok=True)
    p = tiny_params(**{"model.name": "test_efficientnet"})
    p["train"].update(mask_loss=1.0, epochs=2)
    run_stages_in(tmp_path, p, ["train"])
    with open(tmp_path / "reports/train/history.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    mask_losses = [float(r["train_mask_loss"]) for r in rows]
    assert len(mask_losses) == 2 and all(0 < m < 10 for m in mask_losses)
    assert all(0 < float(r["train_loss"]) < 10 for r in rows)  # the class loss alone, comparable with val_loss
    saved = checkpoint.load(tmp_path / "models/train/model.pt")["model"]
    assert not any(k.startswith("mask_head.") for k in saved)  # evaluate, export and the runner: the classifier
    model, _ = load_model(tmp_path / "models/train/model.pt")
    assert model.mask_head is None
