"""params.yaml is checked strictly: every mistake names its key."""

from __future__ import annotations

import copy

import pytest
import yaml

from pipeline.config import ConfigError, load_params, member_params, params_from_dict
from tests.conftest import ROOT, load_default_params


def test_the_shipped_params_load():
    p = load_params(ROOT / "params.yaml")
    assert p.data.source == "synthetic" and p.prepare.image_size >= 32
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
        (lambda p: p["promote"].update(max_false_alarm_rate=0.0), "promote.max_false_alarm_rate: must be in"),
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
