"""Promote: register the exported model and move the alias ``champion`` only to a better model.

1. The variant that export recommends for ``promote.provider`` (with its card, and its tile graph when
   the card has tiles) is logged to the model's training run under ``registry/<variant>/`` and registered
   as a new version of ``promote.model_name``; the same files registered again (DVC re-running the stage)
   reuse their version.
2. That version gets the alias ``challenger``.
3. With no champion yet, it becomes the champion. Otherwise both are scored on the *current* test
   split, end to end from the image files through the edge runner, each with its own preprocessing and
   its own card threshold, and ``promote.rules`` decide: in order, the first metric whose difference
   exceeds its tolerance decides; when every rule ties, ``promote.promote_on_tie``.
4. The comparison is written to ``reports/promote/decision.json`` and recorded on both training runs
   (metrics ``promote_*`` and tags) and on both model versions (tags).
5. ``reports/promote/registry.json`` says which registry the aliases were set in and what they point at.
   dvc.yaml keeps it out of DVC's cache, which turns DVC's run cache off for this stage: the stage's
   real effect is on the registry, and a run restored from the run cache (another checkout's, or an
   earlier run with the same inputs) would write the files and leave the registry as it was.

The runner serves ``models:/<model_name>@champion`` and hot-reloads when the alias moves.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import numpy as np
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from pipeline import tracking
from pipeline.config import Params, PromoteRule
from pipeline.data.prepare import load_split, read_summary
from pipeline.export.variants import variant_path
from serving.card import ModelCard, card_path_for
from serving.registry import resolve
from serving.runner import Runner

log = logging.getLogger(__name__)

CACHE = Path("models/promote/cache")  # champions downloaded for the comparison, by name and version


def score_on_files(model_path: Path, root: Path, paths: list[str], truth: list[str], ok_class: str) -> dict:
    """Defect recall, false-alarm rate and accuracy of one exported model on image files, at its card's
    threshold. A class the model does not know counts as a miss (the newer model may know more)."""
    runner = Runner(model_path, providers="cpu", spin=False, force=True, warmup=0)
    preds = list(runner.predict_files([root / p for p in paths], batch_size=32))
    unreadable = [p.path for p in preds if p.error]
    if unreadable:
        raise RuntimeError(f"promote: test images could not be read: {unreadable[:5]}")
    is_defect = np.array([t != ok_class for t in truth])
    flagged = np.array([p.decision == "defect" for p in preds])
    correct = np.array([p.label == t for p, t in zip(preds, truth, strict=True)])
    return {
        "defect_recall": float(flagged[is_defect].mean()) if is_defect.any() else float("nan"),
        "false_alarm_rate": float(flagged[~is_defect].mean()) if (~is_defect).any() else float("nan"),
        "accuracy": float(correct.mean()),
        "binary_accuracy": float((flagged == is_defect).mean()),
        "images": len(paths),
    }


def decide(
    challenger: dict,
    champion: dict,
    rules: list[PromoteRule],
    promote_on_tie: bool,
    refuse_false_alarm_rate: float = 1.0,
) -> tuple[bool, str]:
    """(promote?, why): the false-alarm limit first, then the rules in order."""
    new_far, old_far, limit = challenger["false_alarm_rate"], champion["false_alarm_rate"], refuse_false_alarm_rate
    if new_far > limit:
        return False, f"false_alarm_rate {new_far:.4f} above promote.refuse_false_alarm_rate {limit}"
    if old_far > limit:
        return True, f"champion's false_alarm_rate {old_far:.4f} above promote.refuse_false_alarm_rate {limit}"
    for rule in rules:
        new, old = challenger[rule.metric], champion[rule.metric]
        gain = (new - old) if rule.better == "higher" else (old - new)
        if abs(gain) > rule.tolerance:
            verb = "better" if gain > 0 else "worse"
            return gain > 0, f"{rule.metric} {verb}: {new:.4f} vs champion {old:.4f} (tolerance {rule.tolerance})"
    return promote_on_tie, f"every rule tied ({', '.join(r.metric for r in rules)}); promote_on_tie={promote_on_tie}"


def register(client: MlflowClient, run: tracking.Run, name: str, model_path: Path, card: ModelCard) -> str:
    """Log the variant into the training run and register it; reuse the version already holding this file."""
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="Defect detection: exported ONNX model + card (runner)")
    tiles_sha256 = card.tiles.sha256 if card.tiles else ""
    for mv in client.search_model_versions(f"name='{name}'"):
        if mv.tags.get("sha256") == card.sha256 and mv.tags.get("tiles_sha256", "") == tiles_sha256:
            log.info("promote: %s is already version %s of %s", model_path.name, mv.version, name)
            return str(mv.version)
    folder = f"registry/{card.variant}"
    run.log_artifacts(model_path, folder)
    if card.tiles:  # the tile graph beside the whole one, where the runner looks for it
        run.log_artifacts(model_path.parent / card.tiles.model, folder)
    run.log_artifacts(card_path_for(model_path), folder)
    source = f"{client.get_run(run.run_id).info.artifact_uri}/{folder}"
    tags = {
        "variant": card.variant,
        "sha256": card.sha256,
        "architecture": card.architecture,
        "data_fingerprint": card.data_fingerprint,
        "threshold": str(card.threshold),
    }
    description = f"{card.architecture} {card.variant}, {card.input.size} px, classes {card.classes}"
    if card.tiles:
        tags |= {"tiles_sha256": tiles_sha256, "tiles_architecture": card.tiles.architecture}
        description += f", with {card.tiles.architecture} tiles of {card.tiles.size} px"
    mv = client.create_model_version(name, source, run_id=run.run_id, tags=tags, description=description)
    return str(mv.version)


def promote(params: Params, export_dir: Path, raw_images: Path, prepared: Path, out_dir: Path) -> dict:
    cfg = params.promote
    variants = json.loads(Path("reports/export/variants.json").read_text())
    variant = variants["recommended"].get(cfg.provider)
    if variant is None:
        raise RuntimeError(f"promote: export recommends no deployable variant for provider {cfg.provider!r}")
    model_path = variant_path(export_dir / "model.onnx", variant)
    card = ModelCard.read(card_path_for(model_path))

    _, y_test, paths = load_split(prepared, "test")
    classes = read_summary(prepared)["classes"]
    truth = [classes[i] for i in y_test]
    ok_class = card.ok_class

    with tracking.resume_run(params.mlflow, Path("models/train/run.json"), stage="promote") as run:
        client = run.client
        version = register(client, run, cfg.model_name, model_path, card)
        client.set_registered_model_alias(cfg.model_name, "challenger", version)
        new = score_on_files(model_path, raw_images, paths, truth, ok_class)
        try:
            champ = client.get_model_version_by_alias(cfg.model_name, "champion")
        except MlflowException:
            champ = None
        if champ is None:
            promoted, why, old = True, "no champion yet: the first model becomes champion", None
        elif str(champ.version) == version:
            promoted, why, old = True, f"version {version} is already the champion", new
        else:
            files = resolve(f"models:/{cfg.model_name}/{champ.version}", tracking_uri=client.tracking_uri, cache=CACHE)
            old = score_on_files(files.model_path, raw_images, paths, truth, ok_class)
            promoted, why = decide(new, old, cfg.rules, cfg.promote_on_tie, cfg.refuse_false_alarm_rate)
        if promoted:
            client.set_registered_model_alias(cfg.model_name, "champion", version)
        decision = {
            "model_name": cfg.model_name,
            "challenger": {"version": version, "run_id": run.run_id, "variant": variant, **new},
            "champion_before": None
            if champ is None
            else {"version": str(champ.version), "run_id": champ.run_id, **(old or {})},
            "champion_after": version if promoted else str(champ.version),
            "promoted": promoted,
            "reason": why,
            "rules": [asdict(r) for r in cfg.rules],
            "test_images": len(paths),
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "decision.json").write_text(json.dumps(decision, indent=2) + "\n")
        registry = {
            "tracking_uri": without_credentials(client.tracking_uri),
            "model_name": cfg.model_name,
            "champion": decision["champion_after"],
            "challenger": version,
        }
        (out_dir / "registry.json").write_text(json.dumps(registry, indent=2) + "\n")
        record(run, client, decision, out_dir / "decision.json")
    return decision


def without_credentials(uri: str) -> str:
    """``http://user:secret@host/`` -> ``http://host/``: the file goes into git."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri  # also keeps sqlite:///x as written (urlunsplit would drop its empty netloc)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def record(run: tracking.Run, client: MlflowClient, d: dict, report: Path) -> None:
    """The comparison on both training runs and both model versions."""
    name, ch, before = d["model_name"], d["challenger"], d["champion_before"]
    run.log_metrics({f"promote_{k}": ch[k] for k in ("defect_recall", "false_alarm_rate", "accuracy")})
    tags = {
        "promote.version": ch["version"],
        "promote.decision": "champion" if d["promoted"] else "challenger",
        "promote.reason": d["reason"],
    }
    if before and before["version"] != ch["version"]:
        tags["promote.compared_with"] = f"version {before['version']} (run {before['run_id']})"
        run.log_metrics({f"promote_champion_{k}": before[k] for k in ("defect_recall", "false_alarm_rate", "accuracy")})
        outcome = "lost to" if d["promoted"] else "held against"
        client.set_tag(
            before["run_id"],
            f"promote.challenged_by.v{ch['version']}",
            f"{outcome} version {ch['version']} (run {ch['run_id']}): {d['reason']}",
        )
        client.set_model_version_tag(name, before["version"], f"challenged_by.v{ch['version']}", d["reason"])
    run.set_tags(tags)
    client.set_model_version_tag(name, ch["version"], "promotion", f"{tags['promote.decision']}: {d['reason']}")
    run.log_artifacts(report, "promote")
