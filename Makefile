# Two commands for a newcomer: `make run` (set up + dvc repro) and `make test` (set up + pytest).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export PYTHONUNBUFFERED := 1

.PHONY: setup run test test-fast ui lint format bench bench-quick bench-train gpu-check tracking-server tracking-server-stop clean

# The venv is rebuilt when the pinned requirements change. torch 2.14.1 / torchvision 0.29.1 are pinned
# because they install from this machine's disk; other versions download gigabytes.
$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements.txt
	$(PY) -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

setup: $(STAMP)

run: setup
	dvc repro
	python -m pipeline.summary

# The full suite, what CI runs (~20 min on 2 cores).
test: setup
	pytest -q

# The edit loop (about 1 min on 2 cores): unit and small integration tests, no training runs or dvc repro
# (tests marked slow, or using the session's trained-model fixtures, are left out: tests/conftest.py).
test-fast: setup
	pytest -q -m "not slow and not gpu and not real_data"

ui: setup
	mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000

# Shared MLflow server: PostgreSQL backend, artifacts served over HTTP, state in .tracking-server/
tracking-server: setup
	scripts/tracking_server.sh start

tracking-server-stop:
	scripts/tracking_server.sh stop

# Style: ruff's linter and formatter (CI runs both checks before the tests).
lint: setup
	ruff check .
	ruff format --check .

format: setup
	ruff format .
	ruff check --fix .

# Every performance figure, side by side on this machine (~20 min on 2 cores; needs `make run` first):
# reports/bench/*.json, reports/bench/README.md (the tables) and reports/bench/bench.png.
bench: setup
	python benchmarks/bench.py

bench-quick: setup
	python benchmarks/bench.py --quick

# Training throughput on this CPU: the train stage's loop vs a plain PyTorch loop, side by side.
bench-train: setup
	python benchmarks/train_throughput.py --mode loop --steps 8 --rounds 5

# On a machine with an NVIDIA GPU and its own python3 (torch, timm, pytest): gpu tests + GPU benchmark.
gpu-check:
	scripts/gpu_check.sh

clean:
	rm -rf data models mlartifacts mlflow.db .dvc/cache .dvc/tmp
