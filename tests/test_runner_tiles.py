"""The runner with a tile graph beside the whole-image one: fused scores, file checks, files of mixed sizes,
HTTP, the registry. Two tiny hand-built ONNX graphs (a channel mean and a channel max, each through a
linear layer and softmax) stand in for the exported pair, so every test runs in seconds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from PIL import Image

from serving.card import InputSpec, ModelCard, TileSpec, card_path_for, sha256_file
from serving.preprocess import resize_image
from serving.runner import TILE_CHUNK, Runner, RunnerError
from serving.tiles import cut_tiles, fuse, image_probs, is_tile_graph, tile_graph_path
from tests.serving_helpers import Server

CLASSES = ["ok", "scratch", "dent"]
SIZE, TILE, WEIGHT = 32, 16, 0.4


def tiny_graph(side: int, reduce: str, seed: int) -> onnx.ModelProto:
    """(N, side, side, 3) uint8 -> probs (N, 3) and defect_score (N,): softmax of a linear map of each
    channel's mean or max, as the exported graphs' I/O."""
    rng = np.random.default_rng(seed)
    weights = helper.make_tensor("w", TensorProto.FLOAT, [3, 3], rng.normal(0, 0.03, 9).tolist())
    bias = helper.make_tensor("b", TensorProto.FLOAT, [3], [1.0, -0.5, -0.5])
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    ok = helper.make_tensor("ok", TensorProto.INT64, [], [0])
    nodes = [
        helper.make_node("Cast", ["image"], ["x"], to=TensorProto.FLOAT),
        helper.make_node(reduce, ["x"], ["pooled"], axes=[1, 2], keepdims=0),
        helper.make_node("MatMul", ["pooled", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=1),
        helper.make_node("Gather", ["probs", "ok"], ["p_ok"], axis=1),
        helper.make_node("Sub", ["one", "p_ok"], ["defect_score"]),
    ]
    graph = helper.make_graph(
        nodes,
        f"tiny_{reduce}",
        [helper.make_tensor_value_info("image", TensorProto.UINT8, ["batch", side, side, 3])],
        [
            helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("defect_score", TensorProto.FLOAT, ["batch"]),
        ],
        [weights, bias, one, ok],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def write_pair(folder: Path, name: str = "model.onnx") -> Path:
    """The whole graph, its tile graph beside it (``tile_graph_path``) and the card naming both."""
    folder.mkdir(parents=True, exist_ok=True)
    model = folder / name
    tiles = tile_graph_path(model)
    onnx.save(tiny_graph(SIZE, "ReduceMean", 0), str(model))
    onnx.save(tiny_graph(TILE, "ReduceMax", 1), str(tiles))
    ModelCard(
        name="tiny-tiles",
        architecture="mean",
        classes=CLASSES,
        ok_class="ok",
        input=InputSpec(SIZE, 3, "letterbox"),
        threshold=0.5,
        sha256=sha256_file(model),
        tiles=TileSpec(tiles.name, sha256_file(tiles), TILE, WEIGHT, "max"),
    ).write(card_path_for(model))
    return model


def photos(n: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def runner(model) -> Runner:
    return Runner(model, providers="cpu")


def by_hand(model: Path, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The contract with two plain onnxruntime sessions: whole graph on the resized photographs, tile graph
    on every tile, each photograph's most suspicious tile, fused by the card's weight."""
    whole_s, tile_s = (ort.InferenceSession(str(p)) for p in (model, tile_graph_path(model)))
    whole = whole_s.run(["probs"], {"image": np.stack([resize_image(p, SIZE, "letterbox") for p in batch])})[0]
    cuts = [[t for _, _, t in cut_tiles(p, TILE)] for p in batch]
    tile_probs = tile_s.run(["probs"], {"image": np.stack([t for c in cuts for t in c])})[0]
    parent = np.concatenate([[i] * len(c) for i, c in enumerate(cuts)])
    view = image_probs(tile_probs, parent, len(batch), 0)
    # image_probs itself, checked here once: the first photograph's view is its tile with the highest 1 - p(ok)
    first = tile_probs[parent == 0]
    np.testing.assert_array_equal(view[0], first[np.argmax(1 - first[:, 0])])
    fused = fuse(whole, view, WEIGHT)
    return fused, 1 - fused[:, 0]


@pytest.mark.parametrize("shape", [(4, 50, 70), (2, 32, 32), (1, 7, 10)], ids=["70x50", "32x32", "10x7"])
def test_fused_scores_are_the_two_graphs_by_hand(model, runner, shape):
    batch = photos(*shape)
    probs, score = runner.predict(batch)
    want_probs, want_score = by_hand(model, batch)
    np.testing.assert_allclose(probs, want_probs, atol=1e-6)
    np.testing.assert_allclose(score, want_score, atol=1e-6)
    assert probs.dtype == score.dtype == np.float32 and probs.shape == (shape[0], 3)
    whole, tiles = runner.predict_views(batch)
    np.testing.assert_allclose(fuse(whole, tiles, WEIGHT), probs, atol=1e-7)
    assert not np.allclose(whole, tiles)  # two views that differ: the fusion is really tested


def test_a_batch_of_more_tiles_than_one_run_holds_is_scored_in_chunks(model, runner):
    batch = photos(4, 50, 70, seed=3)  # 4 x 20 tiles
    assert len(batch) * len(cut_tiles(batch[0], TILE)) > TILE_CHUNK
    np.testing.assert_allclose(runner.predict(batch)[0], by_hand(model, batch)[0], atol=1e-6)


def test_the_runner_takes_photographs_of_any_size_but_not_other_channels(runner):
    assert runner.input_shape == (-1, -1, 3)
    for bad in (photos(1, 20, 20)[..., :1], photos(1, 20, 20).astype(np.float32), np.zeros((1, 0, 5, 3), np.uint8)):
        with pytest.raises(ValueError, match="expected uint8"):
            runner.predict(bad)


def test_a_changed_or_missing_tile_graph_is_refused_naming_the_file(tmp_path):
    model = write_pair(tmp_path)
    tiles = tile_graph_path(model)
    proto = onnx.load(str(tiles))
    proto.doc_string = "retrained"
    onnx.save(proto, str(tiles))
    with pytest.raises(RunnerError, match=rf"{tiles.name}: sha256 .* does not match the model card's tiles"):
        Runner(model, providers="cpu")
    tiles.unlink()
    with pytest.raises(RunnerError, match=rf"{tiles.name}: tile graph not found"):
        Runner(model, providers="cpu")


def test_predict_files_scores_photographs_of_mixed_sizes_and_reports_a_corrupt_one(runner, tmp_path):
    shapes = [(50, 70), (32, 32), (50, 70), None, (32, 32), (7, 10)]
    files, want = [], {}
    for i, hw in enumerate(shapes):
        path = tmp_path / f"{i}.png"
        if hw is None:
            path.write_bytes(b"\x89PNG\r\n\x1a\n not really")
        else:
            img = photos(1, *hw, seed=i)[0]
            Image.fromarray(img).save(path)
            want[str(path)] = runner.predict(img[None])[1][0]
        files.append(path)
    assert runner.load(files[0]).shape == (50, 70, 3)  # full resolution, not the model input
    rows = list(runner.predict_files(files, batch_size=2))
    assert len(rows) == len(files)
    bad = [r for r in rows if r.error]
    assert [r.path for r in bad] == [str(files[3])] and bad[0].label is None
    good = [r for r in rows if not r.error]
    assert [r.path for r in good] == [str(f) for f in files if str(f) in want]  # input order kept
    for r in good:
        assert r.defect_score == pytest.approx(float(want[r.path]), abs=1e-6)
        assert r.decision == ("defect" if r.defect_score >= 0.5 else "ok") and r.label in CLASSES


def test_http_classify_and_infer_take_full_photographs_and_bad_requests_get_4xx(model, runner, tmp_path):
    png = tmp_path / "photo.png"
    Image.fromarray(photos(1, 50, 70, seed=7)[0]).save(png)
    want = next(runner.predict_files([png])).defect_score
    srv = Server(model, "--max-batch-size", "4", token=None)
    try:
        name = runner.card.name
        meta = srv.get(f"/v2/models/{name}").json()
        assert meta["inputs"][0]["shape"] == [-1, -1, -1, 3]
        assert {k: meta["parameters"][k] for k in ("tile_architecture", "tile_size", "tile_weight")} == {
            "tile_architecture": "max",
            "tile_size": TILE,
            "tile_weight": WEIGHT,
        }
        r = srv.post(f"/v2/models/{name}/classify", data=png.read_bytes(), headers={"Content-Type": "image/png"})
        assert r.status_code == 200, r.text
        assert r.json()["defect_score"] == pytest.approx(want, abs=1e-6)

        def infer(x: np.ndarray, datatype: str = "UINT8"):
            body = {
                "inputs": [{"name": "image", "shape": list(x.shape), "datatype": datatype, "data": x.ravel().tolist()}]
            }
            return srv.post(f"/v2/models/{name}/infer", json=body)

        x = photos(2, 50, 70, seed=8)
        r = infer(x)
        assert r.status_code == 200, r.text
        got = {o["name"]: o["data"] for o in r.json()["outputs"]}
        want_scores = runner.predict(x)[1]
        np.testing.assert_allclose(np.array(got["defect_score"], np.float32), want_scores, atol=1e-6)
        assert r.json()["parameters"]["threshold"] == 0.5  # the card's, beside the fused scores it decided
        assert got["decision"] == ["defect" if s >= 0.5 else "ok" for s in want_scores]
        assert all("the card's threshold 0.500" in reason for reason in got["reason"])
        for resp, status, word in [
            (infer(photos(1, 20, 20)[..., :1]), 400, "does not match"),  # one channel for an RGB model
            (infer(np.zeros((1, 0, 20, 3), np.uint8)), 400, "empty dimension"),
            (infer(photos(1, 20, 20).astype(np.float32), "FP32"), 400, "UINT8"),
            (infer(photos(5, 20, 20)), 400, "maximum"),
            (srv.post(f"/v2/models/{name}/classify", data=b"not an image"), 400, "not a recognised image"),
        ]:
            assert resp.status_code == status and word in resp.json()["error"], resp.text
        assert infer(photos(1, 7, 10)).status_code == 200  # still serving, and a photograph smaller than a tile
    finally:
        assert srv.stop() == 0, srv.output()[-2000:]


def test_each_variants_tile_graph_is_named_after_its_whole_graph():
    assert tile_graph_path(Path("models/export/model.fp16.onnx")) == Path("models/export/model.fp16.tiles.onnx")
    assert is_tile_graph(tile_graph_path("model.onnx")) and not is_tile_graph("model.int8.onnx")


def test_a_registered_version_with_its_tile_graph_resolves_to_the_whole_graph(model, runner, tmp_path):
    from mlflow import MlflowClient

    from pipeline import tracking
    from pipeline.registry import promote
    from serving.registry import resolve

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri, uri)
    run_id = client.create_run(client.create_experiment("tiles")).info.run_id
    run = tracking.Run(client, run_id, tracking.Buffer(uri, tmp_path / "buffer"))
    card = ModelCard.read(card_path_for(model))
    version = promote.register(client, run, "tiny-tiles", model, card)
    assert promote.register(client, run, "tiny-tiles", model, card) == version  # the same pair: the same version
    resolved = resolve(f"models:/tiny-tiles/{version}", tracking_uri=uri, cache=tmp_path / "cache")
    assert resolved.model_path.name == "model.onnx"
    assert sorted(p.name for p in resolved.model_path.parent.iterdir()) == [
        "model.card.json",
        "model.onnx",
        "model.tiles.onnx",
    ]
    pulled = Runner(resolved.model_path, providers="cpu", version=resolved.version)
    x = photos(2, 50, 70, seed=9)
    np.testing.assert_allclose(pulled.predict(x)[1], runner.predict(x)[1], atol=1e-7)
