"""params.yaml is checked strictly: every mistake names its key."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import yaml

from pipeline.config import (
    SYNTHETIC_CLASSES,
    ConfigError,
    ModelConfig,
    as_flat_dict,
    load_params,
    member_params,
    params_from_dict,
)
from tests.conftest import ROOT, load_default_params


def test_the_shipped_params_load():
    p = load_params(ROOT / "params.yaml")
    assert p.data.source == "synthetic" and p.prepare.image_size == "auto"  # the images decide their input side
    assert isinstance(p.train.lr, float)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p: p["train"].pop("lr"), "train.lr: missing key"),
        (lambda p: p["train"].update(learning_rate=0.1), "train.learning_rate: unknown key"),
        (lambda p: p["train"].update(lr="fast"), "train.lr: expected a number, got 'fast'"),
        (lambda p: p["train"].update(epochs=2.5), "train.epochs: expected an integer"),
        (lambda p: p["prepare"].update(resize="crop"), "prepare.resize: expected one of ['letterbox', 'squash']"),
        (lambda p: p["data"].update(channels=2), "data.channels: expected one of [1, 3]"),
        (lambda p: p["augment"].update(orientation="upright"), "augment.orientation: expected one of ['auto', "),
        (lambda p: p["data"]["synthetic"]["counts"].update(ok="many"), "data.synthetic.counts.ok: expected an integer"),
        (lambda p: p.pop("export"), "export: missing key"),
        (lambda p: p.update(extra={}), "extra: unknown key"),
        (lambda p: p["prepare"]["split"].update(val=0.6, test=0.4), "prepare.split"),
        (lambda p: p["data"].update(ok_class="good"), "data.ok_class"),
        (lambda p: p["promote"]["rules"][0].update(metric="f1"), "promote.rules[0].metric: expected one of"),
        (lambda p: p["promote"]["rules"][1].update(better="more"), "promote.rules[1].better: expected one of"),
        (lambda p: p["promote"].update(rules=[]), "promote.rules: at least one rule"),
        (lambda p: p["promote"].update(refuse_false_alarm_rate=0.0), "promote.refuse_false_alarm_rate: must be in"),
        (lambda p: p["train"].pop("init_from"), "train.init_from: missing key"),
        (lambda p: p["train"].update(monitor="last", early_stopping_patience=3), "train.early_stopping_patience"),
        (lambda p: p["train"].update(focal_gamma=-2), "train.focal_gamma: must be >= 0 (0 = off), got -2"),
        (lambda p: p["train"].update(mask_loss=-1.0), "train.mask_loss: must be >= 0 (0 = off), got -1.0"),
        (lambda p: p["train"].update(majority_per_epoch=0), "train.majority_per_epoch: a share in (0, 1]"),
        (
            lambda p: p["train"].update(majority_per_epoch=0.5, class_weighting="sampling"),
            "train.majority_per_epoch: only with train.class_weighting none or loss",
        ),
        (
            lambda p: p["train"].update(ensemble=2, ensemble_members=[{}]),
            "train.ensemble_members: one entry per member",
        ),
        (
            lambda p: p["train"].update(ensemble=2, ensemble_members=[{}, {"prepare.image_size": 64}]),
            "train.ensemble_members[1]: prepare.image_size: a member may change augment.policy, augment.orientation, ",
        ),
        (
            lambda p: p["train"].update(ensemble=2, ensemble_members=[{}, {"model.global_pool": "mean"}]),
            "train.ensemble_members[1]: model.global_pool: expected one of",
        ),
        (
            lambda p: p["train"].update(ensemble=2, ensemble_members=[{}, {"augment.orientation": "sideways"}]),
            "train.ensemble_members[1]: augment.orientation: expected one of ['auto', 'free', 'fixed']",
        ),
        (
            lambda p: p["train"].update(ensemble=2, ensemble_members=[{}, {"train.lr": "fast"}]),
            "train.ensemble_members[1]: train.lr: expected a number, got 'fast'",
        ),
        (
            lambda p: p["train"].update(ensemble=2, ensemble_members=[{"train.learning_rate": 0.1}, {}]),
            "train.ensemble_members[0]: train.learning_rate: params.yaml has no such key",
        ),
        # checked at load time since pydantic replaced the hand-written checker (before: when a stage ran, or never)
        (lambda p: p["data"].update(channels=True), "data.channels: expected one of [1, 3], got True"),
        (
            lambda p: p["augment"].update(policy=[{"name": "OneOf", "transforms": [{"name": "Blur"}, {"name": "X"}]}]),
            "augment.policy[0].transforms[1].name: 'X' is not an albumentations transform",
        ),
        (
            lambda p: p["augment"].update(policy=[{"name": "HorizontalFlip", "prob": 0.5}]),
            "augment.policy[0]: HorizontalFlip has no argument 'prob' (it takes: p)",
        ),
        (lambda p: p["augment"].update(policy=[{"p": 0.5}]), "augment.policy[0]: expected a mapping with a 'name' key"),
        (
            lambda p: p["train"].update(ensemble=2, ensemble_members=[{}, {"augment.policy": [{"name": "Flipp"}]}]),
            "train.ensemble_members[1]: augment.policy[0].name: 'Flipp' is not an albumentations transform",
        ),
        (lambda p: p["train"].update(lr=-0.001), "train.lr: must be >= 0 (0 = the weights never change), got -0.001"),
        (
            lambda p: p["train"].update(ensemble=2, ensemble_members=[{}, {"train.lr": -1}]),
            "train.ensemble_members[1]: train.lr: must be >= 0",
        ),
        (
            lambda p: p["tiles"]["recipe"].update({"train.lr": -0.1}),
            "params.yaml: tiles.recipe: train.lr: must be >= 0",
        ),
        (lambda p: p["data"]["synthetic"]["counts"].update(dent=5), "data.synthetic.counts: the generator's classes"),
        (lambda p: p["data"]["synthetic"]["counts"].update(spot=-1), "data.synthetic.counts: the generator's classes"),
        (
            lambda p: p["export"].update(min_speedup={"int 8": 1.0}),
            "export.min_speedup: expected one of ['fp32', 'fp16', 'int8'], got 'int 8'",
        ),
        (lambda p: p["benchmark"].update(batch_sizes=[]), "benchmark.batch_sizes: at least one, each at least 1"),
        (lambda p: p.update(source_file="x.yaml"), "source_file: unknown key"),
    ],
)
def test_a_mistake_names_the_key(mutate, message):
    raw = copy.deepcopy(load_default_params())
    mutate(raw)
    with pytest.raises(ConfigError) as exc:
        params_from_dict(raw)
    assert message in str(exc.value)
    assert str(exc.value).startswith("params.yaml: ")


def test_bad_yaml_and_missing_file_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_params(tmp_path / "nope.yaml")
    bad = tmp_path / "params.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_params(bad)


def test_params_are_frozen():
    p = params_from_dict(load_default_params())
    with pytest.raises(AttributeError):
        p.train.lr = 1.0  # type: ignore[misc]


def test_yaml_false_stays_a_string_for_pretrained(tmp_path):
    raw = load_default_params()
    raw["model"]["pretrained"] = False
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(raw))
    assert load_params(f).model.pretrained == "false"


def test_a_member_may_see_the_images_in_every_orientation():
    """A mixed ensemble: member 0 keeps the flips and turns whatever the images say, the others follow
    augment.orientation (auto)."""
    raw = copy.deepcopy(load_default_params())
    raw["augment"]["orientation"] = "auto"
    raw["train"].update(ensemble=3, ensemble_members=[{"augment.orientation": "free"}, {}, {}])
    p = params_from_dict(raw)
    assert [member_params(p, k).augment.orientation for k in range(3)] == ["free", "auto", "auto"]
    assert [member_params(p, k).train.seed for k in range(3)] == [0, 1, 2]


def test_as_flat_dict_is_what_the_fingerprint_hashed_before_pydantic():
    """train's fingerprint hashes json.dumps(as_flat_dict(section), sort_keys=True): types must not drift
    (an integer in a float field is a float, YAML's false in a string field the word "false")."""
    raw = load_default_params()
    raw["model"].update(name="resnet10t", pretrained=False, drop_rate=0, global_pool="max", input_norm="dataset")
    raw["benchmark"].update(batch_sizes=[1, 8], http_seconds=4)
    raw["tiles"]["use"] = False  # YAML's bare off
    p = params_from_dict(raw)
    model = dict(raw["model"], pretrained="false", drop_rate=0.0)
    assert json.dumps(as_flat_dict(p.model), sort_keys=True) == json.dumps(model, sort_keys=True)
    flat = as_flat_dict(p)
    assert json.dumps(flat["benchmark.http_seconds"]) == "4.0" and flat["benchmark.batch_sizes"] == [1, 8]
    assert flat["tiles.use"] == "off" and flat["source_file"] == "params.yaml"
    assert flat["data.synthetic.counts.ok"] == raw["data"]["synthetic"]["counts"]["ok"]
    assert flat["augment.policy"] == raw["augment"]["policy"] and flat["tiles.recipe.train.lr"] == 0.001
    assert flat["export.min_speedup.int8"] == 1.0 and flat["promote.rules"][0]["metric"] == "defect_recall"
    assert set(as_flat_dict(p.train)) == {f.name for f in dataclasses.fields(p.train)}


def test_every_problem_is_one_line_naming_its_key():
    raw = load_default_params()
    raw["train"].update(lr="fast", epochs=2.5)
    raw["data"].pop("seed")
    with pytest.raises(ConfigError) as exc:
        params_from_dict(raw)
    lines = str(exc.value).splitlines()
    assert len(lines) == 3 and all(line.startswith("params.yaml: ") for line in lines)
    assert {line.split(": ")[1] for line in lines} == {"data.seed", "train.epochs", "train.lr"}


def test_configs_stay_plain_frozen_dataclasses():
    """Positional construction, replace and asdict: what train, the stages and the tests do with them."""
    positional = ModelConfig("resnet10t", "false", 0.0, "avg", "dataset")
    assert positional == ModelConfig(
        name="resnet10t", pretrained="false", drop_rate=0.0, global_pool="avg", input_norm="dataset"
    )
    assert dataclasses.replace(positional, name="x").name == "x"
    assert dataclasses.asdict(positional)["pretrained"] == "false"
    with pytest.raises(dataclasses.FrozenInstanceError):
        positional.name = "y"  # type: ignore[misc]


def test_the_synthetic_classes_are_the_generators():
    from pipeline.data.synthetic import CLASSES

    assert SYNTHETIC_CLASSES == CLASSES


def _write(tmp_path, raw):
    f = tmp_path / "params.yaml"
    f.write_text(yaml.safe_dump(raw))
    return f


def test_a_missing_data_source_folder_stops_at_load_time(tmp_path, monkeypatch):
    """Relative to the working directory, where the ingest stage reads it (the project root)."""
    raw = load_default_params()
    raw["data"].update(source="images", ok_class="good")
    f = _write(tmp_path, raw)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^data\.source: folder images does not exist \(set in .*params.yaml; "):
        load_params(f)
    (tmp_path / "images").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"data\.source: folder images is not a folder"):
        load_params(f)
    assert load_params(f, stage="evaluate").data.source == "images"  # data pulled with dvc: later stages run
    with pytest.raises(ConfigError, match=r"data\.source: folder images is not a folder"):
        load_params(f, stage="ingest")
    (tmp_path / "images").unlink()
    (tmp_path / "images").mkdir()
    assert load_params(f).data.source == "images"
    params_from_dict(raw)  # a dict alone names no working directory: checked where it is loaded from a file


def test_a_missing_weights_file_stops_at_load_time(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = load_default_params()
    raw["train"].update(ensemble=2, ensemble_members=[{}, {"model.pretrained": "w/b0.pth"}])
    with pytest.raises(ConfigError) as exc:
        load_params(_write(tmp_path, raw))
    assert str(exc.value).startswith("train.ensemble_members[1]: model.pretrained: weights file w/b0.pth not found")
    (tmp_path / "w").mkdir()
    (tmp_path / "w/b0.pth").write_bytes(b"")
    assert load_params(_write(tmp_path, raw)).train.ensemble == 2
    raw["model"]["pretrained"] = "w/gone.pth"
    with pytest.raises(ConfigError, match="^model.pretrained: weights file w/gone.pth not found"):
        load_params(_write(tmp_path, raw))
