"""The research prototypes in experiments/ still run and produce what the README says they do."""

from __future__ import annotations

import shutil
import subprocess
import sys

import torch
import yaml

from pipeline.config import params_from_dict
from pipeline.model import create_model
from tests.conftest import ROOT, tiny_params, venv_env


def test_simsiam_writes_backbone_weights_that_model_pretrained_loads(prepared_project, tmp_path):
    shutil.copytree(prepared_project, tmp_path, dirs_exist_ok=True)
    p = tiny_params(**{"model.name": "test_efficientnet"})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    env = venv_env()
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments/simsiam_pretrain.py"), "--epochs", "2", "--batch-size", "8",
         "--view-size", "32", "--out", "models/simsiam.pth"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "epoch 2/2" in proc.stdout and "collapsed" in proc.stdout
    saved = torch.load(tmp_path / "models/simsiam.pth")
    assert not any(k.startswith("classifier") for k in saved)  # a backbone: the classifier is the task's

    p["model"]["pretrained"] = str(tmp_path / "models/simsiam.pth")
    net = create_model(params_from_dict(p).model, num_classes=4, in_chans=3)
    torch.manual_seed(p["train"]["seed"])  # the script's starting point: the same seed, the same init
    fresh = create_model(params_from_dict(tiny_params(**{"model.name": "test_efficientnet"})).model, 0, 3)
    loaded = net.backbone.state_dict()
    for name, weight in saved.items():
        assert torch.equal(loaded[name], weight), name
    # The pretraining moved the weights away from a fresh start.
    assert not torch.equal(loaded["conv_stem.weight"], fresh.backbone.state_dict()["conv_stem.weight"])
