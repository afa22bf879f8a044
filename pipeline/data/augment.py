"""The training augmentation policy, described in params.yaml and built by albumentations' serializer.

    augment:
      policy:
        - {name: HorizontalFlip, p: 0.5}
        - {name: OneOf, p: 0.3, transforms: [{name: GaussNoise}, {name: GaussianBlur}]}

Each entry names an albumentations transform and its arguments, so ``dvc exp run -S`` can change it.
A wrong name or argument is a ConfigError naming ``augment.policy[i]``.

``augment.orientation`` decides whether the policy's flips and 90-degree turns are used: ``free`` keeps
them, ``fixed`` drops them, ``auto`` measures the training images (``pose_of``): where a camera shows
every part in one pose and light, the images are not alike under a mirror or a turn, and mirrored or
turned views are images the line never produces (on the magnetic tiles they cost recall; on the synthetic
data, drawn in every orientation, dropping them cost accuracy: docs/research/readme_measurements.md).
"""

from __future__ import annotations

from pipeline.plots import image_grid
from pipeline.seeds import BALANCE, derive_seed
from pipeline.data.prepare import load_split, read_summary
import inspect
import logging
from pathlib import Path
from typing import Any

import albumentations as A
import numpy as np
import torch
from torch.utils.data import Dataset

from pipeline.config import ConfigError
from pipeline.data.masks import MASK_UNKNOWN

log = logging.getLogger(__name__)

# The lossless views of an image: mirrors, 90-degree turns and their products. ``orientation: fixed`` drops
# them from the policy; rotations by other angles and affine moves are left to the policy as written.
ORIENTATION_TRANSFORMS = frozenset(
    {"HorizontalFlip", "VerticalFlip", "RandomRotate90", "Transpose", "D4", "SquareSymmetry"}
)
# ``auto``: the images have a pose when one of the statistics of ``pose_of`` is this far from its mirrored or
# turned value, in standard deviations over the images (0.2: a small effect), and 4 standard errors away
# (a small training split must show it clearly). Measured: the magnetic tiles 0.55 and 1.93, the synthetic
# data (every orientation by construction) at most 0.05.
POSE_EFFECT = 0.2
POSE_STANDARD_ERRORS = 4.0


def pose_of(images: np.ndarray, chunk: int = 512) -> dict[str, Any]:
    """Do the images look alike under mirrors and 90-degree turns? Three statistics per image, each of
    which a mirror or a turn flips in sign, on the grayscale image standardized per image (as the model
    sees it): where the light sits left/right and top/bottom (the brightness-weighted centre's offset), and
    whether vertical or horizontal edges dominate (log of the mean |d/dx| over the mean |d/dy|). Images in
    every orientation average each to about 0; a fixed camera and light give a consistent sign. Each
    statistic's effect is its mean over the images in standard deviations; ``pose`` is ``fixed`` when one
    exceeds ``POSE_EFFECT`` and ``POSE_STANDARD_ERRORS`` standard errors, else ``free``."""
    n = len(images)
    if n < 2:
        return {"pose": "free", "images": n, "threshold": None, "effects": {}}
    light_x, light_y, edges = [], [], []
    for start in range(0, n, chunk):
        g = images[start : start + chunk].astype(np.float32).mean(axis=-1)  # (n, H, W) grayscale
        g = (g - g.mean(axis=(1, 2), keepdims=True)) / (g.std(axis=(1, 2), keepdims=True) + 1e-6)
        h, w = g.shape[1:]
        light_x.append((g * np.linspace(-1, 1, w)[None, None, :]).mean(axis=(1, 2)))
        light_y.append((g * np.linspace(-1, 1, h)[None, :, None]).mean(axis=(1, 2)))
        ex, ey = np.abs(np.diff(g, axis=2)).mean(axis=(1, 2)), np.abs(np.diff(g, axis=1)).mean(axis=(1, 2))
        edges.append(np.log((ex + 1e-6) / (ey + 1e-6)))
    stats = {"light_left_right": light_x, "light_top_bottom": light_y, "edges_vertical_horizontal": edges}
    effects = {}
    for name, parts in stats.items():
        v = np.concatenate(parts)
        effects[name] = round(float(abs(v.mean()) / (v.std() + 1e-9)), 3)
    threshold = max(POSE_EFFECT, POSE_STANDARD_ERRORS / np.sqrt(n))
    pose = "fixed" if max(effects.values()) > threshold else "free"
    return {"pose": pose, "images": n, "threshold": round(float(threshold), 3), "effects": effects}


def without_orientation(policy: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The policy with every transform of ``ORIENTATION_TRANSFORMS`` taken out, inside composes too; a
    compose left with nothing to do goes as well."""
    out = []
    for spec in policy:
        if not isinstance(spec, dict) or spec.get("name") in ORIENTATION_TRANSFORMS:
            continue
        if isinstance(spec.get("transforms"), list):
            inner = without_orientation(spec["transforms"])
            if not inner:
                continue
            spec = {**spec, "transforms": inner}
        out.append(spec)
    return out


def resolve_policy(
    policy: list[dict[str, Any]], orientation: str, train_images: np.ndarray
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The policy to train with under ``augment.orientation`` (free, fixed or auto; see the module's
    docstring) and a report of the decision: the pose measured on ``train_images`` (the prepared training
    split), whether the flips and turns are used, and which transforms were dropped."""
    report = {"orientation": orientation, **pose_of(train_images)}
    keep = orientation == "free" or (orientation == "auto" and report["pose"] == "free")
    resolved = policy if keep else without_orientation(policy)
    report["flips_and_turns"] = "kept" if keep else "dropped"
    report["dropped"] = [] if keep else sorted(_names(policy) & ORIENTATION_TRANSFORMS)
    return resolved, report


def _names(policy: list[dict[str, Any]]) -> set[str]:
    names = set()
    for spec in policy:
        if isinstance(spec, dict):
            names.add(str(spec.get("name")))
            names |= _names(spec.get("transforms") or [])
    return names


def _to_serialized(spec: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(spec, dict) or "name" not in spec:
        raise ConfigError(f"{where}: expected a mapping with a 'name' key, got {spec!r}")
    args = dict(spec)
    name = args.pop("name")
    cls = getattr(A, str(name), None)
    if not (isinstance(cls, type) and issubclass(cls, A.BasicTransform | A.BaseCompose)):
        raise ConfigError(f"{where}: {name!r} is not an albumentations transform")
    params = inspect.signature(cls.__init__).parameters
    accepted = set(params) - {"self", "args", "kwargs"}
    unknown = sorted(set(args) - accepted)
    if unknown:
        raise ConfigError(f"{where}: {name} has no argument {unknown[0]!r} (it takes: {', '.join(sorted(accepted))})")
    if "p" in params and "p" not in args:  # A.from_dict would use 0.5, not the transform's own default
        args["p"] = params["p"].default
    if "transforms" in args:
        args["transforms"] = [_to_serialized(t, f"{where}.transforms[{i}]") for i, t in enumerate(args["transforms"])]
    return {"__class_fullname__": name, **args}


def build_policy(policy: list[dict[str, Any]], seed: int | None = None) -> A.Compose:
    """A Compose from the params description, via ``A.from_dict`` (albumentations' own deserializer)."""
    transforms = [_to_serialized(t, f"augment.policy[{i}]") for i, t in enumerate(policy)]
    try:
        compose = A.from_dict({"transform": {"__class_fullname__": "Compose", "transforms": transforms, "p": 1.0}})
    except Exception as exc:  # pydantic validation errors of a transform's arguments, mostly
        raise ConfigError(f"augment.policy: albumentations rejected the policy: {exc}") from None
    if seed is not None:
        seed_policy(compose, seed)
    return compose


def seed_policy(transform: A.BasicTransform | A.BaseCompose, seed: int, _path: tuple[int, ...] = ()) -> None:
    """Seed a policy so that its transforms draw independently: each gets its own stream from (seed, its
    position in the policy tree).

    albumentations' own ``set_random_seed`` hands the *same* seed to every transform, so each one's first
    draw, the one that decides whether it applies, is the same number: transforms with equal ``p`` fire
    together. With one seed per image (what makes a resumed run replay the same augmentation) that held
    for every image: HorizontalFlip and VerticalFlip at 0.5 were both applied or neither, a 180-degree
    turn and never a mirror image, and gamma, noise and affine moves came in lockstep with them.
    """
    transform.set_random_seed(int(np.random.SeedSequence([seed, *_path]).generate_state(1)[0]))
    for i, child in enumerate(getattr(transform, "transforms", [])):  # after the parent's, which propagates
        seed_policy(child, seed, (*_path, i + 1))


def save_policy(compose: A.Compose, path: Path) -> None:
    A.save(compose, str(path), data_format="json")


def apply_policy(policy: A.Compose, img: np.ndarray, mask: np.ndarray | None = None):
    """The policy on one (H, W, C) image, keeping the channel axis (albumentations drops it for one
    channel). A crop in the policy makes H and W smaller: training on tiles of the prepared image while
    evaluation and the runner score the whole image (with ``model.global_pool: max``, the max over tiles).
    With a (H, W) ``mask`` it returns (image, mask), the mask moved exactly as the image (flips, turns,
    crops, affine moves) and left alone by pixel-level transforms (gamma, noise)."""
    if mask is None:
        out = policy(image=img)["image"]
        return out.reshape(*out.shape[:2], img.shape[2])
    res = policy(image=img, mask=mask)
    return res["image"].reshape(*res["image"].shape[:2], img.shape[2]), res["mask"]


class ImageDataset(Dataset):
    """Packed (N, H, W, C) uint8 images with labels; applies the policy on the fly (training only).

    An item key is an index, or ``(index, seed)``: the policy is then seeded for that one image, so an
    image's augmentation depends on the seed alone, not on worker count or on where a run resumed.
    With ``masks`` ((N, H, W) uint8, see ``pipeline.data.prepare.MASK_UNKNOWN``) an item is (image, label,
    mask), the mask augmented with its image.
    """

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        transform: A.Compose | None = None,
        masks: np.ndarray | None = None,
    ) -> None:
        self.images, self.labels, self.transform, self.masks = images, labels, transform, masks
        # per image, once: is its mask known at all (an unknown one is never augmented, see __getitem__)
        self.mask_known = None if masks is None else (masks != MASK_UNKNOWN).any(axis=(1, 2))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple:
        i, seed = key if isinstance(key, tuple) else (key, None)
        img = self.images[i]
        mask = self.masks[i] if self.masks is not None else None
        if self.transform is not None:
            if seed is not None:
                seed_policy(self.transform, seed)
            if mask is None or not self.mask_known[i]:
                # an unknown mask stays unknown: moved with the image, a rotation or shift would fill its
                # new border with 0 ("no defect here") and make a defect image's mask look known and clear
                img = apply_policy(self.transform, img)
                mask = None if mask is None else np.full(img.shape[:2], MASK_UNKNOWN, np.uint8)
            else:
                img, mask = apply_policy(self.transform, img, mask)
        item = (torch.from_numpy(np.ascontiguousarray(img)), int(self.labels[i]))
        return item if mask is None else (*item, torch.from_numpy(np.ascontiguousarray(mask)))


def balance_copies(
    images: np.ndarray, labels: np.ndarray, policy: A.Compose, balance: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Extra augmented copies that raise every class to ``balance`` x the largest class's count.

    Offline balancing for rare defect classes: returns (images, labels, index of the source image) of the
    copies only, for the training split. Each copy is the policy applied to a class image in turn,
    seeded by (seed, copy number), so the set is reproducible. ``balance`` 0 returns nothing.
    """
    counts = np.bincount(labels) if len(labels) else np.zeros(0, np.int64)
    target = int(np.ceil(balance * counts.max())) if balance > 0 and len(counts) else 0
    out, out_labels, sources = [], [], []
    for c, n in enumerate(counts):
        members = np.nonzero(labels == c)[0]
        for k in range(max(0, target - n) if n else 0):
            i = members[k % n]
            seed_policy(policy, derive_seed(seed, BALANCE, c, k))
            copy = apply_policy(policy, images[i])
            if copy.shape != images[i].shape:
                raise ConfigError(
                    f"augment.balance: the policy turns a {images[i].shape} image into {copy.shape}; balancing "
                    "copies join the training images and must keep their size (a cropping policy needs balance 0)"
                )
            out.append(copy)
            out_labels.append(c)
            sources.append(i)
    shape = (0, *images.shape[1:])
    return (
        np.stack(out) if out else np.zeros(shape, np.uint8),
        np.array(out_labels, np.int64),
        np.array(sources, np.int64),
    )


def preview(policy: A.Compose, prepared_dir: Path, per_class: int, path: Path) -> None:
    """A PNG grid, a row per class: one training image, then ``per_class`` augmented versions of it."""
    classes = read_summary(prepared_dir)["classes"]
    images, labels, _ = load_split(prepared_dir, "train")
    rows, titles = [], []
    for i, c in enumerate(classes):
        idx = np.nonzero(labels == i)[0]
        if len(idx) == 0:
            continue
        original = images[idx[0]]
        rows.append([original] + [apply_policy(policy, original) for _ in range(per_class)])
        titles.append(c)
    image_grid(rows, titles, path, col_titles=["original"] + [f"augmented {k + 1}" for k in range(per_class)])
