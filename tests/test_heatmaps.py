"""Grad-CAM heatmaps and the pointing game: what evaluate draws and scores over the defect masks."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.config import params_from_dict
from pipeline.evaluation.heatmaps import gradcam, pointing_game
from pipeline.model import Ensemble, create_model
from tests.conftest import tiny_params


def test_the_pointing_game_hits_inside_the_grown_mask_and_skips_images_without_one():
    mask = np.zeros((16, 16), bool)
    mask[4:6, 4:6] = True
    maps = np.zeros((5, 16, 16), np.float32)
    maps[0, 5, 5] = 1.0  # peak on the defect
    maps[1, 7, 5] = 1.0  # two pixels below it: inside a tolerance of 2, outside one of 1
    maps[2, 14, 14] = 1.0  # far away
    maps[4, 5, 5] = 1.0  # on the defect, but the image has no mask
    masks = [mask, mask, mask, mask, None]  # maps[3] is all zero: it points nowhere
    assert pointing_game(maps, masks, tolerance=2).tolist()[:4] == [1.0, 1.0, 0.0, 0.0]
    assert np.isnan(pointing_game(maps, masks, tolerance=2)[4])
    assert pointing_game(maps, masks, tolerance=1)[1] == 0.0


def member(seed: int):
    torch.manual_seed(seed)
    net = create_model(params_from_dict(tiny_params(**{"model.name": "test_efficientnet"})).model, 3, 3)
    # The classifier starts at zero (equal odds), where every gradient, and so every heatmap, is zero.
    torch.nn.init.normal_(net.backbone.get_classifier().weight, std=1.0)
    return net.eval()


def test_an_ensembles_heatmap_is_the_mean_of_its_members_each_scaled_alike():
    images = np.random.default_rng(0).integers(0, 256, (4, 32, 32, 3), np.uint8)
    targets = np.array([0, 1, 2, 1])
    a, b = member(0), member(1)
    with torch.no_grad():
        b.backbone.get_classifier().weight.mul_(100.0)  # b's gradients 100x a's: must not outweigh a
    maps_a, maps_b = gradcam(a, images, targets), gradcam(b, images, targets)
    assert maps_a.shape == (4, 32, 32) and maps_a.min() >= 0
    assert set(maps_a.max(axis=(1, 2)).round(5)) <= {0.0, 1.0}  # each scaled to its peak (none: all zero)
    assert not np.allclose(maps_a, maps_b, atol=0.05)  # two members that look at different places

    both = gradcam(Ensemble([a, b]), images, targets)
    mean = (maps_a + maps_b) / 2
    peak = mean.max(axis=(1, 2), keepdims=True)
    assert peak.min() > 0  # every image has a member that points somewhere
    assert np.allclose(both, mean / peak, atol=1e-5)
