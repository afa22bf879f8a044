"""Train: a timm EfficientNet on the packed images, with a checkpoint each epoch and resume.

The epoch loop fits on one screen; ``train_one_epoch`` and ``evaluate_arrays`` return dicts. Every
epoch reseeds torch and the augmentation policy from (seed, epoch), so a run resumed from an epoch
checkpoint replays exactly what an uninterrupted run would have done.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import random
import time
from pathlib import Path

import mlflow
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler
from tqdm import tqdm

from pipeline import checkpoint, tracking
from pipeline.augment import ImageDataset, build_policy, seed_worker
from pipeline.config import Params, as_flat_dict
from pipeline.model import DefectNet, create_model
from pipeline.plots import curves_plot
from pipeline.prepare import load_split, read_summary
from pipeline.runtime import Runtime, resolve_runtime

log = logging.getLogger(__name__)


def fingerprint(params: Params, prepared_dir: Path) -> str:
    """sha256 over the params that shape the weights and the bytes of the training data."""
    h = hashlib.sha256()
    for section in (params.model, params.train, params.augment, params.prepare):
        h.update(json.dumps(as_flat_dict(section), sort_keys=True, default=str).encode())
    for name in ("train.npz", "val.npz"):
        h.update((prepared_dir / name).read_bytes())
    return h.hexdigest()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def warmup_cosine(warmup_steps: int, total_steps: int):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def class_weights(labels: np.ndarray, num_classes: int) -> torch.Tensor:
    """Inverse-frequency weights, mean 1: a rare defect class counts as much as the OK class."""
    counts = np.bincount(labels, minlength=num_classes).astype(np.float64)
    w = counts.sum() / np.maximum(counts, 1) / num_classes
    return torch.tensor(w, dtype=torch.float32)


def train_one_epoch(
    model: nn.Module,
    loader: DataLoader,
    criterion: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rt: Runtime,
    desc: str,
) -> dict:
    model.train()
    loss_sum, correct, seen, t0 = 0.0, 0, 0, time.perf_counter()
    bar = tqdm(loader, desc=desc, unit="batch", leave=False)
    for x, y in bar:  # x: (B, H, W, C) uint8, y: (B,) int64
        x, y = x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True)
        with rt.autocast():
            logits = model(x)
            loss = criterion(logits.float(), y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{desc}: loss is {loss.item()}; stopping (the last good checkpoint is kept)")
        optimizer.zero_grad(set_to_none=True)
        rt.scaler.scale(loss).backward()
        rt.scaler.step(optimizer)
        rt.scaler.update()
        scheduler.step()
        loss_sum += loss.item() * len(y)
        correct += (logits.argmax(1) == y).sum().item()
        seen += len(y)
        bar.set_postfix(loss=f"{loss_sum / seen:.3f}", img_s=f"{seen / (time.perf_counter() - t0):.0f}")
    elapsed = time.perf_counter() - t0
    return {
        "train_loss": loss_sum / seen,
        "train_acc": correct / seen,
        "train_img_s": seen / elapsed,
        "lr": scheduler.get_last_lr()[0],
    }


@torch.inference_mode()
def predict_logits(model: nn.Module, images: np.ndarray, rt: Runtime, batch_size: int = 64) -> np.ndarray:
    """(N, H, W, C) uint8 -> logits (N, K) float32, in eval mode."""
    model.eval()
    out = []
    for i in range(0, len(images), batch_size):
        x = torch.from_numpy(images[i : i + batch_size]).to(rt.device)
        with rt.autocast():
            out.append(model(x).float().cpu())
    return torch.cat(out).numpy() if out else np.zeros((0, 0), np.float32)


def evaluate_arrays(
    model: nn.Module, images: np.ndarray, labels: np.ndarray, rt: Runtime, criterion: nn.Module
) -> dict:
    logits = predict_logits(model, images, rt)
    loss = criterion(torch.from_numpy(logits), torch.from_numpy(labels)).item()
    return {"val_loss": loss, "val_acc": float((logits.argmax(1) == labels).mean())}


def save_model(net: DefectNet, meta: dict, path: Path) -> None:
    """The consolidated model that evaluate and export read: weights plus what it takes to rebuild it."""
    checkpoint.save_atomic({"version": checkpoint.CHECKPOINT_VERSION, "model": net.state_dict(), "meta": meta}, path)


def load_model(path: Path) -> tuple[DefectNet, dict]:
    """The consolidated model and its meta; everything needed to rebuild it is in the file itself."""
    from pipeline.config import ModelConfig

    ckpt = checkpoint.load(path)
    if ckpt is None:
        raise FileNotFoundError(f"{path}: no readable trained model (run the train stage)")
    meta = ckpt["meta"]
    cfg = ModelConfig(
        name=meta["architecture"],
        pretrained="false",
        drop_rate=0.0,
        global_pool=meta["global_pool"],
        input_norm=meta["input_norm"],
    )
    net = create_model(cfg, len(meta["classes"]), meta["channels"])
    net.load_state_dict(ckpt["model"])
    return net.eval(), meta


def train(params: Params, prepared_dir: Path, out_dir: Path, reports_dir: Path) -> dict:
    cfg = params.train
    seed_everything(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rt = resolve_runtime(cfg.device, cfg.precision)
    info = read_summary(prepared_dir)
    classes, channels = info["classes"], info["channels"]
    x_tr, y_tr, _ = load_split(prepared_dir, "train")
    x_va, y_va, _ = load_split(prepared_dir, "val")
    policy = build_policy(params.augment.policy)
    dataset = ImageDataset(x_tr, y_tr, policy)
    generator = torch.Generator()
    loader = DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=RandomSampler(dataset, generator=generator),
        num_workers=cfg.num_workers,
        worker_init_fn=seed_worker,
        drop_last=len(dataset) > cfg.batch_size,
        pin_memory=rt.device.type == "cuda",
        persistent_workers=False,
    )

    model = create_model(params.model, len(classes), channels).to(rt.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(cfg.warmup_epochs * steps, cfg.epochs * steps)
    )
    weight = class_weights(y_tr, len(classes)) if cfg.class_weighting == "balanced" else None
    criterion = nn.CrossEntropyLoss(
        weight=weight.to(rt.device) if weight is not None else None, label_smoothing=cfg.label_smoothing
    )
    eval_criterion = nn.CrossEntropyLoss()

    ckpt_dir, fp = out_dir / "checkpoints", fingerprint(params, prepared_dir)
    state = {"epoch": 0, "best": math.inf, "history": [], "run_id": None}
    last = checkpoint.load(ckpt_dir / "last.pt")
    if last is not None and last["fingerprint"] != fp:
        log.warning(
            "checkpoint %s was trained on other params or data (fingerprint %s, now %s): starting fresh",
            ckpt_dir / "last.pt",
            last["fingerprint"][:12],
            fp[:12],
        )
        last = None
    if last is not None:
        model.load_state_dict(last["model"])
        optimizer.load_state_dict(last["optimizer"])
        scheduler.load_state_dict(last["scheduler"])
        rt.scaler.load_state_dict(last["scaler"])
        state = {k: last[k] for k in state}
        log.info("resuming from %s after epoch %d", ckpt_dir / "last.pt", state["epoch"])

    meta = {
        "architecture": params.model.name,
        "global_pool": params.model.global_pool,
        "input_norm": params.model.input_norm,
        "classes": classes,
        "ok_class": info["ok_class"],
        "channels": channels,
        "image_size": info["image_size"],
        "resize": info["resize"],
        "fingerprint": fp,
    }
    run_name = f"{params.model.name}-{info['image_size']}px-{fp[:8]}"
    tags = {**tracking.git_info(), **tracking.dvc_lock_hashes(), "data.fingerprint": fp, "stage": "train"}
    with tracking.start_run(params.mlflow, state["run_id"], run_name, tags) as run:
        if state["run_id"] is None:
            mlflow.log_params({k: str(v)[:500] for k, v in as_flat_dict(params).items() if k != "source_file"})
        state["run_id"] = run.info.run_id
        log.info(
            "training %s on %d images (%s, %s) for %d epochs; MLflow run %s",
            params.model.name,
            len(dataset),
            rt.device,
            rt.precision,
            cfg.epochs,
            run.info.run_id,
        )
        for epoch in range(state["epoch"], cfg.epochs):
            torch.manual_seed(cfg.seed * 1000 + epoch)  # the epoch's shuffle, dropout and augmentation
            generator.manual_seed(cfg.seed * 1000 + epoch)
            policy.set_random_seed(cfg.seed * 1000 + epoch)
            row = {"epoch": epoch + 1}
            row |= train_one_epoch(
                model, loader, criterion, optimizer, scheduler, rt, f"epoch {epoch + 1}/{cfg.epochs}"
            )
            row |= evaluate_arrays(model, x_va, y_va, rt, eval_criterion)
            state["history"].append(row)
            mlflow.log_metrics({k: v for k, v in row.items() if k != "epoch"}, step=epoch + 1)
            log.info("epoch %d: %s", epoch + 1, ", ".join(f"{k}={v:.4g}" for k, v in row.items() if k != "epoch"))
            if row["val_loss"] < state["best"]:
                state["best"] = row["val_loss"]
                save_model(model, {**meta, "epoch": epoch + 1, "val_loss": row["val_loss"]}, ckpt_dir / "best.pt")
            state["epoch"] = epoch + 1
            checkpoint.save_atomic(
                {
                    "version": checkpoint.CHECKPOINT_VERSION,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "scaler": rt.scaler.state_dict(),
                    "fingerprint": fp,
                    **state,
                },
                ckpt_dir / "last.pt",
            )
        best = checkpoint.load(ckpt_dir / "best.pt")
        (out_dir / "model.pt").write_bytes((ckpt_dir / "best.pt").read_bytes())
        (out_dir / "run.json").write_text(json.dumps({"run_id": state["run_id"], "fingerprint": fp}) + "\n")
        reports_dir.mkdir(parents=True, exist_ok=True)
        with open(reports_dir / "history.csv", "w", newline="") as f:
            w = csv.DictWriter(f, list(state["history"][0]))
            w.writeheader()
            w.writerows(state["history"])
        curves_plot(state["history"], ["train_loss", "val_loss"], "loss", reports_dir / "loss.png")
        curves_plot(state["history"], ["train_acc", "val_acc"], "accuracy", reports_dir / "accuracy.png")
        summary = {
            "best_epoch": best["meta"]["epoch"],
            "best_val_loss": best["meta"]["val_loss"],
            "epochs": cfg.epochs,
            "train_images": len(dataset),
            "train_img_s": float(np.median([r["train_img_s"] for r in state["history"]])),
            "device": str(rt.device),
            "precision": rt.precision,
        }
        (reports_dir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
        mlflow.log_artifacts(str(reports_dir), "train")
    return summary
