"""What every runner output says about its decision: the defect score, the card's threshold it was compared to,
the model and version, and a reason that names both numbers (and the most likely class where it disagrees with
the decision). Every output the runner has, on real onnxruntime sessions and real HTTP: the CLI's CSV and JSONL,
the folder watcher's results, /classify, KServe v2 /infer (JSON and binary, the official client), the review
queue. And the ``--help`` examples name what the pipeline writes.

The model is a hand-built graph whose probabilities are the image's channel means over their sum, so a flat
colour picks them: (150, 60, 40) is p = (0.6, 0.24, 0.16) over (ok, scratch, dent), class ok, defect score 0.4.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.http as triton

from serving import cli
from serving.card import card_path_for, sha256_file
from serving.review import ReviewRule
from serving.runner import Runner, verdict
from tests.conftest import ROOT, load_default_params
from tests.serving_helpers import Server, flat_images, share_card, share_graph, watch_once

SIDE = 32
# flat colours -> (class, defect score): the probabilities are the colour over its sum
COLOURS = {
    "ok_but_flagged": ((150, 60, 40), "ok", 0.4),  # over a 0.3 threshold: class ok, decision defect
    "scratch": ((60, 110, 80), "scratch", 0.76),  # defect under both thresholds, class agrees
    "clean": ((200, 30, 20), "ok", 0.2),  # ok under both thresholds, class agrees
    "scratch_but_passed": ((90, 100, 60), "scratch", 0.64),  # under a 0.7 threshold: class scratch, decision ok
}


def write_model(folder: Path, threshold: float) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model = folder / "model.onnx"
    onnx.save(share_graph(SIDE), str(model))
    share_card(SIDE, threshold, sha256=sha256_file(model)).write(card_path_for(model))
    return model


@pytest.fixture(scope="module")
def strict(tmp_path_factory) -> Path:
    """A card at threshold 0.3: an image at p(ok) 0.6 is class ok and decision defect."""
    return write_model(tmp_path_factory.mktemp("strict"), 0.3)


@pytest.fixture(scope="module")
def lenient(tmp_path_factory) -> Path:
    """A card at threshold 0.7: an image at p(scratch) 0.4, p(ok) 0.36 is class scratch and decision ok."""
    return write_model(tmp_path_factory.mktemp("lenient"), 0.7)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    return flat_images(tmp_path_factory.mktemp("images"), {n: rgb for n, (rgb, _, _) in COLOURS.items()}, SIDE)


def assert_explained(row: dict, threshold: float, version: str) -> None:
    """A scored row names its score, the card's threshold, the decision and the model version, and its reason
    is that comparison in words, naming the class exactly when it disagrees with the decision."""
    name = Path(row["path"]).stem
    _, label, score = COLOURS[name]
    decision = "defect" if score >= threshold else "ok"
    assert row["defect_score"] == pytest.approx(score, abs=1e-5)
    assert row["threshold"] == threshold and row["decision"] == decision
    assert row["model_version"] == version and row["model"] == "shares"
    sign = ">=" if decision == "defect" else "<"
    said = f"defect score {score:.3f} {sign} the card's threshold {threshold:.3f} -> {decision}"
    assert row["reason"].startswith(said), row["reason"]
    disagrees = (decision == "defect") == (label == "ok")
    assert row["reason"].endswith(f", although the most likely class is {label}") == disagrees, row["reason"]


# --- the rule in words --------------------------------------------------------------------------------------


def test_the_reason_names_the_score_the_threshold_and_a_disagreeing_class():
    assert verdict(0.31, 0.07, "ok", "ok") == (
        "defect",
        "defect score 0.310 >= the card's threshold 0.070 -> defect, although the most likely class is ok",
    )
    assert verdict(0.64, 0.7, "scratch", "ok") == (
        "ok",
        "defect score 0.640 < the card's threshold 0.700 -> ok, although the most likely class is scratch",
    )
    assert verdict(0.9, 0.07, "crack", "ok") == ("defect", "defect score 0.900 >= the card's threshold 0.070 -> defect")
    assert verdict(0.01, 0.07, "ok", "ok") == ("ok", "defect score 0.010 < the card's threshold 0.070 -> ok")
    # a score a hair under the threshold is not printed equal to it: as many decimals as tell them apart
    decision, reason = verdict(0.0699996, 0.07, "ok", "ok")
    assert decision == "ok" and "0.0699996 < the card's threshold 0.0700000" in reason
    assert verdict(0.07, 0.07, "ok", "ok")[1].startswith("defect score 0.070 >= the card's threshold 0.070")


# --- files: the runner, the CLI, the watcher ----------------------------------------------------------------


@pytest.mark.parametrize("threshold", [0.3, 0.7])
def test_predict_files_rows_carry_score_threshold_version_and_reason(strict, lenient, images, threshold):
    runner = Runner(strict if threshold == 0.3 else lenient, providers="cpu")
    rows = list(runner.predict_files(sorted(images.values()), 2))
    assert len(rows) == 4 and not any(r.error for r in rows)
    for r in rows:
        assert_explained({**r.__dict__}, threshold, runner.version)
    disagreeing = [r for r in rows if "although" in r.reason]
    assert len(disagreeing) == 1  # ok_but_flagged at 0.3, scratch_but_passed at 0.7


def test_cli_predict_csv_and_jsonl_carry_threshold_reason_and_version(strict, images, tmp_path, capsys):
    runner = Runner(strict, providers="cpu")
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    inputs = [str(p) for p in sorted(images.values())] + [str(broken)]
    base = ["predict", "--model", str(strict), "--providers", "cpu", *inputs]
    assert cli.main([*base, "--out", str(tmp_path / "out.csv")]) == 0
    assert cli.main([*base, "--out", str(tmp_path / "out.jsonl")]) == 0
    with open(tmp_path / "out.csv", newline="") as f:
        table = list(csv.DictReader(f))
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert {"defect_score", "threshold", "decision", "reason", "model", "model_version"} <= set(table[0])
    for csv_row, json_row in zip(table, lines, strict=True):
        if Path(json_row["path"]).name == "broken.png":  # not scored: no score, no threshold, no reason
            assert json_row["error"] and json_row["threshold"] is None and json_row["reason"] == ""
            assert csv_row["threshold"] == "" and csv_row["reason"] == ""
            continue
        assert_explained(json_row, 0.3, runner.version)
        numbers = {k: float(csv_row[k]) for k in ("defect_score", "threshold")}
        assert_explained({**csv_row, **numbers}, 0.3, runner.version)
    flagged = next(r for r in table if Path(r["path"]).stem == "ok_but_flagged")
    assert (flagged["class"], flagged["decision"]) == ("ok", "defect")
    assert flagged["reason"] == (
        "defect score 0.400 >= the card's threshold 0.300 -> defect, although the most likely class is ok"
    )


def test_watch_results_and_review_queue_entries_carry_threshold_and_reason(strict, images, tmp_path):
    runner = Runner(strict, providers="cpu")
    rule = ReviewRule(margin=1.0, min_confidence=0.0)  # every image queued
    counts, results, queue = watch_once(runner, images.values(), tmp_path, rule)
    assert counts == {"done": 4, "failed": 0, "review": 4, "skipped": 0}
    assert len(results) == 4 and len(queue) == 4
    for row in results + queue:
        assert_explained({**row, "path": row["file"]}, 0.3, runner.version)
    for q in queue:  # why it was queued, beside why it was decided
        assert q["review_reasons"] and "of the threshold 0.300" in q["review_reasons"][0]


# --- HTTP ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(strict, tmp_path_factory):
    review = tmp_path_factory.mktemp("review")
    srv = Server(strict, "--max-batch-size", "4", "--review-dir", str(review), "--review-margin", "1.0", token=None)
    srv.review = review
    yield srv
    assert srv.stop() == 0, srv.output()[-2000:]


def test_classify_answers_and_its_review_queue_entries_name_the_threshold_and_reason(server, strict, images):
    version = Runner(strict, providers="cpu").version
    for name, path in images.items():
        r = server.post("/v2/models/shares/classify", data=path.read_bytes(), headers={"Content-Type": "image/png"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert_explained({**body, "path": path.name, "model": body["model_name"]}, 0.3, version)
        assert body["class"] == COLOURS[name][1]
    queue = [json.loads(line) for line in (server.review / "queue.jsonl").read_text().splitlines()]
    assert len(queue) == 4
    for q in queue:
        assert q["threshold"] == 0.3 and q["model_version"] == version and "the card's threshold 0.300" in q["reason"]
        assert q["review_reasons"]


def test_v2_infer_returns_class_decision_and_reason_with_the_threshold_as_a_parameter(server, strict):
    runner = Runner(strict, providers="cpu")
    meta = server.get("/v2/models/shares").json()
    assert [o["name"] for o in meta["outputs"]] == ["probs", "defect_score", "class", "decision", "reason"]
    assert meta["parameters"]["threshold"] == 0.3 and "defect_score >= threshold" in meta["parameters"]["decision_rule"]
    x = np.stack([np.full((SIDE, SIDE, 3), rgb, np.uint8) for rgb, _, _ in COLOURS.values()])
    body = {"inputs": [{"name": "image", "shape": list(x.shape), "datatype": "UINT8", "data": x.ravel().tolist()}]}
    before = {d: server.metric("defect_runner_images_total", decision=d) for d in ("defect", "ok")}
    r = server.post("/v2/models/shares/infer", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    after = {d: server.metric("defect_runner_images_total", decision=d) for d in ("defect", "ok")}
    assert {d: after[d] - before[d] for d in after} == {"defect": 3, "ok": 1}  # counted by decision
    assert answer["parameters"]["threshold"] == 0.3 and answer["parameters"]["ok_class"] == "ok"
    assert answer["model_version"] == runner.version
    out = {o["name"]: o for o in answer["outputs"]}
    assert out["probs"]["datatype"] == "FP32" and out["reason"]["datatype"] == "BYTES"
    assert out["reason"]["shape"] == [4]
    for i, name in enumerate(COLOURS):
        row = {
            "path": name,
            "defect_score": out["defect_score"]["data"][i],
            "threshold": answer["parameters"]["threshold"],
            "decision": out["decision"]["data"][i],
            "reason": out["reason"]["data"][i],
            "model": answer["model_name"],
            "model_version": answer["model_version"],
        }
        assert_explained(row, 0.3, runner.version)
        assert out["class"]["data"][i] == COLOURS[name][1]
    # the official client, binary outputs: strings come back as BYTES tensors it decodes
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    inp = triton.InferInput("image", list(x.shape), "UINT8")
    inp.set_data_from_numpy(x)
    outs = [triton.InferRequestedOutput(n, binary_data=True) for n in ("defect_score", "decision", "reason")]
    res = client.infer("shares", [inp], outputs=outs)
    assert [d.decode() for d in res.as_numpy("decision")] == out["decision"]["data"]
    assert [d.decode() for d in res.as_numpy("reason")] == out["reason"]["data"]
    np.testing.assert_allclose(res.as_numpy("defect_score"), out["defect_score"]["data"], atol=1e-6)
    assert res.get_response()["parameters"]["threshold"] == 0.3


# --- the --help examples ------------------------------------------------------------------------------------


def test_help_examples_name_the_files_and_the_registered_model_the_pipeline_writes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    examples = [line for line in text.splitlines() if line.startswith("defect-runner ")]
    assert {e.split()[1] for e in examples} == {"predict", "watch", "serve"}
    params = load_default_params()
    models = {m for e in examples for m in re.findall(r"--model (\S+)", e)}
    registered = f"models:/{params['promote']['model_name']}@champion"
    assert models == {"models/export/model.onnx", registered}
    assert 'Path("models/export/model.onnx")' in (ROOT / "stages/export.py").read_text()  # where export writes it
    uris = {u for e in examples for u in re.findall(r"--tracking-uri (\S+)", e)}
    assert uris == {params["mlflow"]["tracking_uri"]}  # the store promote registers it in
