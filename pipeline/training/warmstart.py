"""Warm start: train from earlier weights instead of random ones (``train.init_from``).

- ``none``: random initialisation (or ``model.pretrained``).
- ``champion``: the weights of the model that holds the alias ``champion`` of the registered model
  ``promote.model_name``: the ``model/model.pt`` artifact of that version's training run. With no
  champion yet (the first run) training starts from scratch and says so.
- a path: a ``model.pt`` written by the train stage.

What was loaded is part of the training fingerprint, so a checkpoint made from other starting
weights is not resumed. Layers whose shape differs (a class added since) keep their fresh
initialisation, and the log lists them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from mlflow.artifacts import download_artifacts
from mlflow.exceptions import MlflowException
from torch import nn

from pipeline import checkpoint, tracking
from pipeline.config import ConfigError, Params

log = logging.getLogger(__name__)

CACHE = Path("models/train/init")


@dataclass(frozen=True)
class WarmStart:
    identity: str  # goes into the fingerprint and the run's tags
    run_id: str  # the training run of those weights ("" for a plain file)
    path: Path

    def load_into(self, model: nn.Module, architecture: str) -> None:
        ckpt = checkpoint.load(self.path)
        if ckpt is None:
            raise ConfigError(f"train.init_from: {self.path} is not a readable model file ({self.identity})")
        meta, weights = ckpt["meta"], ckpt["model"]
        members = meta.get("members", 1)
        # an ensemble (train.ensemble): start from its first member of the same network
        names = [m["architecture"] for m in meta.get("member_models", [meta] * members)]
        if architecture not in names:
            raise ConfigError(
                f"train.init_from: {self.identity} is a {meta['architecture']} model, but model.name is "
                f"{architecture}; use train.init_from: none to change the architecture"
            )
        own = model.state_dict()
        if members > 1 or "member_models" in meta:  # an ensemble's file, one member kept beside tiles included
            k = names.index(architecture)
            prefix = f"members.{k}."
            weights = {key.removeprefix(prefix): v for key, v in weights.items() if key.startswith(prefix)}
            log.info("warm start from member %d of the %d members of %s", k, members, self.identity)
        usable = {k: v for k, v in weights.items() if k in own and own[k].shape == v.shape}
        fresh = sorted(k for k in own if k not in usable)
        model.load_state_dict(usable, strict=False)
        log.info(
            "warm start from %s: %d tensors loaded%s",
            self.identity,
            len(usable),
            f", kept fresh (shape changed): {', '.join(fresh)}" if fresh else "",
        )


def resolve_init(params: Params) -> WarmStart | None:
    source = params.train.init_from
    if source in ("none", "", "false"):
        return None
    if source == "champion":
        return _champion(params)
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"train.init_from: {path} not found (use none, champion or the path of a model.pt)")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return WarmStart(f"{path} (sha256 {digest[:12]})", "", path)


def _champion(params: Params) -> WarmStart | None:
    client = tracking.client_for(params.mlflow)
    name = params.promote.model_name
    try:
        mv = client.get_model_version_by_alias(name, "champion")
    except MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            log.warning("train.init_from: champion: no models:/%s@champion yet: starting from scratch", name)
            return None
        raise ConfigError(
            f"train.init_from: champion: cannot ask {client.tracking_uri} for models:/{name}@champion ({exc.message})"
        ) from None
    dest = CACHE / f"{name}-v{mv.version}"
    if not (dest / "model.pt").is_file():
        partial = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
        try:
            download_artifacts(
                run_id=mv.run_id,
                artifact_path="model/model.pt",
                dst_path=str(partial),
                tracking_uri=client.tracking_uri,
            )
        except (MlflowException, OSError) as exc:
            shutil.rmtree(partial, ignore_errors=True)
            raise ConfigError(
                f"train.init_from: champion: models:/{name}@champion (version {mv.version}) has no weights to start "
                f"from in run {mv.run_id} (artifact model/model.pt: {exc}); use train.init_from: none"
            ) from None
        shutil.rmtree(dest, ignore_errors=True)
        partial.rename(dest)
    found = next(dest.rglob("model.pt"))
    return WarmStart(f"models:/{name}@champion (version {mv.version}, run {mv.run_id})", mv.run_id, found)
