"""Stage promote: register the export, alias it challenger, and move champion only to a better model (of the
same classes: another class set is refused, see ``pipeline.registry.promote``)."""

import json
from pathlib import Path

from pipeline import summary, tracking
from pipeline.entry import run_stage
from pipeline.registry.promote import FIGURES, promote


def main(params):
    d = promote(params, Path("models/export"), Path("data/raw/images"), Path("data/prepared"), Path("reports/promote"))
    before, c = d["champion_before"], d["challenger"]
    vs = f" vs champion version {before['version']}" if before and before["version"] != c["version"] else ""
    registered = d["comparable"] and d["registered"]
    verdict = "now champion" if d["promoted"] else "stays challenger" if registered else "not registered"
    figures = ", ".join(f"{k.replace('_', ' ')} {c[k]:.3f}" for k in FIGURES if k in c)
    what = f"{'version ' + c['version'] if c['version'] else 'the model'} ({c['variant'] or 'no variant'})"
    print(f"promote: {what}: {figures or 'not scored'}{vs}; {verdict}: {d['reason']}")
    champion = bool(d["promoted"] or (c["version"] and d["champion_after"] == c["version"]))  # dvc metrics show:
    Path("reports/promote/headline.json").write_text(json.dumps({"champion": champion}) + "\n")
    with tracking.resume_run(params.mlflow, Path("models/train/run.json"), stage="promote") as run:
        run.log_artifacts(summary.write(Path("reports")), "summary")


if __name__ == "__main__":
    run_stage("promote", main)
