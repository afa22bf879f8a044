#!/usr/bin/env bash
# The train and evaluate stages of a prepared dataset, timed on a GPU box that has torch, timm and numpy
# but neither albumentations, MLflow nor DVC (the GPU check machine), with the stages' own code.
#
#   scripts/gpu_pipeline.sh pack EXP   (here) EXP is a checkout where `dvc repro augment` has run (e.g. on the
#                                      magnetic tiles): copies its prepared data (recompressed), the reports
#                                      the train stage reads, params.yaml and the raw masks into .gpu/exp, and
#                                      downloads the missing pure-Python/cp312 wheels into .gpu/whl (.gpu: ~40 MB in all).
#                                      Add `/.gpu/` to .git/info/exclude; it travels as a carried path.
#   scripts/gpu_pipeline.sh run        (there) installs the wheels into /tmp/site, runs the stages in a copy
#                                      of the tree under /tmp/gpu-pipeline with a file MLflow store, and
#                                      writes train/evaluate logs, seconds per stage and the reports to
#                                      ${OUT:-reports/gpu}. WHL_DIR overrides .gpu/whl (e.g. cp311 wheels,
#                                      to try it on this machine first).
set -uo pipefail
cd "$(dirname "$0")/.."

# Imported by the train and evaluate stages and absent from the GPU machine's image (its package list is in
# the device README); the versions are this checkout's .venv's, so both machines run the same library code.
CARRY="albucore albumentations annotated-types cachetools captum databricks-sdk fastapi gitdb gitpython
importlib_metadata mlflow-skinny mlflow-tracing opentelemetry-api opentelemetry-proto opentelemetry-sdk
opentelemetry-semantic-conventions pydantic pydantic_core python-dotenv python-multipart simsimd smmap
sqlparse starlette stringzilla typing-inspection"

pack() {
  local exp=${1:?usage: scripts/gpu_pipeline.sh pack EXP (a checkout where dvc repro augment has run)}
  for f in data/prepared/train.npz data/prepared/prepare.json reports/validate/summary.json reports/augment/policy.json; do
    [[ -f "$exp/$f" ]] || { echo "pack: $exp/$f is missing: run 'dvc repro augment' in $exp first" >&2; exit 2; }
  done
  rm -rf .gpu/exp && mkdir -p .gpu/exp/data/prepared .gpu/exp/data/raw .gpu/exp/reports/validate \
    .gpu/exp/reports/augment .gpu/whl
  .venv/bin/python - "$exp" <<'EOF'
import sys
from pathlib import Path

import numpy as np

src = Path(sys.argv[1]) / "data/prepared"
for f in sorted(src.glob("*.npz")):  # uncompressed on disk for speed; compressed they travel at ~1/5
    with np.load(f) as z:
        np.savez_compressed(Path(".gpu/exp/data/prepared") / f.name, **{k: z[k] for k in z.files})
EOF
  cp "$exp/data/prepared/prepare.json" .gpu/exp/data/prepared/
  cp -r "$exp/data/augmented" .gpu/exp/data/
  [[ -d "$exp/data/raw/masks" ]] && cp -r "$exp/data/raw/masks" .gpu/exp/data/raw/
  cp "$exp/reports/validate/summary.json" .gpu/exp/reports/validate/
  cp "$exp/reports/augment/policy.json" .gpu/exp/reports/augment/
  cp "$exp/params.yaml" "$exp/dvc.lock" .gpu/exp/
  local pins
  pins=$(.venv/bin/python -c 'import importlib.metadata as m, sys; print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' $CARRY)
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl $pins 2>&1 | grep -v "is ignored" || true
  du -sh .gpu
}

run() {
  local out=${OUT:-reports/gpu} work=/tmp/gpu-pipeline
  mkdir -p "$out"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${WHL_DIR:-.gpu/whl}"/*.whl \
    || { echo "run: installing the wheels in ${WHL_DIR:-.gpu/whl} failed" >&2; exit 1; }
  rm -rf "$work" && mkdir -p "$work"
  cp -r pipeline serving stages pyproject.toml "$work"/ && cp -r .gpu/exp/. "$work"/
  cd "$work" || exit 1
  export PYTHONPATH="/tmp/site:$work" PYTHONUNBUFFERED=1 \
    MLFLOW_ALLOW_FILE_STORE=true MLFLOW_TRACKING_URI="file:$work/mlruns"
  python3 -c 'import torch, timm; print("torch", torch.__version__, "timm", timm.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")' \
    | tee "$out/pipeline_env.txt"
  local t0 t1 t2 rc_train rc_eval
  t0=$(date +%s.%N)
  timeout "${TRAIN_TIMEOUT:-420}" python3 stages/train.py >"$out/train.log" 2>&1
  rc_train=$?
  t1=$(date +%s.%N)
  timeout 150 python3 stages/evaluate.py >"$out/evaluate.log" 2>&1
  rc_eval=$?
  t2=$(date +%s.%N)
  python3 - "$t0" "$t1" "$t2" "$rc_train" "$rc_eval" <<'EOF' | tee "$out/pipeline_seconds.json"
import json, sys
t0, t1, t2 = map(float, sys.argv[1:4])
print(json.dumps({"train_s": round(t1 - t0, 1), "evaluate_s": round(t2 - t1, 1),
                  "train_exit": int(sys.argv[4]), "evaluate_exit": int(sys.argv[5])}))
EOF
  tail -3 "$out/train.log"; tail -2 "$out/evaluate.log"
  tar czf "$out/pipeline_reports.tgz" reports/train reports/evaluate 2>/dev/null
  return $(( rc_train != 0 || rc_eval != 0 ))
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  run) run ;;
  *) echo "usage: scripts/gpu_pipeline.sh pack EXP | run" >&2; exit 2 ;;
esac
