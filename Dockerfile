# The edge runner for GPU boxes next to the line: onnxruntime-gpu on a CUDA runtime, no torch.
# onnxruntime-gpu 1.31 is built against CUDA 12.x and cuDNN 9; this base image carries both.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/runner
ENV PATH=/opt/runner/bin:$PATH

WORKDIR /app
COPY serving/requirements.txt /app/serving/requirements.txt
RUN pip install --no-cache-dir -r /app/serving/requirements.txt
COPY serving /app/serving

RUN useradd --system --uid 10001 --create-home runner
USER runner

# The model is mounted at /models (model.onnx + model.card.json), never baked into the image.
VOLUME ["/models"]
ENTRYPOINT ["python3", "-m", "serving.cli"]
CMD ["predict", "--model", "/models/model.onnx", "--providers", "auto", "/data"]
