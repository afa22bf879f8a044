"""Stage validate: data/raw -> manifest + quarantine (data/validated) and the gate report (reports/validate)."""

import json
from pathlib import Path

from pipeline.data.validate import gate, validate, write_outputs
from pipeline.entry import run_stage


def main(params):
    classes = sorted(json.loads(Path("data/raw/ingest.json").read_text())["counts"])
    accepted, quarantined, summary = validate(Path("data/raw/images"), classes, params.validate)
    write_outputs(Path("data/validated"), Path("reports/validate"), accepted, quarantined, summary)
    print(
        f"validate: {summary['accepted']} accepted, {summary['quarantined']} quarantined "
        f"(see reports/validate/report.md)"
    )
    gate(summary, quarantined, params.validate)


if __name__ == "__main__":
    run_stage("validate", main)
