# The edge runner for NVIDIA GPU boxes next to the line: serving/ only (onnxruntime-gpu, numpy, pillow,
# the HTTP server), no torch, no pipeline/. It serves KServe v2 HTTP on port 8080.
#
# Build (from the repo root; .dockerignore sends only serving/ as the build context):
#   docker build -t defect-runner .
#
# Run with a mounted model (model.onnx and its model.card.json side by side in /srv/models):
#   docker run --gpus all --init -p 8080:8080 -v /srv/models:/models:ro \
#       -e DEFECT_RUNNER_TOKEN=... defect-runner
#
# Run with the champion pulled from the MLflow registry at start:
#   docker run --gpus all --init -p 8080:8080 \
#       -e MODEL=models:/defect-detection@champion -e MLFLOW_TRACKING_URI=http://mlflow:5000 \
#       -e DEFECT_RUNNER_TOKEN=... defect-runner
#
# Arguments after the image name go to `serve`: `docker run ... defect-runner --providers cuda --threads 4`.
# Signals reach the runner itself (the entrypoint execs it): `docker stop` sends SIGTERM, a graceful
# shutdown; `docker kill -s HUP <container>` reloads the model. --init adds a tiny init as PID 1 that
# forwards them and reaps children.
#
# The server listens on 0.0.0.0 inside the container, so anyone who reaches the published port reaches
# it: set DEFECT_RUNNER_TOKEN (the runner then asks for `Authorization: Bearer <token>`) unless the port
# is only published on a trusted interface (-p 127.0.0.1:8080:8080).
#
# Why this base image: onnxruntime-gpu 1.31.1 from PyPI is built against CUDA 13.0 (its
# capi/build_and_package_info.py says cuda_version = '13.0'; libonnxruntime_providers_cuda.so needs
# libcudart.so.13, libcublas.so.13, libcublasLt.so.13, libcurand.so.10) and cuDNN 9 (its `cudnn` extra is
# nvidia-cudnn-cu13~=9.0). onnxruntime's requirements page: a build for CUDA major N works with any
# N.x runtime (NVIDIA minor-version compatibility), and cuDNN 8 and 9 are not interchangeable. The
# nvidia/cuda `<ver>-cudnn-runtime-<os>` images carry the CUDA runtime and math libraries (cudart,
# cuBLAS, cuRAND, cuFFT) plus cuDNN 9; 13.0.3 is the newest 13.0 patch release, the CUDA minor the wheel
# was built with. ubuntu24.04 gives Python 3.12, for which every pinned wheel in serving/requirements.txt
# exists. The host needs an NVIDIA driver for CUDA 13.0 (580 or newer) and the NVIDIA Container Toolkit.
# TensorRT is not in this image: `--providers auto` uses CUDA, then the CPU.
FROM nvidia/cuda:13.0.3-cudnn-runtime-ubuntu24.04

ARG DEBIAN_FRONTEND=noninteractive
# apt packages are not version-pinned on purpose (DL3008): the base image tag already fixes Ubuntu 24.04
# (so Python 3.12), and the Ubuntu archive drops superseded package versions, so exact pins would break
# rebuilds and hold back security updates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/runner \
    PATH=/opt/runner/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /app
# Requirements first: the dependency layer is rebuilt only when the pins change, not on every code edit.
# mlflow-skinny lets the runner resolve models:/NAME@alias against MLFLOW_TRACKING_URI; one pip call,
# so the resolver checks it against the runner's pins.
COPY serving/requirements.txt serving/requirements.txt
RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install --no-cache-dir --disable-pip-version-check -r serving/requirements.txt mlflow-skinny==3.17.2

# Only the serving package: the runner never imports pipeline/ or torch.
COPY serving/ serving/

# A numeric, non-root user (Kubernetes' runAsNonRoot can verify a number, not a name).
RUN groupadd --system --gid 10001 runner \
    && useradd --system --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin runner
USER 10001:10001

# /models/model.onnx (with model.card.json beside it) when mounted, or a registry URI such as
# models:/defect-detection@champion (needs MLFLOW_TRACKING_URI).
ENV MODEL=/models/model.onnx
EXPOSE 8080

# Ready means the model is loaded and the runner answers; urllib raises on any non-2xx (e.g. 503 while
# loading), so the check exits 1. Sends the bearer token when one is set. start-period covers a
# registry download and provider start-up.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request as u; t = os.environ.get('DEFECT_RUNNER_TOKEN'); r = u.Request('http://127.0.0.1:8080/v2/health/ready', headers={'Authorization': 'Bearer ' + t} if t else {}); sys.exit(0 if u.urlopen(r, timeout=4).status == 200 else 1)"]

# sh only expands $MODEL, then exec replaces it with python (the runner gets the signals); "$@" is the
# extra arguments given after the image name (CMD, empty by default).
ENTRYPOINT ["/bin/sh", "-c", "exec python -m serving.launch serve --model \"$MODEL\" --host 0.0.0.0 --port 8080 \"$@\"", "defect-runner"]
CMD []
