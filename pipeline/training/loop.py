"""The training loop's parts that need torch alone: data order, losses, EMA, one epoch.

Nothing here imports MLflow, DVC or albumentations, so the GPU check (scripts/gpu_check.sh) and the
throughput benchmark run this exact loop on a machine that has only torch and timm.

Reproducibility contract: the order of the training images in epoch ``e`` is a function of
(seed, e) alone, and each image's augmentation is seeded by (seed, e, its position in the epoch).
Together with the torch RNG state saved in the checkpoint (dropout), a run resumed at any step
replays exactly what the uninterrupted run did.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Sampler
from tqdm import tqdm

from pipeline.data.masks import MASK_UNKNOWN
from pipeline.distributed import Dist, unwrap
from pipeline.runtime import Runtime
from pipeline.seeds import AUGMENT, ORDER, derive_seed


class EpochBatches(Sampler[list[tuple[int, int]]]):
    """This rank's batches for one epoch, as ``[(image index, augmentation seed), ...]`` lists.

    The epoch's order is a permutation (or, with ``balanced``, a class-balanced draw with replacement)
    seeded by (seed, epoch), cut to a multiple of the world size and dealt out rank by rank, so every
    rank runs the same number of steps. ``majority`` < 1 keeps only that share of the most frequent
    class's images in each epoch, a fresh draw every epoch (the other classes are all kept): on a line's
    data, where OK images are most of the split, an epoch costs less and the defects are seen more often
    for the same training time. ``set_epoch(e, start)`` skips the first ``start`` batches: that
    is how a resumed run continues in the middle of an epoch.
    """

    def __init__(
        self,
        labels: np.ndarray,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        balanced: bool = False,
        majority: float = 1.0,
    ) -> None:
        self.batch_size, self.seed, self.rank, self.world = batch_size, seed, rank, world
        counts = np.bincount(labels)
        top = int(counts.argmax())
        self.majority_idx = torch.from_numpy(np.flatnonzero(labels == top))
        self.rest_idx = torch.from_numpy(np.flatnonzero(labels != top))
        self.majority_kept = round(majority * len(self.majority_idx))
        self.n = len(self.rest_idx) + self.majority_kept  # images per epoch
        self.per_rank = self.n // world
        if self.per_rank == 0:
            raise ValueError(f"{self.n} training images cannot be shared by {world} processes")
        self.weights = torch.tensor(1.0 / counts[labels], dtype=torch.float64) if balanced else None
        self.epoch, self.start = 0, 0

    def __len__(self) -> int:  # steps per epoch; a split smaller than a batch still makes one step
        return max(1, self.per_rank // self.batch_size)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        g = torch.Generator().manual_seed(derive_seed(self.seed, ORDER, self.epoch))
        if self.weights is not None:
            order = torch.multinomial(self.weights, self.n, replacement=True, generator=g)
        elif self.majority_kept < len(self.majority_idx):
            kept = self.majority_idx[torch.randperm(len(self.majority_idx), generator=g)[: self.majority_kept]]
            pool = torch.cat([self.rest_idx, kept])
            order = pool[torch.randperm(len(pool), generator=g)]
        else:
            order = torch.randperm(self.n, generator=g)
        mine = order[: self.per_rank * self.world][self.rank :: self.world].tolist()
        size = min(self.batch_size, len(mine))
        for b in range(self.start, len(self)):
            places = [p * self.world + self.rank for p in range(b * size, (b + 1) * size)]  # in the whole epoch
            yield [(mine[q // self.world], derive_seed(self.seed, AUGMENT, self.epoch, q)) for q in places]


class FocalLoss(nn.Module):
    """Cross-entropy with each image's term scaled by (1 - p(true class)) ** gamma (Lin et al., 2017):
    the many images the model already gets right (on a line: OK surfaces) stop dominating the loss."""

    def __init__(self, gamma: float, weight: torch.Tensor | None = None, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.gamma, self.weight = gamma, weight
        self.ce = nn.CrossEntropyLoss(weight=weight, label_smoothing=label_smoothing, reduction="none")

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        log_p_true = logits.log_softmax(dim=1).gather(1, y[:, None]).squeeze(1)
        # 1 - p from the log (exact near p = 1), floored: (1 - p) ** gamma has an infinite slope at p = 1
        # when gamma < 1, and a saturated softmax reaches p = 1 in float32
        miss = (-torch.expm1(log_p_true)).clamp_min(1e-6)
        terms = miss**self.gamma * self.ce(logits, y)
        # the same normalization as nn.CrossEntropyLoss: by the summed class weights of the batch
        return terms.sum() / (self.weight[y].sum() if self.weight is not None else len(y))


class RankingLoss(nn.Module):
    """Cross-entropy plus ``weight`` x a pairwise ranking term on the defect-vs-OK score.

    The score is the log-odds of "some defect class" against the OK class. For every (defect, OK) pair
    in the batch the term adds softplus(score_ok - score_defect), the logistic surrogate of ROC AUC
    (RankNet): it pushes each defect above the OK images that outscore it, and as nearly every OK image
    soon scores far below the defects, its gradient comes from the few OK images that look defective,
    the ones that set a low false-alarm threshold. A batch without both kinds adds nothing; under
    DDP/FSDP the pairs are those of each process's own batch.
    """

    def __init__(self, ok_index: int, weight: float, ce: nn.Module) -> None:
        super().__init__()
        self.ok_index, self.weight, self.ce = ok_index, weight, ce

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.ce(logits, y)
        if self.weight <= 0:
            return loss
        is_ok = y == self.ok_index
        others = torch.cat([logits[:, : self.ok_index], logits[:, self.ok_index + 1 :]], dim=1)
        score = torch.logsumexp(others, dim=1) - logits[:, self.ok_index]
        pos, neg = score[~is_ok], score[is_ok]
        if len(pos) and len(neg):
            loss = loss + self.weight * F.softplus(neg[None, :] - pos[:, None]).mean()
        return loss


def cell_size(pixels: int, cells: int) -> int:
    """The stride that cut ``pixels`` into ``cells``: the smallest power of two with cells * stride >= pixels
    (a CNN's strides are powers of two, and its last cell is partial when the side is no multiple)."""
    stride = 1
    while stride * cells < pixels:
        stride *= 2
    return stride


class MaskLoss(nn.Module):
    """Binary cross-entropy of the mask head against the defect mask, cell by cell (mixed supervision,
    Bozic et al., 2021: pixel labels where a dataset has them teach a small from-scratch network *where*
    a defect is, not only that one is there).

    ``masks``: (B, H, W) uint8 at the input size, 1 on the defect, 0 elsewhere, ``MASK_UNKNOWN`` on every pixel
    of an image whose mask is not known. The head's (h, w) grid has cells of the network's stride, as its
    strided convolutions cut them (the last row and column partial when H is no multiple of it); a cell
    is a defect cell when any of its pixels is, so a one-pixel crack still marks its cell.
    Images with an unknown mask add nothing. No host sync: the loss stays on the device.
    """

    def __init__(self, weight: float) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, mask_logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        (h, w), (H, W) = mask_logits.shape[-2:], masks.shape[-2:]
        sh, sw = cell_size(H, h), cell_size(W, w)
        defect = F.pad((masks == 1).float()[:, None], (0, w * sw - W, 0, h * sh - H))
        target = F.max_pool2d(defect, (sh, sw))
        per_cell = F.binary_cross_entropy_with_logits(mask_logits.float(), target, reduction="none")
        known = (masks != MASK_UNKNOWN).flatten(1).any(dim=1)[:, None, None, None]
        per_cell = torch.where(known, per_cell, 0.0)  # an unknown image's head adds nothing, even an inf logit
        known = known.float()
        # defect cells and clear cells weigh half each: a crack covers a few of the 64 cells of a defect
        # image and none of an OK image's, so a plain mean is nearly all "clear" and learns little of where
        pos, neg = target * known, (1 - target) * known
        n_pos, n_neg = pos.sum(), neg.sum()
        halves = (n_pos > 0).float() + (n_neg > 0).float()  # 0 when nothing in the batch is known: no loss
        pos_mean = (per_cell * pos).sum() / n_pos.clamp_min(1)
        neg_mean = (per_cell * neg).sum() / n_neg.clamp_min(1)
        return self.weight * (pos_mean + neg_mean) / halves.clamp_min(1)


class EMA:
    """Exponential moving average of the trainable weights (``decay`` 0: off, every method a no-op).

    The decay warms up as min(decay, (1 + n) / (10 + n)) so the average is not dominated by the random
    initial weights. Buffers (BatchNorm statistics) are not averaged; the live ones are used. Works on
    FSDP-sharded parameters too: each rank averages its own shards.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay, self.updates = decay, 0
        params = unwrap(model).named_parameters()
        self.shadow = {n: p.detach().clone() for n, p in params if p.requires_grad} if decay > 0 else {}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        if not self.shadow:
            return
        self.updates += 1
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for n, p in unwrap(model).named_parameters():
            if n in self.shadow:
                self.shadow[n].lerp_(p.detach(), 1.0 - d)

    @contextlib.contextmanager
    def applied(self, model: nn.Module) -> Iterator[None]:
        """Inside the block the model holds the averaged weights; afterwards its own again."""
        if not self.shadow:
            yield
            return
        params = dict(unwrap(model).named_parameters())
        backup = {n: params[n].detach().clone() for n in self.shadow}
        with torch.no_grad():
            for n, t in self.shadow.items():
                params[n].copy_(t)
        try:
            yield
        finally:
            with torch.no_grad():
                for n, t in backup.items():
                    params[n].copy_(t)

    def state_dict(self) -> dict:
        return {"updates": self.updates, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.updates = state["updates"]
        for n, t in state["shadow"].items():
            self.shadow[n].copy_(t)


@dataclass
class EpochProgress:
    """Where this rank is inside the current epoch; saved in checkpoints so a resume continues the sums."""

    step: int = 0  # batches done
    loss_sum: float = 0.0
    mask_loss_sum: float = 0.0  # the mask head's loss (train.mask_loss); loss_sum holds the class loss
    correct: int = 0
    seen: int = 0
    elapsed: float = 0.0  # seconds spent training in this epoch (all sessions)

    def as_dict(self) -> dict:
        return asdict(self)


class NonFiniteLoss(FloatingPointError):
    pass


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of an FSDP DTensor, the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


class RunningSums:
    """An epoch's running sums on the device (class loss, mask loss, correct), so a GPU is not stalled by a
    host sync every step; ``synced`` reads them summed over ranks, ``store`` puts them in ``progress``."""

    def __init__(self, progress: EpochProgress, model: nn.Module, d: Dist, dev: torch.device, desc: str) -> None:
        self.progress, self.model, self.d, self.dev, self.desc = progress, model, d, dev, desc
        self.loss = torch.tensor(progress.loss_sum, dtype=torch.float64, device=dev)
        self.mask = torch.tensor(progress.mask_loss_sum, dtype=torch.float64, device=dev)
        self.correct = torch.tensor(progress.correct, dtype=torch.float64, device=dev)
        self.t0 = time.perf_counter() - progress.elapsed

    def synced(self) -> tuple[float, float, float, float]:
        """Global mean class loss, accuracy, image count and mean mask loss; raises on a non-finite loss or
        weight (all ranks)."""
        dev, progress = self.dev, self.progress
        bad_weights = sum(~torch.isfinite(local(p.detach())).all() for p in self.model.parameters())
        seen = torch.tensor(float(progress.seen), dtype=torch.float64, device=dev)
        bad_weights = torch.as_tensor(bad_weights, dtype=torch.float64, device=dev)
        stats = torch.stack([self.loss, self.correct, seen, bad_weights, self.mask])
        if self.d.enabled:
            stats = stats.clone()
            torch.distributed.all_reduce(stats)
        loss, corr, n, bad, mask = stats.tolist()
        loss_all = loss + mask
        if not math.isfinite(loss_all) or bad:
            what = "the weights became inf or NaN"
            if not math.isfinite(loss_all):
                what = f"the training loss became {loss_all}"
            raise NonFiniteLoss(
                f"{self.desc}: {what} by step {progress.step} of the epoch; stopping. "
                "The last good checkpoint is kept (lower train.lr, or set train.grad_clip)"
            )
        return loss / max(n, 1), corr / max(n, 1), n, mask / max(n, 1)

    def store(self) -> None:
        p = self.progress
        p.loss_sum, p.correct = self.loss.item(), int(self.correct.item())
        p.mask_loss_sum = self.mask.item()
        p.elapsed = time.perf_counter() - self.t0


def train_step(
    model: nn.Module,
    batch: list[torch.Tensor],
    criterion: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rt: Runtime,
    ema: EMA,
    sums: RunningSums,
    grad_clip: float,
    mask_criterion: MaskLoss | None,
) -> None:
    """One optimizer step on ``batch`` = [x (B, H, W, C) uint8, y (B,) int64, optional masks (B, H, W) uint8]."""
    dev = rt.device
    x, y, *masks = batch
    x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
    with rt.autocast():
        if mask_criterion is not None and masks:
            logits, mask_logits = model(x, with_mask=True)
            mask_loss = mask_criterion(mask_logits, masks[0].to(dev, non_blocking=True))
            class_loss = criterion(logits.float(), y)
            loss = class_loss + mask_loss
            sums.mask += mask_loss.detach().double() * len(y)
        else:
            logits = model(x)
            loss = class_loss = criterion(logits.float(), y)
    optimizer.zero_grad(set_to_none=True)
    rt.scaler.scale(loss).backward()
    if grad_clip > 0:
        rt.scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    rt.scaler.step(optimizer)
    rt.scaler.update()
    scheduler.step()
    ema.update(model)
    sums.loss += class_loss.detach().double() * len(y)  # train_loss: the class loss, like val_loss
    sums.correct += (logits.detach().argmax(1) == y).sum().double()
    sums.progress.seen += len(y)
    sums.progress.step += 1


def train_one_epoch(
    model: nn.Module,
    loader: DataLoader,
    criterion: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rt: Runtime,
    ema: EMA,
    progress: EpochProgress,
    d: Dist,
    grad_clip: float = 0.0,
    desc: str = "train",
    checkpoint_due: Callable[[EpochProgress], bool] | None = None,
    checkpoint: Callable[[EpochProgress], None] | None = None,
    sync_every: int = 10,
    mask_criterion: MaskLoss | None = None,
) -> dict:
    """Train over ``loader`` from ``progress.step`` on; return the epoch's figures (global over ranks).

    When ``checkpoint_due(progress)`` says so after a step, the loss is checked (on every rank) and
    ``checkpoint(progress)`` saves. A NaN or inf loss raises ``NonFiniteLoss`` before any checkpoint
    could record the broken weights. The running sums stay on the device between checks (``RunningSums``).
    With ``mask_criterion`` the loader also yields masks and the model's mask head is trained beside the
    classifier (``MaskLoss``).
    """
    model.train()
    sums, seen0 = RunningSums(progress, model, d, rt.device, desc), progress.seen
    sampler = getattr(loader, "batch_sampler", None)
    total = len(sampler) if sampler is not None else len(loader)
    bar = tqdm(total=total, initial=progress.step, desc=desc, unit="batch", leave=False, disable=not d.is_main)
    batches, waited = iter(loader), 0.0
    while True:
        t_wait = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            break
        waited += time.perf_counter() - t_wait  # time the step stood idle, waiting for the data loader
        train_step(model, batch, criterion, optimizer, scheduler, rt, ema, sums, grad_clip, mask_criterion)
        bar.update(1)
        due = checkpoint is not None and checkpoint_due is not None and checkpoint_due(progress)
        if due or progress.step % sync_every == 0:
            mean_loss, _, n, _ = sums.synced()
            elapsed = time.perf_counter() - sums.t0
            bar.set_postfix(loss=f"{mean_loss:.3f}", img_s=f"{(n - seen0 * d.world_size) / max(elapsed, 1e-9):.0f}")
        if due:
            sums.store()
            checkpoint(progress)
    bar.close()
    mean_loss, acc, n, mean_mask_loss = sums.synced()
    sums.store()
    figures = {"train_loss": mean_loss}
    if mask_criterion is not None:  # the mask head's loss; the gradient follows train_loss + train_mask_loss
        figures["train_mask_loss"] = mean_mask_loss
    return figures | {
        "train_acc": acc,
        "train_img_s": n / max(progress.elapsed, 1e-9),
        "data_wait_share": waited / max(progress.elapsed, 1e-9),  # of this epoch's training time
        "lr": scheduler.get_last_lr()[0],
    }
