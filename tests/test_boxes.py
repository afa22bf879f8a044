"""Pascal VOC boxes as defect masks: read safely, painted 1-based inclusive and clipped, and every bad
annotation one problem naming its file while the ingest goes on."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.config import params_from_dict
from pipeline.data.check import check_data
from pipeline.data.ingest import ingest, ingest_masks
from pipeline.data.masks import MAX_XML_BYTES, box_mask, parse_xml, read_mask, shown_size, voc_boxes
from pipeline.data.prepare import load_mask
from tests.conftest import ROOT, tiny_params

NEU_DET = Path(os.environ.get("DEFECT_NEU_DET", ROOT.parent / "shared" / "datasets" / "neu_det"))


def voc(*boxes, size=None, root="annotation", filename="someone-else.jpg") -> str:
    """A Pascal VOC file as LabelImg writes it: ``boxes`` are (xmin, ymin, xmax, ymax), numbers or strings."""
    objects = "".join(
        f"<object><name>dent</name><bndbox><xmin>{a}</xmin><ymin>{b}</ymin><xmax>{c}</xmax><ymax>{d}</ymax>"
        "</bndbox></object>"
        for a, b, c, d in boxes
    )
    size_xml = f"<size><width>{size[0]}</width><height>{size[1]}</height><depth>3</depth></size>" if size else ""
    return f"<{root}><filename>{filename}</filename>{size_xml}{objects}</{root}>"


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def write_image(path: Path, size=(40, 30)) -> Path:
    """A ``size`` (width, height) RGB image."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size[1], size[0], 3), 90, np.uint8)).save(path)
    return path


def test_a_box_covers_its_corners_inclusive_one_based(tmp_path):
    xml = write(tmp_path / "a.xml", voc((1, 1, 10, 5), size=(40, 30)))
    boxes, problems = voc_boxes(xml, (40, 30))
    assert problems == [] and boxes == [(0, 0, 10, 5)]
    mask = box_mask(boxes, (40, 30))
    assert mask.shape == (30, 40) and mask.dtype == np.uint8
    assert (mask[:5, :10] == 255).all() and mask.sum() == 255 * 50  # columns 1..10, rows 1..5: 50 pixels
    whole = voc_boxes(write(tmp_path / "b.xml", voc((1, 1, 40, 30))), (40, 30))[0]
    assert (box_mask(whole, (40, 30)) == 255).all()  # 1..40 x 1..30 is the whole image
    assert voc_boxes(write(tmp_path / "c.xml", voc((7, 3, 7, 3))), (40, 30))[0] == [(6, 2, 7, 3)]  # one pixel


def test_two_objects_paint_their_union_and_fractions_round_to_pixels(tmp_path):
    xml = write(tmp_path / "a.xml", voc((2, 2, 5, 5), (4, 4, 8.4, 6.5)))
    boxes, problems = voc_boxes(xml, (40, 30))
    assert problems == [] and boxes == [(1, 1, 5, 5), (3, 3, 8, 7)]
    mask = box_mask(boxes, (40, 30))
    expected = np.zeros((30, 40), np.uint8)
    expected[1:5, 1:5] = 255
    expected[3:7, 3:8] = 255
    assert np.array_equal(mask, expected)


def test_a_box_over_the_edge_is_clipped_and_a_box_outside_is_a_problem(tmp_path):
    xml = write(tmp_path / "a.xml", voc((0, -3, 55, 12), (30, 28, 45, 40)))  # a 0-based exporter's 0, and beyond
    boxes, problems = voc_boxes(xml, (40, 30))
    assert problems == [] and boxes == [(0, 0, 40, 12), (29, 27, 40, 30)]
    boxes, problems = voc_boxes(write(tmp_path / "b.xml", voc((3, 3, 9, 9), (41, 5, 60, 9))), (40, 30))
    assert boxes == [(2, 2, 9, 9)]
    assert problems == [
        "<object> 2 (dent): (41, 5, 60, 9) lies outside the 40x30 image; expected x in 1..40 and y in 1..30"
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        ("<annotation><object>", "not readable as XML (no element found"),
        (b"\xff\xfe\x00garbage", "not readable as XML"),
        ('<?xml version="1.0" encoding="no-such-codec"?><annotation/>', "not readable as XML"),
        ("<labels><box/></labels>", "root element <labels>; expected a Pascal VOC <annotation>"),
        (voc((9, 2, 3, 8)), "<object> 1 (dent): (9, 2, 3, 8) is inverted; expected xmin <= xmax and ymin <= ymax"),
        (voc(("ten", 2, 3, 8)), "xmin='ten', ymin='2', xmax='3', ymax='8'; expected four numbers of pixels"),
        (voc(("nan", 2, 3, 8)), "xmin='nan'"),
        (voc((1, 2, "", 8)), "xmax=''"),
        ("<annotation><object><name>dent</name></object></annotation>", "<object> 1 (dent) has no <bndbox>"),
        (voc((1, 1, 5, 5), size=(30, 40)), "<size> is 30x40 but the image is 40x30"),
    ],
)
def test_a_bad_annotation_is_a_problem_saying_what_was_expected(tmp_path, text, message):
    xml = write(tmp_path / "a.xml", text)
    boxes, problems = voc_boxes(xml, (40, 30))
    assert boxes == [] and len(problems) == 1 and message in problems[0], problems


def test_a_file_with_one_good_and_one_bad_box_lists_the_bad_one(tmp_path):
    boxes, problems = voc_boxes(write(tmp_path / "a.xml", voc((1, 1, 5, 5), (9, 9, 2, 2), (1, "x", 2, 2))), (40, 30))
    assert boxes == [(0, 0, 5, 5)]  # the caller writes no mask: half the boxes would call the rest clean
    assert [p.split(":")[0] for p in problems] == ["<object> 2 (dent)", "<object> 3 (dent)"]


BILLION_LAUGHS = (
    '<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">'
    + "".join(f'<!ENTITY lol{i} "{("&lol" + (str(i - 1) if i > 1 else "") + ";") * 10}">' for i in range(1, 10))
    + "]><annotation><filename>&lol9;</filename></annotation>"
)


@pytest.mark.parametrize(
    "text",
    [
        BILLION_LAUGHS,
        '<!DOCTYPE a [<!ENTITY x SYSTEM "file:///etc/passwd">]><annotation><filename>&x;</filename></annotation>',
        '<!DOCTYPE annotation SYSTEM "http://example.invalid/voc.dtd"><annotation/>',
        BILLION_LAUGHS.encode("utf-16"),  # a byte search for "<!DOCTYPE" would not see this one
    ],
    ids=["billion-laughs", "external-entity", "external-dtd", "utf-16"],
)
def test_doctype_and_entities_are_refused_before_anything_expands(tmp_path, text):
    xml = write(tmp_path / "bomb.xml", text)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"declares a DOCTYPE or entity; expected a plain Pascal VOC"):
        parse_xml(xml)
    assert time.perf_counter() - start < 1.0
    assert voc_boxes(xml, (40, 30))[1][0].startswith("declares a DOCTYPE")


def test_an_oversized_xml_is_refused_unparsed(tmp_path):
    xml = write(tmp_path / "big.xml", "<annotation>" + " " * MAX_XML_BYTES + "</annotation>")
    with pytest.raises(ValueError, match=r"more than 1048576 bytes; expected a Pascal VOC file of a few KiB"):
        parse_xml(xml)


def test_the_size_of_an_image_is_read_as_it_is_decoded(tmp_path):
    plain = write_image(tmp_path / "plain.jpg", (40, 30))
    turned = tmp_path / "turned.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 40x30, shown (and decoded) turned a quarter: 30x40
    Image.open(plain).save(turned, exif=exif)
    assert shown_size(plain) == (40, 30) and shown_size(turned) == (30, 40)
    assert shown_size(write(tmp_path / "fake.jpg", b"not an image")) is None


def defect_folder(tmp_path: Path) -> Path:
    """``line/{ok,dent}`` with a sibling ``line_annotations`` of every kind of VOC file and ``line_masks``."""
    src = tmp_path / "line"
    for name in ("a", "b", "c", "d", "e", "f", "g"):
        write_image(src / "dent" / f"{name}.jpg")
    write_image(src / "dent" / "sub" / "h.png")
    write(src / "dent" / "broken.jpg", b"\xff\xd8 not a jpeg")
    for name in ("o1", "o2"):
        write_image(src / "ok" / f"{name}.jpg")
    ann = tmp_path / "line_annotations"
    write(ann / "dent" / "a.xml", voc((1, 1, 10, 5)))  # good
    write(ann / "dent" / "b.xml", voc((2, 2, 5, 5), (30, 20, 50, 40)))  # two objects, the second clipped
    write(ann / "dent" / "c.xml", "<annotation><object>")  # malformed
    write(ann / "dent" / "d.xml", voc((9, 2, 3, 8)))  # inverted
    write(ann / "dent" / "e.xml", BILLION_LAUGHS)  # refused
    write(ann / "dent" / "f.xml", voc())  # no objects on a defect image: unknown
    write(ann / "dent" / "g.xml", voc((1, 1, 3, 3)))  # loses to the PNG mask below
    write(ann / "dent" / "sub" / "h.xml", voc((5, 5, 6, 6)))  # a subfolder, as the images have it
    write(ann / "dent" / "broken.xml", voc((1, 1, 3, 3)))  # its image cannot be opened: validate's to report
    write(ann / "dent" / "zz.xml", voc((1, 1, 3, 3)))  # no such image
    write(ann / "ok" / "o1.xml", voc(size=(40, 30)))  # an OK image with nothing on it: as expected
    write(ann / "Dent" / "a.xml", voc((1, 1, 3, 3)))  # not a class folder
    g = np.zeros((30, 40), np.uint8)
    g[20:25, 30:35] = 255
    (tmp_path / "line_masks" / "dent").mkdir(parents=True)
    Image.fromarray(g).save(tmp_path / "line_masks" / "dent" / "g.png")
    return src


def test_ingest_paints_boxes_into_masks_and_lists_every_bad_annotation(tmp_path):
    src = defect_folder(tmp_path)
    cfg = dataclasses.replace(params_from_dict(tiny_params()).data, source=str(src), ok_class="ok")
    summary = ingest(cfg, tmp_path / "raw")
    assert summary == json.loads((tmp_path / "raw/ingest.json").read_text())
    masks = summary["masks"]
    ann = tmp_path / "line_annotations"
    assert masks["folders"] == [str(tmp_path / "line_masks"), str(ann)]
    assert masks["kind"] == "both" and masks["images"] == 4 and masks["from_boxes"] == 3  # a, b, h; g's PNG
    problems = {(p["file"], p["problem"].split(";")[0]) for p in masks["problems"]}
    assert problems == {
        (str(ann / "Dent/a.xml"), "no image Dent/a.*"),
        (str(ann / "dent/zz.xml"), "no image dent/zz.*"),
        (str(ann / "dent/c.xml"), "not readable as XML (no element found: line 1, column 20)"),
        (str(ann / "dent/d.xml"), "<object> 1 (dent): (9, 2, 3, 8) is inverted"),
        (str(ann / "dent/e.xml"), "declares a DOCTYPE or entity"),
        (str(ann / "dent/f.xml"), "no <object> with a <bndbox>"),
    }
    assert all("expected" in p["problem"] for p in masks["problems"])

    raw = tmp_path / "raw/masks"
    assert sorted(p.relative_to(raw).as_posix() for p in raw.rglob("*.png")) == [
        "dent/a.png",
        "dent/b.png",
        "dent/g.png",
        "dent/sub/h.png",
    ]
    b = np.asarray(Image.open(raw / "dent/b.png"))
    assert b.shape == (30, 40) and set(np.unique(b)) == {0, 255}
    assert (b[1:5, 1:5] == 255).all() and (b[19:, 29:] == 255).all() and b.sum() == 255 * (16 + 11 * 11)
    assert (raw / "dent/g.png").read_bytes() == (tmp_path / "line_masks/dent/g.png").read_bytes()  # the PNG won
    # what the later stages read: the same reader as for a drawn mask
    assert read_mask(raw, "dent/a.jpg").sum() == 50 and read_mask(raw, "dent/sub/h.png").sum() == 4
    small = load_mask(raw, "dent/a.jpg", 20, "letterbox")  # 40x30 -> 20x15 below 2 rows of padding
    assert small[2:4, :5].all() and not small[:2].any() and not small[5:].any() and not small[:, 5:].any()


def test_defect_check_prints_each_bad_annotation_and_stops_nothing(tmp_path, capsys):
    src = defect_folder(tmp_path)
    p = params_from_dict(tiny_params())
    p = dataclasses.replace(p, data=dataclasses.replace(p.data, source=str(src), ok_class="ok"))
    check_data(p)
    out = capsys.readouterr().out
    folders = f"{tmp_path / 'line_masks'}, {tmp_path / 'line_annotations'}"
    assert f"masks: {folders}: 4 images, 3 of them painted from boxes" in out
    bad = [line for line in out.splitlines() if line.startswith("bad annotation: ")]
    assert len(bad) == 6 and f"bad annotation: {tmp_path / 'line_annotations/dent/d.xml'}: <object> 1" in out
    assert not (tmp_path / "raw").exists() and not list(tmp_path.rglob("data"))  # nothing written


@pytest.mark.skipif(not NEU_DET.is_dir(), reason=f"the NEU-DET steel images are not at {NEU_DET} (set DEFECT_NEU_DET)")
def test_neu_det_boxes_become_one_mask_per_image(tmp_path):
    annotations = NEU_DET.with_name(NEU_DET.name + "_annotations")
    classes = sorted(p.name for p in NEU_DET.iterdir() if p.is_dir())
    masks = ingest_masks(NEU_DET, classes, "none", None)  # every file read and checked, nothing written
    assert masks["kind"] == "boxes" and masks["problems"] == []
    assert masks["images"] == masks["from_boxes"] == 1800 and masks["folders"] == [str(annotations)]
    # one image end to end: <bndbox> 2, 2, 193, 194 -> rows 1..193, columns 1..192 (0-based) of 200 x 200
    boxes, problems = voc_boxes(annotations / "crazing/crazing_1.xml", shown_size(NEU_DET / "crazing/crazing_1.jpg"))
    mask = box_mask(boxes, (200, 200))
    assert problems == [] and mask[1:194, 1:193].all() and mask.sum() == 255 * 193 * 192
