"""The promote stage against a real MLflow registry (SQLite store): register, challenger, champion rules."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipeline.config import PromoteRule, params_from_dict
from pipeline.registry.promote import champion_classes, decide, judge, other_product
from serving.card import InputSpec, ModelCard
from serving.registry import resolve
from serving.runner import Runner
from tests.conftest import load_default_params, run_stages_in, tiny_params

RULES = [
    PromoteRule("defect_recall", "higher", 0.005),
    PromoteRule("false_alarm_rate", "lower", 0.005),
    PromoteRule("accuracy", "higher", 0.0),
]


def m(recall: float, far: float, acc: float) -> dict:
    return {"defect_recall": recall, "false_alarm_rate": far, "accuracy": acc}


@pytest.mark.parametrize(
    ("new", "old", "promoted", "why"),
    [
        (m(0.95, 0.30, 0.8), m(0.90, 0.10, 0.9), True, "defect_recall better"),  # recall decides first
        (m(0.90, 0.10, 0.9), m(0.95, 0.01, 0.9), False, "defect_recall worse"),
        (m(0.952, 0.10, 0.7), m(0.950, 0.20, 0.9), True, "false_alarm_rate better"),  # recall within tolerance
        (m(0.95, 0.203, 0.95), m(0.95, 0.200, 0.90), True, "accuracy better"),  # both within tolerance
        (m(0.95, 0.20, 0.90), m(0.95, 0.20, 0.90), False, "every rule tied"),  # a tie keeps the champion
        (m(1.00, 1.00, 0.50), m(0.90, 0.10, 0.90), False, "above promote.refuse_false_alarm_rate"),  # flags everything
        (m(0.80, 0.10, 0.80), m(1.00, 0.99, 0.50), True, "champion's false_alarm_rate"),
    ],
)
def test_rules_decide_in_order(new, old, promoted, why):
    got, reason = decide(new, old, RULES, promote_on_tie=False, refuse_false_alarm_rate=0.95)
    assert got is promoted and why in reason, reason


def test_a_tie_promotes_when_asked():
    assert decide(m(0.9, 0.1, 0.9), m(0.9, 0.1, 0.9), RULES, promote_on_tie=True)[0] is True


def test_a_first_model_flagging_more_good_parts_than_the_bound_is_not_crowned():
    """The case of a model ranking fairly whose threshold flagged 92% of the good parts: no champion yet
    must not mean any model becomes one."""
    params = params_from_dict(load_default_params())
    assert params.promote.refuse_false_alarm_rate <= 0.05  # a line-acceptable default
    crowned, why, _ = judge(params, None, None, "1", m(0.99, 0.92, 0.37), (), RULES)
    assert not crowned and "no champion yet" in why and "not crowned" in why
    crowned, why, _ = judge(params, None, None, "1", m(0.99, 0.01, 0.95), (), RULES)
    assert crowned and why == "no champion yet: the first model becomes champion"


SORTING_RULES = [PromoteRule("min_class_recall", "higher", 0.005), PromoteRule("accuracy", "higher", 0.0)]


@pytest.mark.parametrize(
    ("new", "old", "promoted", "why"),
    [
        (
            {"min_class_recall": 0.95, "accuracy": 0.97},
            {"min_class_recall": 0.90, "accuracy": 0.99},
            True,
            "min_class_recall better",
        ),  # the worst class first: a line sorting into bins needs every bin
        (
            {"min_class_recall": 0.952, "accuracy": 0.97},
            {"min_class_recall": 0.95, "accuracy": 0.98},
            False,
            "accuracy worse",
        ),
    ],
)
def test_defect_type_sorting_is_promoted_by_its_worst_class_then_accuracy(new, old, promoted, why):
    got, reason = decide(new, old, SORTING_RULES, promote_on_tie=False, refuse_false_alarm_rate=0.05)
    assert got is promoted and why in reason, reason


def card_of(classes: list[str], ok_class: str = "ok") -> ModelCard:
    return ModelCard("m", "net", classes, ok_class, InputSpec(64, 3, "letterbox"), 0.5)


def test_only_models_of_the_same_classes_compete():
    champion = (["ok", "scratch", "crack"], "ok")
    assert other_product(champion, card_of(["crack", "ok", "scratch"])) == ""  # the order is the model's own
    why = other_product(champion, card_of(["ok", "scratch", "crack", "dent"]))
    assert why == (
        "champion classes ['crack', 'ok', 'scratch'] vs challenger ['crack', 'dent', 'ok', 'scratch']: "
        "a different product; register under another promote.model_name"
    )
    why = other_product(champion, card_of(["ok", "scratch", "crack"], ok_class="scratch"))
    assert why.startswith("champion OK class 'ok' vs challenger 'scratch': a different product")


@pytest.fixture(scope="module")
def registry_project(tmp_path_factory, exported_project) -> Path:
    work = tmp_path_factory.mktemp("promote")
    shutil.copytree(exported_project, work, dirs_exist_ok=True)
    return work


def client_for(project: Path) -> MlflowClient:
    uri = f"sqlite:///{project / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def decision(project: Path) -> dict:
    return json.loads((project / "reports/promote/decision.json").read_text())


def test_first_model_becomes_champion_and_the_runner_can_pull_it(registry_project, tmp_path):
    params = tiny_params(**{"model.name": "test_efficientnet"})
    run_stages_in(registry_project, params, ["promote"])
    d = decision(registry_project)
    assert d["promoted"] and d["champion_before"] is None and "first model" in d["reason"]
    client = client_for(registry_project)
    name = params["promote"]["model_name"]
    champion = client.get_model_version_by_alias(name, "champion")
    assert str(champion.version) == str(client.get_model_version_by_alias(name, "challenger").version) == "1"
    run_id = json.loads((registry_project / "models/train/run.json").read_text())["run_id"]
    assert champion.run_id == run_id  # the version points at the training run that holds the whole story
    card = json.loads((registry_project / "reports/export/variants.json").read_text())
    assert champion.tags["variant"] == card["recommended"]["cuda"]
    run = client.get_run(run_id)
    assert run.data.tags["promote.decision"] == "champion"
    assert run.data.metrics["promote_defect_recall"] == d["challenger"]["defect_recall"]
    assert d["comparable"] and d["challenger"]["classes"] == ["crack", "ok", "scratch", "spot"]

    # The version says what it is, how it scored and why it is the champion; so does the registered model.
    evaluated = json.loads((registry_project / "reports/evaluate/metrics.json").read_text())
    tags = champion.tags
    assert json.loads(tags["classes"]) == d["challenger"]["classes"] and tags["ok_class"] == "ok"
    assert float(tags["test_accuracy"]) == pytest.approx(d["challenger"]["accuracy"], abs=1e-4)
    assert float(tags["test_defect_recall"]) == pytest.approx(d["challenger"]["defect_recall"], abs=1e-4)
    assert float(tags["test_false_alarm_rate"]) == pytest.approx(d["challenger"]["false_alarm_rate"], abs=1e-4)
    assert float(tags["test_roc_auc"]) == pytest.approx(evaluated["roc_auc"], abs=1e-4)
    assert tags["data_fingerprint"] == run.data.tags["data.fingerprint"] and tags["threshold"]
    assert "telling apart crack, ok, scratch, spot (OK class: ok)" in champion.description
    assert "Champion: no champion yet: the first model becomes champion." in champion.description
    assert "crack, ok, scratch, spot (OK class: ok)" in client.get_registered_model(name).description
    assert run.data.tags["mlflow.note.content"].startswith("Test split, ")  # evaluate's headline figures
    assert run.data.tags["mlflow.note.content"].endswith(
        f"Registry: version 1 of {name}; champion: no champion yet: the first model becomes champion."
    )

    # What the runner pulls is the registered file, and it scores images.
    files = resolve(f"models:/{name}@champion", tracking_uri=client.tracking_uri, cache=tmp_path / "cache")
    runner = Runner(files.model_path, providers="cpu", force=True, warmup=0)
    images = sorted((registry_project / "data/raw/images").rglob("*.png"))[:3]
    assert [p.error for p in runner.predict_files(images)] == ["", "", ""]
    # Version numbers are per store: another store's version 1 (a copy of this one here) is cached apart.
    shutil.copy(registry_project / "mlflow.db", tmp_path / "other.db")
    other = resolve(
        f"models:/{name}@champion", tracking_uri=f"sqlite:///{tmp_path / 'other.db'}", cache=tmp_path / "cache"
    )
    here, there = (f.model_path.relative_to(tmp_path / "cache").parts for f in (files, other))
    assert other.version == "1" and here[0] != there[0] and here[1:] == there[1:]  # store / name / version / ...

    # DVC re-running the stage (say, after a params change) registers nothing new.
    run_stages_in(registry_project, params, ["promote"])
    assert [str(v.version) for v in client.search_model_versions(f"name='{name}'")] == ["1"]


def test_a_worse_model_stays_challenger_and_both_runs_record_it(registry_project):
    """lr 0: the zero-initialised head never learns, every image scores the same. Without a false-alarm
    ceiling (1.0) its card catches the val defects by flagging everything, which promotion refuses."""
    params = tiny_params(**{"model.name": "test_efficientnet"})
    champion_run = json.loads((registry_project / "models/train/run.json").read_text())["run_id"]
    params["train"]["lr"] = 0.0
    params["evaluate"]["max_false_alarm_rate"] = 1.0  # no ceiling: the recall target alone sets the threshold
    params["promote"]["refuse_false_alarm_rate"] = 0.95  # the champion, one epoch old, may flag many itself
    run_stages_in(registry_project, params, ["train", "evaluate", "export", "promote"])
    d = decision(registry_project)
    assert d["challenger"]["false_alarm_rate"] == 1.0
    assert not d["promoted"] and "refuse_false_alarm_rate" in d["reason"]
    client = client_for(registry_project)
    name = params["promote"]["model_name"]
    assert str(client.get_model_version_by_alias(name, "champion").version) == "1"
    assert str(client.get_model_version_by_alias(name, "challenger").version) == "2"
    assert d["champion_before"]["version"] == "1" and d["champion_before"]["run_id"] == champion_run
    new_run = client.get_run(d["challenger"]["run_id"])
    assert new_run.data.tags["promote.decision"] == "challenger"
    assert new_run.data.tags["promote.compared_with"].startswith("version 1")
    assert "promote_champion_defect_recall" in new_run.data.metrics
    old_tags = client.get_run(champion_run).data.tags
    assert old_tags["promote.challenged_by.v2"].startswith("held against version 2")
    assert "challenged_by.v2" in client.get_model_version(name, "1").tags
    description = client.get_model_version(name, "2").description
    assert f"Not champion (the champion is version 1): {d['reason']}." in description


def test_a_model_of_other_classes_is_refused_before_it_is_registered(registry_project):
    """The champion (as its tags say) tells apart other classes: the new model is another product. Nothing is
    registered, no alias moves, and decision.json says why and what to do."""
    params = tiny_params(**{"model.name": "test_efficientnet"})
    client = client_for(registry_project)
    name = params["promote"]["model_name"]
    champion = client.get_model_version_by_alias(name, "champion")
    challenger = str(client.get_model_version_by_alias(name, "challenger").version)
    versions = sorted(str(v.version) for v in client.search_model_versions(f"name='{name}'"))
    # Registered before these tags existed: the classes come from the champion's card.
    for tag in ("classes", "ok_class"):
        client.delete_model_version_tag(name, champion.version, tag)
    untagged = client.get_model_version(name, champion.version)
    assert champion_classes(client, name, untagged) == (["crack", "ok", "scratch", "spot"], "ok")

    client.set_model_version_tag(name, champion.version, "classes", json.dumps(["ok", "dent"]))
    client.set_model_version_tag(name, champion.version, "ok_class", "ok")
    run_stages_in(registry_project, params, ["promote"])
    d = decision(registry_project)
    assert d["comparable"] is False and d["promoted"] is False
    assert d["reason"] == (
        "champion classes ['dent', 'ok'] vs challenger ['crack', 'ok', 'scratch', 'spot']: "
        "a different product; register under another promote.model_name"
    )
    assert d["challenger"]["version"] is None and d["champion_before"]["classes"] == ["ok", "dent"]
    assert d["champion_after"] == str(champion.version)
    assert "defect_recall" not in d["champion_before"]  # never scored against each other
    assert sorted(str(v.version) for v in client.search_model_versions(f"name='{name}'")) == versions
    assert str(client.get_model_version_by_alias(name, "champion").version) == str(champion.version)
    assert str(client.get_model_version_by_alias(name, "challenger").version) == challenger
    registry = json.loads((registry_project / "reports/promote/registry.json").read_text())
    assert registry["champion"] == str(champion.version) and registry["challenger"] == challenger
    run = client.get_run(d["challenger"]["run_id"])
    assert run.data.tags["promote.decision"] == "refused" and run.data.tags["promote.reason"] == d["reason"]
