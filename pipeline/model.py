"""The network, its file and its predictions: what training, evaluation, export and benchmark share.

``DefectNet`` takes what the runner feeds the exported graph, (N, H, W, C) uint8 pixels, and does the
rest inside the module: to float, scale to [0, 1], normalize, NHWC -> NCHW. Training, evaluation and
export all use this same module, so the normalization can never drift between them.

``save_model`` / ``load_model`` / ``load_tile_model`` are the consolidated ``model.pt`` the train stage
writes (weights plus what it takes to rebuild the network); ``predict_logits`` scores packed images.
Nothing here imports the trainer: loading or running a model never needs it.
"""

from __future__ import annotations

import logging
import math
import socket
from pathlib import Path

import numpy as np
import timm
import torch
from torch import nn

from pipeline import checkpoint
from pipeline.config import ConfigError, ModelConfig
from pipeline.distributed import Dist
from pipeline.runtime import Runtime

log = logging.getLogger(__name__)


def feature_layer(backbone: nn.Module, max_reduction: int = 16) -> tuple[str, int]:
    """Name and channel count of the deepest feature layer of a timm backbone with stride <= ``max_reduction``
    (from its ``feature_info``): 8 x 8 cells at 128 px, fine enough to say where a crack is."""
    info = getattr(backbone, "feature_info", None)
    if not info:
        raise ValueError(f"{type(backbone).__name__} has no feature_info: cannot pick a feature layer")
    f = [f for f in info if f["reduction"] <= max_reduction][-1]
    return f["module"], f["num_chs"]


class DefectNet(nn.Module):
    def __init__(
        self, backbone: nn.Module, mean: tuple[float, ...], std: tuple[float, ...], per_image: bool = False
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.per_image = per_image
        self.mask_head: nn.Module | None = None
        self._features: torch.Tensor | None = None  # the hooked layer's output, kept for one with_mask call
        self._keep = False
        # (1, C, 1, 1) so they broadcast over NCHW; scaled to the 0..255 pixel range once, here.
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1) * 255.0, persistent=False)
        self.register_buffer("inv_std", 1.0 / (torch.tensor(std).view(1, -1, 1, 1) * 255.0), persistent=False)

    def add_mask_head(self) -> None:
        """A training-only 1x1 convolution on the stride-16 features that predicts, cell by cell, whether the
        defect mask covers it (``train.mask_loss``). The classifier is untouched: the head only shapes the
        features it pools, and it is left out of the saved model, the export and the runner."""
        name, channels = feature_layer(self.backbone)
        self.mask_head = nn.Conv2d(channels, 1, kernel_size=1)
        self.backbone.get_submodule(name).register_forward_hook(self._keep_features)

    def _keep_features(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not self._keep:  # evaluation and inference: nothing held on to
            return
        if output.ndim != 4:
            raise ConfigError(
                f"train.mask_loss: the features of {type(self.backbone).__name__} are not a spatial grid "
                f"(shape {tuple(output.shape)}), so there is no cell to mark a defect in; set train.mask_loss: 0"
            )
        self._features = output

    def forward(self, x: torch.Tensor, with_mask: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: (N, H, W, C) uint8 or float pixels 0..255 -> logits (N, K); with ``with_mask`` also the mask
        head's logits (N, 1, h, w) at the stride-16 grid."""
        x = x.permute(0, 3, 1, 2).float()  # NCHW view of NHWC memory: already channels_last
        if self.per_image:
            # Each image to zero mean, unit std over all its pixels: the global brightness and contrast of
            # a shot (lamp ageing, exposure, material tint) stop mattering, local structure remains.
            # The +1 (in 0..255 units) keeps a flat image from being blown up to noise.
            mean = x.mean(dim=(1, 2, 3), keepdim=True)
            std = ((x - mean) ** 2).mean(dim=(1, 2, 3), keepdim=True).sqrt()
            x = (x - mean) / (std + 1.0)
        else:
            x = (x - self.mean) * self.inv_std
        if with_mask and self.mask_head is None:
            raise RuntimeError("with_mask=True needs add_mask_head() first")
        self._keep, self._features = with_mask, None
        try:
            logits = self.backbone(x)
        finally:
            self._keep = False
        if not with_mask:
            return logits
        features, self._features = self._features, None
        if features is None:
            raise RuntimeError("the mask head's feature hook did not fire in this forward pass")
        return logits, self.mask_head(features)


class Ensemble(nn.Module):
    """Members trained alike but for their seed, as one network: the mean of their class probabilities,
    returned as its log (logits whose softmax is that mean), so evaluation, export and the runner treat
    it like a single model. Measured on the magnetic tiles: docs/training.md, *Ensembles*."""

    def __init__(self, members: list[DefectNet]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.stack([m(x).float().softmax(dim=1) for m in self.members]).mean(dim=0)
        return probs.clamp_min(1e-12).log()


class ExportHead(nn.Module):
    """What the ONNX graph computes: probabilities (N, K) and defect score (N,) = 1 - p(ok); without an OK
    class (``ok_index`` None: defect-type sorting) the second output is the most likely class's probability."""

    def __init__(self, net: DefectNet, ok_index: int | None) -> None:
        super().__init__()
        self.net = net
        self.ok_index = ok_index

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = self.net(x).float().softmax(dim=1)
        if self.ok_index is None:
            return probs, probs.amax(dim=1)
        return probs, 1.0 - probs[:, self.ok_index]


def _hub_reachable(timeout: float = 3.0) -> bool:
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def create_model(cfg: ModelConfig, num_classes: int, in_chans: int) -> DefectNet:
    """Build the network; ``cfg.pretrained`` is false, hub (needs internet) or a local weights file."""
    try:
        pretrained_cfg = timm.get_pretrained_cfg(cfg.name)
    except RuntimeError:
        pretrained_cfg = None
    if not timm.is_model(cfg.name):
        raise ConfigError(f"model.name: {cfg.name!r} is not a timm model (e.g. tf_efficientnet_lite0, efficientnet_b0)")
    kwargs: dict = {
        "num_classes": num_classes,
        "in_chans": in_chans,
        "drop_rate": cfg.drop_rate,
        "global_pool": cfg.global_pool,
    }
    if cfg.pretrained == "hub":
        if not _hub_reachable():
            raise ConfigError(
                "model.pretrained: 'hub' needs internet access to download weights and none is reachable; "
                "download the weights file elsewhere and set model.pretrained to its local path, or use false"
            )
        kwargs["pretrained"] = True
    elif cfg.pretrained not in ("false", "", "none"):
        path = Path(cfg.pretrained)
        if not path.is_file():
            raise ConfigError(f"model.pretrained: weights file {path} not found (use false, hub or a local path)")
        # timm loads the file, drops the classifier when num_classes differs and adapts in_chans.
        kwargs.update(pretrained=True, pretrained_cfg_overlay={"file": str(path)})
    backbone = timm.create_model(cfg.name, **kwargs)
    head = backbone.get_classifier()
    if isinstance(head, nn.Linear):
        # A fresh EfficientNet's logits start with a std of ~10 (loss ~5 for 4 classes), and the first
        # epochs are spent shrinking them. A zero classifier starts every class at equal odds (loss ln K).
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
    if kwargs.get("pretrained") is None:
        # TF-ported variants use BatchNorm momentum 0.01, tuned for ImageNet's ~1M steps; with a few
        # hundred steps the running statistics would still be mostly their initial values at eval time.
        for m in backbone.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.momentum = 0.1
    mean = tuple(pretrained_cfg.mean) if pretrained_cfg else (0.485, 0.456, 0.406)
    std = tuple(pretrained_cfg.std) if pretrained_cfg else (0.229, 0.224, 0.225)
    if in_chans == 1:  # grayscale: one channel with the average statistics
        mean, std = (sum(mean) / len(mean),), (sum(std) / len(std),)
    return DefectNet(backbone, mean, std, per_image=cfg.input_norm == "per_image")


MODEL_META = ("architecture", "global_pool", "input_norm")  # what it takes to rebuild a member's network


def save_model(state: dict[str, torch.Tensor], meta: dict, path: Path, tiles: dict | None = None) -> None:
    """The consolidated model that evaluate and export read: weights plus what it takes to rebuild it;
    ``tiles``: the tile model's ``{"model": weights, "meta": ...}``, kept beside it."""
    ckpt = {"version": checkpoint.CHECKPOINT_VERSION, "model": state, "meta": meta}
    checkpoint.save_atomic(ckpt | ({"tiles": tiles} if tiles else {}), path)


def _read(path: Path) -> dict:
    ckpt = checkpoint.load(path)
    if ckpt is None:
        raise FileNotFoundError(f"{path}: no readable trained model (run the train stage)")
    return ckpt


def _rebuild(spec: dict, classes: int, channels: int) -> DefectNet:
    """A member's network from its meta (``MODEL_META``), no dropout, no pretrained weights: the file has them."""
    cfg = ModelConfig(spec["architecture"], "false", 0.0, spec["global_pool"], spec["input_norm"])
    return create_model(cfg, classes, channels)


def load_model(path: Path) -> tuple[DefectNet | Ensemble, dict]:
    """The consolidated model and its meta; everything needed to rebuild it is in the file itself."""
    ckpt = _read(path)
    meta = ckpt["meta"]
    k, c = len(meta["classes"]), meta["channels"]
    members = meta.get("members", 1)
    if members == 1 and "member_models" not in meta:
        net: nn.Module = _rebuild(meta, k, c)
    else:  # each member its own network (train.ensemble_members may change model.*); older files: all alike
        net = Ensemble([_rebuild(spec, k, c) for spec in meta.get("member_models", [meta] * members)])
    net.load_state_dict(ckpt["model"])
    return net.eval(), meta


def load_tile_model(path: Path) -> tuple[DefectNet, dict] | None:
    """The tile model packed beside the whole-image model in ``path`` (``train`` with tiles) and its meta
    (``weight``, ``tile``: the input side), or None where the model has no tiles."""
    ckpt = _read(path)
    if "tiles" not in ckpt:
        return None
    meta = ckpt["tiles"]["meta"]
    net = _rebuild(meta, len(meta["classes"]), meta["channels"])
    net.load_state_dict(ckpt["tiles"]["model"])
    return net.eval(), meta


@torch.no_grad()
def predict_logits(
    model: nn.Module, images: np.ndarray, rt: Runtime, d: Dist | None = None, batch_size: int = 64
) -> np.ndarray:
    """(N, H, W, C) uint8 -> logits (N, K) float32 in eval mode; with several ranks each does a share.

    Every rank runs the same number of batches (FSDP gathers parameters collectively in each forward),
    so the shares are padded to equal length and the padding dropped after gathering.
    """
    d = d or Dist("none")
    model.eval()
    n = len(images)
    idx = np.minimum(np.arange(math.ceil(n / d.world_size)) * d.world_size + d.rank, max(n - 1, 0))
    out = []
    for i in range(0, len(idx), batch_size):
        x = torch.from_numpy(images[idx[i : i + batch_size]]).to(rt.device)
        with rt.autocast():
            out.append(model(x).float().cpu())
    mine = torch.cat(out).numpy() if out else np.zeros((0, 0), np.float32)
    if not d.enabled:
        return mine[:n]
    gathered = d.all_gather_object((idx, mine))
    logits = np.zeros((n, mine.shape[1]), np.float32)
    for i, part in gathered:
        logits[i] = part
    return logits
