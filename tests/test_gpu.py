"""CUDA paths of training: fp16 with a GradScaler, bf16, channels_last, NCCL. Marked ``gpu``; skipped where
torch sees no CUDA device. Imports only torch, timm and the torch-only pipeline modules, so
scripts/gpu_check.sh runs it on a GPU box that has neither albumentations, MLflow nor DVC."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
from torch import nn

from pipeline import distributed
from pipeline.config import ModelConfig
from pipeline.distributed import Dist
from pipeline.model import create_model, predict_logits
from pipeline.runtime import resolve_runtime
from pipeline.training.loop import EMA, EpochProgress, train_one_epoch

pytestmark = pytest.mark.gpu


def tiny_model(device: torch.device, channels_last: bool = False) -> nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig("test_efficientnet", "false", 0.0, "avgmax", "per_image")
    model = create_model(cfg, 4, 3).to(device)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def batches(n: int = 6, bs: int = 16, size: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, bs, size, size, 3), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 4, (n, bs), generator=g)
    return [(x[i], y[i]) for i in range(n)]


def train_steps(model: nn.Module, rt, d: Dist | None = None, ema: float = 0.0) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return train_one_epoch(
        model,
        batches(),
        nn.CrossEntropyLoss(),
        opt,
        sched,
        rt,
        EMA(model, ema),
        EpochProgress(),
        d or Dist("none"),
        grad_clip=5.0,
    )


def test_auto_precision_picks_amp_the_gpu_supports():
    rt = resolve_runtime("auto", "auto")
    assert rt.device.type == "cuda"
    assert rt.precision == ("bf16" if torch.cuda.is_bf16_supported() else "fp16")
    assert rt.scaler.is_enabled() == (rt.precision == "fp16")


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_training_steps_in_each_precision_learn_and_stay_finite(precision):
    rt = resolve_runtime("cuda", precision)
    model = tiny_model(rt.device, channels_last=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = train_steps(model, rt, ema=0.9)
    assert np.isfinite(out["train_loss"]) and out["train_img_s"] > 0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    if precision == "fp16":  # the scaler ran and kept a usable scale
        assert rt.scaler.is_enabled() and rt.scaler.get_scale() > 0
    logits = predict_logits(model, batches(1)[0][0].numpy(), rt)
    assert logits.shape == (16, 4) and np.isfinite(logits).all()


def test_amp_and_fp32_agree_on_the_same_weights():
    fp32, bf16 = resolve_runtime("cuda", "fp32"), resolve_runtime("cuda", "bf16")
    model = tiny_model(fp32.device)
    x = batches(1)[0][0].numpy()
    a, b = predict_logits(model, x, fp32), predict_logits(model, x, bf16)
    assert np.abs(a - b).max() < 0.1 * (np.abs(a).max() + 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nccl_ddp_and_fsdp_train_in_a_one_process_group(monkeypatch):
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    for mode in ("ddp", "fsdp"):
        monkeypatch.setenv("MASTER_PORT", str(_free_port()))
        d = distributed.init(mode, "cuda")
        try:
            assert torch.distributed.get_backend() == "nccl"
            rt = resolve_runtime("cuda", "auto")
            rt.device = torch.device("cuda", 0)
            model = distributed.wrap(tiny_model(rt.device), d, rt.device)
            out = train_steps(model, rt, d, ema=0.9)
            assert np.isfinite(out["train_loss"])
        finally:
            d.close()
    assert not os.environ.get("CUDA_LAUNCH_BLOCKING")
