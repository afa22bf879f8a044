"""Where the runner's model comes from: a file path, or the MLflow model registry.

``models:/NAME@champion`` (an alias) or ``models:/NAME/3`` (a version) is resolved with the MLflow
client against ``--tracking-uri`` (or ``MLFLOW_TRACKING_URI``), and the version's files (the ONNX
model, its tile graph if it has one, and its card) are downloaded into a cache folder named by the
store, name and version, so a restart or a reload of the same version downloads nothing. MLflow is imported only
here and only for ``models:/`` sources: a runner fed with model files needs no MLflow at all (install
``mlflow-skinny`` for the registry; the Docker image has it).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from serving.tiles import is_tile_graph


class RegistryError(RuntimeError):
    """The model source cannot be resolved; the message says why."""


@dataclass(frozen=True)
class ResolvedModel:
    model_path: Path
    card_path: Path | None  # None: the card beside the model
    version: str  # registry version ("3") or "" for a plain file
    source: str  # what the user asked for


_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")


def is_registry_uri(source: str) -> bool:
    return str(source).startswith("models:/")


def resolve(source: str, card: str | None = None, tracking_uri: str | None = None, cache: Path | None = None):
    """A model source -> local files. Plain paths pass through; ``models:/`` URIs are downloaded."""
    if not is_registry_uri(source):
        return ResolvedModel(Path(source), Path(card) if card else None, "", source)
    m = _MODELS_URI.match(source)
    if not m:
        raise RegistryError(f"{source}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
    try:  # here, not at the top: mlflow is optional and its import takes ~1.2 s (measured)
        from mlflow import MlflowClient
        from mlflow.artifacts import download_artifacts
        from mlflow.exceptions import MlflowException
    except ImportError:
        raise RegistryError(
            f"{source}: loading from the MLflow registry needs the mlflow client "
            "(pip install mlflow-skinny==3.17.2), or pass a model file instead"
        ) from None
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise RegistryError(f"{source}: no tracking URI: pass --tracking-uri or set MLFLOW_TRACKING_URI")
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    name = m["name"]
    try:
        mv = (
            client.get_model_version_by_alias(name, m["alias"])
            if m["alias"]
            else client.get_model_version(name, m["version"])
        )
        dest = cache or Path(os.environ.get("DEFECT_RUNNER_CACHE", Path.home() / ".cache" / "defect-runner"))
        # Version numbers are per store: two stores' "version 1" are different models, so the store is in the path.
        dest = dest / hashlib.sha256(uri.encode()).hexdigest()[:12] / name / str(mv.version)
        if not dest.is_dir():  # download beside, then rename: a killed download never looks complete
            partial = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
            partial.mkdir(parents=True, exist_ok=True)
            download_artifacts(artifact_uri=mv.source, dst_path=str(partial), tracking_uri=uri)
            partial.rename(dest)
    except MlflowException as exc:
        raise RegistryError(f"{source} at {uri}: {exc.message}") from None
    # The whole-image graph; a tile graph beside it (X.tiles.onnx) is found by the runner through the card.
    models = sorted(p for p in dest.rglob("*.onnx") if not is_tile_graph(p))
    if len(models) != 1:
        raise RegistryError(
            f"{source} (version {mv.version}) must hold exactly one whole-image .onnx file (and its tile graph, "
            f"if any) with its card, found {[p.name for p in sorted(dest.rglob('*.onnx'))]} in {mv.source}"
        )
    return ResolvedModel(models[0], Path(card) if card else None, str(mv.version), source)
