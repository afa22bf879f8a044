"""The augmentation policy lives in params.yaml and round-trips through albumentations' serializer."""

from __future__ import annotations

import json

import albumentations as A
import numpy as np
import pytest

from pipeline.config import ConfigError
from pipeline.data.augment import (
    ImageDataset,
    apply_policy,
    balance_copies,
    build_policy,
    pose_of,
    resolve_policy,
    save_policy,
    without_orientation,
)
from serving.preprocess import load_image
from tests.conftest import REAL_DATA, load_default_params


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


def test_a_transform_without_p_keeps_its_own_default():
    """albumentations' deserializer would make every transform without `p` a coin flip (0.5); a crop
    written without `p` must crop every image, as the transform's own default (1.0) says."""
    compose = build_policy([{"name": "RandomCrop", "height": 16, "width": 24}, {"name": "GaussianBlur"}], seed=0)
    assert [t.p for t in compose.transforms] == [1.0, 0.5]
    img = np.zeros((32, 48, 3), np.uint8)
    assert {apply_policy(compose, img).shape for _ in range(20)} == {(16, 24, 3)}


def test_a_cropping_policy_trains_on_tiles_and_keeps_the_channel_axis():
    images = np.random.default_rng(0).integers(0, 255, (4, 32, 32, 1), np.uint8)
    crop = build_policy([{"name": "RandomCrop", "height": 16, "width": 16}])
    data = ImageDataset(images, np.array([0, 1, 0, 1]), crop)
    img, label = data[(1, 7)]
    assert tuple(img.shape) == (16, 16, 1) and label == 1


def test_balancing_copies_refuse_a_policy_that_changes_the_image_size():
    images = np.zeros((6, 32, 32, 3), np.uint8)
    crop = build_policy([{"name": "RandomCrop", "height": 16, "width": 16}])
    message = r"augment.balance: the policy turns a \(32, 32, 3\) image into \(16, 16, 3\)"
    with pytest.raises(ConfigError, match=message):
        balance_copies(images, np.array([0, 0, 0, 0, 0, 1]), crop, balance=1.0, seed=0)


def test_each_transform_of_a_seeded_policy_draws_on_its_own():
    """Training seeds the policy once per image (so a resumed run replays it). Two flips at p 0.5 must
    then give all four outcomes about equally often: albumentations' own seeding gave every transform
    the same seed, so both flipped or neither (a 180-degree turn, never a mirror image)."""
    img = np.arange(8 * 8, dtype=np.uint8).reshape(8, 8, 1)
    outcomes = {"none": img, "horizontal": img[:, ::-1], "vertical": img[::-1], "both": img[::-1, ::-1]}
    data = ImageDataset(img[None], np.array([0]), build_policy([{"name": "HorizontalFlip"}, {"name": "VerticalFlip"}]))
    seen = dict.fromkeys(outcomes, 0)
    for seed in range(400):
        out = data[(0, seed)][0].numpy()
        seen[next(k for k, v in outcomes.items() if np.array_equal(out, v))] += 1
    assert all(60 <= n <= 140 for n in seen.values()), seen  # 100 each expected; binomial sd ~8.7
    assert np.array_equal(data[(0, 7)][0], data[(0, 7)][0])  # and the same seed, the same image


def test_the_default_policy_leaves_about_half_the_training_images_as_they_are():
    """params.yaml promises: half the images untouched (Sequential at p 0.5), the rest drawn as a surface
    allows. A few of the other half come out unchanged too (no flip, a zero turn, gamma near 1)."""
    img = np.random.default_rng(0).integers(40, 200, (16, 16, 1), np.uint8)
    policy = build_policy(load_default_params()["augment"]["policy"])
    data = ImageDataset(img[None], np.array([0]), policy)
    unchanged = sum(np.array_equal(data[(0, seed)][0].numpy(), img) for seed in range(400))
    assert 180 <= unchanged <= 260, unchanged  # about 0.54 x 400 expected; binomial sd ~10


def lit_parts(n: int, one_pose: bool, seed: int = 0) -> np.ndarray:
    """Parts lit from one side with edges running one way (grooves); ``one_pose``: every image as a fixed
    camera shows it, else each in one of the eight mirrored and turned views."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:32, 0:32] / 31.0
    out = []
    for _ in range(n):
        img = 90 + 80 * y + 30 * np.sin(x * 40 + rng.uniform(0, 6)) + rng.normal(0, 12, (32, 32))
        if not one_pose:
            img = np.rot90(img, rng.integers(4))
            img = img[:, ::-1] if rng.integers(2) else img
        out.append(np.clip(img, 0, 255).astype(np.uint8))
    return np.stack(out)[..., None].repeat(3, axis=-1)


def test_auto_orientation_drops_flips_and_turns_only_where_the_images_have_a_pose():
    policy = load_default_params()["augment"]["policy"]
    gamma_only = [
        {"name": "Sequential", "p": 0.5, "transforms": [{"name": "RandomGamma", "gamma_limit": [70, 150], "p": 0.5}]}
    ]
    fixed, report = resolve_policy(policy, "auto", lit_parts(200, one_pose=True))
    assert fixed == gamma_only and report["pose"] == "fixed" and report["flips_and_turns"] == "dropped"
    assert report["dropped"] == ["HorizontalFlip", "RandomRotate90", "VerticalFlip"]
    assert report["effects"]["light_top_bottom"] > 1 and report["effects"]["edges_vertical_horizontal"] > 1
    free, report = resolve_policy(policy, "auto", lit_parts(200, one_pose=False))
    assert free == policy and report["pose"] == "free" and report["dropped"] == []
    assert max(report["effects"].values()) < report["threshold"] == pytest.approx(4 / np.sqrt(200), abs=1e-3)
    # the user's word wins over the measurement either way
    assert resolve_policy(policy, "free", lit_parts(200, one_pose=True))[0] == policy
    assert resolve_policy(policy, "fixed", lit_parts(200, one_pose=False))[0] == gamma_only


def test_a_few_images_must_show_a_pose_clearly():
    """Ten images in random views can line up by chance: the threshold grows with the standard error."""
    report = pose_of(lit_parts(10, one_pose=False, seed=3))
    assert report["threshold"] == pytest.approx(4 / np.sqrt(10), abs=1e-3) and report["pose"] == "free"
    assert pose_of(lit_parts(10, one_pose=True))["pose"] == "fixed"


def test_without_orientation_reaches_into_composes_and_drops_emptied_ones():
    policy = [
        {"name": "D4"},
        {"name": "OneOf", "transforms": [{"name": "Transpose"}, {"name": "HorizontalFlip"}]},
        {"name": "OneOf", "p": 0.3, "transforms": [{"name": "VerticalFlip"}, {"name": "GaussianBlur"}]},
        {"name": "RandomGamma"},
    ]
    assert without_orientation(policy) == [
        {"name": "OneOf", "p": 0.3, "transforms": [{"name": "GaussianBlur"}]},
        {"name": "RandomGamma"},
    ]
    build_policy(without_orientation(policy))  # still a policy albumentations builds


@pytest.mark.skipif(not REAL_DATA.is_dir(), reason=f"the magnetic tile photographs are not at {REAL_DATA}")
def test_the_magnetic_tile_photographs_have_a_pose():
    """A fixed camera and light: every tile lit the same way, its edges along one axis. auto drops the
    flips and turns there (mirrored views cost recall, README)."""
    files = sorted(p for p in REAL_DATA.rglob("*") if p.suffix.lower() in {".jpg", ".png"})[::4]
    images = np.stack([load_image(f, 128, 3, "letterbox") for f in files])
    report = pose_of(images)
    assert report["pose"] == "fixed", report
    assert report["effects"]["light_top_bottom"] > 0.4 and report["effects"]["edges_vertical_horizontal"] > 1
