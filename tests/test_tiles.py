"""The tile model in the pipeline: where the data has defect masks, the prepare stage cuts the photographs
at 1:1 into tiles labeled by the masks, the train stage trains the tile model beside the kept whole-image
members, the evaluate stage judges the fused probabilities, and the export writes a tile graph per variant
that the runner uses the same way."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
import yaml

from pipeline.config import ConfigError, params_from_dict
from pipeline.data.masks import read_mask
from pipeline.data.prepare import read_summary
from pipeline.data.tiling import tile_data, tile_labels
from pipeline.evaluation.fusion import tile_view
from pipeline.metrics import roc_auc, softmax
from pipeline.model import load_model, load_tile_model, predict_logits
from pipeline.runtime import resolve_runtime
from serving.card import ModelCard
from serving.preprocess import decode_image
from serving.runner import Runner
from serving.tiles import cut_tiles, fuse, image_probs, spans
from tests.conftest import run_stages_in, tiny_params


def tiled_params() -> dict:
    """Tiny synthetic data (64 px photographs) with tiles on: 32 px inputs, so 4 tiles per photograph; two
    whole-image members of which only the second is kept, and a 1-epoch resnet10t tile model."""
    p = tiny_params(**{"model.name": "test_efficientnet", "prepare.image_size": 32})
    p["train"].update(ensemble=2, ensemble_members=[{}, {}])
    p["tiles"].update(use="auto", keep_members=[1])
    p["tiles"]["recipe"] = {"model.name": "resnet10t", "train.epochs": 1, "train.lr": 0.0005}
    return p


@pytest.fixture(scope="module")
def tiled(tmp_path_factory):
    work = tmp_path_factory.mktemp("tiled")
    run_stages_in(work, tiled_params(), ["ingest", "validate", "prepare", "augment", "train", "evaluate", "export"])
    return work


def test_tiles_params_are_checked_by_name():
    for key, value, said in [
        ("weight", 0.0, "tiles.weight: a share in (0, 1]"),
        ("keep_members", [3], "tiles.keep_members: indices of train.ensemble's members (0..2)"),
        ("recipe", {"data.channels": 1}, "tiles.recipe: data.channels: the tile model may change model.*"),
        ("recipe", {"train.lr": "fast"}, "tiles.recipe: train.lr: expected a number"),
        ("recipe", {"train.lrr": 0.1}, "tiles.recipe: train.lrr: params.yaml has no such key"),
        ("use", "on", "tiles.use: expected one of ['auto', 'off']"),
    ]:
        p = tiny_params()
        p["train"].update(ensemble=3, ensemble_members=[])
        p["tiles"][key] = value
        with pytest.raises(ConfigError, match=re.escape(said)):
            params_from_dict(p)
    p = tiny_params()
    p["tiles"]["use"] = yaml.safe_load("use: off")["use"]  # YAML reads a bare off as false: still means off
    assert params_from_dict(p).tiles.use == "off"


def test_prepare_cuts_1to1_tiles_labeled_by_the_masks(tiled):
    info = read_summary(tiled / "data/prepared")
    tiles_info = read_summary(tiled / "data/prepared/tiles")
    assert info["tiles"]["tile"] == 32 and info["tiles"]["tiles_per_image"] == 4.0  # 64 px at 1:1 in 32 px tiles
    assert tiles_info["image_size"] == 32 and tiles_info["classes"] == info["classes"]
    ok = info["classes"].index(info["ok_class"])
    with np.load(tiled / "data/prepared/tiles/train.npz") as z:
        images, labels, paths = z["images"], z["labels"], [str(p) for p in z["paths"]]
    assert images.shape[1:] == (32, 32, 3) and (labels >= 0).all()  # the left-out tiles are not trained on
    assert ((labels != ok).sum(), (labels == ok).sum()) == (
        info["tiles"]["train_tiles"]["defect"],
        info["tiles"]["train_tiles"]["ok"],
    )
    # Each tile is its photograph's pixels at 1:1, labeled by the photograph's mask.
    by_photo: dict[str, dict] = {}
    for img, lab, p in zip(images, labels, paths, strict=True):
        rel, xy = p.split("#")
        by_photo.setdefault(rel, {})[tuple(map(int, xy.split(",")))] = (img, lab)
    class_of = {c: i for i, c in enumerate(info["classes"])}
    checked_defect = 0
    for rel, tiles in list(by_photo.items())[:12]:
        photo = decode_image(tiled / "data/raw/images" / rel, 3)
        mask = read_mask(tiled / "data/raw/masks", rel)
        label = class_of[rel.split("/")[0]]
        positions = [(x, y) for y in spans(64, 32) for x in spans(64, 32)]
        expected = tile_labels(mask, label, ok, positions, 32, 16)
        for (x, y), want in zip(positions, expected, strict=True):
            if want is None:
                assert (x, y) not in tiles
                continue
            img, lab = tiles[(x, y)]
            assert np.array_equal(img, photo[y : y + 32, x : x + 32]) and lab == want
            checked_defect += want != ok
    assert checked_defect > 0


def test_prepare_without_masks_or_with_tiles_off_cuts_no_tiles(tiled, tmp_path):
    for name in ("data", "reports"):
        shutil.copytree(tiled / name, tmp_path / name)
    p = tiled_params()
    p["tiles"]["use"] = "off"
    run_stages_in(tmp_path, p, ["prepare"])
    assert read_summary(tmp_path / "data/prepared")["tiles"] is None
    assert not (tmp_path / "data/prepared/tiles").exists()
    shutil.rmtree(tmp_path / "data/raw/masks")
    run_stages_in(tmp_path, tiled_params(), ["prepare"])
    assert read_summary(tmp_path / "data/prepared")["tiles"] is None
    assert not (tmp_path / "data/prepared/tiles").exists()


def test_train_keeps_the_chosen_members_and_packs_the_tile_model(tiled):
    net, meta = load_model(tiled / "models/train/model.pt")
    assert meta["members"] == 1 and meta["member_seeds"] == [1]  # only member 1 (tiles.keep_members), seed + 1
    assert (tiled / "models/train/checkpoints/member-1/model.pt").is_file()
    assert not (tiled / "models/train/checkpoints/member-0").exists()
    tnet, tmeta = load_tile_model(tiled / "models/train/model.pt")
    assert tmeta["architecture"] == "resnet10t" and tmeta["weight"] == 0.5 and tmeta["tile"] == 32
    history = (tiled / "models/train/checkpoints/tiles/reports/history.csv").read_text().splitlines()
    assert len(history) == 2 and ",0.0005" in history[1]  # one epoch, at the recipe's learning rate
    summary = json.loads((tiled / "reports/train/metrics.json").read_text())
    assert summary["tiles"]["architecture"] == "resnet10t" and "tiles_val_auc" in summary


def test_evaluate_judges_the_fused_probabilities_and_each_view(tiled):
    m = json.loads((tiled / "reports/evaluate/metrics.json").read_text())
    net, meta = load_model(tiled / "models/train/model.pt")
    tnet, tmeta = load_tile_model(tiled / "models/train/model.pt")
    rt = resolve_runtime("cpu", "fp32")
    with np.load(tiled / "data/prepared/test.npz") as z:
        x, y, paths = z["images"], z["labels"], [str(p) for p in z["paths"]]
    ok = meta["classes"].index(meta["ok_class"])
    whole = softmax(predict_logits(net, x, rt))
    tiles = tile_view(tnet, paths, tiled / "data/raw/images", 32, 3, ok, rt)
    fused = fuse(whole, tiles, 0.5)
    assert np.allclose(fused, (whole + tiles) / 2, atol=1e-6)
    assert m["roc_auc"] == pytest.approx(roc_auc(1 - fused[:, ok], y != ok))
    assert m["whole_roc_auc"] == pytest.approx(roc_auc(1 - whole[:, ok], y != ok))
    assert m["tiles_roc_auc"] == pytest.approx(roc_auc(1 - tiles[:, ok], y != ok))
    assert m["tiles_weight"] == 0.5 and (tiled / "reports/evaluate/views/tiles/roc.png").is_file()
    # The heatmaps are the tile model's over each photograph's most suspicious tile (the whole model's beside):
    # zero outside that tile, which is one quadrant of a 64 px photograph cut into 32 px tiles.
    from pipeline.evaluation.heatmaps import tile_cams

    assert 0 <= m["pointing_game"] <= 1 and 0 <= m["whole_pointing_game"] <= 1
    assert (tiled / "reports/evaluate/views/whole/heatmaps.png").is_file()
    photo = lambda i: decode_image(tiled / "data/raw/images" / paths[i], 3)  # noqa: E731
    maps = tile_cams(tnet, photo, y, 32, ok, 32, meta["resize"])(list(range(6)))
    for cam in maps:
        lit = np.argwhere(cam > 0)
        if len(lit):
            assert np.ptp(lit[:, 0]) <= 16 and np.ptp(lit[:, 1]) <= 16  # one 16 px quadrant (+1 px: the resize)


def test_export_writes_a_tile_graph_per_variant_and_the_runner_scores_photographs_as_evaluated(tiled):
    card = ModelCard.read(tiled / "models/export/model.card.json")
    assert card.tiles is not None and card.tiles.model == "model.tiles.onnx" and card.tiles.size == 32
    assert card.tiles.architecture == "resnet10t" and card.tiles.weight == 0.5
    for v in ("fp16", "int8"):
        c = ModelCard.read(tiled / f"models/export/model.{v}.card.json")
        assert c.tiles.model == f"model.{v}.tiles.onnx" and (tiled / "models/export" / c.tiles.model).is_file()
    parity = json.loads((tiled / "reports/export/parity.json").read_text())
    assert (
        parity["fp32"]["prob_max_abs_diff"]
        <= yaml.safe_load((tiled / "params.yaml").read_text())["export"]["max_abs_diff"]
    )
    # One test photograph through the runner: the whole graph on its letterbox, the tile graph on its 4 tiles.
    net, meta = load_model(tiled / "models/train/model.pt")
    tnet, _ = load_tile_model(tiled / "models/train/model.pt")
    rel = json.loads(json.dumps([str(p) for p in np.load(tiled / "data/prepared/test.npz")["paths"]]))[0]
    photo = decode_image(tiled / "data/raw/images" / rel, 3)
    runner = Runner(tiled / "models/export/model.onnx", providers="cpu", force=True)
    (pred,) = runner.predict_files([tiled / "data/raw/images" / rel])
    rt = resolve_runtime("cpu", "fp32")
    from serving.preprocess import resize_image

    whole = softmax(predict_logits(net, resize_image(photo, 32, meta["resize"])[None], rt))
    tiles = np.stack([t for _, _, t in cut_tiles(photo, 32)])
    tile = image_probs(softmax(predict_logits(tnet, tiles, rt)), np.zeros(len(tiles), int), 1, card.ok_index)
    expected = 1 - fuse(whole, tile, 0.5)[0, card.ok_index]
    assert pred.defect_score == pytest.approx(float(expected), abs=1e-4)


def test_retraining_warm_starts_from_a_model_with_tiles(tiled):
    """``train.init_from`` a model.pt with one kept member and a tile model: the member's weights load (not
    the tile network's), where a file of one member was once read as a plain model and nothing loaded."""
    from pipeline.model import create_model
    from pipeline.training.warmstart import resolve_init

    p = tiled_params()
    p["train"]["init_from"] = str(tiled / "models/train/model.pt")
    params = params_from_dict(p)
    member, _ = load_model(tiled / "models/train/model.pt")
    fresh = create_model(params.model, 4, 3)
    resolve_init(params).load_into(fresh, params.model.name)
    for name, value in member.members[0].state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_tiles_are_cut_at_full_resolution_and_labeled_by_the_defect_mask():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (200, 300, 3), dtype=np.uint8)
    pieces = cut_tiles(image, 128)
    assert [(x, y) for x, y, _ in pieces] == [(x, y) for y in (0, 72) for x in (0, 86, 172)]
    covered = np.zeros((200, 300), bool)
    for x, y, t in pieces:
        assert t.shape == (128, 128, 3) and np.array_equal(t, image[y : y + 128, x : x + 128])  # 1:1, no resampling
        covered[y : y + 128, x : x + 128] = True
    assert covered.all() and spans(128, 128) == [0] and spans(129, 128) == [0, 1]
    ((x, y, small),) = cut_tiles(image[:90, :100], 128)
    top, left = (128 - 90) // 2, (128 - 100) // 2
    assert np.array_equal(small[top : top + 90, left : left + 100], image[:90, :100])  # padded, not scaled

    mask = np.zeros((200, 300), bool)
    mask[10:15, 10:15] = True  # 25 px in the first tile only
    mask[150:152, 295:299] = True  # 8 px, in the last tile: too few to call it a defect, too many to call it clean
    positions = [(x, y) for x, y, _ in pieces]
    assert tile_labels(mask, 3, 0, positions, 128, 16) == [3, 0, 0, 0, 0, None]
    assert tile_labels(None, 3, 0, positions, 128, 16) == [None] * 6  # a defect without a mask: not known where
    assert tile_labels(None, 0, 0, positions, 128, 16) == [0] * 6  # every tile of an OK image is OK

    probs = np.array([[0.9, 0.1, 0.0], [0.3, 0.2, 0.5], [0.95, 0.05, 0.0], [0.6, 0.4, 0.0]], np.float32)
    out = image_probs(probs, np.array([0, 0, 1, 1]), 2, ok_index=0)
    assert np.array_equal(out, probs[[1, 3]])  # each image: its most suspicious tile's probabilities


def test_auto_cuts_no_tiles_where_each_photograph_is_one_tile(prepared_project, tmp_path):
    """Photographs the size of the model's input (the tiny project: 64 px at 64 px) have masks but one tile
    each: a tile model would see what the whole-image model sees, at twice the training cost."""
    prepared = shutil.copytree(prepared_project / "data/prepared", tmp_path / "prepared")
    raw = prepared_project / "data/raw"
    assert any((raw / "masks").rglob("*.png"))
    cut, why = tile_data("auto", prepared, raw / "images", raw / "masks", 16)
    assert (
        cut is None and why == "tiles.use auto: the photographs are one tile each (the whole-image model sees them 1:1)"
    )
    assert not (prepared / "tiles").exists()
    assert tile_data("off", prepared, raw / "images", raw / "masks", 16) == (None, "tiles.use off")
