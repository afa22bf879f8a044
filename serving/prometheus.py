"""Prometheus metrics of the HTTP server (``GET /metrics``), one registry per server instance.

What an operator watches: requests by endpoint and status code, latency per phase (decode, queue,
inference, and the whole request), batch sizes (above 1 under load means dynamic batching works),
decisions, the review queue, reloads, and which model version runs on which provider.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "defect_runner_requests", "HTTP requests by endpoint and status code", ["endpoint", "code"], registry=r
        )
        self.phase = Histogram(
            "defect_runner_phase_seconds",
            "Time per request phase: decode (image bytes to pixels), queue (waiting for a batch), "
            "inference (the model call its batch made), total (the whole request)",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "defect_runner_batch_size", "Images per model call", buckets=BATCH_BUCKETS, registry=r
        )
        self.images = Counter("defect_runner_images", "Images scored, by decision", ["decision"], registry=r)
        self.in_flight = Gauge("defect_runner_in_flight_requests", "Requests being handled now", registry=r)
        self.review_queued = Counter(
            "defect_runner_review_queued", "Images this server copied to the review queue", registry=r
        )
        self.review_queue_size = Gauge(
            "defect_runner_review_queue_size", "Images listed in the review queue file", registry=r
        )
        self.reloads = Counter("defect_runner_reloads", "Model reloads by outcome", ["outcome"], registry=r)
        self.model = Gauge(
            "defect_runner_model_info",
            "The model being served (value 1): name, version, variant and execution provider",
            ["name", "version", "variant", "provider"],
            registry=r,
        )

    def set_model(self, name: str, version: str, variant: str, provider: str) -> None:
        self.model.clear()
        self.model.labels(name, version, variant, provider).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
