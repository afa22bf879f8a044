"""defect-runner serve over real HTTP: the official KServe v2 client, 30+ bad requests, fuzzing, load,
hot reload, graceful shutdown, the image endpoint and its review queue, the registry."""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from serving.preprocess import load_image
from serving.runner import Runner, provider_options
from tests.conftest import ROOT, venv_env
from tests.serving_helpers import TOKEN, Server, copy_model, new_version


@pytest.fixture(scope="module")
def model(exported_project) -> Path:
    return exported_project / "models/export/model.onnx"


@pytest.fixture(scope="module")
def runner(model) -> Runner:
    return Runner(model, providers="cpu")


@pytest.fixture(scope="module")
def images(exported_project) -> list[Path]:
    return sorted((exported_project / "data/raw/images").rglob("*.png"))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    review = tmp_path_factory.mktemp("review")
    srv = Server(model, "--max-batch-size", "8", "--review-dir", str(review), "--review-margin", "1.0")
    srv.review = review
    yield srv
    assert srv.stop() == 0, srv.output()[-2000:]


def infer_path(runner: Runner) -> str:
    return f"/v2/models/{runner.card.name}/infer"


def good_json(runner: Runner, x: np.ndarray) -> dict:
    return {
        "inputs": [{"name": runner.input_name, "shape": list(x.shape), "datatype": "UINT8", "data": x.ravel().tolist()}]
    }


def assert_serves(server: Server, runner: Runner) -> None:
    x = np.full((1, *runner.input_shape), 127, dtype=np.uint8)
    r = server.post(infer_path(runner), json=good_json(runner, x))
    assert r.status_code == 200, r.text
    got = np.array(r.json()["outputs"][1]["data"], dtype=np.float32)
    np.testing.assert_allclose(got, runner.predict(x)[1], atol=1e-6)


# --- the official client ---------------------------------------------------------------------------


def test_official_kserve_v2_client_gets_metadata_readiness_and_the_runners_scores(server, runner, images):
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))

    def auth() -> dict:  # a fresh dict per call: tritonclient writes its own headers into the one it gets
        return dict(server.headers)

    name = runner.card.name
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(name, headers=auth())
    assert client.is_model_ready(name, model_version=runner.version, headers=auth())
    assert not client.is_model_ready("no-such-model", headers=auth())
    meta = client.get_model_metadata(name, headers=auth())
    assert meta["inputs"] == [{"name": runner.input_name, "datatype": "UINT8", "shape": [-1, *runner.input_shape]}]
    assert [o["name"] for o in meta["outputs"]] == ["probs", "defect_score", "class", "decision", "reason"]
    assert meta["parameters"]["classes"] == runner.card.classes and meta["versions"] == [runner.version]
    assert meta["parameters"]["threshold"] == runner.card.threshold
    assert "binary_tensor_data" in client.get_server_metadata(headers=auth())["extensions"]

    x = np.stack([runner.load(p) for p in images[:5]])
    want_probs, want_score = runner.predict(x)
    for binary in (True, False):  # the binary tensor extension (the client's default) and plain JSON
        inp = triton.InferInput(runner.input_name, list(x.shape), "UINT8")
        inp.set_data_from_numpy(x, binary_data=binary)
        outs = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("probs", "defect_score")]
        res = client.infer(name, [inp], outputs=outs, request_id=f"r-{binary}", headers=auth())
        np.testing.assert_allclose(res.as_numpy("probs"), want_probs, atol=1e-6)
        np.testing.assert_allclose(res.as_numpy("defect_score"), want_score, atol=1e-6)
        assert res.get_response()["id"] == f"r-{binary}"
        assert res.get_response()["parameters"]["threshold"] == runner.card.threshold
    # gzip-compressed request body, the version in the URL, no outputs named (all come back, binary)
    inp = triton.InferInput(runner.input_name, list(x.shape), "UINT8")
    inp.set_data_from_numpy(x)
    res = client.infer(name, [inp], model_version=runner.version, request_compression_algorithm="gzip", headers=auth())
    np.testing.assert_allclose(res.as_numpy("defect_score"), want_score, atol=1e-6)
    with pytest.raises(triton.InferenceServerException, match="401|bearer"):
        client.infer(name, [inp])  # no token


def test_image_endpoint_gives_the_cli_decision_and_queues_unsure_images(server, runner, images):
    path = f"/v2/models/{runner.card.name}/classify"
    before = server.metric("defect_runner_review_queued_total")
    for i, img in enumerate(images[:4]):
        data = img.read_bytes()
        if i % 2:
            r = server.post(path, files={"image": (img.name, data, "image/png")})
        else:
            r = server.post(path, data=data, headers={**server.headers, "Content-Type": "image/png"})
        assert r.status_code == 200, r.text
        body = r.json()
        (want,) = runner.predict_files([img])
        assert body["class"] == want.label and body["decision"] == want.decision
        assert body["defect_score"] == pytest.approx(want.defect_score, abs=1e-6)
        assert body["threshold"] == want.threshold == runner.card.threshold and body["reason"] == want.reason
        assert set(body["timing_ms"]) == {"decode", "queue", "inference", "batch_size"}
        assert body["review_reasons"]  # --review-margin 1.0: every image is unsure
    queue = [json.loads(line) for line in (server.review / "queue.jsonl").read_text().splitlines()]
    assert len(queue) >= 4 and all((server.review / q["review"]).is_file() for q in queue)
    assert (server.review / queue[-1]["review"]).parent.name == queue[-1]["class"]
    assert all(q["threshold"] == runner.card.threshold and q["reason"] and q["review_reasons"] for q in queue)
    assert server.metric("defect_runner_review_queued_total") == before + 4
    assert server.metric("defect_runner_phase_seconds_count", phase="decode") >= 4
    assert (
        server.metric(
            "defect_runner_model_info",
            name=runner.card.name,
            version=runner.version,
            variant=runner.card.variant,
            provider="CPUExecutionProvider",
        )
        == 1
    )


# --- bad input: every case a different mistake -----------------------------------------------------


def _png(size=(8, 8)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size).save(buf, "PNG")
    return buf.getvalue()


def bad_requests(runner: Runner, server: Server):
    """(case, response, expected status, a word the error must contain)."""
    name, inp, (h, w, c) = runner.card.name, runner.input_name, runner.input_shape
    url, auth = server.url, server.headers
    infer = f"{url}/v2/models/{name}/infer"
    classify = f"{url}/v2/models/{name}/classify"
    n = h * w * c

    def body(**over) -> dict:
        tensor = {"name": inp, "shape": [1, h, w, c], "datatype": "UINT8", "data": [0] * n} | over
        return {"inputs": [tensor]}

    def post(u, **kw):
        return requests.post(u, headers=kw.pop("headers", auth), timeout=30, **kw)

    ok_json = json.dumps(body()).encode()
    binary_head = json.dumps(
        {"inputs": [{"name": inp, "shape": [1, h, w, c], "datatype": "UINT8", "parameters": {"binary_data_size": n}}]}
    ).encode()
    bin_headers = {**auth, "Inference-Header-Content-Length": str(len(binary_head))}
    return [
        ("body not JSON", post(infer, data=b"{not json"), 400, "not valid JSON"),
        ("empty body", post(infer, data=b""), 400, "empty request body"),
        ("JSON array", post(infer, json=[1, 2]), 400, "JSON object"),
        ("no inputs", post(infer, json={}), 400, "missing field 'inputs'"),
        ("inputs not a list", post(infer, json={"inputs": {}}), 400, "non-empty list"),
        ("inputs empty", post(infer, json={"inputs": []}), 400, "non-empty list"),
        ("two inputs", post(infer, json={"inputs": body()["inputs"] * 2}), 400, "exactly one input"),
        ("input not an object", post(infer, json={"inputs": [3]}), 400, "JSON object"),
        ("unknown input name", post(infer, json=body(name="pixels")), 400, "unknown input 'pixels'"),
        ("no shape", post(infer, json={"inputs": [{"name": inp, "datatype": "UINT8", "data": []}]}), 400, "'shape'"),
        ("shape of strings", post(infer, json=body(shape=["1", h, w, c])), 400, "list of integers"),
        ("negative dimension", post(infer, json=body(shape=[-1, h, w, c])), 400, "negative"),
        ("wrong rank", post(infer, json=body(shape=[h, w, c])), 400, "rank 3"),
        ("wrong image size", post(infer, json=body(shape=[1, h + 1, w, c])), 400, "does not match"),
        ("batch of zero", post(infer, json=body(shape=[0, h, w, c], data=[])), 400, "batch size of 0"),
        ("batch above the maximum", post(infer, json=body(shape=[9, h, w, c], data=[0] * 9 * n)), 400, "maximum is 8"),
        ("unknown datatype", post(infer, json=body(datatype="FLOAT")), 400, "not a v2 datatype"),
        ("wrong datatype", post(infer, json=body(datatype="FP32")), 400, "takes UINT8"),
        (
            "no data",
            post(infer, json={"inputs": [{"name": inp, "shape": [1, h, w, c], "datatype": "UINT8"}]}),
            400,
            "missing field 'data'",
        ),
        ("too few values", post(infer, json=body(data=[0] * (n - 1))), 400, "elements"),
        ("value above 255", post(infer, json=body(data=[256] + [0] * (n - 1))), 400, "[0, 255]"),
        ("fractional value", post(infer, json=body(data=[0.5] + [0] * (n - 1))), 400, "integers"),
        ("string values", post(infer, json=body(data=["a"] * n)), 400, "only numbers"),
        ("ragged nested data", post(infer, json=body(data=[[0, 0], [0]])), 400, "ragged"),
        ("unknown output", post(infer, json=body() | {"outputs": [{"name": "logits"}]}), 400, "unknown output"),
        ("outputs not a list", post(infer, json=body() | {"outputs": "probs"}), 400, "'outputs' must be a list"),
        ("id not a string", post(infer, json=body() | {"id": 7}), 400, "id must be a string"),
        ("parameters not an object", post(infer, json=body() | {"parameters": [1]}), 400, "parameters"),
        ("unknown top-level field", post(infer, json=body() | {"input": []}), 400, "unknown field 'input'"),
        (
            "binary header not a number",
            post(infer, data=binary_head + bytes(n), headers={**auth, "Inference-Header-Content-Length": "ten"}),
            400,
            "must be an integer",
        ),
        (
            "binary header longer than body",
            post(infer, data=binary_head, headers={**auth, "Inference-Header-Content-Length": "999999"}),
            400,
            "body has",
        ),
        (
            "binary data too short",
            post(infer, data=binary_head + bytes(n - 1), headers=bin_headers),
            400,
            "bytes follow",
        ),
        (
            "binary_data_size wrong",
            post(
                infer,
                data=json.dumps(body(parameters={"binary_data_size": 3})).encode(),
                headers={**auth, "Inference-Header-Content-Length": str(len(ok_json) + 40)},
            ),
            400,
            "",
        ),
        ("unsupported encoding", post(infer, data=ok_json, headers={**auth, "Content-Encoding": "br"}), 415, "br"),
        ("broken gzip", post(infer, data=b"\x1f\x8bnope", headers={**auth, "Content-Encoding": "gzip"}), 400, "gzip"),
        (
            "gzip bomb",
            post(infer, data=gzip.compress(bytes(40 * 1024 * 1024)), headers={**auth, "Content-Encoding": "gzip"}),
            413,
            "limit",
        ),
        ("body over the limit", post(infer, data=bytes(17 * 1024 * 1024)), 413, "exceeds the limit"),
        ("chunked body over the limit", post(infer, data=(bytes(1 << 20) for _ in range(17))), 413, "limit"),
        ("unknown model", post(f"{url}/v2/models/nope/infer", data=ok_json), 404, "unknown model 'nope'"),
        ("unknown version", post(f"{url}/v2/models/{name}/versions/999/infer", data=ok_json), 404, "no version"),
        ("GET on infer", requests.get(infer, headers=auth, timeout=10), 405, "not allowed"),
        ("unknown path", requests.get(f"{url}/v3/anything", headers=auth, timeout=10), 404, "no route"),
        ("no token", requests.post(infer, data=ok_json, timeout=10), 401, "bearer token"),
        ("wrong token", post(infer, data=ok_json, headers={"Authorization": "Bearer nope"}), 401, "bearer token"),
        ("wrong auth scheme", post(infer, data=ok_json, headers={"Authorization": f"Basic {TOKEN}"}), 401, "bearer"),
        ("image: empty", post(classify, data=b"", headers={**auth, "Content-Type": "image/png"}), 400, "empty image"),
        (
            "image: not an image",
            post(classify, data=b"hello", headers={**auth, "Content-Type": "image/png"}),
            400,
            "not a recognised image",
        ),
        (
            "image: truncated PNG",
            post(classify, data=_png()[:40], headers={**auth, "Content-Type": "image/png"}),
            400,
            "image",
        ),
        (
            "image: decompression bomb",
            post(classify, data=_png((8000, 6000)), headers={**auth, "Content-Type": "image/png"}),
            413,
            "pixels",
        ),
        (
            "image: wrong content type",
            post(classify, data=_png(), headers={**auth, "Content-Type": "text/plain"}),
            415,
            "not an image",
        ),
        ("image: multipart without a file", post(classify, files={"note": (None, "x")}), 400, "no file part"),
        (
            "image: broken multipart",
            post(
                classify, data=b"--zz\r\nnonsense", headers={**auth, "Content-Type": "multipart/form-data; boundary=zz"}
            ),
            400,
            "multipart",
        ),
        ("reload of an unknown model", post(f"{url}/v2/repository/models/nope/load"), 404, "unknown model"),
    ]


def test_every_malformed_request_gets_its_4xx_and_the_server_keeps_serving(server, runner):
    cases = bad_requests(runner, server)
    assert len({c[0] for c in cases}) >= 30
    failures = []
    for case, resp, status, word in cases:
        try:
            message = resp.json().get("error", "")
        except ValueError:
            message = f"<not JSON: {resp.text[:80]!r}>"
        if resp.status_code != status or word.lower() not in message.lower():
            failures.append(f"{case}: got {resp.status_code} {message!r}, expected {status} with {word!r}")
    assert not failures, "\n".join(failures)
    assert_serves(server, runner)
    assert server.metric("defect_runner_requests_total", endpoint="infer", code="400") >= 25


# --- fuzzing -----------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-300, 300) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def tensor_like(name: str):
    return st.fixed_dictionaries(
        {},
        optional={
            "name": st.sampled_from([name, "x", ""]) | json_values,
            "shape": st.lists(st.integers(-2, 70), max_size=5) | json_values,
            "datatype": st.sampled_from(["UINT8", "FP32", "BYTES", "BOOL", "nope"]) | json_values,
            "data": st.lists(st.integers(-2, 300), max_size=20) | json_values,
            "parameters": st.fixed_dictionaries({}, optional={"binary_data_size": st.integers(-1, 10**6)})
            | json_values,
        },
    )


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_fuzzed_requests_never_get_a_5xx(server, runner):
    infer = server.url + infer_path(runner)
    classify = server.url + f"/v2/models/{runner.card.name}/classify"
    seen: list[int] = []

    requests_ = st.one_of(
        st.fixed_dictionaries(
            {"inputs": st.lists(tensor_like(runner.input_name), max_size=2) | json_values},
            optional={"outputs": json_values, "id": json_values, "parameters": json_values},
        ).map(lambda d: ("json", json.dumps(d).encode(), None)),
        st.tuples(st.just("bytes"), st.binary(max_size=300), st.none() | st.integers(-5, 400).map(str)),
        st.tuples(st.just("image"), st.binary(max_size=300), st.none()),
    )

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(requests_)
    def run(req):
        kind, data, header_len = req
        headers = dict(server.headers)
        if header_len is not None:
            headers["Inference-Header-Content-Length"] = header_len
        if kind == "image":
            headers["Content-Type"] = "image/png"
        r = requests.post(classify if kind == "image" else infer, data=data, headers=headers, timeout=30)
        seen.append(r.status_code)
        assert r.status_code < 500, (r.status_code, r.text[:300], data[:200])

    run()
    assert len(seen) >= 150 and any(s == 400 for s in seen)
    assert_serves(server, runner)


# --- load ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_under_load_batches_form_nothing_is_lost_and_memory_stays_flat(server, runner, images):
    x = np.stack([runner.load(p) for p in images[:16]])
    want = runner.predict(x)[1]
    client_url = server.url + infer_path(runner)
    batches_before = (server.metric("defect_runner_batch_size_count"), server.metric("defect_runner_batch_size_sum"))

    def client(k: int, until: float) -> list[tuple[int, bool]]:
        session, out = requests.Session(), []
        i = k
        while time.monotonic() < until:
            body = json.dumps(good_json(runner, x[i % 16 : i % 16 + 1]) | {"id": f"{k}-{i}"}).encode()
            r = session.post(client_url, data=body, headers=server.headers, timeout=30)
            ok = r.status_code == 200 and r.json()["id"] == f"{k}-{i}"
            ok = ok and abs(r.json()["outputs"][1]["data"][0] - float(want[i % 16])) < 1e-5
            out.append((r.status_code, ok))
            i += 1
        return out

    def burst(seconds: float) -> list[tuple[int, bool]]:
        until = time.monotonic() + seconds
        with ThreadPoolExecutor(16) as pool:
            return [r for rs in pool.map(lambda k: client(k, until), range(16)) for r in rs]

    burst(2)  # warm up: allocator pools and caches settle
    rss_before = server.rss_mb()
    results = burst(6)
    rss_after = server.rss_mb()
    assert results and all(ok for _, ok in results), [r for r in results if not r[1]][:5]  # none lost or mixed up
    count = server.metric("defect_runner_batch_size_count") - batches_before[0]
    mean_batch = (server.metric("defect_runner_batch_size_sum") - batches_before[1]) / count
    print(
        f"load: {len(results)} requests in 6 s from 16 clients, mean batch {mean_batch:.2f}, "
        f"RSS {rss_before:.0f} -> {rss_after:.0f} MB"
    )
    assert mean_batch > 1.5  # concurrent requests really share model calls
    assert rss_after - rss_before < 50, f"RSS grew {rss_before:.0f} -> {rss_after:.0f} MB"


# --- lifecycle: hot reload, graceful shutdown ----------------------------------------------------------


def test_hot_reload_swaps_the_model_without_dropping_requests(model, runner, tmp_path):
    live = copy_model(model, tmp_path / "live")
    srv = Server(live, "--max-batch-size", "8")
    try:
        x = np.full((1, *runner.input_shape), 90, dtype=np.uint8)
        # Each client's own answers, in order: its next request starts after its last answer, so once a
        # client has been served the new version it must never see the old one again. (One list for all
        # clients would order answers by when the threads appended them, not by when they were served.)
        seen, codes, stop = [[] for _ in range(4)], [], threading.Event()

        def hammer(versions):
            while not stop.is_set():
                r = srv.post(infer_path(runner), json=good_json(runner, x))
                codes.append(r.status_code)
                if r.status_code == 200:
                    versions.append(r.json()["model_version"])

        threads = [threading.Thread(target=hammer, args=(v,)) for v in seen]
        for t in threads:
            t.start()
        time.sleep(1)
        # A new version lands in place (as a deployment would copy it), then SIGHUP.
        v2 = new_version(model, tmp_path / "v2", "retrained")
        new = json.loads(v2.with_name("model.card.json").read_text())["sha256"][:12]
        for f in (v2, v2.with_name("model.card.json")):
            f.replace(live.parent / f.name)
        srv.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while srv.metric("defect_runner_reloads_total", outcome="ok") < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)
        # A broken file is refused: the server says why and keeps the version it has.
        live.write_bytes(live.read_bytes()[:-10])
        r = srv.post(f"/v2/repository/models/{runner.card.name}/load")
        assert r.status_code == 422 and "still serving" in r.json()["error"], r.text
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join()
    finally:
        assert srv.stop() == 0
    assert codes and set(codes) == {200}, f"requests failed during reload: {sorted(set(codes))}"
    for versions in seen:
        assert versions[0] == runner.version and versions[-1] == new
        assert versions.index(new) > 0 and runner.version not in versions[versions.index(new) :]


def test_sigterm_finishes_requests_in_flight_then_exits(model, runner):
    # A long queue delay keeps requests waiting in the batcher when SIGTERM arrives.
    srv = Server(model, "--max-batch-size", "64", "--max-queue-delay-ms", "1500")
    x = np.full((1, *runner.input_shape), 30, dtype=np.uint8)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(srv.post, infer_path(runner), json=good_json(runner, x)) for _ in range(4)]
        time.sleep(0.5)
        srv.proc.send_signal(signal.SIGTERM)
        codes = [f.result().status_code for f in futures]
    assert codes == [200] * 4
    assert srv.stop() == 0
    with pytest.raises(requests.ConnectionError):
        requests.get(srv.url + "/v2/health/live", timeout=2)


# --- loading: registry, providers --------------------------------------------------------------------


def test_the_runner_pulls_the_champion_from_the_mlflow_registry(model, runner, images, tmp_path):
    import mlflow
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment_name="serve-test")
    client, name = MlflowClient(uri), runner.card.name
    client.create_registered_model(name)
    for i, note in enumerate(["first", "second"], start=1):
        files = new_version(model, tmp_path / note, note)
        with mlflow.start_run() as run:
            mlflow.log_artifact(str(files), "export")
            mlflow.log_artifact(str(files.with_name("model.card.json")), "export")
        mv = client.create_model_version(name, f"{run.info.artifact_uri}/export", run.info.run_id)
        assert str(mv.version) == str(i)
    client.set_registered_model_alias(name, "champion", "1")
    env = {"MLFLOW_TRACKING_URI": uri, "DEFECT_RUNNER_CACHE": str(tmp_path / "cache")}
    srv = Server(f"models:/{name}@champion", "--max-batch-size", "4", env=env)
    try:
        r = srv.get(f"/v2/models/{name}")
        assert r.json()["versions"] == ["1"]
        client.set_registered_model_alias(name, "champion", "2")  # promotion moved the alias
        r = srv.post(f"/v2/repository/models/{name}/load")
        assert r.status_code == 200 and r.json() == {"name": name, "previous_version": "1", "version": "2"}
        assert_serves(srv, runner)
        assert srv.get(f"/v2/models/{name}").json()["versions"] == ["2"]
    finally:
        srv.stop()
    # The batch CLI takes the same URI; a missing alias is a clear error.
    from serving.cli import main

    assert (
        main(
            [
                "predict",
                "--model",
                f"models:/{name}/1",
                "--tracking-uri",
                uri,
                str(images[0]),
                "--out",
                str(tmp_path / "o.jsonl"),
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "o.jsonl").read_text())["decision"] in ("ok", "defect")
    assert main(["predict", "--model", f"models:/{name}@nope", "--tracking-uri", uri, str(images[0])]) == 2


def test_tensorrt_gets_an_engine_cache_and_fp16_flag(tmp_path):
    opts = provider_options(
        ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
        str(tmp_path / "trt"),
        trt_fp16=True,
    )
    name, trt = opts[0]
    assert name == "TensorrtExecutionProvider" and opts[1:] == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert trt["trt_engine_cache_enable"] == "1" and trt["trt_engine_cache_path"] == str(tmp_path / "trt")
    assert trt["trt_fp16_enable"] == "1" and (tmp_path / "trt").is_dir()
    assert provider_options(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]


def test_the_server_refuses_to_start_when_cuda_falls_back_to_cpu(model):
    proc = subprocess.run(
        [sys.executable, "-m", "serving.cli", "serve", "--model", str(model), "--providers", "cuda,cpu"],
        cwd=ROOT,
        env=venv_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--allow-cpu-fallback" in proc.stderr, proc.stderr[-2000:]


def test_load_image_of_the_runner_is_what_the_server_scores(server, runner, images):
    # The same bytes through /classify and through load_image + /infer give the same score.
    spec = runner.card.input
    x = load_image(images[5], spec.size, spec.channels, spec.resize)[None]
    r1 = server.post(infer_path(runner), json=good_json(runner, x)).json()
    r2 = server.post(
        f"/v2/models/{runner.card.name}/classify",
        data=images[5].read_bytes(),
        headers={**server.headers, "Content-Type": "image/png"},
    ).json()
    assert r1["outputs"][1]["data"][0] == pytest.approx(r2["defect_score"], abs=1e-6)


def test_the_batcher_keeps_serving_after_a_request_fails_before_it_is_queued():
    from serving.batcher import Batcher

    async def main():
        batcher = Batcher(lambda x: ({"sum": x.sum(axis=(1, 2, 3))}, "v1"), max_batch_size=4, max_queue_delay=0.05)
        batcher.start()
        await asyncio.sleep(0.05)  # the batcher is now idle, waiting for work
        with pytest.raises(ValueError):
            async with batcher.slot():  # announced, then fails while "decoding": wakes the batcher, no item
                raise ValueError("undecodable")
        async with batcher.slot() as submit:
            result = await asyncio.wait_for(submit(np.ones((2, 2, 2, 1), np.uint8)), 5)
        await batcher.stop()
        return result

    result = asyncio.run(main())
    assert list(result.outputs["sum"]) == [4, 4] and result.tag == "v1" and result.batch_size == 2
