"""What a `dvc repro` achieved, in a few lines a person reads in seconds.

    python -m pipeline.summary            # from the project root, after dvc repro (`make run` ends with it)

Reads the stages' small JSON reports (``reports/``); a stage that has not run yet is said so, not guessed.
The promote stage, the last, writes the same lines to ``reports/summary.md`` and logs them to the model's
MLflow run. ``dvc metrics show`` lists the headline figures; the detail is in ``reports/<stage>/``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _read_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) if path.is_file() else {}


def training_seconds(t: dict) -> float | None:
    """Training alone, without the stages before and after it, from the train stage's metrics.json; an
    ensemble's is the sum of its members' and its tile model's (its own summary has no epoch count: members
    may differ)."""
    if "members" in t:
        tile_model = [t["tiles"]] if isinstance(t.get("tiles"), dict) else []
        parts = [training_seconds(m) for m in [*t["members"], *tile_model]]
        return None if None in parts else round(sum(parts), 1)
    if not t.get("train_img_s"):
        return None
    per_epoch = t.get("epoch_images", t["train_images"])
    return round(t["epochs_run"] * per_epoch / t["train_img_s"], 1)


def _data_line(prepared: dict | None, params: dict) -> str | None:
    if not prepared:
        return None
    splits = {name: sum(counts.values()) for name, counts in prepared["splits"].items()}
    defects = [c for c in prepared["classes"] if c != prepared["ok_class"]]
    ok = "no OK class (defect-type sorting), " if prepared["ok_class"] is None else f"{prepared['ok_class']} + "
    return (
        f"data:      {params['data']['source']}: {sum(splits.values())} images, {ok}"
        f"{len(defects)} defect classes ({', '.join(defects)}); "
        + " / ".join(f"{n} {name}" for name, n in splits.items())
    )


def _model_line(recipe: dict | None, train: dict | None, params: dict, prepared: dict | None) -> str | None:
    if not train:
        return None
    members = len(train.get("members", [])) or 1
    size = (prepared or {}).get("image_size", params["prepare"]["image_size"])
    what = f"{params['model']['name']}, {size} px"
    what += f", {members} models" if members > 1 else ""
    what += " + a tile model" if recipe and recipe.get("tiles") else ""
    seconds = training_seconds(train)
    took = f", trained in {seconds / 60:.1f} min" if seconds else ""
    return f"model:     {what}{took} ({train['device']}, {train['precision']}, {train['train_images']} images)"


def _test_lines(ev: dict) -> list[str]:
    if ev["threshold"] is None:  # defect-type sorting
        return [
            f"test:      {ev['test_images']} images: accuracy {ev['accuracy']:.3f}, worst class recall "
            f"{ev['min_class_recall']:.3f} (the most likely class decides: no OK class, no threshold)"
        ]
    p = ev["operating_point"]
    ceiling, target = p["max_false_alarm_rate"], p["target_defect_recall"]
    if p["status"] == "meets target":
        how = [
            f"threshold: {ev['threshold']:.3f} (the card's): on val {p['val_defect_recall']:.1%} of defects "
            f"caught within the {ceiling:.0%} false-alarm ceiling"
        ]
    else:
        how = [
            f"threshold: {ev['threshold']:.3f} (the card's): BELOW TARGET, MARKED FOR REVIEW (not deployable)",
            f"           at the {ceiling:.0%} false-alarm ceiling it catches only {p['val_defect_recall']:.1%} of "
            f"val defects (target {target:.0%})",
        ]
    small = (
        [
            f"warning:   a small val split ({p.get('val_defect_parts')} defect, {p.get('val_ok_parts')} OK parts) set "
            "the threshold: reports/evaluate/metrics.json"
        ]
        if p["warnings"]
        else []
    )
    return [
        f"test:      {ev['test_images']} images: accuracy {ev['accuracy']:.3f}, "
        f"defect-vs-OK ROC AUC {ev['roc_auc']:.3f}",
        *how,
        f"at it:     catches {ev['defect_recall']:.1%} of test defects, flags {ev['false_alarm_rate']:.1%} of OK parts",
        *small,
    ]


def lines(reports: Path = Path("reports"), root: Path = Path()) -> list[str]:
    params = _read_yaml(root / "params.yaml")
    recipe, train = _read(reports / "train/recipe.json"), _read(reports / "train/metrics.json")
    prepared = _read(root / "data/prepared/prepare.json")
    out = [_data_line(prepared, params), _model_line(recipe, train, params, prepared)]
    ev = _read(reports / "evaluate/metrics.json")
    if ev:
        out += _test_lines(ev)
    ex = _read(reports / "export/variants.json")
    if ex:
        ok = [v for v, r in ex["variants"].items() if r["deployable"]]
        gpu = f"GPU boxes get {ex['recommended'].get('cuda')}" if ex["recommended"] else "nothing to ship"
        out.append(f"exported:  {', '.join(ok) or 'no variant'} deployable; {gpu}")
    d = _read(reports / "promote/decision.json")
    if d:
        c = d["challenger"]
        verdict = "now champion" if d["promoted"] else f"stays challenger (champion: version {d['champion_after']})"
        if d.get("comparable") is False:  # another class set: refused before registering
            out.append(f"registry:  not registered under {d['model_name']}: another product's classes")
        elif d.get("registered") is False:  # export marked no variant deployable
            out.append(f"registry:  not registered under {d['model_name']}: no deployable variant")
        else:
            out.append(f"registry:  {d['model_name']} version {c['version']} ({c['variant']}) {verdict}")
        out.append(f"because:   {d['reason']}")
    out = [line for line in out if line]
    name = params.get("promote", {}).get("model_name", "defect-detection")
    uri = params.get("mlflow", {}).get("tracking_uri", "sqlite:///mlflow.db")
    if not out:
        return ["no stage has written its report yet: run `dvc repro`"]
    registered = not d or d.get("registered", True)
    serve = (
        f"defect-runner serve --model models:/{name}@champion --tracking-uri {uri}"
        if registered
        else "defect-runner serve --model models/export/model.onnx  (marked for review: not registered, it warns)"
    )
    return out + [
        "reports:   reports/evaluate/ (review.png: the images to look at first), `dvc metrics show`, MLflow: `make ui`",
        f"serve it:  {serve}",
        "your data: defect check -S data.source=DIR, then dvc exp run -S data.source=DIR -S data.ok_class=NAME",
    ]


def write(reports: Path = Path("reports"), root: Path = Path()) -> Path:
    """``reports/summary.md``: the lines, and where the detail is."""
    path = reports / "summary.md"
    body = "\n".join(f"    {line}" for line in lines(reports, root))
    path.write_text(f"# What this run achieved\n\n{body}\n")
    return path


def main() -> int:
    print("\n".join(lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
