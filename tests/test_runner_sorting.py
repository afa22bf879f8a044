"""Two additions to the model card and every runner output: defect-type sorting (no OK class, no threshold)
and the card's operating point (a model marked for review still runs, with a loud warning).

The models are hand-built graphs (``tests.serving_helpers.share_graph``) whose probabilities are the image's
channel means over their sum, so a flat colour picks them, bound to their cards as export binds them
(``save_carded``). For the sorting graph, ``defect_score`` is the most likely class's probability.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from serving import cli
from serving.card import (
    BINARY_OUTPUTS,
    CardError,
    ModelCard,
    card_path_for,
    card_sha256,
)
from serving.review import ReviewRule
from serving.runner import Runner, RunnerError
from serving.server import SORTING_RULE, model_metadata
from tests.serving_helpers import (
    Server,
    flat_images,
    save_carded,
    share_card,
    share_graph,
    sorting_card,
    watch_once,
)

SIDE = 32
CLASSES = ["crazing", "scratches", "patches"]  # NEU-like defect types: every image is a defect
# flat colours -> (most likely class, its probability): the probabilities are the colour over its sum
COLOURS = {
    "scratched": ((10, 180, 10), "scratches", 0.9),
    "crazed": ((150, 30, 20), "crazing", 0.75),
    "unsure": ((70, 60, 90), "patches", 90 / 220),  # under the 0.6 review confidence
}
BELOW_TARGET = {
    "status": "below target",
    "target_defect_recall": 0.99,
    "max_false_alarm_rate": 0.01,
    "val_defect_recall": 0.93,
    "val_false_alarm_rate": 0.01,
    "val_defect_images": 40,
    "val_ok_images": 140,
    "warnings": ["the val split has 40 defect images: the threshold rests on a handful of them"],
}


def reason(label: str, p: float) -> str:
    return f"most likely class {label} at p={p:.3f} (defect-type sorting: no OK class, no threshold)"


def binary_card(**fields) -> ModelCard:
    return share_card(SIDE, 0.3, **fields)


@pytest.fixture(scope="module")
def sorter(tmp_path_factory) -> Path:
    return save_carded(
        share_graph(SIDE, sorting=True), sorting_card(SIDE, CLASSES), tmp_path_factory.mktemp("s") / "m.onnx"
    )


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    return flat_images(tmp_path_factory.mktemp("images"), {n: rgb for n, (rgb, _, _) in COLOURS.items()}, SIDE)


def assert_sorted(row: dict, version: str) -> None:
    """A sorting row: the decision is the most likely class, its probability where a binary row has the defect
    score, no threshold, and a reason that says so."""
    _, label, p = COLOURS[Path(row["path"]).stem]
    assert (row["class"] if "class" in row else row["label"]) == label and row["decision"] == label
    assert row["defect_score"] == pytest.approx(p, abs=1e-5)
    assert row["threshold"] is None and row["reason"] == reason(label, p)
    assert row["model"] == "steel-sorter" and row["model_version"] == version


# --- the card contract --------------------------------------------------------------------------------------


def test_a_sorting_card_has_no_ok_class_no_threshold_and_decides_among_its_classes():
    raw = json.loads(sorting_card(SIDE, CLASSES).to_json())
    assert raw["ok_class"] is None and raw["threshold"] is None and raw["tiles"] is None
    assert "operating_point" not in raw  # an empty operating point is left out of the JSON
    card = ModelCard.from_dict(raw)
    assert card.sorting and card.decisions == tuple(CLASSES) and card.threshold is None
    with pytest.raises(CardError, match="'steel-sorter': ok_class is null .defect-type sorting., so there is no OK"):
        _ = card.ok_index
    binary = binary_card()
    assert not binary.sorting and binary.decisions == ("defect", "ok") and binary.ok_index == 0


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda c: c.update(threshold=0.5), "field 'threshold' must be null when 'ok_class' is null"),
        (lambda c: c.update(ok_class="crazing"), "field 'threshold' is null, but only a sorting card (ok_class null)"),
        (
            lambda c: c.update(tiles={"model": "m.tiles.onnx", "sha256": "0" * 64, "size": 16, "weight": 0.5}),
            "field 'tiles' must be null for a sorting card",
        ),
        (lambda c: c.update(outputs=BINARY_OUTPUTS), "field 'outputs' must be {\"probs\""),
        (lambda c: c.pop("outputs"), "field 'outputs' must be"),
        (lambda c: c.update(ok_class=""), "field 'ok_class' must be a non-empty string, or null for a defect-type"),
        (lambda c: c.pop("threshold"), "missing field 'threshold'"),
        (lambda c: c.update(operating_point=["below target"]), "field 'operating_point' must be a JSON object"),
    ],
)
def test_the_null_rules_are_refused_naming_the_field_and_the_file(tmp_path, edit, field):
    raw = json.loads(sorting_card(SIDE, CLASSES).to_json())
    edit(raw)
    path = tmp_path / "m.card.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(CardError) as exc:
        ModelCard.read(path)
    assert field in str(exc.value) and str(path) in str(exc.value)


def test_a_card_without_an_operating_point_hashes_as_before_and_one_with_it_is_bound(sorter, tmp_path):
    raw = json.loads(binary_card().to_json())
    before = {k: v for k, v in raw.items() if k != "sha256"}  # the canonical JSON cards had before the field
    old = hashlib.sha256(json.dumps(before, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert card_sha256(ModelCard.from_dict(raw)) == old
    marked = ModelCard.from_dict({**raw, "operating_point": BELOW_TARGET})
    assert card_sha256(marked) != old and json.loads(marked.to_json())["operating_point"] == BELOW_TARGET
    # an edited operating point in the sidecar is refused, naming the field (the graph recorded the card's hash)
    model = save_carded(share_graph(SIDE), binary_card(operating_point=BELOW_TARGET), tmp_path / "m.onnx")
    card = json.loads(card_path_for(model).read_text())
    card["operating_point"]["status"] = "meets target"
    card_path_for(model).write_text(json.dumps(card))
    with pytest.raises(CardError, match="the card is not the one export recorded"):
        Runner(model, providers="cpu")
    # a sorting card is bound the same way: its nulls are in the recorded hash
    card = json.loads(card_path_for(sorter).read_text())
    copy = tmp_path / "sorter" / sorter.name
    copy.parent.mkdir()
    shutil.copy(sorter, copy)
    card_path_for(copy).write_text(json.dumps({**card, "classes": CLASSES[::-1]}))
    with pytest.raises(CardError, match="'classes': card"):
        Runner(copy, providers="cpu")


# --- sorting: every output ----------------------------------------------------------------------------------


def test_predict_files_rows_of_a_sorting_model_name_the_class_its_probability_and_no_threshold(sorter, images):
    runner = Runner(sorter, providers="cpu")
    assert runner.warning == ""
    rows = list(runner.predict_files(sorted(images.values()), 2))
    assert len(rows) == 3 and not any(r.error for r in rows)
    for r in rows:
        assert_sorted(r.__dict__, runner.version)
    probs, score = runner.predict(np.full((1, SIDE, SIDE, 3), (10, 180, 10), np.uint8))
    assert score[0] == pytest.approx(probs[0].max())  # the graph's defect_score: the most likely class's p


def test_cli_predict_csv_and_jsonl_of_a_sorting_model(sorter, images, tmp_path, capsys):
    version = Runner(sorter, providers="cpu").version
    base = ["predict", "--model", str(sorter), "--providers", "cpu", *map(str, sorted(images.values()))]
    assert cli.main([*base, "--out", str(tmp_path / "out.csv")]) == 0
    assert cli.main([*base, "--out", str(tmp_path / "out.jsonl")]) == 0
    assert "warning" not in capsys.readouterr().err
    with open(tmp_path / "out.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert list(table[0])[:8] == [
        "path",
        "class",
        *[f"p_{c}" for c in CLASSES],
        "defect_score",
        "threshold",
        "decision",
    ]
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    for csv_row, json_row in zip(table, lines, strict=True):
        assert_sorted(json_row, version)
        assert csv_row["threshold"] == "" and csv_row["decision"] == csv_row["class"] == json_row["label"]
        assert float(csv_row["defect_score"]) == pytest.approx(json_row["defect_score"])
        assert csv_row["reason"] == json_row["reason"]


def test_watch_queues_a_sorting_models_unsure_images_by_their_confidence_alone(sorter, images, tmp_path):
    runner = Runner(sorter, providers="cpu")
    rule = ReviewRule(margin=1.0, min_confidence=0.6)  # the margin would queue every binary image: no threshold here
    counts, results, (queued, *more) = watch_once(runner, images.values(), tmp_path, rule)
    assert counts == {"done": 3, "failed": 0, "review": 1, "skipped": 0} and not more
    for row in results:
        assert_sorted({**row, "path": row["file"]}, runner.version)
    assert queued["file"] == "unsure.png" and queued["review"] == "patches/unsure.png"
    assert queued["review_reasons"] == ["top class probability 0.409 < 0.6"]


def test_serve_a_sorting_model_classify_infer_metadata_and_decision_counters(sorter, images, tmp_path):
    srv = Server(sorter, "--review-dir", str(tmp_path / "review"), "--review-margin", "1.0", token=None)
    try:
        version = Runner(sorter, providers="cpu").version
        meta = srv.get("/v2/models/steel-sorter").json()["parameters"]
        assert meta["sorting"] is True and meta["decision_rule"] == SORTING_RULE and meta["classes"] == CLASSES
        assert "threshold" not in meta and "ok_class" not in meta and "operating_point" not in meta
        for name, path in images.items():
            r = srv.post(
                "/v2/models/steel-sorter/classify", data=path.read_bytes(), headers={"Content-Type": "image/png"}
            )
            assert r.status_code == 200, r.text
            body = r.json()
            assert_sorted({**body, "path": path.name, "model": body["model_name"]}, version)
            assert bool(body["review_reasons"]) == (name == "unsure")
        x = np.stack([np.full((SIDE, SIDE, 3), rgb, np.uint8) for rgb, _, _ in COLOURS.values()])
        body = {"inputs": [{"name": "image", "shape": list(x.shape), "datatype": "UINT8", "data": x.ravel().tolist()}]}
        r = srv.post("/v2/models/steel-sorter/infer", json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["parameters"] == {"decision_rule": SORTING_RULE, "sorting": True}
        out = {o["name"]: o["data"] for o in answer["outputs"]}
        for i, (_, label, p) in enumerate(COLOURS.values()):
            assert out["class"][i] == out["decision"][i] == label and out["reason"][i] == reason(label, p)
            assert out["defect_score"][i] == pytest.approx(p, abs=1e-5)
        counts = {c: srv.metric("defect_runner_images_total", decision=c) for c in [*CLASSES, "defect", "ok"]}
        assert counts == {"crazing": 2, "scratches": 2, "patches": 2, "defect": 0, "ok": 0}
        (queued,) = [json.loads(x) for x in (tmp_path / "review/queue.jsonl").read_text().splitlines()]
        assert queued["threshold"] is None and queued["decision"] == "patches" and queued["review_reasons"]
    finally:
        assert srv.stop() == 0, srv.output()[-2000:]


# --- the operating point ------------------------------------------------------------------------------------


def test_a_model_below_its_target_runs_with_a_loud_warning_and_serve_shows_its_operating_point(tmp_path, caplog):
    model = save_carded(share_graph(SIDE), binary_card(operating_point=BELOW_TARGET), tmp_path / "m.onnx")
    with caplog.at_level(logging.WARNING, logger="serving.runner"):
        runner = Runner(model, providers="cpu")
    (record,) = [r for r in caplog.records if "MARKED FOR REVIEW" in r.getMessage()]
    assert record.levelno == logging.WARNING and record.getMessage() == runner.warning
    assert runner.warning.startswith(f"MODEL MARKED FOR REVIEW: {card_path_for(model)}: its operating point is below")
    assert "val defect recall 0.930 against the target 0.990" in runner.warning
    assert "the val split has 40 defect images" in runner.warning
    meta = model_metadata(runner)["parameters"]
    assert meta["operating_point"] == BELOW_TARGET and meta["threshold"] == 0.3 and meta["ok_class"] == "ok"
    # its decisions are the binary ones, unchanged
    (row,) = runner.predict_files([_flat(tmp_path, (150, 60, 40))])
    assert (row.decision, row.threshold) == ("defect", 0.3)
    assert (
        row.reason == "defect score 0.400 >= the card's threshold 0.300 -> defect, although the most likely class is ok"
    )


def test_cli_predict_prints_one_warning_line_for_a_model_marked_for_review(tmp_path, capsys):
    marked = save_carded(share_graph(SIDE), binary_card(operating_point=BELOW_TARGET), tmp_path / "m" / "m.onnx")
    meets = save_carded(
        share_graph(SIDE), binary_card(operating_point={**BELOW_TARGET, "status": "meets target"}), tmp_path / "ok.onnx"
    )
    image = _flat(tmp_path, (150, 60, 40))
    for model, warned in ((marked, True), (meets, False)):
        assert (
            cli.main(["predict", "--model", str(model), "--providers", "cpu", image, "--out", str(tmp_path / "o.csv")])
            == 0
        )
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("defect-runner: warning:")]
        assert lines == ([f"defect-runner: warning: {Runner(model, providers='cpu').warning}"] if warned else [])
    assert str(card_path_for(marked)) in Runner(marked, providers="cpu").warning


def test_not_deployable_below_target_runs_other_reasons_need_force_and_both_warn(tmp_path):
    reason_op = "marked for review: at the 1.0% false-alarm ceiling it catches 93.0% of the val defects"
    below = binary_card(operating_point=BELOW_TARGET, deployable=False, not_deployable_reason=reason_op)
    runner = Runner(save_carded(share_graph(SIDE), below, tmp_path / "below.onnx"), providers="cpu")
    assert "below target and its card marks it not deployable (marked for review" in runner.warning
    both = binary_card(
        operating_point=BELOW_TARGET, deployable=False, not_deployable_reason=f"{reason_op}; int8 defect recall drops"
    )
    with pytest.raises(RunnerError, match="pass force"):  # below target and another reason: the other one counts
        Runner(save_carded(share_graph(SIDE), both, tmp_path / "both.onnx"), providers="cpu")
    drift = binary_card(deployable=False, not_deployable_reason="int8 defect recall drops by 0.05")
    path = save_carded(share_graph(SIDE), dataclasses.replace(drift, variant="int8"), tmp_path / "int8.onnx")
    with pytest.raises(RunnerError, match="not deployable .int8 defect recall drops by 0.05.; pass force"):
        Runner(path, providers="cpu")
    forced = Runner(path, providers="cpu", force=True)
    assert forced.warning.startswith(f"MODEL MARKED FOR REVIEW: {card_path_for(path)}: its card marks it not")
    assert Runner(save_carded(share_graph(SIDE), binary_card(), tmp_path / "plain.onnx"), providers="cpu").warning == ""


def _flat(folder: Path, rgb: tuple[int, int, int]) -> str:
    return str(flat_images(folder, {"flat": rgb}, SIDE)["flat"])
