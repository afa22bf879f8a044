"""The exported model and the edge runner: parity with PyTorch, the card's guarantees, no torch import."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from pipeline.config import params_from_dict
from pipeline.data.prepare import load_split
from pipeline.export.onnx import export_onnx
from pipeline.export.variants import compare, gate, write_card
from pipeline.metrics import softmax
from pipeline.model import DefectNet, load_model, predict_logits
from pipeline.runtime import resolve_runtime
from serving.card import ModelCard
from serving.preprocess import load_image
from serving.runner import Runner, RunnerError
from tests.conftest import ROOT, venv_env

CPU = resolve_runtime("cpu", "fp32")


@pytest.fixture(scope="module")
def model(exported_project):
    net, meta = load_model(exported_project / "models/train/model.pt")
    return net, meta, exported_project / "models/export/model.onnx"


def test_onnx_matches_pytorch_on_random_and_real_images(model, exported_project):
    net, _, onnx_path = model
    runner = Runner(onnx_path, providers="cpu")
    real, _, _ = load_split(exported_project / "data/prepared", "test")
    rand = np.random.default_rng(0).integers(0, 256, (8, *real.shape[1:]), dtype=np.uint8)
    for images in (real, rand):
        torch_probs = softmax(predict_logits(net, images, CPU))
        onnx_probs, score = runner.predict(images)
        assert np.abs(torch_probs - onnx_probs).max() < 1e-4
        assert np.allclose(score, 1 - onnx_probs[:, runner.card.ok_index], atol=1e-6)


def test_same_file_same_score_in_pytorch_onnx_and_runner_cli(model, exported_project, tmp_path):
    net, meta, onnx_path = model
    files = sorted((exported_project / "data/raw/images").rglob("*.png"))[::7][:5]
    card = ModelCard.read(onnx_path.with_name("model.card.json"))
    batch = np.stack([load_image(f, card.input.size, card.input.channels, card.input.resize) for f in files])
    torch_scores = 1 - softmax(predict_logits(net, batch, CPU))[:, card.ok_index]
    out = tmp_path / "scores.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "serving.cli",
            "predict",
            "--model",
            str(onnx_path),
            *map(str, files),
            "--out",
            str(out),
        ],
        env=venv_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["path"] for r in rows] == [str(f) for f in files]
    cli_scores = np.array([r["defect_score"] for r in rows])
    assert np.abs(cli_scores - torch_scores).max() < 1e-4
    decisions = ["defect" if s >= card.threshold else "ok" for s in torch_scores]
    assert [r["decision"] for r in rows] == decisions
    assert all(r["threshold"] == card.threshold and "the card's threshold" in r["reason"] for r in rows)


def test_a_bad_file_is_an_error_row_not_a_crash(model, tmp_path):
    _, _, onnx_path = model
    good = tmp_path / "good.png"
    from PIL import Image

    Image.new("RGB", (80, 60), (90, 90, 90)).save(good)
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    out = tmp_path / "out.csv"
    proc = subprocess.run(
        [sys.executable, "-m", "serving.cli", "predict", "--model", str(onnx_path), str(tmp_path), "--out", str(out)],
        env=venv_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "broken.jpg" in text and "cannot decode" in text
    assert "scored 1 of 2 files (1 unreadable)" in proc.stderr


def test_runner_never_imports_torch(model):
    _, _, onnx_path = model
    code = (
        f"import sys, numpy as np; from serving.runner import Runner; r = Runner({str(onnx_path)!r}, "
        "providers='cpu'); r.predict(np.zeros((1, *r.input_shape), np.uint8)); "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'pipeline', 'timm')]; "
        "assert not bad, bad; print('clean')"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=venv_env(), capture_output=True, text=True, cwd=ROOT)
    assert proc.stdout.strip() == "clean", proc.stderr


def test_tampered_model_is_refused(model, tmp_path):
    _, _, onnx_path = model
    shutil.copy(onnx_path, tmp_path / "model.onnx")
    shutil.copy(onnx_path.with_name("model.card.json"), tmp_path / "model.card.json")
    with open(tmp_path / "model.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(RunnerError, match="does not match the model card"):
        Runner(tmp_path / "model.onnx", providers="cpu")


def test_not_deployable_card_is_refused_unless_forced(model, tmp_path):
    _, _, onnx_path = model
    shutil.copy(onnx_path, tmp_path / "model.onnx")
    card = ModelCard.read(onnx_path.with_name("model.card.json"))
    # as the export stage marks a variant: in the graph's embedded card and the sidecar (an edit of the
    # sidecar alone is refused: tests/test_hostile_files.py)
    write_card(
        dataclasses.replace(card, deployable=False, not_deployable_reason="defect recall dropped 5%"),
        tmp_path / "model.onnx",
    )
    with pytest.raises(RunnerError, match="not deployable .defect recall dropped 5%"):
        Runner(tmp_path / "model.onnx", providers="cpu")
    assert Runner(tmp_path / "model.onnx", providers="cpu", force=True).ready


def test_onnx_metadata_carries_the_card(model):
    import onnx

    _, _, onnx_path = model
    props = {p.key: p.value for p in onnx.load(str(onnx_path)).metadata_props}
    embedded = json.loads(props["model_card"])
    sidecar = json.loads(onnx_path.with_name("model.card.json").read_text())
    assert embedded == {k: v for k, v in sidecar.items() if k != "sha256"}
    assert embedded["parity"]["prob_max_abs_diff"] < 1e-3 and embedded["variant"] == "fp32"


def test_a_broken_export_is_caught_by_parity(model, tmp_path):
    import copy

    from serving.card import card_path_for, sha256_file

    net, meta, onnx_path = model
    # A briefly trained tiny net is nearly uniform whatever its input; give its head real weights so a
    # change of preprocessing shows in the probabilities, as it would with a trained model.
    reference = copy.deepcopy(net)
    torch.nn.init.normal_(reference.backbone.get_classifier().weight, std=1.0)
    # The same weights with another normalization in the graph: what a drifted preprocessing looks like.
    broken = DefectNet(reference.backbone, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), per_image=False).eval()
    card = ModelCard.read(onnx_path.with_name("model.card.json"))
    path = tmp_path / "broken.onnx"
    export_onnx(broken, card.ok_index, card.input.size, card.input.channels, 17, path, card)
    dataclasses.replace(card, sha256=sha256_file(path)).write(card_path_for(path))
    images = np.random.default_rng(1).integers(0, 256, (16, card.input.size, card.input.size, 3), np.uint8)
    paths = [f"random{i}" for i in range(16)]
    report = compare(
        softmax(predict_logits(reference, images, CPU)),
        Runner(path, providers="cpu").predict(images)[0],
        paths,
        card.ok_index,
        card.threshold,
    )
    cfg = params_from_dict(yaml.safe_load((ROOT / "params.yaml").read_text())).export
    assert report["prob_max_abs_diff"] > 1e-2
    reason = gate({"fp32": report}, cfg)["fp32"]  # what the export stage fails on
    assert "export.max_abs_diff" in reason


def test_asking_for_cuda_without_a_gpu_fails_clearly_unless_fallback_allowed(model):
    _, _, onnx_path = model
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RunnerError) as exc:
        Runner(onnx_path, providers="cuda")
    assert "allow-cpu-fallback" in str(exc.value) or "not in this onnxruntime build" in str(exc.value)
    try:
        runner = Runner(onnx_path, providers="cuda,cpu", allow_cpu_fallback=True)
    except RunnerError as e:  # a CPU-only onnxruntime build has no CUDA provider to fall back from
        pytest.skip(str(e))
    assert runner.providers == ["CPUExecutionProvider"]
