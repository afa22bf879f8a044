"""The augmentation policy lives in params.yaml and round-trips through albumentations' serializer."""

from __future__ import annotations

import json

import albumentations as A
import numpy as np
import pytest

from pipeline.augment import build_policy, save_policy
from pipeline.config import ConfigError
from tests.conftest import load_default_params


def test_default_policy_round_trips(tmp_path):
    policy = load_default_params()["augment"]["policy"]
    compose = build_policy(policy, seed=3)
    save_policy(compose, tmp_path / "policy.json")
    saved = json.loads((tmp_path / "policy.json").read_text())
    names = [t["__class_fullname__"] for t in saved["transform"]["transforms"]]
    assert names == [t["name"] for t in policy]
    reloaded = A.load(str(tmp_path / "policy.json"), data_format="json")
    img = np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)
    reloaded.set_random_seed(3)
    compose.set_random_seed(3)
    assert np.array_equal(compose(image=img)["image"], reloaded(image=img)["image"])


def test_nested_transforms_are_built():
    compose = build_policy(
        [{"name": "OneOf", "p": 1.0, "transforms": [{"name": "GaussianBlur"}, {"name": "MedianBlur", "blur_limit": 3}]}]
    )
    assert type(compose.transforms[0]).__name__ == "OneOf"


@pytest.mark.parametrize(
    "policy, message",
    [
        ([{"name": "HorizontalFlipp", "p": 0.5}], "augment.policy[0]: 'HorizontalFlipp' is not an albumentations"),
        ([{"name": "HorizontalFlip"}, {"name": "Affine", "rotation": 10}], "augment.policy[1]: Affine has no argument"),
        ([{"p": 0.5}], "augment.policy[0]: expected a mapping with a 'name' key"),
        ([{"name": "GaussNoise", "std_range": "loud"}], "albumentations rejected the policy"),
    ],
)
def test_a_wrong_transform_is_a_clear_error(policy, message):
    with pytest.raises(ConfigError) as exc:
        build_policy(policy)
    assert message in str(exc.value)
