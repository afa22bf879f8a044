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
   (metrics ``promote_*`` and tags) and on both model versions (tags). The new version carries what it is
   as tags (variant, classes, OK class, threshold, data and training fingerprints, its test figures) and
   says it in its description, with why it is or is not the champion; the registered model describes
   what it holds and what its aliases mean.
5. ``reports/promote/registry.json`` says which registry the aliases were set in and what they point at.
   dvc.yaml keeps it out of DVC's cache, which turns DVC's run cache off for this stage: the stage's
   real effect is on the registry, and a run restored from the run cache (another checkout's, or an
   earlier run with the same inputs) would write the files and leave the registry as it was.

Models of different class sets never compete for one champion: a model that tells apart other classes
(or calls another class OK) than the champion is another product. Promote then refuses before registering
anything: no version, no alias moves, and decision.json says ``comparable: false`` with the two class
lists and the way out (another ``promote.model_name``). The champion's classes come from its version's
tags, or from its card for versions registered before the tags existed.

The runner serves ``models:/<model_name>@champion`` and hot-reloads when the alias moves.
"""

from __future__ import annotations

import json
import logging
import re
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
    threshold (both models know every class: other class sets are refused before scoring)."""
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


def register(
    client: MlflowClient, run: tracking.Run, name: str, model_path: Path, card: ModelCard, data_fingerprint: str = ""
) -> str:
    """Log the variant into the training run and register it; reuse the version already holding this file.
    The version's tags say what it is; ``data_fingerprint``: the training run's ``data.fingerprint``."""
    ensure_registered_model(client, name, card)
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
        "classes": json.dumps(card.classes),
        "ok_class": card.ok_class,
        "input_size": str(card.input.size),
        "threshold": str(card.threshold),
        "data_fingerprint": data_fingerprint or card.data_fingerprint,
        "training_fingerprint": card.data_fingerprint,  # the card's: params, code and data of the training
    }
    if card.tiles:
        tags |= {"tiles_sha256": tiles_sha256, "tiles_architecture": card.tiles.architecture}
    mv = client.create_model_version(name, source, run_id=run.run_id, tags=tags, description=what_it_is(card))
    return str(mv.version)


def what_it_is(card: ModelCard) -> str:
    tiles = f", with a {card.tiles.architecture} tile model on {card.tiles.size} px tiles" if card.tiles else ""
    return (
        f"{card.architecture} ({card.variant} ONNX, {card.input.size} px{tiles}) telling apart "
        f"{', '.join(card.classes)} (OK class: {card.ok_class}); flags a defect at defect score >= "
        f"{card.threshold:.4f}."
    )


def ensure_registered_model(client: MlflowClient, name: str, card: ModelCard) -> None:
    """The registered model, created where missing, with a description of what it holds (a description a
    person wrote instead is kept)."""
    text = (
        f"Defect detection for one product: images classed as {', '.join(card.classes)} (OK class: "
        f"{card.ok_class}). Each version is an exported ONNX model with its model card, for the edge runner. "
        f"Alias `champion`: what the runners serve (`models:/{name}@champion`); `challenger`: the newest "
        "model compared with it on the current test split. Only models of these classes compete here: "
        "another class set is another product, under another `promote.model_name`."
    )
    try:
        current = client.get_registered_model(name).description or ""
    except MlflowException:
        client.create_registered_model(name, description=text)
        current = text
    if current != text and (not current or current.startswith("Defect detection")):
        client.update_registered_model(name, description=text)
    client.set_registered_model_tag(name, "classes", json.dumps(card.classes))
    client.set_registered_model_tag(name, "ok_class", card.ok_class)


def champion_classes(client: MlflowClient, name: str, champ) -> tuple[list[str], str]:
    """The champion version's classes and OK class: from its tags, or its card (older versions)."""
    if "classes" in champ.tags and "ok_class" in champ.tags:
        return json.loads(champ.tags["classes"]), champ.tags["ok_class"]
    files = resolve(f"models:/{name}/{champ.version}", tracking_uri=client.tracking_uri, cache=CACHE)
    card = ModelCard.read(card_path_for(files.model_path))
    return card.classes, card.ok_class


def other_product(champion: tuple[list[str], str], card: ModelCard) -> str:
    """Why the challenger cannot compete with the champion ("" when it can): other classes, another OK class."""
    classes, ok = champion
    way_out = "a different product; register under another promote.model_name"
    if sorted(classes) != sorted(card.classes):
        return f"champion classes {sorted(classes)} vs challenger {sorted(card.classes)}: {way_out}"
    if ok != card.ok_class:
        return f"champion OK class {ok!r} vs challenger {card.ok_class!r}: {way_out}"
    return ""


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

    with tracking.resume_run(params.mlflow, Path("models/train/run.json"), stage="promote") as run:
        client = run.client
        champ = alias_version(client, cfg.model_name, "champion")
        new = score_on_files(model_path, raw_images, paths, truth, card.ok_class)
        champ_classes = champion_classes(client, cfg.model_name, champ) if champ else None
        refused = other_product(champ_classes, card) if champ_classes else ""
        version, old = None, None
        if refused:
            promoted, why = False, refused
        else:
            data_fp = client.get_run(run.run_id).data.tags.get("data.fingerprint", "")
            version = register(client, run, cfg.model_name, model_path, card, data_fp)
            client.set_registered_model_alias(cfg.model_name, "challenger", version)
            promoted, why, old = judge(params, client, champ, version, new, (raw_images, paths, truth, card.ok_class))
            if promoted:
                client.set_registered_model_alias(cfg.model_name, "champion", version)
        decision = {
            "model_name": cfg.model_name,
            "challenger": {
                "version": version,
                "run_id": run.run_id,
                "variant": variant,
                "classes": card.classes,
                **new,
            },
            "champion_before": None
            if champ is None
            else {"version": str(champ.version), "run_id": champ.run_id, "classes": champ_classes[0], **(old or {})},
            "champion_after": version if promoted else str(champ.version),
            "promoted": promoted,
            "comparable": not refused,
            "reason": why,
            "rules": [asdict(r) for r in cfg.rules],
            "test_images": len(paths),
        }
        write_reports(client, decision, out_dir)
        record(run, client, decision, out_dir / "decision.json")
        if version is not None:
            describe(run, client, decision, card)
    return decision


def alias_version(client: MlflowClient, name: str, alias: str):
    """The model version ``alias`` points at, or None (no such alias, or no such registered model yet)."""
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def judge(params: Params, client: MlflowClient, champ, version: str, new: dict, test: tuple) -> tuple:
    """(promoted, why, the champion's figures or None): the rules, with both scored on today's test split
    (``test``: the image folder, the test files, their classes and the OK class)."""
    cfg = params.promote
    if champ is None:
        return True, "no champion yet: the first model becomes champion", None
    if str(champ.version) == version:
        return True, f"version {version} is already the champion", new
    files = resolve(f"models:/{cfg.model_name}/{champ.version}", tracking_uri=client.tracking_uri, cache=CACHE)
    old = score_on_files(files.model_path, *test)
    promoted, why = decide(new, old, cfg.rules, cfg.promote_on_tie, cfg.refuse_false_alarm_rate)
    return promoted, why, old


def write_reports(client: MlflowClient, decision: dict, out_dir: Path) -> None:
    """decision.json, and registry.json: where the aliases live and what they point at now."""
    name = decision["model_name"]
    challenger = alias_version(client, name, "challenger")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "decision.json").write_text(json.dumps(decision, indent=2) + "\n")
    registry = {
        "tracking_uri": without_credentials(client.tracking_uri),
        "model_name": name,
        "champion": decision["champion_after"],
        "challenger": str(challenger.version) if challenger else None,
    }
    (out_dir / "registry.json").write_text(json.dumps(registry, indent=2) + "\n")


def without_credentials(uri: str) -> str:
    """``http://user:secret@host/`` -> ``http://host/``: the file goes into git."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri  # also keeps sqlite:///x as written (urlunsplit would drop its empty netloc)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


FIGURES = ("defect_recall", "false_alarm_rate", "accuracy")


def record(run: tracking.Run, client: MlflowClient, d: dict, report: Path) -> None:
    """The comparison on both training runs and both model versions (a refused model: on its run alone)."""
    name, ch, before = d["model_name"], d["challenger"], d["champion_before"]
    run.log_metrics({f"promote_{k}": ch[k] for k in FIGURES})
    outcome = "champion" if d["promoted"] else "challenger" if d["comparable"] else "refused"
    tags = {"promote.version": ch["version"] or "none", "promote.decision": outcome, "promote.reason": d["reason"]}
    if before and d["comparable"] and before["version"] != ch["version"]:
        tags["promote.compared_with"] = f"version {before['version']} (run {before['run_id']})"
        run.log_metrics({f"promote_champion_{k}": before[k] for k in FIGURES})
        verb = "lost to" if d["promoted"] else "held against"
        client.set_tag(
            before["run_id"],
            f"promote.challenged_by.v{ch['version']}",
            f"{verb} version {ch['version']} (run {ch['run_id']}): {d['reason']}",
        )
        client.set_model_version_tag(name, before["version"], f"challenged_by.v{ch['version']}", d["reason"])
    run.set_tags(tags)
    if ch["version"] is not None:
        client.set_model_version_tag(name, ch["version"], "promotion", f"{outcome}: {d['reason']}")
    run.log_artifacts(report, "promote")


def describe(run: tracking.Run, client: MlflowClient, d: dict, card: ModelCard) -> None:
    """The new version's test figures as tags and, in words, what it is and why it is or is not the champion;
    a champion it replaced says by which version; the training run's description gains the outcome."""
    name, ch, before = d["model_name"], d["challenger"], d["champion_before"]
    evaluated = Path("reports/evaluate/metrics.json")
    auc = json.loads(evaluated.read_text()).get("roc_auc") if evaluated.is_file() else None
    figures = {f"test_{k}": ch[k] for k in FIGURES} | ({"test_roc_auc": auc} if auc is not None else {})
    for key, value in figures.items():
        client.set_model_version_tag(name, ch["version"], key, f"{value:.4f}")
    verdict = "Champion" if d["promoted"] else f"Not champion (the champion is version {d['champion_after']})"
    if not (before and before["version"] == ch["version"]):  # not a re-run on the champion itself
        text = (
            f"{what_it_is(card)}\n\nTest split, {ch['images']} images scored end to end by the edge runner at "
            f"that threshold: accuracy {ch['accuracy']:.1%}, defect recall {ch['defect_recall']:.1%}, "
            f"false-alarm rate {ch['false_alarm_rate']:.1%}"
            + (f"; ROC AUC {auc:.3f} (evaluate stage, PyTorch)" if auc is not None else "")
            + f".\n\n{verdict}: {d['reason']}.\n\nTrained in MLflow run {ch['run_id']}."
        )
        client.update_model_version(name, ch["version"], description=text)
    if d["promoted"] and before and before["version"] != ch["version"]:
        old = client.get_model_version(name, before["version"]).description or ""
        replaced = f"Replaced as champion by version {ch['version']}: {d['reason']}."
        client.update_model_version(name, before["version"], description=f"{old}\n\n{replaced}".strip())
    note = client.get_run(run.run_id).data.tags.get("mlflow.note.content", "")
    note = re.split(r"(?:^|\n\n)Registry:", note)[0]  # a re-run replaces its own line
    outcome = f"Registry: version {ch['version']} of {name}; {verdict.lower()}: {d['reason']}."
    run.set_tags({"mlflow.note.content": f"{note}\n\n{outcome}".strip()})
