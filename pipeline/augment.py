"""The training augmentation policy, described in params.yaml and built by albumentations' serializer.

    augment:
      policy:
        - {name: HorizontalFlip, p: 0.5}
        - {name: OneOf, p: 0.3, transforms: [{name: GaussNoise}, {name: GaussianBlur}]}

Each entry names an albumentations transform and its arguments, so ``dvc exp run -S`` can change it.
A wrong name or argument is a ConfigError naming ``augment.policy[i]``.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

import albumentations as A
import numpy as np
import torch
from torch.utils.data import Dataset

from pipeline.config import ConfigError
from pipeline.prepare import MASK_UNKNOWN

log = logging.getLogger(__name__)


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
    With ``masks`` ((N, H, W) uint8, see ``pipeline.prepare.MASK_UNKNOWN``) an item is (image, label,
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
            seed_policy(policy, (seed * 1_000_003 + c * 100_003 + k) % 2**31)
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
    from pipeline.plots import image_grid
    from pipeline.prepare import load_split, read_summary

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
