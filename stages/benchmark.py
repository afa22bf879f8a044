"""Stage benchmark: the edge runner (each exported variant) vs PyTorch eager on the same model and test
images, interleaved; end to end from PNG and JPEG files; the HTTP server vs the runner in process
(``pipeline.export.benchmark``, the driver ``make bench`` shares)."""

import json
from pathlib import Path

from pipeline import tracking
from pipeline.entry import run_stage
from pipeline.export.benchmark import Inputs, flat_metrics, run_benchmark, summary_line

OUT = Path("reports/benchmark")


def main(params):
    report = run_benchmark(params.benchmark, Inputs(), OUT)
    (OUT / "metrics.json").write_text(json.dumps(report, indent=2) + "\n")
    with tracking.resume_run(params.mlflow, Path("models/train/run.json"), stage="benchmark") as run:
        run.log_metrics(flat_metrics(report, params.benchmark.batch_sizes))
        run.log_artifacts(OUT / "metrics.json", "benchmark")
        run.log_artifacts(OUT / "benchmark.png", "benchmark")
    print(summary_line(report))


if __name__ == "__main__":
    run_stage("benchmark", main)
