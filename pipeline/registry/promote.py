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


def score_on_files(model_path: Path, root: Path, paths: list[str], truth: list[str], ok_class: str | None) -> dict:
    """Accuracy and the worst class's recall of one exported model on image files and, with an OK class,
    its defect recall and false-alarm rate at its card's threshold (both models know every class: other
    class sets are refused before scoring)."""
    runner = Runner(model_path, providers="cpu", spin=False, force=True, warmup=0)
    preds = list(runner.predict_files([root / p for p in paths], batch_size=32))
    unreadable = [p.path for p in preds if p.error]
    if unreadable:
        raise RuntimeError(f"promote: test images could not be read: {unreadable[:5]}")
    correct = np.array([p.label == t for p, t in zip(preds, truth, strict=True)])
    recalls = [correct[[t == c for t in truth]].mean() for c in sorted(set(truth))]
    figures = {"accuracy": float(correct.mean()), "min_class_recall": float(min(recalls)), "images": len(paths)}
    if ok_class is None:  # defect-type sorting: the most likely class is the decision
        return figures
    is_defect = np.array([t != ok_class for t in truth])
    flagged = np.array([p.decision == "defect" for p in preds])
    return figures | {
        "defect_recall": float(flagged[is_defect].mean()) if is_defect.any() else float("nan"),
        "false_alarm_rate": float(flagged[~is_defect].mean()) if (~is_defect).any() else float("nan"),
        "binary_accuracy": float((flagged == is_defect).mean()),
    }


def over_false_alarm_bound(figures: dict, limit: float) -> bool:
    """True when a model flags more OK images than ``promote.refuse_false_alarm_rate`` at its own threshold
    (never for defect-type sorting, which has no OK images)."""
    return figures.get("false_alarm_rate", 0.0) > limit


def decide(
    challenger: dict,
    champion: dict,
    rules: list[PromoteRule],
    promote_on_tie: bool,
    refuse_false_alarm_rate: float = 1.0,
) -> tuple[bool, str]:
    """(promote?, why): the false-alarm bound first (with an OK class), then the rules in order."""
    limit = refuse_false_alarm_rate
    if over_false_alarm_bound(challenger, limit):
        return False, (
            f"false_alarm_rate {challenger['false_alarm_rate']:.4f} at its own threshold above "
            f"promote.refuse_false_alarm_rate {limit}: a line cannot run it"
        )
    if over_false_alarm_bound(champion, limit):
        return (
            True,
            f"champion's false_alarm_rate {champion['false_alarm_rate']:.4f} above "
            f"promote.refuse_false_alarm_rate {limit}",
        )
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
    what = f"{card.architecture} ({card.variant} ONNX, {card.input.size} px{tiles})"
    if card.ok_class is None:
        return f"{what} sorting defect types: {', '.join(card.classes)} (no OK class; the most likely class decides)."
    return (
        f"{what} telling apart {', '.join(card.classes)} (OK class: {card.ok_class}); flags a defect at defect "
        f"score >= {card.threshold:.4f}."
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
        return not_deployable(params, variants, out_dir)
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
            test = (raw_images, paths, truth, card.ok_class)
            promoted, why, old = judge(params, client, champ, version, new, test, rules_for(cfg, card))
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
            "champion_after": version if promoted else (str(champ.version) if champ else None),
            "promoted": promoted,
            "comparable": not refused,
            "reason": why,
            "registered": version is not None,
            "rules": [asdict(r) for r in rules_for(cfg, card)],
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


def rules_for(cfg, card: ModelCard) -> list[PromoteRule]:
    """``promote.rules`` for a defect/OK model, ``promote.sorting_rules`` for defect-type sorting."""
    return cfg.sorting_rules if card.ok_class is None else cfg.rules


def not_deployable(params: Params, variants: dict, out_dir: Path) -> dict:
    """Export marked no variant deployable for ``promote.provider`` (e.g. an operating point below the recall
    target): nothing is registered, no alias moves, and decision.json says why."""
    cfg = params.promote
    reasons = {v: r.get("not_deployable_reason", "") for v, r in variants["variants"].items()}
    why = f"export marks no variant deployable for provider {cfg.provider}: {reasons.get('fp32') or reasons}"
    with tracking.resume_run(params.mlflow, Path("models/train/run.json"), stage="promote") as run:
        champ = alias_version(run.client, cfg.model_name, "champion")
        decision = {
            "model_name": cfg.model_name,
            "challenger": {"version": None, "run_id": run.run_id, "variant": None},
            "champion_before": None if champ is None else {"version": str(champ.version), "run_id": champ.run_id},
            "champion_after": None if champ is None else str(champ.version),
            "promoted": False,
            "comparable": True,
            "registered": False,
            "reason": why,
            "rules": [],
            "test_images": 0,
        }
        write_reports(run.client, decision, out_dir)
        run.set_tags({"promote.decision": "not registered", "promote.reason": why})
    log.warning("promote: %s", why)
    return decision


def judge(
    params: Params, client: MlflowClient, champ, version: str, new: dict, test: tuple, rules: list[PromoteRule]
) -> tuple:
    """(promoted, why, the champion's figures or None): the rules, with both scored on today's test split
    (``test``: the image folder, the test files, their classes and the OK class). A first model is crowned
    only within the false-alarm bound."""
    cfg = params.promote
    if champ is None:
        if over_false_alarm_bound(new, cfg.refuse_false_alarm_rate):
            return (
                False,
                (
                    f"no champion yet, and this model's false_alarm_rate {new['false_alarm_rate']:.4f} at its own "
                    f"threshold is above promote.refuse_false_alarm_rate {cfg.refuse_false_alarm_rate}: not crowned"
                ),
                None,
            )
        return True, "no champion yet: the first model becomes champion", None
    if str(champ.version) == version:
        return True, f"version {version} is already the champion", new
    files = resolve(f"models:/{cfg.model_name}/{champ.version}", tracking_uri=client.tracking_uri, cache=CACHE)
    old = score_on_files(files.model_path, *test)
    promoted, why = decide(new, old, rules, cfg.promote_on_tie, cfg.refuse_false_alarm_rate)
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


FIGURES = ("defect_recall", "false_alarm_rate", "accuracy", "min_class_recall")  # those a model's task has


def figures_of(scored: dict) -> dict:
    return {k: scored[k] for k in FIGURES if k in scored}


def record(run: tracking.Run, client: MlflowClient, d: dict, report: Path) -> None:
    """The comparison on both training runs and both model versions (a refused model: on its run alone)."""
    name, ch, before = d["model_name"], d["challenger"], d["champion_before"]
    run.log_metrics({f"promote_{k}": v for k, v in figures_of(ch).items()})
    outcome = "champion" if d["promoted"] else "challenger" if d["comparable"] else "refused"
    tags = {"promote.version": ch["version"] or "none", "promote.decision": outcome, "promote.reason": d["reason"]}
    if before and d["comparable"] and before["version"] != ch["version"]:
        tags["promote.compared_with"] = f"version {before['version']} (run {before['run_id']})"
        run.log_metrics({f"promote_champion_{k}": v for k, v in figures_of(before).items()})
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
    figures = {f"test_{k}": v for k, v in figures_of(ch).items()} | ({"test_roc_auc": auc} if auc is not None else {})
    for key, value in figures.items():
        client.set_model_version_tag(name, ch["version"], key, f"{value:.4f}")
    verdict = "Champion" if d["promoted"] else f"Not champion (the champion is version {d['champion_after']})"
    if not (before and before["version"] == ch["version"]):  # not a re-run on the champion itself
        said = (
            f"at that threshold: accuracy {ch['accuracy']:.1%}, defect recall {ch['defect_recall']:.1%}, "
            f"false-alarm rate {ch['false_alarm_rate']:.1%}"
            if "defect_recall" in ch
            else f"(most likely class): accuracy {ch['accuracy']:.1%}, worst class recall {ch['min_class_recall']:.1%}"
        )
        text = (
            f"{what_it_is(card)}\n\nTest split, {ch['images']} images scored end to end by the edge runner {said}"
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
