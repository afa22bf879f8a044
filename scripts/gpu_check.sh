#!/usr/bin/env bash
# The GPU check: run on a machine with an NVIDIA GPU, with that machine's own python3 and packages
# (torch, timm, numpy, pytest, pyyaml, tqdm, pydantic; no installs). Inside 10 minutes it runs
#   1. the tests marked `gpu` (fp16 + GradScaler, bf16, NCCL DDP/FSDP, ...), and
#   2. the training-throughput benchmark of the default EfficientNet at 224 px, batch 256: fp32 vs AMP,
#      with and without channels_last, and AMP + channels_last + torch.compile, side by side in one
#      process; then the same without compile at the pipeline's own 128 px and batch 32, and
#   3. the inference benchmark at 224 px, batch 1 and 256: PyTorch fp32, fp16 + channels_last,
#      + torch.compile (CUDA graphs), onnxruntime CUDA and TensorRT where this machine's onnxruntime has them.
# Results go to ${OUT:-reports/gpu}: pytest's log, the benchmark JSON and its printed table.
# Copy the table into README.md's benchmark section with the date and the GPU name.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-reports/gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO GPU")' | tee "$out/env.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$out/env.txt" 2>/dev/null || true

# -p no:cacheprovider: write nothing into the tree; the conftest needs pyyaml and torch at import,
# pipeline.config pydantic (pip's wheel; carry it where that machine lacks it).
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tee "$out/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

timeout 180 python3 benchmarks/train_throughput.py --mode gpu --steps 20 --rounds 3 \
  --out "$out/train_throughput_gpu.json" 2>&1 | tee "$out/train_throughput_gpu.txt"
bench_rc=${PIPESTATUS[0]}
# The pipeline's defaults (params.yaml): 128 px, batch 32 per process; what the train stage would see.
timeout 50 python3 benchmarks/train_throughput.py --mode gpu --steps 20 --rounds 3 --image-size 128 \
  --batch-size 32 --no-compile --out "$out/train_throughput_gpu_128.json" 2>&1 | tee -a "$out/train_throughput_gpu.txt"
bench_rc=$(( bench_rc || PIPESTATUS[0] ))
echo "anchor: ~2,500 img/s training EfficientNet-B0 with AMP on one A100 (NVIDIA's published figure)" \
  | tee -a "$out/train_throughput_gpu.txt"

timeout 200 python3 benchmarks/gpu_inference.py --out "$out/inference_gpu.json" 2>&1 | tee "$out/inference_gpu.txt"
infer_rc=${PIPESTATUS[0]}

echo "gpu tests: exit $tests_rc; training benchmark: exit $bench_rc; inference benchmark: exit $infer_rc"
exit $(( tests_rc != 0 || bench_rc != 0 || infer_rc != 0 ))
