"""Hostile files and cards against the real runner, ``predict`` and ``watch``: no mocks, real files.

A tiny hand-built graph (``tests.test_runner_tiles.tiny_graph``) carded by the export stage's own
``write_card`` stands in for an exported model, so every test here runs in seconds.
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from pipeline.export.variants import write_card
from serving.card import METADATA_CARD_SHA256, CardError, InputSpec, ModelCard, TileSpec, card_path_for, sha256_file
from serving.files import list_inputs, score_files
from serving.review import ReviewRule
from serving.runner import Runner, RunnerError
from serving.watch import CLAIMS, DIED_TWICE, Claims, Watcher
from tests.conftest import ROOT, venv_env
from tests.test_runner_tiles import tiny_graph

SIZE, TILE = 32, 16
CARD = ModelCard(
    name="tiny",
    architecture="mean",
    classes=["ok", "scratch", "dent"],
    ok_class="ok",
    input=InputSpec(SIZE, 3, "letterbox"),
    threshold=0.5,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A whole-image graph with its card embedded and beside it, as the export stage writes them."""
    path = tmp_path_factory.mktemp("model") / "model.onnx"
    onnx.save(tiny_graph(SIZE, "ReduceMean", 0), str(path))
    write_card(CARD, path)
    return path


@pytest.fixture(scope="module")
def runner(model) -> Runner:
    return Runner(model, providers="cpu")


def copy_model(model: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(model, dest / model.name)
    shutil.copy(card_path_for(model), card_path_for(dest / model.name))
    return dest / model.name


def edit_card(path: Path, edit) -> None:
    card = json.loads(card_path_for(path).read_text())
    edit(card)
    card_path_for(path).write_text(json.dumps(card))


# --- the card ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda c: c.update(threshold=float("nan")), "'threshold' must be a finite number in [0, 1], got nan"),
        (lambda c: c.update(threshold=1.5), "'threshold' must be a finite number in [0, 1]"),
        (lambda c: c.update(threshold="0.5"), "'threshold' must be a finite number"),
        (lambda c: c.update(deployable="false"), "'deployable' must be true or false (a JSON boolean), got 'false'"),
        (lambda c: c.update(classes=["ok", "scratch", "ok"]), "'classes' must not repeat a class"),
        (lambda c: c.update(ok_class="good"), "'ok_class' 'good' is not one of classes"),
        (lambda c: c.update(variant="fp8"), "'variant' must be one of"),
        (lambda c: c["input"].update(size=-32), "'input.size' must be a positive integer"),
        (lambda c: c["input"].update(channels=True), "'input.channels' must be one of 1, 3, got True"),
        (lambda c: c.update(tiles={"model": "../x.onnx", "sha256": "0" * 64, "size": 8, "weight": 0.5}), "tiles.model"),
        (lambda c: c.pop("classes"), "missing field 'classes'"),
        (lambda c: c.update(colour="blue"), "unknown field 'colour'"),
        # Valid against the schema, but not the card export recorded in the graph:
        (lambda c: c.update(threshold=0.3), "'threshold': card 0.3, model 0.5"),
        (lambda c: c.update(classes=["scratch", "ok", "dent"]), "'classes': card ['scratch', 'ok', 'dent']"),
        (lambda c: c.update(deployable=False, not_deployable_reason="x"), "'deployable': card False, model True"),
        (lambda c: c["input"].update(resize="squash"), "'input.resize': card 'squash', model 'letterbox'"),
        # Not the graph's shapes (checked before the card hash: these name the graph)
        (lambda c: c["input"].update(size=64), "'input.size' and 'input.channels' give an input (N, 64, 64, 3)"),
        (lambda c: c.update(classes=["ok", "scratch"]), "'classes' names 2 classes, the graph's probs has 3"),
    ],
)
def test_a_bad_or_edited_card_is_refused_naming_the_field_and_the_file(model, tmp_path, edit, field):
    path = copy_model(model, tmp_path)
    edit_card(path, edit)
    with pytest.raises(CardError) as exc:
        Runner(path, providers="cpu")
    assert field in str(exc.value) and str(tmp_path) in str(exc.value)


def test_a_sidecar_that_is_the_embedded_card_loads_whatever_its_layout(model, tmp_path):
    path = copy_model(model, tmp_path)
    card = json.loads(card_path_for(path).read_text())
    card_path_for(path).write_text(json.dumps(dict(reversed(card.items())), indent=None))  # keys reordered
    assert Runner(path, providers="cpu").card.classes == CARD.classes


def test_a_model_exported_before_the_card_hash_is_checked_against_its_embedded_card(model, tmp_path, caplog):
    """Models in a user's models/ from before the hash: accepted when the sidecar is the embedded card, with a
    line asking for a re-export; refused, naming the field, when it is not."""
    path = copy_model(model, tmp_path)
    proto = onnx.load(str(path))
    for prop in [p for p in proto.metadata_props if p.key == METADATA_CARD_SHA256]:
        proto.metadata_props.remove(prop)
    onnx.save(proto, str(path))
    edit_card(path, lambda c: c.update(sha256=sha256_file(path)))
    with caplog.at_level(logging.WARNING, logger="serving.runner"):
        assert Runner(path, providers="cpu").ready
    assert "exported before the card's own sha256 was recorded" in caplog.text
    edit_card(path, lambda c: c.update(threshold=0.05))
    with pytest.raises(CardError, match="'threshold': card 0.05, model 0.5"):
        Runner(path, providers="cpu")


def test_a_changed_model_or_tile_graph_is_refused(model, tmp_path):
    path = copy_model(model, tmp_path)
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(RunnerError, match="does not match the model card's"):
        Runner(path, providers="cpu")
    # a tile graph: its sha256 is in the card, and the card's own hash covers that
    folder = tmp_path / "tiles"
    folder.mkdir()
    whole, tiles = folder / "model.onnx", folder / "model.tiles.onnx"
    onnx.save(tiny_graph(SIZE, "ReduceMean", 0), str(whole))
    onnx.save(tiny_graph(TILE, "ReduceMax", 1), str(tiles))
    write_card(dataclasses.replace(CARD, tiles=TileSpec(tiles.name, sha256_file(tiles), TILE, 0.4)), whole)
    assert Runner(whole, providers="cpu").tile_session is not None
    onnx.save(tiny_graph(TILE, "ReduceMax", 2), str(tiles))  # another tile graph under the same name
    with pytest.raises(RunnerError, match="does not match the model card's tiles"):
        Runner(whole, providers="cpu")


class _Inotify:
    """Counts the times a file is opened (Linux inotify IN_OPEN), whoever opens it (Python or onnxruntime)."""

    def __init__(self, path: Path) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        assert self.fd >= 0 and self.libc.inotify_add_watch(self.fd, str(path).encode(), 0x20) >= 0

    def opens(self) -> int:
        n = 0
        while True:
            try:
                buf = os.read(self.fd, 4096)
            except BlockingIOError:
                return n
            while buf:
                n += 1
                buf = buf[16 + struct.unpack_from("iIII", buf)[3] :]


def test_the_model_is_read_once_and_run_from_the_bytes_that_were_hashed(model, tmp_path):
    """One open of the model file: the session is made from the hashed bytes, so a file swapped between the
    check and the load cannot be the one that runs."""
    path = copy_model(model, tmp_path)
    watch = _Inotify(path)
    Runner(path, providers="cpu", warmup=1)
    assert watch.opens() == 1


# --- hostile files ----------------------------------------------------------------------------------------


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` with almost no pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def dds_unknown_pixel_format() -> bytes:
    """A 192-byte DDS whose pixel format Pillow's decoder does not implement: it raises NotImplementedError."""
    header = struct.pack("<7I", 124, 0x1007, 4, 4, 0, 0, 0) + b"\0" * 44
    pixel_format = struct.pack("<2I4s5I", 32, 0x4, b"ZZZZ", 0, 0, 0, 0, 0)
    return b"DDS " + header + pixel_format + struct.pack("<5I", 0x1000, 0, 0, 0, 0) + b"\0" * 64


def image_bytes(fmt: str, size=(40, 30), mode="RGB", seed=0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).convert(mode).save(buf, format=fmt)
    return buf.getvalue()


def poison(folder: Path) -> dict[str, str]:
    """Files no decoder can score, each with a word its error row must carry."""
    folder.mkdir(parents=True, exist_ok=True)
    png, jpeg = image_bytes("PNG"), image_bytes("JPEG")
    files = {
        "empty.png": (b"", "empty"),
        "truncated.png": (png[: len(png) // 2], "truncated.png"),
        "truncated.jpg": (jpeg[:200], "truncated.jpg"),
        "notes.png": (b"not an image at all", "notes.png"),
        "bomb.png": (png_declaring(200_000, 200_000), "pixels"),
        "odd.dds": (dds_unknown_pixel_format(), "odd.dds"),
    }
    for name, (data, _) in files.items():
        (folder / name).write_bytes(data)
    return {name: word for name, (_, word) in files.items()}


def good(folder: Path, n: int = 4) -> list[str]:
    """Readable images, some under the wrong extension (the decoder reads the content, not the name)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i, (fmt, name) in enumerate([("PNG", "a.png"), ("JPEG", "b.jpg"), ("PNG", "c.jpg"), ("BMP", "d.tif")][:n]):
        (folder / name).write_bytes(image_bytes(fmt, (30 + 7 * i, 40), seed=i))
        names.append(name)
    return names


def test_predict_scores_every_good_file_beside_poison_ones_and_writes_a_row_for_each(model, tmp_path):
    folder = tmp_path / "images"
    ok, bad = good(folder), poison(folder)
    os.mkfifo(folder / "pipe.png")
    (folder / "dangling.png").symlink_to(tmp_path / "nowhere.png")
    (folder / "loop").symlink_to(folder, target_is_directory=True)
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "serving.cli", "predict", "--model", str(model), str(folder), str(tmp_path / "nope")]
        + ["--out", str(out), "--providers", "cpu", "--batch-size", "3"],
        env=venv_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {Path(r["path"]).name: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == sorted([*ok, *bad, "pipe.png", "dangling.png", "loop", "nope"])
    for name in ok:
        assert rows[name]["decision"] in ("ok", "defect") and not rows[name]["error"], rows[name]
    for name, word in bad.items():
        assert rows[name]["decision"] is None and word in rows[name]["error"], rows[name]
    assert "FIFO" in rows["pipe.png"]["error"] and "broken symbolic link" in rows["dangling.png"]["error"]
    assert "not followed" in rows["loop"]["error"] and "no such file" in rows["nope"]["error"]
    assert "scored 4 of 14 files (6 unreadable, 4 skipped)" in proc.stderr


# every (format, mode) Pillow writes here, found by trying: what the generated files are made of
MODES = ("1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "I", "I;16", "F", "YCbCr")


def _writable() -> list[tuple[str, str]]:
    Image.init()
    pairs = []
    for fmt in sorted(Image.SAVE):
        for mode in MODES:
            try:
                Image.new(mode, (3, 2)).save(io.BytesIO(), format=fmt)
            except Exception:  # noqa: BLE001, S112 (a pair this Pillow cannot write: not generated)
                continue
            pairs.append((fmt, mode))
    return pairs


WRITABLE = _writable()


@st.composite
def hostile_image(draw) -> bytes:
    """Any format and mode Pillow writes, extreme aspect ratios, then maybe truncated or with bytes flipped."""
    fmt, mode = draw(st.sampled_from(WRITABLE))
    w, h = draw(st.sampled_from([(1, 1), (1, 300), (300, 1), (17, 9), (64, 64), (2, 150)]))
    arr = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    try:
        Image.fromarray(arr).convert(mode).save(buf, format=fmt)
    except Exception:  # noqa: BLE001 (a size this format refuses to write, e.g. an icon over 256 px: raw bytes)
        buf = io.BytesIO(arr.tobytes())
    data = buf.getvalue()
    cut = draw(st.sampled_from(["whole", "truncated", "flipped"]))
    if cut == "truncated" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif cut == "flipped" and data:
        at = draw(st.lists(st.integers(0, len(data) - 1), min_size=1, max_size=8))
        data = bytes(b ^ 0xFF if i in at else b for i, b in enumerate(data))
    return data


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=hostile_image(), ext=st.sampled_from([".png", ".jpg", ".dds", ".bin", ""]))
def test_any_generated_file_is_its_own_row_and_never_stops_the_good_ones(runner, tmp_path, data, ext):
    folder = tmp_path / f"h{abs(hash(data)) % 10**8}"
    folder.mkdir(exist_ok=True)
    before, after = folder / "before.png", folder / "after.png"
    before.write_bytes(image_bytes("PNG", seed=1))
    after.write_bytes(image_bytes("PNG", seed=2))
    odd = folder / f"odd{ext}"
    odd.write_bytes(data)
    rows = list(score_files(runner, [before, odd, after], batch_size=3))
    assert [r.path for r in rows if r.path != str(odd)] == [str(before), str(after)]
    assert sum(r.path == str(odd) for r in rows) == 1
    for r in rows:
        if r.path == str(odd) and r.error:
            assert str(odd) in r.error and r.decision is None
        else:
            assert r.decision in ("ok", "defect") and 0 <= r.defect_score <= 1


def test_list_inputs_names_every_entry_and_never_opens_a_fifo(tmp_path):
    good(tmp_path / "in")
    os.mkfifo(tmp_path / "in" / "pipe")
    (tmp_path / "in" / ".hidden.png").write_bytes(image_bytes("PNG"))
    entries = dict(list_inputs([str(tmp_path / "in"), str(tmp_path / "in" / "*.png"), "missing/*.png"]))
    assert entries[tmp_path / "in" / "pipe"].startswith("skipped: a FIFO")
    assert entries[tmp_path / "in" / ".hidden.png"] == ""  # predict scores what a person pointed it at
    assert entries[Path("missing/*.png")] == "no such file, folder or matching glob"


# --- watch ------------------------------------------------------------------------------------------------


def watcher(runner: Runner, inbox: Path, out: Path, results: str = "results.jsonl", **kw) -> Watcher:
    rule = kw.pop("rule", ReviewRule(margin=1.0, min_confidence=0.0))  # everything scored goes to review
    return Watcher(runner, inbox, out / results, out / "done", out / "failed", out / "review", rule, **kw)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_once(w: Watcher, timeout: float = 60) -> dict:
    """``w.run(once=True)`` in a thread, failing (not hanging) when it does not finish."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(w.run(once=True, poll=0.05)), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the watcher is stuck"
    return result


def test_watch_gives_every_hostile_entry_a_line_and_never_reads_outside_its_inbox(runner, tmp_path):
    inbox, out, outside = tmp_path / "inbox", tmp_path / "out", tmp_path / "outside"
    ok, bad = good(inbox), poison(inbox / "cam2")
    outside.mkdir()
    secret = outside / "secret.png"
    secret.write_bytes(image_bytes("PNG", seed=7))
    (inbox / "to_secret.png").symlink_to(secret)
    (inbox / "to_outside").symlink_to(outside, target_is_directory=True)
    (inbox / "to_inside.png").symlink_to(inbox / "a.png")
    os.mkfifo(inbox / "pipe.png")
    (inbox / ".partial.png").write_bytes(image_bytes("PNG"))
    (inbox / ".cache").mkdir()
    (inbox / ".cache" / "x.png").write_bytes(image_bytes("PNG"))
    odd_name = os.fsdecode(b"caf\xe9.png")  # not UTF-8
    (inbox / odd_name).write_bytes(image_bytes("PNG", seed=3))

    counts = run_once(watcher(runner, inbox, out, settle=0.0))
    rows = {r["file"]: r for r in lines(out / "results.jsonl")}
    links = ["to_secret.png", "to_outside", "to_inside.png"]
    expected = [*ok, *[f"cam2/{n}" for n in bad], *links, "pipe.png", ".partial.png", ".cache", odd_name]
    assert sorted(rows) == sorted(expected) and len(lines(out / "results.jsonl")) == len(expected)
    for name in [*ok, odd_name]:
        assert rows[name]["decision"] and (out / "done" / name).is_file()
    for name, word in bad.items():
        assert word in rows[f"cam2/{name}"]["error"] and (out / "failed" / name).is_file()
    for name in links:
        assert rows[name]["error"].startswith("refused: a symbolic link") and (out / "failed" / name).is_symlink()
    assert "FIFO" in rows["pipe.png"]["error"] and (out / "failed" / "pipe.png").is_fifo()
    for name in (".partial.png", ".cache"):
        assert rows[name]["skipped"] and "left in the inbox" in rows[name]["error"]
        assert (inbox / name).exists()
    assert secret.read_bytes() == image_bytes("PNG", seed=7) and sorted(p.name for p in outside.iterdir()) == [
        "secret.png"
    ]
    review = [p for p in (out / "review").rglob("*") if p.is_file() and p.name != "queue.jsonl"]
    assert len(review) == len(ok) + 1 and all(p.read_bytes() != secret.read_bytes() for p in review)
    assert counts == {"done": 5, "failed": 6, "review": 5, "skipped": 6}
    assert not list((inbox / CLAIMS).iterdir())  # the claim folder is gone after a clean stop


def test_a_file_that_vanishes_before_or_after_it_is_claimed_does_not_stop_the_watcher(runner, tmp_path):
    inbox, out = tmp_path / "inbox", tmp_path / "out"
    good(inbox, 2)
    w = watcher(runner, inbox, out, settle=0.0)
    run_once(w)  # opens and closes its claims: reuse the object step by step below
    for name in ("late.png", "gone.png"):
        (inbox / name).write_bytes(image_bytes("PNG"))
    w.claims = Claims(w.inbox)
    try:
        ready = w.settled(w.scan()) or w.settled(w.scan())
        assert sorted(e.rel for e in ready) == ["gone.png", "late.png"]
        (inbox / "gone.png").unlink()  # vanishes between the scan and the claim
        assert w.claims.take("gone.png") is None
        name = w.claims.take("late.png")
        (w.claims.path_of(name)).unlink()  # vanishes after the claim
        with open(out / "results.jsonl", "a") as f:
            w.score(f, [("late.png", name)])
    finally:
        w.claims.close()
    rows = lines(out / "results.jsonl")
    assert [r["file"] for r in rows[2:]] == ["late.png"] and "vanished" in rows[2]["error"]


def test_two_watchers_on_one_inbox_score_each_file_exactly_once(runner, tmp_path):
    inbox, out = tmp_path / "inbox", tmp_path / "out"
    names = []
    for i in range(40):  # the same file name in two folders: both land in the shared done/, neither overwritten
        (inbox / f"cam{i % 2}").mkdir(parents=True, exist_ok=True)
        (inbox / f"cam{i % 2}" / f"img{i // 2}.png").write_bytes(image_bytes("PNG", (20, 20), seed=i))
        names.append(f"cam{i % 2}/img{i // 2}.png")
    rule = ReviewRule(0.0, 0.0)
    a = watcher(runner, inbox, out, "a.jsonl", settle=0.0, batch_size=4, rule=rule)
    b = watcher(runner, inbox, out, "b.jsonl", settle=0.0, batch_size=4, rule=rule)
    threads = [threading.Thread(target=w.run, kwargs={"once": True, "poll": 0.01}, daemon=True) for w in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    rows = lines(out / "a.jsonl") + lines(out / "b.jsonl")
    assert sorted(r["file"] for r in rows) == sorted(names)  # each once, none twice
    assert lines(out / "a.jsonl") and lines(out / "b.jsonl"), "one watcher did all the work: no race was tested"
    assert len(list((out / "done").iterdir())) == 40 and not list((out / "failed").iterdir())
    assert len({r["moved_to"] for r in rows}) == 40


def _die_holding_claims(inbox: Path, rels: list[str], in_retry: bool) -> None:
    """A real watcher process that claims ``rels`` and is killed (SIGKILL) before it scores them: what a
    decoder crash or the OOM killer leaves behind."""
    code = (
        "import os, signal; from pathlib import Path; from serving.watch import RETRY, Claims\n"
        f"c = Claims(Path({str(inbox)!r}))\n"
        f"for rel in {rels!r}:\n"
        "    name = c.take(rel)\n"
        f"    if {in_retry!r}: os.rename(name, RETRY + '/' + name, src_dir_fd=c.fd, dst_dir_fd=c.fd)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=venv_env(), timeout=60)
    assert proc.returncode == -signal.SIGKILL


def test_a_watcher_that_died_mid_batch_is_recovered_without_a_crash_loop(runner, tmp_path):
    inbox, out = tmp_path / "inbox", tmp_path / "out"
    good(inbox, 3)
    _die_holding_claims(inbox, ["a.png", "b.jpg"], in_retry=False)  # died scoring a batch: retried, one by one
    (inbox / "killer.png").write_bytes(image_bytes("PNG"))
    _die_holding_claims(inbox, ["killer.png"], in_retry=True)  # died again scoring it alone: not retried
    assert sorted(p.name for p in inbox.iterdir()) == [CLAIMS, "c.jpg"]
    counts = run_once(watcher(runner, inbox, out, settle=0.0))
    rows = {r["file"]: r for r in lines(out / "results.jsonl")}
    assert sorted(rows) == ["a.png", "b.jpg", "c.jpg", "killer.png"]
    assert all(rows[n]["decision"] for n in ("a.png", "b.jpg", "c.jpg"))
    assert rows["killer.png"]["error"] == DIED_TWICE and (out / "failed" / "killer.png").is_file()
    assert counts["done"] == 3 and counts["failed"] == 1
    assert not list((inbox / CLAIMS).iterdir())  # the dead watchers' claim folders are gone
