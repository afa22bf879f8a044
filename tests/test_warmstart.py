"""Warm start (`train.init_from`): earlier weights in, changed layers fresh, wrong inputs named."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.config import ConfigError, ModelConfig, params_from_dict
from pipeline.model import create_model, save_model
from pipeline.training.fit import training_fingerprint
from pipeline.training.warmstart import resolve_init
from tests.conftest import tiny_params

CFG = ModelConfig(
    name="test_efficientnet", pretrained="false", drop_rate=0.0, global_pool="avgmax", input_norm="per_image"
)


def saved_model(path, num_classes: int):
    torch.manual_seed(1)
    net = create_model(CFG, num_classes, 3)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p))  # weights no fresh model has
    save_model(net.state_dict(), {"architecture": CFG.name}, path)
    return net


def test_weights_load_and_a_new_class_head_starts_fresh(tmp_path):
    old = saved_model(tmp_path / "model.pt", num_classes=4)
    params = params_from_dict(tiny_params(**{"train.init_from": str(tmp_path / "model.pt")}))
    init = resolve_init(params)
    assert str(tmp_path / "model.pt") in init.identity and "sha256" in init.identity

    same = create_model(CFG, 4, 3)
    init.load_into(same, CFG.name)
    for (name, a), b in zip(old.state_dict().items(), same.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    wider = create_model(CFG, 5, 3)  # a class was added since: the head's shape changed
    fresh_head = {k: v.clone() for k, v in wider.state_dict().items() if "classifier" in k}
    init.load_into(wider, CFG.name)
    for k, v in wider.state_dict().items():
        if "classifier" in k:
            assert torch.equal(v, fresh_head[k]), k
        else:
            assert torch.equal(v, old.state_dict()[k]), k


def test_the_warm_start_is_part_of_the_fingerprint(tmp_path, prepared_project):
    params = params_from_dict(tiny_params())
    prepared = prepared_project / "data/prepared"
    assert training_fingerprint(params, prepared, "") != training_fingerprint(
        params, prepared, "models:/m@champion (version 1)"
    )
    assert training_fingerprint(params, prepared, "x") == training_fingerprint(params, prepared, "x")


def test_bad_sources_are_named(tmp_path):
    with pytest.raises(ConfigError, match="train.init_from: .*nope.pt not found"):
        resolve_init(params_from_dict(tiny_params(**{"train.init_from": str(tmp_path / "nope.pt")})))
    saved_model(tmp_path / "model.pt", 4)
    other = dataclasses.replace(CFG, name="tf_efficientnet_lite0")
    init = resolve_init(params_from_dict(tiny_params(**{"train.init_from": str(tmp_path / "model.pt")})))
    with pytest.raises(ConfigError, match="is a test_efficientnet model, but model.name is tf_efficientnet_lite0"):
        init.load_into(create_model(other, 4, 3), other.name)


def test_champion_without_a_registry_entry_starts_from_scratch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = tiny_params(**{"train.init_from": "champion"})
    p["mlflow"]["tracking_uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert resolve_init(params_from_dict(p)) is None
